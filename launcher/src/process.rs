//! What `/proc` tells of another process, for the one-line messages that name it (the holder of
//! a port, the processes on a GPU): its command line, its user, whether it is stopped.
//!
//! Must not: signal or wait for the process, or decide anything from what it reads.

/// Longest command line shown, in characters.
const MAX_COMMAND: usize = 120;

/// `pid`'s command line on one line: arguments joined by spaces, control characters as spaces,
/// cut at [`MAX_COMMAND`] characters (its name when it has no arguments).
pub fn command_line(pid: u32) -> String {
    let text = full_command_line(pid);
    let one_line: String = text
        .split(char::is_control)
        .filter(|w| !w.is_empty())
        .collect::<Vec<_>>()
        .join(" ");
    match one_line.char_indices().nth(MAX_COMMAND) {
        Some((at, _)) => format!("{}...", &one_line[..at]),
        None => one_line,
    }
}

/// Whether `pid` is stopped (state `T`, by SIGSTOP or a job-control signal; `t`, by a debugger),
/// as `/proc/<pid>/stat` says; false when it cannot be read.
pub fn is_stopped(pid: i32) -> bool {
    matches!(state(pid), Some('T' | 't'))
}

/// Whether `pid` has exited: a zombie not yet reaped (state `Z` or `X`), or gone. A signal to
/// its process group still succeeds then, but it did not end it.
pub fn has_exited(pid: i32) -> bool {
    match state(pid) {
        Some(state) => matches!(state, 'Z' | 'X'),
        // Gone, where /proc can be read at all.
        None => std::path::Path::new("/proc/self/stat").exists(),
    }
}

/// The state letter in `/proc/<pid>/stat`, or `None` when it cannot be read.
fn state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The state follows the command name, which is in parentheses and may hold any character.
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.trim_start().chars().next())
}

fn full_command_line(pid: u32) -> String {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let words: Vec<String> = raw
        .split(|&b| b == 0)
        .filter(|w| !w.is_empty())
        .map(|w| String::from_utf8_lossy(w).into_owned())
        .collect();
    if words.is_empty() {
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        return comm.trim().to_string();
    }
    words.join(" ")
}

/// The name of the user `pid` runs as (its real uid, from `/proc` and `/etc/passwd`), else
/// `uid N`, else `unknown`.
pub fn user_of(pid: u32) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let Some(uid) = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().next())
    else {
        return "unknown".into();
    };
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
    passwd
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            (f.get(2) == Some(&uid)).then(|| f[0].to_string())
        })
        .unwrap_or_else(|| format!("uid {uid}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A command line is shown on one line, and not at any length.
    #[test]
    fn a_command_line_is_one_line_and_capped() {
        let mut child = std::process::Command::new("sh")
            .args(["-c", &format!("sleep 30\n{}", "x".repeat(300))])
            .spawn()
            .unwrap();
        let started = std::time::Instant::now();
        let mut shown = command_line(child.id());
        // Until the child has exec'd sh.
        while !shown.starts_with("sh -c") && started.elapsed().as_secs() < 5 {
            std::thread::sleep(std::time::Duration::from_millis(10));
            shown = command_line(child.id());
        }
        let _ = child.kill();
        let _ = child.wait();
        assert!(shown.starts_with("sh -c sleep 30 xxx"), "{shown}");
        assert!(
            !shown.contains('\n') && shown.ends_with("...") && shown.len() == MAX_COMMAND + 3,
            "{shown}"
        );
    }

    #[test]
    fn a_stopped_process_is_seen_as_stopped() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        assert!(!is_stopped(pid));
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGSTOP,
        );
        let started = std::time::Instant::now();
        while !is_stopped(pid) && started.elapsed().as_secs() < 5 {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let stopped = is_stopped(pid);
        let _ = child.kill();
        let _ = child.wait();
        assert!(stopped);
        assert!(!is_stopped(i32::MAX));
    }

    #[test]
    fn an_exited_process_not_yet_reaped_is_seen_as_exited() {
        let mut child = std::process::Command::new("sleep")
            .arg("0.2")
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        let running = has_exited(pid);
        let started = std::time::Instant::now();
        while !has_exited(pid) && started.elapsed().as_secs() < 5 {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        // A zombie until it is reaped: a signal to it still succeeds.
        let zombie = (has_exited(pid), state(pid));
        let signalled = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_ok();
        let _ = child.wait();
        assert!(!running);
        assert_eq!(zombie, (true, Some('Z')));
        assert!(signalled);
        assert!(has_exited(pid));
    }
}
