//! The names of the shared-memory segments a run's workers create (in `/dev/shm`), shared by
//! the runtime that creates them and the launcher that removes what dead workers left.
//!
//! A name carries the creating process's id, so that a sweeper can tell a segment whose creator
//! is gone from one in use, and a random part, so that no one can guess it. This module only
//! names; it must not create, map or remove anything.

/// Where the segments appear in the file system (Linux's POSIX shared memory).
pub const DIR: &str = "/dev/shm";

/// The first part of every segment's file name.
pub const PREFIX: &str = "gptrec-";

/// The `shm_open` name (with its leading `/`) of a segment created by process `pid`; `nonce` is
/// random hex.
pub fn segment_name(pid: u32, nonce: &str) -> String {
    format!("/{PREFIX}{pid}-{nonce}")
}

/// The id of the process that created the segment file `file_name` (as listed in [`DIR`]), or
/// `None` when the name is not one of ours.
pub fn owner_pid(file_name: &str) -> Option<u32> {
    let rest = file_name.strip_prefix(PREFIX)?;
    let (pid, nonce) = rest.split_once('-')?;
    if nonce.is_empty() || !nonce.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    pid.parse().ok()
}

/// Whether process `pid` has ended (it is not running, or is a zombie waiting to be reaped).
pub fn creator_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name, which is in parentheses and may hold anything.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| matches!(rest.trim_start().chars().next(), Some('Z' | 'X'))),
        Err(_) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_strangers_are_not_ours() {
        let name = segment_name(4242, "00ff9a");
        assert_eq!(name, "/gptrec-4242-00ff9a");
        assert_eq!(owner_pid(&name[1..]), Some(4242));
        for other in [
            "gptrec-x-00ff",
            "gptrec-12-",
            "gptrec-12-zz",
            "gptrec-12",
            "torch_123",
            "gptrec--ab",
        ] {
            assert_eq!(owner_pid(other), None, "{other}");
        }
    }

    #[test]
    fn a_running_process_is_not_gone_and_a_reaped_one_is() {
        assert!(!creator_gone(std::process::id()));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert!(creator_gone(pid));
    }
}
