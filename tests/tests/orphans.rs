//! Nothing a worker started outlives a SIGKILL of `launch`: a `setsid` grandchild and a
//! double-forked daemon, with the job's cgroup (`cgroup.kill`); with the fallback (process
//! groups and a subreaper, `LAUNCH_CGROUP=off`), the daemon still goes, and the `setsid`
//! escapee is the case it cannot cover. Processes are found by the run id in their
//! environment, never assumed.

mod support;

use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use support::*;

const T: Duration = Duration::from_secs(60);

/// Per worker: the shell, a `setsid` grandchild (a session and group of its own), a daemon
/// double-forked by a subshell (re-parented away from the worker) and the worker's own sleep.
const SCRIPT: &str = "setsid sleep 60 & (sleep 61 &); exec sleep 62";

/// Starts two such workers, waits for all 6 processes, SIGKILLs `launch`; the run's processes
/// still alive 2 s later, by command line.
fn killed_launch_leaves(id: &str, cgroup: bool) -> Vec<String> {
    let mut cmd = launch_cmd(&[
        "--num-processes",
        "2",
        "--master-port",
        "0",
        "--run-id",
        id,
        "--",
        "sh",
        "-c",
        SCRIPT,
    ]);
    if !cgroup {
        cmd.env("LAUNCH_CGROUP", "off");
    }
    let mut launch = cmd.spawn().unwrap();
    // The shells and the subshell live for a moment beside the sleeps they start, so the
    // count alone can pass 6 on the way: wait for the settled set, by command line.
    let settled = [
        "sleep 60", "sleep 60", "sleep 61", "sleep 61", "sleep 62", "sleep 62",
    ];
    let start = Instant::now();
    let mut started = Vec::new();
    while start.elapsed() < T {
        started = command_lines(&processes_of_run(id));
        started.sort();
        if started == settled {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        started, settled,
        "2 x (sleep 62, setsid sleep 60, sleep 61)"
    );
    kill(Pid::from_raw(launch.id() as i32), Signal::SIGKILL).unwrap();
    let _ = launch.wait();
    std::thread::sleep(Duration::from_secs(2));
    let left = processes_of_run(id);
    let named = command_lines(&left);
    for &pid in &left {
        let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
    }
    named
}

/// The command lines of `pids`, arguments joined by spaces (empty for one already gone).
fn command_lines(pids: &[i32]) -> Vec<String> {
    pids.iter()
        .map(|pid| {
            let line = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            String::from_utf8_lossy(&line)
                .replace('\0', " ")
                .trim()
                .to_string()
        })
        .collect()
}

/// Whether `launch` would put this job in a cgroup here (its dry run says so).
fn cgroup_here() -> bool {
    let out = launch(&["--dry-run", "--", "true"], T);
    out.assert_code(0);
    let line = out.stdout.lines().find(|l| l.contains("orphans:"));
    let line = line.unwrap_or_else(|| panic!("no orphans line: {}", out.stdout));
    if !line.contains("the job's own cgroup") {
        eprintln!("skipped: no cgroup here ({line})");
        return false;
    }
    true
}

#[test]
fn with_a_cgroup_a_sigkill_of_launch_leaves_neither_a_setsid_grandchild_nor_a_daemon() {
    if !cgroup_here() {
        return;
    }
    let left = killed_launch_leaves(&unique_run_id("cgroup-kill"), true);
    assert_eq!(left, Vec::<String>::new(), "survived SIGKILL of launch");
}

#[test]
fn without_a_cgroup_the_daemon_goes_and_only_the_setsid_escapee_is_left() {
    let out = launch_cmd(&["--dry-run", "--", "true"])
        .env("LAUNCH_CGROUP", "off")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains("orphans:      the workers' process groups, with a child subreaper (no cgroup: LAUNCH_CGROUP=off; a worker's child that leaves its process group survives a SIGKILL of launch)"),
        "{said}"
    );
    let left = killed_launch_leaves(&unique_run_id("pgroup-kill"), false);
    assert_eq!(
        left,
        vec!["sleep 60", "sleep 60"],
        "what the fallback leaves"
    );
}
