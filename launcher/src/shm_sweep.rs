//! Removes the shared-memory segments that dead workers left in `/dev/shm`. A worker unlinks
//! its segment as soon as every rank has mapped it, so only a worker killed during that moment
//! of set-up leaves one; the launcher sweeps before it starts a group, after each group ends,
//! and its orphan guard sweeps when the launcher itself was killed. Only segments whose creator
//! is gone are touched, so other runs on the machine keep theirs.

use std::path::Path;

use common::shm_segments::{creator_gone, owner_pid, DIR};

/// Removes every segment in `/dev/shm` whose creator has ended; returns the names removed.
pub fn sweep_stale() -> Vec<String> {
    sweep_dir(Path::new(DIR))
}

/// [`sweep_stale`] over `dir`.
pub fn sweep_dir(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let stale = owner_pid(&name).is_some_and(creator_gone);
        // Another user's segment in the sticky /dev/shm cannot be removed: leave it be.
        if stale && std::fs::remove_file(entry.path()).is_ok() {
            removed.push(name);
        }
    }
    removed
}

/// [`sweep_stale`], logging what was removed.
pub fn sweep_and_log() {
    let removed = sweep_stale();
    if !removed.is_empty() {
        tracing::info!(
            "removed {} shared-memory segment(s) left in {DIR} by workers that died: {}",
            removed.len(),
            removed.join(", ")
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_segments_of_dead_creators_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        // Another test of this process may reap it first (adopted.rs waits for any child):
        // either way it is gone once its /proc entry is.
        let _ = child.wait();
        let gone = std::path::Path::new("/proc").join(dead.to_string());
        for _ in 0..500 {
            if !gone.exists() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let live = std::process::id();
        let names = [
            format!("gptrec-{dead}-0a1b"),
            format!("gptrec-{live}-0a1b"),
            format!("other-{dead}-0a1b"),
        ];
        for name in &names {
            std::fs::write(dir.path().join(name), b"").unwrap();
        }
        assert_eq!(sweep_dir(dir.path()), vec![names[0].clone()]);
        assert!(!dir.path().join(&names[0]).exists());
        assert!(dir.path().join(&names[1]).exists());
        assert!(dir.path().join(&names[2]).exists());
    }
}
