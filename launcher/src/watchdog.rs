//! The orphan guard: a plain helper process (this binary, run as `launch --orphan-guard`)
//! that outlives the launcher when the launcher is killed without a word (SIGKILL, the OOM
//! killer), and then kills what the workers left: the job's cgroup as one act (`cgroup.kill`,
//! where [`crate::cgroup`] could make one), and every worker process group it was told of; then
//! it execs itself without the launcher's environment (`--orphan-guard-sweep`) to sweep what the
//! killed workers left in `/dev/shm` once they are gone. Workers die with the launcher through
//! PR_SET_PDEATHSIG, but their own children would not.
//!
//! The launcher tells it over a pipe, one line each: `+PGID` (watch), `-PGID` (forget), `d`
//! (a normal end: leave). The end of the pipe without `d` means the launcher is gone. The
//! guard is in a session of its own (a terminal's Ctrl-C or `kill -- -PGID` to the launcher's
//! group does not reach it), ignores the signals that end a job, and is not the launcher's
//! child (it is started through a double fork, before the launcher becomes a subreaper), so
//! the launcher's reaping of adopted processes never meets it.
//!
//! Owns: the guard's life, and the list of groups it kills. Must not: decide when a worker is
//! stopped while the launcher lives (the supervisor does).

use std::io::{BufRead as _, Write as _};
use std::os::unix::process::CommandExt as _;
use std::path::PathBuf;
use std::process::{ChildStdin, Stdio};

use nix::sys::signal::{killpg, signal, SigHandler, Signal};
use nix::unistd::Pid;

use crate::cgroup::JobCgroup;

/// The hidden first argument that runs this binary as the guard (the cgroup's directory, if
/// any, follows).
pub const GUARD_ARG: &str = "--orphan-guard";

/// The hidden first argument of the guard's sweep after a kill (the cgroup's directory, if
/// any, follows).
pub const SWEEP_ARG: &str = "--orphan-guard-sweep";

/// The launcher's end of the pipe to the guard, and the job's cgroup if it has one.
pub struct Watchdog {
    pipe: Option<ChildStdin>,
    cgroup: Option<JobCgroup>,
}

impl Watchdog {
    /// Makes the job's cgroup where it can and starts the guard. Call before the launcher
    /// becomes a child subreaper (the guard must not be re-parented to it).
    pub fn start() -> std::io::Result<Watchdog> {
        let cgroup = match JobCgroup::create() {
            Ok(c) => Some(c),
            Err(why) => {
                tracing::debug!("no cgroup for the job: {why}");
                None
            }
        };
        let mut command = std::process::Command::new("/proc/self/exe");
        command
            .arg0("launch-watchdog")
            .arg(GUARD_ARG)
            .args(cgroup.as_ref().map(|c| c.dir().as_os_str()))
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: setsid and fork are async-signal-safe; the intermediate process leaves with
        // `_exit` at once, the guard goes on to its exec.
        unsafe {
            command.pre_exec(|| {
                libc::setsid();
                match libc::fork() {
                    -1 => Err(std::io::Error::last_os_error()),
                    0 => Ok(()),
                    _ => libc::_exit(0),
                }
            });
        }
        let mut intermediate = command.spawn()?;
        let pipe = intermediate.stdin.take();
        intermediate.wait()?;
        Ok(Watchdog { pipe, cgroup })
    }

    /// The job's cgroup, where the workers start.
    pub fn cgroup(&self) -> Option<&JobCgroup> {
        self.cgroup.as_ref()
    }

    /// From now on, kill group `pgid` if the launcher dies.
    pub fn watch(&mut self, pgid: i32) {
        self.say(&format!("+{pgid}"));
    }

    /// The group is gone (torn down and reaped); stop watching it.
    pub fn forget(&mut self, pgid: i32) {
        self.say(&format!("-{pgid}"));
    }

    /// What the workers left that nothing else stopped: everything still in the job's cgroup
    /// is killed (the teardown's last step). The processes it found, if any.
    pub fn kill_leftovers(&self) -> bool {
        match &self.cgroup {
            Some(c) if c.populated() => {
                c.kill();
                true
            }
            _ => false,
        }
    }

    /// Says the job's peak memory and processes, where its cgroup has the controllers that
    /// count them (at the run's end).
    pub fn report_peaks(&self) {
        let Some(cgroup) = &self.cgroup else {
            return;
        };
        let (memory, pids) = cgroup.peaks();
        let parts: Vec<String> = memory
            .map(|b| format!("peak memory {:.1} MiB", b as f64 / (1u64 << 20) as f64))
            .into_iter()
            .chain(pids.map(|n| format!("at most {n} processes")))
            .collect();
        if !parts.is_empty() {
            tracing::info!("the job's cgroup: {}", parts.join(", "));
        }
    }

    /// Normal exit: the guard leaves without killing anything; the cgroup is removed.
    pub fn disarm(mut self) {
        self.say("d");
        self.pipe = None;
        self.cgroup = None;
    }

    fn say(&mut self, line: &str) {
        // A guard that is gone cannot be told (and the pipe's error is no reason to stop).
        if let Some(pipe) = &mut self.pipe {
            if writeln!(pipe, "{line}").is_err() {
                tracing::warn!("the orphan guard is gone: workers may outlive a killed launch");
                self.pipe = None;
            }
        }
    }
}

/// The guard (`launch --orphan-guard [CGROUP]`): reads the launcher's lines until the pipe
/// ends, then leaves (told `d`) or kills and sweeps.
pub fn guard_main(cgroup: Option<PathBuf>) -> ! {
    for sig in [
        Signal::SIGINT,
        Signal::SIGHUP,
        Signal::SIGTERM,
        Signal::SIGQUIT,
        Signal::SIGTSTP,
        Signal::SIGPIPE,
    ] {
        // SAFETY: setting a disposition to SIG_IGN is always sound.
        let _ = unsafe { signal(sig, SigHandler::SigIgn) };
    }
    let mut groups = std::collections::BTreeSet::new();
    let mut disarmed = false;
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        match (line.split_at_checked(1), line.as_str()) {
            (_, "d") => disarmed = true,
            (Some(("+", pgid)), _) => groups.extend(pgid.parse::<i32>().ok()),
            (Some(("-", pgid)), _) => {
                pgid.parse::<i32>().ok().map(|p| groups.remove(&p));
            }
            _ => {}
        }
    }
    if disarmed {
        std::process::exit(0);
    }
    if let Some(dir) = &cgroup {
        crate::cgroup::kill(dir);
    }
    for &pgid in groups.iter().filter(|&&p| p > 0) {
        let _ = killpg(Pid::from_raw(pgid), Signal::SIGKILL);
    }
    // The sweep waits for the killed to be gone: a fresh program without the launcher's
    // environment (nothing that carries the job's variables lingers), as `launch
    // --orphan-guard-sweep [CGROUP]`; inline where it cannot be started.
    let e = std::process::Command::new("/proc/self/exe")
        .arg0("launch-watchdog")
        .arg(SWEEP_ARG)
        .args(&cgroup)
        .env_clear()
        .exec();
    tracing::debug!("cannot exec the sweep: {e}");
    sweep_main(cgroup)
}

/// After the launcher was killed and its workers with it: what they had not unlinked in
/// `/dev/shm`, once they are gone, and the job's cgroup.
pub fn sweep_main(cgroup: Option<PathBuf>) -> ! {
    for wait_ms in [100, 400, 1500] {
        std::thread::sleep(std::time::Duration::from_millis(wait_ms));
        crate::shm_sweep::sweep_stale();
    }
    if let Some(dir) = &cgroup {
        crate::cgroup::kill_and_remove(dir);
    }
    std::process::exit(0)
}
