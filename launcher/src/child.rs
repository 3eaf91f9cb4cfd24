//! Starting a worker process through the standard library's `Command`: its own process group,
//! stdin on `/dev/null`, both output streams piped, and, between fork and exec (`pre_exec`),
//! what `posix_spawn` cannot do: the job's cgroup joined, descriptors handed down under fixed
//! numbers, SIGUSR1 ignored, PR_SET_PDEATHSIG with the check that the launcher still lives,
//! and the CPU affinity. std resets the signal mask and SIGPIPE's disposition in the child,
//! finds the program as `execvp` does and reports an exec that failed as the spawn's error.
//!
//! Owns: the child's side between fork and exec, and reaping a child by its pid. Must not:
//! decide what the worker gets (the supervisor's spawn does) or wait for it beyond [`wait`].

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{ExitStatus, Stdio};
use std::sync::Once;

/// What to start: the program (looked up in `PATH` as `execvp` does), its arguments, changes to
/// the launcher's environment, descriptors handed down, CPU affinity, signal set-up, the job's
/// cgroup. Output is always piped ([`Child::stdout`], [`Child::stderr`]); stdin is
/// `/dev/null`. The child leads a process group of its own and is killed when the thread that
/// spawned it ends.
pub struct Command {
    inner: std::process::Command,
    /// (launcher's descriptor, number in the child), applied in this order.
    hand_downs: Vec<(RawFd, RawFd)>,
    cpus: Option<nix::sched::CpuSet>,
    ignore_usr1: bool,
    /// The job cgroup's `cgroup.procs`, open for writing: the child moves itself there.
    cgroup_procs: Option<RawFd>,
}

/// A started worker, and the read ends of its output.
pub struct Child {
    pub pid: i32,
    pub stdout: File,
    pub stderr: File,
}

impl Command {
    /// `program` with `args` (a NUL byte in any of them is refused at the spawn).
    pub fn new(program: &OsStr, args: &[OsString]) -> io::Result<Command> {
        let mut inner = std::process::Command::new(program);
        inner
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Own process group: teardown reaches the worker's children, and the terminal's
            // Ctrl-C reaches only the launcher, which forwards it.
            .process_group(0);
        Ok(Command {
            inner,
            hand_downs: Vec::new(),
            cpus: None,
            ignore_usr1: false,
            cgroup_procs: None,
        })
    }

    pub fn env(&mut self, name: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> &mut Command {
        self.inner.env(name, value);
        self
    }

    pub fn envs<K, V>(&mut self, vars: impl IntoIterator<Item = (K, V)>) -> &mut Command
    where
        K: AsRef<OsStr>,
        V: AsRef<OsStr>,
    {
        self.inner.envs(vars);
        self
    }

    pub fn env_remove(&mut self, name: impl AsRef<OsStr>) -> &mut Command {
        self.inner.env_remove(name);
        self
    }

    /// Makes the launcher's `fd` descriptor `number` in the child, open across its exec.
    /// `number` must be one of [`HANDED_DOWN`], which the launcher holds on `/dev/null` so that
    /// no descriptor std uses for the spawn itself can have that number.
    pub fn hand_down(&mut self, fd: RawFd, number: RawFd) -> &mut Command {
        debug_assert!(HANDED_DOWN.contains(&number), "{number} is not reserved");
        self.hand_downs.push((fd, number));
        self
    }

    /// Runs the child on `cpus` only, from before its exec (all its threads start there).
    pub fn pin(&mut self, cpus: nix::sched::CpuSet) -> &mut Command {
        self.cpus = Some(cpus);
        self
    }

    /// Starts the child with SIGUSR1 ignored (an ignored disposition survives exec).
    pub fn ignore_usr1(&mut self) -> &mut Command {
        self.ignore_usr1 = true;
        self
    }

    /// Starts the child inside the cgroup whose `cgroup.procs` is open as `procs` (it must
    /// stay open until the spawn returns).
    pub fn join_cgroup(&mut self, procs: RawFd) -> &mut Command {
        self.cgroup_procs = Some(procs);
        self
    }

    /// Starts the child; returns once it has exec'd, or with the reason it could not.
    pub fn spawn(mut self) -> io::Result<Child> {
        reserve_handed_down_numbers();
        let set_up = SetUp {
            hand_downs: std::mem::take(&mut self.hand_downs),
            cpus: self.cpus,
            ignore_usr1: self.ignore_usr1,
            cgroup_procs: self.cgroup_procs,
            launcher: std::process::id() as libc::pid_t,
        };
        // SAFETY: `SetUp::run` makes system calls only (no allocation, no lock), as the
        // time between fork and exec requires.
        unsafe { self.inner.pre_exec(move || set_up.run()) };
        let mut child = self.inner.spawn()?;
        let piped = || io::Error::other("a piped stream is missing");
        let stream = |s: Option<OwnedFd>| s.map(File::from).ok_or_else(piped);
        Ok(Child {
            pid: child.id() as i32,
            stdout: stream(child.stdout.take().map(OwnedFd::from))?,
            stderr: stream(child.stderr.take().map(OwnedFd::from))?,
        })
    }
}

/// The descriptor numbers workers are handed: the progress pipe and the store's listener.
pub const HANDED_DOWN: [RawFd; 2] = [
    common::progress::PROGRESS_FD,
    common::env_contract::STORE_FD,
];

/// Holds each number of [`HANDED_DOWN`] that is free on `/dev/null` (close-on-exec), once:
/// std's spawn opens a pipe of its own (to hear of a failed exec), which must not get a number
/// the child then overwrites with a handed-down descriptor.
fn reserve_handed_down_numbers() {
    static RESERVED: Once = Once::new();
    RESERVED.call_once(|| {
        let Ok(null) = File::open("/dev/null") else {
            return;
        };
        for number in HANDED_DOWN {
            // SAFETY: F_GETFD only asks whether the number is open; dup3 puts a close-on-exec
            // duplicate of our /dev/null there, only where nothing was (nothing of anyone's
            // is replaced).
            unsafe {
                if libc::fcntl(number, libc::F_GETFD) == -1 {
                    libc::dup3(null.as_raw_fd(), number, libc::O_CLOEXEC);
                }
            }
        }
    });
}

/// What the child does between fork and exec, prepared by the parent.
struct SetUp {
    hand_downs: Vec<(RawFd, RawFd)>,
    cpus: Option<nix::sched::CpuSet>,
    ignore_usr1: bool,
    cgroup_procs: Option<RawFd>,
    launcher: libc::pid_t,
}

impl SetUp {
    /// In the forked child: system calls only, the first failure returned (std reports it as
    /// the spawn's error).
    fn run(&self) -> io::Result<()> {
        let check = |ret: libc::c_int| match ret {
            -1 => Err(io::Error::last_os_error()),
            _ => Ok(()),
        };
        // SAFETY: each call is a system call on values the parent prepared, in the child.
        unsafe {
            if let Some(procs) = self.cgroup_procs {
                // "0" moves the writing process: from here on all it starts is in the cgroup.
                if libc::write(procs, b"0".as_ptr().cast(), 1) != 1 {
                    return Err(io::Error::last_os_error());
                }
            }
            for &(from, to) in &self.hand_downs {
                check(if from == to {
                    libc::fcntl(to, libc::F_SETFD, 0)
                } else {
                    libc::dup2(from, to)
                })?;
            }
            if self.ignore_usr1 {
                libc::signal(libc::SIGUSR1, libc::SIG_IGN);
            }
            // Die with the launcher, even if it is SIGKILLed (the spawning thread is the main
            // thread, which lives as long as the launcher).
            check(libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL))?;
            if libc::getppid() != self.launcher {
                // The launcher died before prctl took effect.
                return Err(io::Error::from_raw_os_error(libc::ESRCH));
            }
            if let Some(cpus) = &self.cpus {
                nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), cpus)?;
            }
        }
        Ok(())
    }
}

/// Waits for child `pid` to end, reaping it.
pub fn wait(pid: i32) -> io::Result<ExitStatus> {
    use nix::sys::wait::waitpid;
    loop {
        match waitpid(nix::unistd::Pid::from_raw(pid), None) {
            Ok(status) => return Ok(exit_status(status)),
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// Child `pid`'s status if it has ended and can be reaped now (it is reaped), else `None`.
pub fn try_wait(pid: i32) -> io::Result<Option<ExitStatus>> {
    use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
    loop {
        match waitpid(nix::unistd::Pid::from_raw(pid), Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) => return Ok(None),
            Ok(status) => return Ok(Some(exit_status(status))),
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// The wait status as std's `ExitStatus` (a raw status word, as `waitpid` fills it).
fn exit_status(status: nix::sys::wait::WaitStatus) -> ExitStatus {
    use nix::sys::wait::WaitStatus;
    match status {
        WaitStatus::Exited(_, code) => ExitStatus::from_raw((code & 0xff) << 8),
        WaitStatus::Signaled(_, signal, core) => {
            ExitStatus::from_raw(signal as i32 | if core { 0x80 } else { 0 })
        }
        // Not asked for (no WUNTRACED / WCONTINUED): cannot be seen; say killed rather than
        // pretend a success.
        _ => ExitStatus::from_raw(libc::SIGKILL),
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use common::progress::PROGRESS_FD;
    use nix::fcntl::OFlag;
    use std::io::Read;

    fn run(command: Command) -> (ExitStatus, String, String) {
        let mut child = command.spawn().expect("spawn");
        let (mut out, mut err) = (String::new(), String::new());
        child.stdout.read_to_string(&mut out).unwrap();
        child.stderr.read_to_string(&mut err).unwrap();
        (wait(child.pid).unwrap(), out, err)
    }

    /// Arguments, environment changes, both streams and the exit code arrive as given.
    #[test]
    fn runs_a_program_with_its_arguments_environment_and_streams() {
        let mut command = Command::new(
            OsStr::new("sh"),
            &[
                "-c".into(),
                "echo \"$A $1\"; echo \"${HOME-unset}\" >&2; exit 3".into(),
                "sh".into(),
                "x y".into(),
            ],
        )
        .unwrap();
        command.env("A", "a").env_remove("HOME");
        let (status, out, err) = run(command);
        assert_eq!(status.code(), Some(3));
        assert_eq!(out, "a x y\n");
        assert_eq!(err, "unset\n");
    }

    /// A program that is not there is an error of the spawn itself, as with std's `Command`.
    #[test]
    fn a_missing_program_is_an_error() {
        let command = Command::new(OsStr::new("/nonexistent/program"), &[]).unwrap();
        let e = command.spawn().err().expect("no such program");
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
        let command = Command::new(OsStr::new("no-such-program-here"), &[]).unwrap();
        assert_eq!(
            command.spawn().err().map(|e| e.kind()),
            Some(io::ErrorKind::NotFound)
        );
    }

    /// The child leads its own group, has PR_SET_PDEATHSIG set, SIGPIPE at its default, SIGUSR1
    /// ignored when asked, runs on the CPUs it was given and gets a handed-down descriptor.
    #[test]
    fn the_child_is_set_up_before_it_execs() {
        let (read, write) = nix::unistd::pipe2(OFlag::O_CLOEXEC).unwrap();
        // `exec`: the status read is the shell's own, not that of a shell busy starting grep.
        let script = "set -e; test \"$(cut -d' ' -f5 /proc/$$/stat)\" = $$; echo here >&3; \
            exec grep -E '^(Cpus_allowed_list|SigIgn|SigBlk)' /proc/self/status";
        let mut command = Command::new(OsStr::new("sh"), &["-c".into(), script.into()]).unwrap();
        // One CPU this process may use (CPU 0 may not be one of them).
        use nix::sched::{sched_getaffinity, CpuSet};
        let allowed = sched_getaffinity(nix::unistd::Pid::from_raw(0)).unwrap();
        let first = (0..CpuSet::count())
            .find(|&c| allowed.is_set(c).unwrap_or(false))
            .unwrap();
        let mut cpus = CpuSet::new();
        cpus.set(first).unwrap();
        command
            .hand_down(write.as_raw_fd(), PROGRESS_FD)
            .pin(cpus)
            .ignore_usr1();
        let (status, out, err) = run(command);
        drop(write);
        assert!(status.success(), "{out}{err}");
        assert!(
            out.contains(&format!("Cpus_allowed_list:\t{first}\n")),
            "{out}"
        );
        let mask = |name: &str| {
            let line = out.lines().find(|l| l.starts_with(name)).unwrap();
            u64::from_str_radix(line.rsplit('\t').next().unwrap(), 16).unwrap()
        };
        // sh itself ignores nothing by default: SIGUSR1 (bit 9) is ours, SIGPIPE (bit 12) not.
        assert_eq!(
            mask("SigIgn:") & (1 << (libc::SIGUSR1 - 1)),
            1 << (libc::SIGUSR1 - 1),
            "{out}"
        );
        assert_eq!(mask("SigIgn:") & (1 << (libc::SIGPIPE - 1)), 0, "{out}");
        assert_eq!(mask("SigBlk:"), 0, "{out}");
        let mut said = String::new();
        File::from(read).read_to_string(&mut said).unwrap();
        assert_eq!(said, "here\n");
    }

    /// The child dies with the thread that started it (PR_SET_PDEATHSIG), as workers die with
    /// the launcher's main thread.
    #[test]
    fn the_child_dies_with_the_thread_that_spawned_it() {
        let command = Command::new(OsStr::new("sleep"), &["30".into()]).unwrap();
        let child = std::thread::spawn(move || command.spawn().unwrap())
            .join()
            .unwrap();
        let status = wait(child.pid).unwrap();
        assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
    }

    /// Several children run before any is waited for, each from a command already consumed:
    /// each keeps its own arguments, environment and output.
    #[test]
    fn children_started_together_keep_their_own_arguments() {
        let started: Vec<Child> = (0..4)
            .map(|i| {
                let mut command = Command::new(
                    OsStr::new("sh"),
                    &[
                        "-c".into(),
                        "echo \"$1 $N\"".into(),
                        "sh".into(),
                        format!("arg{i}").into(),
                    ],
                )
                .unwrap();
                command.env("N", format!("n{i}"));
                command.spawn().unwrap()
            })
            .collect();
        for (i, mut child) in started.into_iter().enumerate() {
            let mut out = String::new();
            child.stdout.read_to_string(&mut out).unwrap();
            assert!(wait(child.pid).unwrap().success());
            assert_eq!(out, format!("arg{i} n{i}\n"));
        }
    }

    /// `execvp`'s rules: a file without `#!` is run by `/bin/sh`; a file that may not be run
    /// is EACCES (and the search goes on past it); an empty name is not found.
    #[test]
    fn programs_are_found_and_run_as_execvp_does() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("plain-script");
        std::fs::write(&script, "echo \"plain $1\"\n").unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        let command = Command::new(script.as_os_str(), &["x".into()]).unwrap();
        let (status, out, err) = run(command);
        assert!(status.success(), "{err}");
        assert_eq!(out, "plain x\n");

        let denied = dir.path().join("not-executable");
        std::fs::write(&denied, "#!/bin/sh\n").unwrap();
        let e = Command::new(denied.as_os_str(), &[]).unwrap().spawn().err();
        assert_eq!(e.map(|e| e.raw_os_error()), Some(Some(libc::EACCES)));

        let e = Command::new(OsStr::new(""), &[]).unwrap().spawn().err();
        assert_eq!(e.map(|e| e.kind()), Some(io::ErrorKind::NotFound));
    }
}
