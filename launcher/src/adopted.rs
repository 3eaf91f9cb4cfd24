//! Processes the launcher adopted: as a child subreaper it becomes the parent of every orphaned
//! descendant of its workers — including those that left the worker's process group with
//! `setsid`, which teardown by process group does not reach. This module finds them (`/proc`,
//! read only when `waitid` says there is a child at all), reaps the ones that exited (never a
//! worker: the group's wait thread waits for those), and stops the ones still running. It
//! decides nothing about when; the supervisor calls it.

use nix::errno::Errno;
use nix::sys::signal::{kill, killpg, Signal};
use nix::sys::wait::{waitid, waitpid, Id, WaitPidFlag};
use nix::unistd::Pid;

/// (pid, state) of every process whose parent is this one, except `workers`.
fn children(workers: &[i32]) -> Vec<(i32, char)> {
    if !has_children() {
        return Vec::new(); // the common end of a run: no need to read all of `/proc`
    }
    let me = std::process::id() as i32;
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| !workers.contains(pid))
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // `pid (comm) state ppid ...`; comm may hold spaces and parentheses.
            let mut rest = stat.get(stat.rfind(')')? + 1..)?.split_whitespace();
            let state = rest.next()?.chars().next()?;
            let ppid: i32 = rest.next()?.parse().ok()?;
            (ppid == me).then_some((pid, state))
        })
        .collect()
}

/// Whether this process has a child that `waitpid(-1)` could wait for: a worker, or a process
/// it adopted, running or exited. The orphan guard is not among them (it was double-forked
/// away before the launcher became a subreaper, see `watchdog`).
fn has_children() -> bool {
    let flags = WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT;
    // WNOWAIT: an exited child stays to be reaped by whoever waits for it.
    waitid(Id::All, flags) != Err(Errno::ECHILD)
}

/// Reaps adopted processes that have exited (zombies), leaving the workers to their threads.
/// Returns how many were reaped.
pub fn reap_zombies(workers: &[i32]) -> usize {
    children(workers)
        .into_iter()
        .filter(|(_, state)| *state == 'Z')
        .filter(|(pid, _)| waitpid(Pid::from_raw(*pid), Some(WaitPidFlag::WNOHANG)).is_ok())
        .count()
}

/// Adopted processes still running (not zombies), except `workers`.
pub fn running(workers: &[i32]) -> Vec<i32> {
    children(workers)
        .into_iter()
        .filter(|(_, state)| *state != 'Z')
        .map(|(pid, _)| pid)
        .collect()
}

/// Sends `signal` to each process and to the process group it leads (a `setsid` escapee leads
/// its own).
pub fn signal(pids: &[i32], signal: Signal) {
    for &pid in pids {
        let _ = killpg(Pid::from_raw(pid), signal);
        let _ = kill(Pid::from_raw(pid), signal);
    }
}

/// The process groups that still have a member.
pub fn alive(groups: &[Pid]) -> Vec<Pid> {
    groups
        .iter()
        .copied()
        .filter(|pg| killpg(*pg, None).is_ok())
        .collect()
}

/// Reaps every orphaned descendant that exited (re-parented to the launcher, a child
/// subreaper), so that dead workers' children do not linger as zombies. Only called once every
/// worker of the group has been waited for, so it cannot take a worker's exit status from its
/// wait thread.
pub fn reap_all() {
    use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
    loop {
        match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) | Err(_) => return,
            Ok(_) => continue,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    #[test]
    fn finds_reaps_and_stops_what_it_adopted() {
        // This test process becomes a subreaper, as `launch` is.
        nix::sys::prctl::set_child_subreaper(true).unwrap();
        // A child that leaves behind an escaped sleeper and a short-lived orphan.
        let status = Command::new("sh")
            .args(["-c", "setsid sleep 30 & (sleep 0.1 &) ; exit 0"])
            .status()
            .unwrap();
        assert!(status.success());
        std::thread::sleep(std::time::Duration::from_millis(600));
        let escaped = running(&[]);
        assert!(!escaped.is_empty(), "the setsid sleeper was not adopted");
        assert!(
            reap_zombies(&[]) >= 1,
            "the short-lived orphan stayed a zombie"
        );
        signal(&escaped, Signal::SIGKILL);
        std::thread::sleep(std::time::Duration::from_millis(300));
        reap_zombies(&[]);
        assert!(running(&[]).iter().all(|p| !escaped.contains(p)));
    }
}
