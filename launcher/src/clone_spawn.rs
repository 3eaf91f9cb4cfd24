//! Starting a worker process: `clone(CLONE_VM)`, so the launcher's memory is neither copied for
//! the child nor torn down again at its `exec` (std's `Command` forks whenever a step must run
//! before `exec`, which costs a few hundred microseconds per worker), and without
//! `CLONE_VFORK`, so the launcher starts the next worker while this one sets up and execs (a
//! vfork'd parent waits through the child's set-up and the first half of its exec, a tenth of
//! a millisecond here, for each worker in turn). Between clone and exec the child does what
//! `posix_spawn` cannot: PR_SET_PDEATHSIG (with the check that the launcher still lives), its
//! CPU affinity, an ignored SIGUSR1, and descriptors handed down under fixed numbers.
//!
//! The child runs beside the launcher in the launcher's memory, so it makes raw system calls
//! only ([`crate::raw_sys`]: no allocation, no lock, no `errno`), and finds its program as
//! `execvp` does from a list the launcher made. The kernel tells the launcher when the child
//! has exec'd or ended: it clears the child's thread id in [`Setup::running`] and wakes a futex
//! there (`CLONE_CHILD_CLEARTID`, as for a thread), and only then may the launcher free what
//! the child reads.
//!
//! Owns: the child's side between clone and exec, and reporting why an exec failed. Must not:
//! decide what the worker gets (the supervisor's spawn does) or wait for it beyond [`Child`].

use std::collections::BTreeMap;
use std::ffi::{c_char, CString, OsStr, OsString};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::atomic::{AtomicI32, AtomicPtr, Ordering};

use nix::fcntl::OFlag;

use crate::raw_sys as raw;

/// The child's stack while it sets up and execs. Only the pages it touches are ever allocated.
const STACK_BYTES: usize = 64 * 1024;

/// Where `execvp` looks when `PATH` is not set (glibc's `_CS_PATH`).
const DEFAULT_PATH: &[u8] = b"/bin:/usr/bin";

/// What to start: the program (looked up in `PATH` as `execvp` does), its arguments, changes to
/// the launcher's environment, descriptors handed down, CPU affinity, signal set-up. Output is
/// always piped ([`Child::stdout`], [`Child::stderr`]); stdin is `/dev/null`. The child leads a
/// process group of its own and is killed when the thread that spawned it ends.
pub struct Command {
    argv: Vec<CString>,
    /// Variables set (`Some`) or removed (`None`), the last word for each name kept.
    env: BTreeMap<OsString, Option<OsString>>,
    /// (launcher's descriptor, number in the child), applied in this order after stdio.
    hand_downs: Vec<(RawFd, RawFd)>,
    cpus: Option<libc::cpu_set_t>,
    ignore_usr1: bool,
}

/// A started worker, and the read ends of its output.
pub struct Child {
    pub pid: i32,
    pub stdout: File,
    pub stderr: File,
}

/// A child cloned, perhaps not exec'd yet: [`Starting::finish`] waits until it has.
pub struct Starting {
    pid: i32,
    in_flight: InFlight,
    stdout: File,
    stderr: File,
}

impl Command {
    /// `program` with `args` (a NUL byte in any of them is refused).
    pub fn new(program: &OsStr, args: &[OsString]) -> io::Result<Command> {
        let argv = std::iter::once(program)
            .chain(args.iter().map(OsString::as_os_str))
            .map(c_string)
            .collect::<io::Result<_>>()?;
        Ok(Command {
            argv,
            env: BTreeMap::new(),
            hand_downs: Vec::new(),
            cpus: None,
            ignore_usr1: false,
        })
    }

    pub fn env(&mut self, name: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> &mut Command {
        let value = value.as_ref().to_os_string();
        self.env.insert(name.as_ref().to_os_string(), Some(value));
        self
    }

    pub fn envs<K, V>(&mut self, vars: impl IntoIterator<Item = (K, V)>) -> &mut Command
    where
        K: AsRef<OsStr>,
        V: AsRef<OsStr>,
    {
        for (name, value) in vars {
            self.env(name, value);
        }
        self
    }

    pub fn env_remove(&mut self, name: impl AsRef<OsStr>) -> &mut Command {
        self.env.insert(name.as_ref().to_os_string(), None);
        self
    }

    /// Makes the launcher's `fd` descriptor `number` in the child, open across its exec.
    pub fn hand_down(&mut self, fd: RawFd, number: RawFd) -> &mut Command {
        self.hand_downs.push((fd, number));
        self
    }

    /// Runs the child on `cpus` only, from before its exec (all its threads start there).
    pub fn pin(&mut self, cpus: libc::cpu_set_t) -> &mut Command {
        self.cpus = Some(cpus);
        self
    }

    /// Starts the child with SIGUSR1 ignored (an ignored disposition survives exec).
    pub fn ignore_usr1(&mut self) -> &mut Command {
        self.ignore_usr1 = true;
        self
    }

    /// Starts the child; returns once it has exec'd, or with the reason it could not.
    #[cfg(test)]
    pub fn spawn(&self) -> io::Result<Child> {
        self.start()?.finish()
    }

    /// Clones the child and returns at once, while it sets up and execs.
    pub fn start(&self) -> io::Result<Starting> {
        let envp = self.environment()?;
        let null = File::open("/dev/null")?; // close-on-exec, as std opens everything
        let (out_read, out_write) = nix::unistd::pipe2(OFlag::O_CLOEXEC)?;
        let (err_read, err_write) = nix::unistd::pipe2(OFlag::O_CLOEXEC)?;
        let mut fds = vec![(null.as_raw_fd(), 0), (out_write.as_raw_fd(), 1)];
        fds.push((err_write.as_raw_fd(), 2));
        fds.extend_from_slice(&self.hand_downs);
        let setup = Box::new(Setup::new(self, envp, fds)?);
        let in_flight = InFlight {
            stack: Stack::new(STACK_BYTES)?,
            setup,
        };
        let pid = in_flight.clone_child()?;
        // The child has copies of these in its own descriptor table now.
        drop((null, out_write, err_write));
        Ok(Starting {
            pid,
            in_flight,
            stdout: File::from(out_read),
            stderr: File::from(err_read),
        })
    }

    /// The launcher's environment with this command's changes, as `NAME=value` strings.
    fn environment(&self) -> io::Result<Vec<CString>> {
        let inherited = std::env::vars_os().filter(|(name, _)| !self.env.contains_key(name));
        let changed = self
            .env
            .iter()
            .filter_map(|(name, value)| Some((name.clone(), value.clone()?)));
        inherited
            .chain(changed)
            .map(|(name, value)| {
                let mut pair = name.into_vec();
                pair.push(b'=');
                pair.extend_from_slice(value.as_bytes());
                c_string(OsStr::from_bytes(&pair))
            })
            .collect()
    }
}

impl Starting {
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Waits until the child has exec'd; if it could not, reaps it and says why.
    pub fn finish(self) -> io::Result<Child> {
        self.in_flight.wait();
        match self.in_flight.setup.error.load(Ordering::SeqCst) {
            0 => Ok(Child {
                pid: self.pid,
                stdout: self.stdout,
                stderr: self.stderr,
            }),
            errno => {
                // It has exited (127) without exec'ing: reap it.
                let _ = wait(self.pid);
                Err(io::Error::from_raw_os_error(errno))
            }
        }
    }
}

/// Waits for child `pid` to end, reaping it.
pub fn wait(pid: i32) -> io::Result<ExitStatus> {
    let mut status = 0;
    loop {
        // SAFETY: waitpid writes the status into a local.
        if unsafe { libc::waitpid(pid, &mut status, 0) } == pid {
            return Ok(ExitStatus::from_raw(status));
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Child `pid`'s status if it has ended and can be reaped now (it is reaped), else `None`.
pub fn try_wait(pid: i32) -> io::Result<Option<ExitStatus>> {
    let mut status = 0;
    loop {
        // SAFETY: waitpid writes the status into a local.
        match unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } {
            0 => return Ok(None),
            -1 if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted => continue,
            -1 => return Err(io::Error::last_os_error()),
            _ => return Ok(Some(ExitStatus::from_raw(status))),
        }
    }
}

fn c_string(text: &OsStr) -> io::Result<CString> {
    CString::new(text.as_bytes()).map_err(|_| {
        let shown = text.to_string_lossy();
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("NUL byte in {shown:?}"),
        )
    })
}

fn null_terminated(strings: &[CString]) -> Vec<*const c_char> {
    let mut pointers: Vec<*const c_char> = strings.iter().map(|s| s.as_ptr()).collect();
    pointers.push(std::ptr::null());
    pointers
}

/// The paths `execvp` would try for `program`, in its order: `program` itself if it names a
/// directory, else each `PATH` entry joined with it (an empty entry is the working directory).
fn candidates(program: &CString) -> io::Result<Vec<CString>> {
    let name = program.as_bytes();
    if name.is_empty() {
        return Ok(Vec::new()); // ENOENT, as execvp says
    }
    if name.contains(&b'/') {
        return Ok(vec![program.clone()]);
    }
    let path = std::env::var_os("PATH");
    let path = path.as_ref().map_or(DEFAULT_PATH, |p| p.as_bytes());
    path.split(|&b| b == b':')
        .map(|dir| {
            let mut full = dir.to_vec();
            if !dir.is_empty() {
                full.push(b'/');
            }
            full.extend_from_slice(name);
            c_string(OsStr::from_bytes(&full))
        })
        .collect()
}

/// Everything the child reads between clone and exec, prepared by the parent and kept, at a
/// fixed address, until the child has exec'd or exited (the child must not allocate: it runs
/// in the parent's memory while the parent goes on).
struct Setup {
    /// Owns what `argv`, `envp`, `candidates` and `script_argv` point at.
    _strings: [Vec<CString>; 3],
    candidates: Vec<*const c_char>,
    argv: Vec<*const c_char>,
    /// `/bin/sh CANDIDATE ARGS...`, for a program the kernel cannot run (no `#!`), as `execvp`
    /// does; the child writes the candidate in.
    script_argv: Vec<AtomicPtr<c_char>>,
    envp: Vec<*const c_char>,
    fds: Vec<(RawFd, RawFd)>,
    cpus: Option<libc::cpu_set_t>,
    ignore_usr1: bool,
    launcher: libc::pid_t,
    /// Set by the child to the errno of the step that failed.
    error: AtomicI32,
    /// The child's thread id until it has exec'd or exited; then 0, with a futex wake.
    running: AtomicI32,
}

impl Setup {
    fn new(command: &Command, env: Vec<CString>, fds: Vec<(RawFd, RawFd)>) -> io::Result<Setup> {
        let candidates = candidates(&command.argv[0])?;
        // The child's own copy: the command may be gone before the child has exec'd.
        let args = command.argv.clone();
        let script_argv = [c"/bin/sh".as_ptr(), std::ptr::null()]
            .into_iter()
            .chain(args[1..].iter().map(|a| a.as_ptr()))
            .chain([std::ptr::null()])
            .map(|p| AtomicPtr::new(p.cast_mut()))
            .collect();
        // Pointers into the strings' own buffers, which stay where they are when the vectors
        // holding them move into the setup.
        Ok(Setup {
            candidates: candidates.iter().map(|c| c.as_ptr()).collect(),
            argv: null_terminated(&args),
            script_argv,
            envp: null_terminated(&env),
            _strings: [candidates, args, env],
            fds,
            cpus: command.cpus,
            ignore_usr1: command.ignore_usr1,
            launcher: std::process::id() as libc::pid_t,
            error: AtomicI32::new(0),
            running: AtomicI32::new(0),
        })
    }
}

/// Runs `clone` (`-1` for an error, else the child's id) with every signal blocked in this
/// thread, so that the child starts with all blocked; the thread's own mask is back after.
pub fn with_signals_blocked(clone: impl FnOnce() -> libc::c_int) -> io::Result<i32> {
    let all = nix::sys::signal::SigSet::all();
    let mut old = nix::sys::signal::SigSet::empty();
    nix::sys::signal::pthread_sigmask(
        nix::sys::signal::SigmaskHow::SIG_SETMASK,
        Some(&all),
        Some(&mut old),
    )?;
    let cloned = match clone() {
        -1 => Err(io::Error::last_os_error()),
        pid => Ok(pid),
    };
    let _ = nix::sys::signal::pthread_sigmask(
        nix::sys::signal::SigmaskHow::SIG_SETMASK,
        Some(&old),
        None,
    );
    cloned
}

/// What a child reads until it has exec'd or exited: not freed before (dropping waits).
struct InFlight {
    setup: Box<Setup>,
    stack: Stack,
}

impl InFlight {
    /// Clones the child onto its stack; returns its pid at once.
    fn clone_child(&self) -> io::Result<i32> {
        // No signal handler of the launcher may run in the child (it shares the launcher's
        // memory): every signal is blocked across the clone; the child resets the handlers to
        // their defaults before it unblocks them.
        let setup = &*self.setup as *const Setup as *mut libc::c_void;
        let running = self.setup.running.as_ptr();
        let flags =
            libc::CLONE_VM | libc::CLONE_PARENT_SETTID | libc::CLONE_CHILD_CLEARTID | libc::SIGCHLD;
        // SAFETY: `child` only makes raw system calls on `setup`, which lives until `running`
        // is cleared (`wait`); the stack is the child's own for as long. The kernel writes the
        // child's id to `running` before clone returns and clears it at the child's exec or
        // exit.
        with_signals_blocked(|| unsafe {
            libc::clone(
                child,
                self.stack.top(),
                flags,
                setup,
                running,
                std::ptr::null_mut::<libc::c_void>(),
                running,
            )
        })
    }

    /// Until the child has exec'd or exited (at once if it was never cloned).
    fn wait(&self) {
        let running = &self.setup.running;
        loop {
            let tid = running.load(Ordering::SeqCst);
            if tid == 0 {
                return;
            }
            // SAFETY: a futex wait on a word of ours while it holds `tid`.
            unsafe {
                libc::syscall(
                    libc::SYS_futex,
                    running.as_ptr(),
                    libc::FUTEX_WAIT,
                    tid,
                    std::ptr::null::<libc::timespec>(),
                )
            };
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.wait();
    }
}

/// The child between clone and exec. Raw system calls only (no allocation, no lock, no panic,
/// no `errno`): on any failure it records the error and exits 127.
extern "C" fn child(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the parent's `Setup`, alive until this child has exec'd or exited.
    let setup = unsafe { &*(arg as *const Setup) };
    // SAFETY: each call below is a system call on values prepared by the parent.
    unsafe {
        reset_signal_handlers();
        for &(from, to) in &setup.fds {
            let moved = if from == to {
                raw::keep_open_across_exec(to)
            } else {
                raw::dup_to(from, to)
            };
            check(setup, moved);
        }
        // Own process group: teardown reaches the worker's children, and the terminal's Ctrl-C
        // reaches only the launcher, which forwards it.
        check(setup, raw::setpgid_self());
        if setup.ignore_usr1 {
            raw::set_signal(libc::SIGUSR1, libc::SIG_IGN);
        }
        // Die with the launcher, even if it is SIGKILLed (the spawning thread is the main
        // thread, which lives as long as the launcher).
        check(
            setup,
            raw::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as usize),
        );
        if raw::getppid() != setup.launcher as isize {
            // The launcher died before prctl took effect.
            check(setup, -(libc::ESRCH as isize));
        }
        // Set here, not lent by the parent for the clone: the child moves itself to its CPUs
        // (through the kernel's stopper thread) while the parent goes on.
        if let Some(cpus) = &setup.cpus {
            check(setup, raw::sched_setaffinity_self(cpus));
        }
        raw::sigprocmask(libc::SIG_SETMASK, 0);
        exec(setup)
    }
}

/// Execs the first candidate that runs, as `execvp` does: on to the next where the file is not
/// there (or not allowed: EACCES is reported if no other runs), a file without `#!` run by
/// `/bin/sh`, any other error final.
///
/// # Safety
/// Only in the child between clone and exec.
unsafe fn exec(setup: &Setup) -> ! {
    let mut denied = false;
    for &path in &setup.candidates {
        let mut errno = raw::errno_of(raw::execve(path, setup.argv.as_ptr(), setup.envp.as_ptr()));
        if errno == libc::ENOEXEC {
            if let Some(slot) = setup.script_argv.get(1) {
                slot.store(path.cast_mut(), Ordering::Relaxed);
            }
            let argv = setup.script_argv.as_ptr().cast::<*const c_char>();
            let sh = c"/bin/sh".as_ptr();
            errno = raw::errno_of(raw::execve(sh, argv, setup.envp.as_ptr()));
        }
        match errno {
            libc::EACCES => denied = true,
            libc::ENOENT | libc::ESTALE | libc::ENOTDIR | libc::ENODEV | libc::ETIMEDOUT => {}
            _ => fail(setup, errno),
        }
    }
    fail(setup, if denied { libc::EACCES } else { libc::ENOENT })
}

/// Every signal with a handler (the launcher's own, Rust's) back to its default, and SIGPIPE
/// (which the launcher ignores) too, as std does for the programs it starts; other ignored
/// signals stay ignored.
///
/// # Safety
/// Only in the child between clone and exec.
unsafe fn reset_signal_handlers() {
    for signal in 1..=64 {
        if signal == libc::SIGKILL || signal == libc::SIGSTOP {
            continue;
        }
        // A function's address, not SIG_DFL (0), SIG_IGN (1) or an error (negative).
        let handled = raw::signal_handler(signal) > libc::SIG_IGN as isize;
        if handled || signal == libc::SIGPIPE {
            raw::set_signal(signal, libc::SIG_DFL);
        }
    }
}

/// Goes on where `ret` is a success; else records its errno for the parent and exits.
///
/// # Safety
/// Only in the child between clone and exec.
unsafe fn check(setup: &Setup, ret: isize) {
    let errno = raw::errno_of(ret);
    if errno != 0 {
        fail(setup, errno);
    }
}

/// Records `errno` for the parent and exits as a shell does for a command it cannot run.
///
/// # Safety
/// Only in the child between clone and exec.
unsafe fn fail(setup: &Setup, errno: i32) -> ! {
    setup
        .error
        .store(if errno == 0 { libc::EIO } else { errno }, Ordering::SeqCst);
    raw::exit(127)
}

/// An anonymous mapping for the child's stack, unmapped when dropped.
struct Stack {
    base: *mut libc::c_void,
    bytes: usize,
}

impl Stack {
    fn new(bytes: usize) -> io::Result<Stack> {
        // Whole pages: the top stays 16-byte aligned, as the ABI wants.
        let bytes = bytes.next_multiple_of(64 * 1024);
        // SAFETY: a fresh private anonymous mapping, owned by the returned value.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Stack { base, bytes })
    }

    /// The stack grows down from here.
    fn top(&self) -> *mut libc::c_void {
        // SAFETY: one past the end of the mapping, which clone never writes at.
        unsafe { self.base.cast::<u8>().add(self.bytes).cast() }
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, no longer used (the child has exec'd or exited:
        // `InFlight` waits for that before its fields drop).
        unsafe { libc::munmap(self.base, self.bytes) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::unix::process::ExitStatusExt;

    fn run(command: &Command) -> (ExitStatus, String, String) {
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
        let (status, out, err) = run(&command);
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
        let script = "set -e; test \"$(cut -d' ' -f5 /proc/$$/stat)\" = $$; echo here >&7; \
            exec grep -E '^(Cpus_allowed_list|SigIgn|SigBlk)' /proc/self/status";
        let mut command = Command::new(OsStr::new("sh"), &["-c".into(), script.into()]).unwrap();
        // One CPU this process may use (CPU 0 may not be one of them).
        let size = std::mem::size_of::<libc::cpu_set_t>();
        // SAFETY: zeroed cpu_set_t values are valid sets; the calls stay within them.
        let (mut allowed, mut cpus): (libc::cpu_set_t, libc::cpu_set_t) =
            unsafe { (std::mem::zeroed(), std::mem::zeroed()) };
        assert_eq!(unsafe { libc::sched_getaffinity(0, size, &mut allowed) }, 0);
        let first = (0..libc::CPU_SETSIZE as usize)
            .find(|&c| unsafe { libc::CPU_ISSET(c, &allowed) })
            .unwrap();
        unsafe { libc::CPU_SET(first, &mut cpus) };
        command
            .hand_down(write.as_raw_fd(), 7)
            .pin(cpus)
            .ignore_usr1();
        let (status, out, err) = run(&command);
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

    /// Several children start before any is waited for, each from a command already dropped:
    /// each keeps its own arguments, environment and output.
    #[test]
    fn children_started_together_keep_their_own_arguments() {
        let started: Vec<Starting> = (0..4)
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
                command.start().unwrap()
            })
            .collect();
        for (i, starting) in started.into_iter().enumerate() {
            let mut child = starting.finish().unwrap();
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
        let (status, out, err) = run(&command);
        assert!(status.success(), "{err}");
        assert_eq!(out, "plain x\n");

        let denied = dir.path().join("not-executable");
        std::fs::write(&denied, "#!/bin/sh\n").unwrap();
        let e = Command::new(denied.as_os_str(), &[]).unwrap().spawn().err();
        assert_eq!(e.map(|e| e.raw_os_error()), Some(Some(libc::EACCES)));

        let e = Command::new(OsStr::new(""), &[]).unwrap().spawn().err();
        assert_eq!(e.map(|e| e.kind()), Some(io::ErrorKind::NotFound));
    }

    /// The paths tried, in `PATH`'s order; an empty entry is the working directory.
    #[test]
    fn candidates_follow_path() {
        let name = CString::new("prog").unwrap();
        let path = std::env::var_os("PATH").unwrap_or_default();
        let tried: Vec<String> = candidates(&name)
            .unwrap()
            .iter()
            .map(|c| c.to_string_lossy().into_owned())
            .collect();
        let expected: Vec<String> = path
            .to_string_lossy()
            .split(':')
            .map(|dir| match dir {
                "" => "prog".to_string(),
                dir => format!("{dir}/prog"),
            })
            .collect();
        assert_eq!(tried, expected);
        let with_slash = CString::new("./prog").unwrap();
        assert_eq!(candidates(&with_slash).unwrap(), vec![with_slash.clone()]);
    }
}
