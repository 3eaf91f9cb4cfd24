//! The orphan guard. Workers die with the launcher through PR_SET_PDEATHSIG, but their own
//! children would not: this small process, forked before any thread exists, holds the set of
//! worker process groups and, if the launcher vanishes without saying goodbye (e.g. SIGKILL),
//! kills every one of those groups. It must stay tiny: no allocation-heavy work, no threads.

use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd};

use nix::sys::signal::{killpg, SigHandler, Signal};
use nix::unistd::{ForkResult, Pid};

/// The launcher's end of the pipe to the guard.
pub struct Watchdog {
    pipe: std::fs::File,
    pid: Pid,
}

impl Watchdog {
    /// Forks the guard.
    ///
    /// # Safety contract
    /// Must be called while the process has a single thread (before the signal thread, output
    /// threads or any worker exist), because the child keeps running Rust code after `fork`.
    pub fn start() -> std::io::Result<Watchdog> {
        let (read_end, write_end) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
        // SAFETY: called before any other thread exists (see above); the child only reads the
        // pipe, calls killpg and _exit.
        match unsafe { fork_unannounced() }? {
            ForkResult::Parent { child } => {
                drop(read_end);
                Ok(Watchdog {
                    pipe: std::fs::File::from(write_end),
                    pid: child,
                })
            }
            ForkResult::Child => {
                drop(write_end);
                guard(read_end)
            }
        }
    }

    /// The guard's pid (a child of the launcher that must be left alone).
    pub fn pid(&self) -> i32 {
        self.pid.as_raw()
    }

    /// From now on, kill group `pgid` if the launcher dies.
    pub fn watch(&mut self, pgid: i32) {
        self.say(&format!("+{pgid}\n"));
    }

    /// The group is gone (torn down and reaped); stop watching it.
    pub fn forget(&mut self, pgid: i32) {
        self.say(&format!("-{pgid}\n"));
    }

    /// Normal exit: the guard leaves without killing anything. It is not waited for: `launch`
    /// exits next, and whoever adopts the guard then reaps it (its exit tells nobody while
    /// `launch` runs, see [`fork_unannounced`]).
    pub fn disarm(mut self) {
        self.say("x\n");
    }

    /// One message in one write: under `PIPE_BUF`, so the guard never reads half of one.
    fn say(&mut self, message: &str) {
        let _ = self.pipe.write_all(message.as_bytes());
    }
}

/// `fork`, except that the child's end sends no SIGCHLD (clone's exit signal 0). Waits that do
/// not ask for `__WALL` or `__WCLONE` do not see such a child at all, so the guard does not
/// count among the launcher's children: "no child left" then means no worker and no adopted
/// process (see [`crate::adopted`]), found with one `waitid` instead of a scan of `/proc`.
///
/// # Safety
/// As `fork` in a process with one thread; glibc's fork handlers do not run, so the child may
/// only use what needs none of them (system calls, this thread's allocator).
unsafe fn fork_unannounced() -> nix::Result<ForkResult> {
    // No flags and no new stack: a copy of this process that resumes here, as fork's does.
    match libc::syscall(
        libc::SYS_clone,
        0 as libc::c_ulong,
        0 as libc::c_ulong,
        0,
        0,
        0,
    ) {
        -1 => Err(nix::errno::Errno::last()),
        0 => Ok(ForkResult::Child),
        pid => Ok(ForkResult::Parent {
            child: Pid::from_raw(pid as i32),
        }),
    }
}

fn guard(pipe: OwnedFd) -> ! {
    // A session of its own: `kill -9 -PGID`, a terminal's Ctrl-C / Ctrl-\ / hang-up and
    // `timeout` signal the launcher's whole process group, and the guard must outlive the
    // launcher to do its job. It still leaves on its own once the launcher is gone.
    let _ = nix::unistd::setsid();
    // SAFETY: setting a signal to SIG_IGN is always sound.
    unsafe {
        for signal in [
            Signal::SIGINT,
            Signal::SIGHUP,
            Signal::SIGTERM,
            Signal::SIGQUIT,
            Signal::SIGTSTP,
            Signal::SIGPIPE,
        ] {
            let _ = nix::sys::signal::signal(signal, SigHandler::SigIgn);
        }
    }
    // Do not hold the console or a test harness's pipes open.
    if let Ok(null) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
    {
        for fd in 0..3 {
            // SAFETY: dup2 onto the standard descriptors of this single-threaded child.
            unsafe { libc::dup2(null.as_raw_fd(), fd) };
        }
    }
    // SAFETY: PR_SET_NAME with a NUL-terminated 16-byte buffer.
    unsafe { libc::prctl(libc::PR_SET_NAME, c"launch-watchdog".as_ptr()) };

    let mut groups: Vec<i32> = Vec::new();
    let mut pending: Vec<u8> = Vec::new();
    let mut buf = [0u8; 512];
    let disarmed = loop {
        match nix::unistd::read(&pipe, &mut buf) {
            Ok(0) => break false,
            Ok(n) => pending.extend_from_slice(&buf[..n]),
            Err(nix::errno::Errno::EINTR) => continue,
            Err(_) => break false,
        }
        let mut disarmed = false;
        while let Some(pos) = pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = pending.drain(..=pos).collect();
            let text = std::str::from_utf8(&line[..line.len() - 1]).unwrap_or("");
            if text == "x" {
                disarmed = true;
            } else if let Some(n) = text.strip_prefix('+').and_then(|n| n.parse().ok()) {
                groups.push(n);
            } else if let Some(n) = text.strip_prefix('-').and_then(|n| n.parse::<i32>().ok()) {
                groups.retain(|g| *g != n);
            }
        }
        if disarmed {
            break true;
        }
    };
    if !disarmed {
        for pgid in &groups {
            let _ = killpg(Pid::from_raw(*pgid), Signal::SIGKILL);
        }
        // What the killed workers had not unlinked yet, once they are gone (reaped by init).
        for wait_ms in [100, 400, 1500] {
            std::thread::sleep(std::time::Duration::from_millis(wait_ms));
            crate::shm_sweep::sweep_stale();
        }
    }
    // SAFETY: leaving the forked child without running the parent's destructors or atexit hooks.
    unsafe { libc::_exit(0) }
}
