//! Starting a worker process the way `posix_spawn` does: `clone(CLONE_VM | CLONE_VFORK)`, so the
//! launcher's memory is neither copied for the child nor torn down again at its `exec` (std's
//! `Command` forks whenever a step must run before `exec`, which costs a few hundred
//! microseconds per worker). Between clone and exec the child does what `posix_spawn` cannot:
//! PR_SET_PDEATHSIG (with the check that the launcher still lives), its CPU affinity, an
//! ignored SIGUSR1, and descriptors handed down under fixed numbers.
//!
//! Owns: the child's side between clone and exec, and reporting why an exec failed. Must not:
//! decide what the worker gets (the supervisor's spawn does) or wait for it beyond [`Child`].

use std::collections::BTreeMap;
use std::ffi::{CString, OsStr, OsString};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::atomic::{AtomicI32, Ordering};

use nix::fcntl::OFlag;

/// The child's stack while it sets up and execs, besides a copy of the argument pointers
/// (`execvpe` makes one for a script without `#!`) and a path buffer. Only the pages it
/// touches are ever allocated.
const STACK_BYTES: usize = 256 * 1024;

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
    pub fn spawn(&self) -> io::Result<Child> {
        let envp = self.environment()?;
        let null = File::open("/dev/null")?; // close-on-exec, as std opens everything
        let (out_read, out_write) = nix::unistd::pipe2(OFlag::O_CLOEXEC)?;
        let (err_read, err_write) = nix::unistd::pipe2(OFlag::O_CLOEXEC)?;
        let mut fds = vec![(null.as_raw_fd(), 0), (out_write.as_raw_fd(), 1)];
        fds.push((err_write.as_raw_fd(), 2));
        fds.extend_from_slice(&self.hand_downs);
        let setup = Setup {
            program: self.argv[0].as_ptr(),
            argv: null_terminated(&self.argv),
            envp: null_terminated(&envp),
            fds,
            cpus: self.cpus,
            ignore_usr1: self.ignore_usr1,
            launcher: std::process::id() as libc::pid_t,
            error: AtomicI32::new(0),
        };
        let pid = clone_vfork(&setup)?;
        drop((null, out_write, err_write)); // the child's copies are its own now
        match setup.error.load(Ordering::SeqCst) {
            0 => Ok(Child {
                pid,
                stdout: File::from(out_read),
                stderr: File::from(err_read),
            }),
            errno => {
                // It has exited (127) without exec'ing: reap it.
                let _ = wait(pid);
                Err(io::Error::from_raw_os_error(errno))
            }
        }
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

fn c_string(text: &OsStr) -> io::Result<CString> {
    CString::new(text.as_bytes()).map_err(|_| {
        let shown = text.to_string_lossy();
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("NUL byte in {shown:?}"),
        )
    })
}

fn null_terminated(strings: &[CString]) -> Vec<*const libc::c_char> {
    let mut pointers: Vec<*const libc::c_char> = strings.iter().map(|s| s.as_ptr()).collect();
    pointers.push(std::ptr::null());
    pointers
}

/// Everything the child reads between clone and exec, prepared by the parent (the child must
/// not allocate: it runs on the parent's memory while the parent's other threads go on).
struct Setup {
    program: *const libc::c_char,
    argv: Vec<*const libc::c_char>,
    envp: Vec<*const libc::c_char>,
    fds: Vec<(RawFd, RawFd)>,
    cpus: Option<libc::cpu_set_t>,
    ignore_usr1: bool,
    launcher: libc::pid_t,
    /// Set by the child to the errno of the step that failed.
    error: AtomicI32,
}

/// Clones the child onto a stack of its own; returns its pid once it has exec'd or exited.
fn clone_vfork(setup: &Setup) -> io::Result<i32> {
    let pointers = setup.argv.len() * std::mem::size_of::<*const libc::c_char>();
    let stack = Stack::new(STACK_BYTES + pointers)?;
    // No signal handler of the launcher may run in the child (it shares the launcher's
    // memory): every signal is blocked across the clone; the child resets the handlers to
    // their defaults before it unblocks them.
    let all = nix::sys::signal::SigSet::all();
    let mut old = nix::sys::signal::SigSet::empty();
    nix::sys::signal::pthread_sigmask(
        nix::sys::signal::SigmaskHow::SIG_SETMASK,
        Some(&all),
        Some(&mut old),
    )?;
    // Created on its CPUs rather than moved there (a running task moves through the kernel's
    // stopper thread): this thread takes the child's affinity for the clone.
    let restore = setup.cpus.as_ref().and_then(Affinity::borrow);
    // SAFETY: `child` only makes system calls on `setup`, which outlives it (CLONE_VFORK: this
    // thread resumes once the child has exec'd or exited); the stack is the child's own.
    let pid = unsafe {
        libc::clone(
            child,
            stack.top(),
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            setup as *const Setup as *mut libc::c_void,
        )
    };
    drop(restore);
    let cloned = match pid {
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

/// The child between clone and exec. Only system calls (no allocation, no lock, no panic):
/// on any failure it records errno and exits 127.
extern "C" fn child(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the parent's `Setup`, alive while the parent waits for this exec.
    let setup = unsafe { &*(arg as *const Setup) };
    // SAFETY: each call below is a system call on values prepared by the parent.
    unsafe {
        reset_signal_handlers();
        for &(from, to) in &setup.fds {
            let moved = if from == to {
                libc::fcntl(to, libc::F_SETFD, 0) // already in place: open across exec
            } else {
                libc::dup2(from, to)
            };
            if moved == -1 {
                fail(setup);
            }
        }
        // Own process group: teardown reaches the worker's children, and the terminal's Ctrl-C
        // reaches only the launcher, which forwards it.
        if libc::setpgid(0, 0) != 0 {
            fail(setup);
        }
        if setup.ignore_usr1 {
            libc::signal(libc::SIGUSR1, libc::SIG_IGN);
        }
        // Die with the launcher, even if it is SIGKILLed (the spawning thread is the main
        // thread, which lives as long as the launcher).
        if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
            fail(setup);
        }
        if libc::getppid() != setup.launcher {
            // The launcher died before prctl took effect.
            *libc::__errno_location() = libc::ESRCH;
            fail(setup);
        }
        // Where the parent could not lend its affinity, this is where it takes effect.
        if let Some(cpus) = &setup.cpus {
            if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), cpus) != 0 {
                fail(setup);
            }
        }
        let mut none: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut none);
        libc::pthread_sigmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
        libc::execvpe(setup.program, setup.argv.as_ptr(), setup.envp.as_ptr());
        fail(setup)
    }
}

/// Every signal the launcher handles (its own handlers, Rust's) back to its default, and
/// SIGPIPE (which Rust ignores) too, as std does for the programs it starts; other ignored
/// signals stay ignored.
///
/// # Safety
/// Only in the child between clone and exec.
unsafe fn reset_signal_handlers() {
    for signal in 1..=libc::SIGRTMAX() {
        if signal == libc::SIGKILL || signal == libc::SIGSTOP {
            continue;
        }
        let mut current: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(signal, std::ptr::null(), &mut current) != 0 {
            continue; // one glibc keeps for itself
        }
        let handled =
            current.sa_sigaction != libc::SIG_DFL && current.sa_sigaction != libc::SIG_IGN;
        if handled || signal == libc::SIGPIPE {
            let mut default: libc::sigaction = std::mem::zeroed();
            default.sa_sigaction = libc::SIG_DFL;
            libc::sigaction(signal, &default, std::ptr::null_mut());
        }
    }
}

/// Records errno for the parent and exits as a shell does for a command it cannot run.
///
/// # Safety
/// Only in the child between clone and exec.
unsafe fn fail(setup: &Setup) -> ! {
    let errno = *libc::__errno_location();
    setup
        .error
        .store(if errno == 0 { libc::EIO } else { errno }, Ordering::SeqCst);
    libc::_exit(127)
}

/// This thread's CPU affinity, set to another until dropped.
struct Affinity {
    own: libc::cpu_set_t,
}

impl Affinity {
    /// Runs this thread on `cpus` for now; `None` (nothing changed) where that fails.
    fn borrow(cpus: &libc::cpu_set_t) -> Option<Affinity> {
        let size = std::mem::size_of::<libc::cpu_set_t>();
        // SAFETY: a zeroed cpu_set_t is a valid set; the calls read and write at most `size`.
        let mut own: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        let saved = unsafe { libc::sched_getaffinity(0, size, &mut own) } == 0;
        (saved && unsafe { libc::sched_setaffinity(0, size, cpus) } == 0)
            .then_some(Affinity { own })
    }
}

impl Drop for Affinity {
    fn drop(&mut self) {
        let size = std::mem::size_of::<libc::cpu_set_t>();
        // SAFETY: restores the set read in `borrow`.
        unsafe { libc::sched_setaffinity(0, size, &self.own) };
    }
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
        // SAFETY: the mapping made in `new`, no longer used (the child has exec'd or exited).
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
}
