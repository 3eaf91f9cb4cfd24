//! The orphan guard. Workers die with the launcher through PR_SET_PDEATHSIG, but their own
//! children would not: this small process holds the set of worker process groups and, if the
//! launcher vanishes without saying goodbye (e.g. SIGKILL), kills every one of those groups and
//! then sweeps what the killed workers left in `/dev/shm`.
//!
//! It starts cloned with `CLONE_VM`: a process of its own (its own descriptors, signal
//! dispositions and session) that shares the launcher's memory instead of a copy of it, so its
//! start costs no page-table copy and the launcher no copy-on-write faults afterwards (a `fork`
//! at start was about a tenth of `launch`'s whole start-up). Sharing memory also shares a fate:
//! the kernel's OOM killer kills every process using the victim's memory, and kernels before
//! 5.16 do so when a process dumps core. So once the launcher has run [`DETACH_AFTER`] (the
//! start-up is over), the guard forks a copy of itself with memory of its own, another child
//! of the launcher's, and leaves; the copy goes on. Either reads the groups to kill and the launcher's
//! last word from a shared mapping ([`Shared`]); its only signal is the end of a pipe whose
//! other end only the launcher holds.
//!
//! Owns: the guard's life, and the list of groups it kills. Must not: run any code that touches
//! the C library's or Rust's per-thread state (while it shares the launcher's memory it shares
//! its main thread's: no allocation, no `errno`, no panic); it makes raw system calls only
//! ([`crate::raw_sys`]), and execs a fresh `launch` ([`SWEEP_ARG`]) for the sweep once the
//! launcher is gone.

use std::cell::UnsafeCell;
use std::ffi::CStr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicPtr, Ordering};

use crate::raw_sys as raw;

/// Worker process groups watched at once: every worker a launcher runs, with room for the
/// groups of a round being torn down while the next starts.
const SLOTS: usize = 4 * common::job_shape::MAX_PROCESSES as usize;

/// How long the launcher runs before the guard takes memory of its own.
const DETACH_AFTER: std::time::Duration = std::time::Duration::from_millis(200);

/// What the launcher and the guard share, in a `MAP_SHARED` mapping (shared across the
/// guard's fork too).
struct Shared {
    /// Set before the launcher closes its end of the pipe at a normal end: the guard leaves.
    disarmed: AtomicBool,
    /// The guard's pid (it changes when the guard forks its copy).
    pid: AtomicI32,
    /// The groups to kill (0: a free slot).
    groups: [AtomicI32; SLOTS],
}

/// The shared mapping, made once by [`Watchdog::start`].
static SHARED: AtomicPtr<Shared> = AtomicPtr::new(std::ptr::null_mut());

/// Only one guard per process: it runs on [`STACK`] and reads [`PIPE`].
static STARTED: AtomicBool = AtomicBool::new(false);

/// The pipe's two descriptor numbers at the clone (read end, write end): the guard's copies.
static PIPE: [AtomicI32; 2] = [AtomicI32::new(-1), AtomicI32::new(-1)];

/// The hidden first argument of the fresh `launch` the guard execs after killing the groups.
pub const SWEEP_ARG: &CStr = c"--orphan-guard-sweep";

/// The guard's stack (in the launcher's memory; only the pages it touches are ever allocated).
#[repr(C, align(64))]
struct Stack(UnsafeCell<[u8; 64 * 1024]>);
// SAFETY: only the guard ever uses it, as its stack.
unsafe impl Sync for Stack {}
static STACK: Stack = Stack(UnsafeCell::new([0; 64 * 1024]));

fn shared() -> Option<&'static Shared> {
    // SAFETY: null, or the mapping made in `start`, never unmapped.
    unsafe { SHARED.load(Ordering::SeqCst).as_ref() }
}

/// The guard's pid now, if it runs (a child of the launcher that must be left alone).
pub fn guard_pid() -> Option<i32> {
    shared().map(|s| s.pid.load(Ordering::SeqCst))
}

/// The launcher's end of the pipe to the guard.
pub struct Watchdog {
    pipe: Option<OwnedFd>,
}

impl Watchdog {
    /// Starts the guard (once per process).
    pub fn start() -> std::io::Result<Watchdog> {
        if STARTED.swap(true, Ordering::SeqCst) {
            return Err(std::io::Error::other("the orphan guard runs already"));
        }
        let shared = map_shared()?;
        SHARED.store(shared, Ordering::SeqCst);
        let (read_end, write_end) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
        PIPE[0].store(read_end.as_raw_fd(), Ordering::SeqCst);
        PIPE[1].store(write_end.as_raw_fd(), Ordering::SeqCst);
        // No signal may reach the guard before it has its own session and mask: every signal
        // is blocked across the clone (the guard sets its own mask).
        // SAFETY: `guard` makes raw system calls only, on the pipe's descriptors (its own
        // copies: no CLONE_FILES), and reads statics and the shared mapping; its stack is
        // `STACK`, used by nothing else. Exit signal 0: the guard's end sends no SIGCHLD, and
        // waits that do not ask for `__WALL` or `__WCLONE` do not see it, so it does not count
        // among the launcher's children ("no child left" is then one `waitid`, see
        // [`crate::adopted`]).
        let pid = crate::clone_spawn::with_signals_blocked(|| unsafe {
            let top = STACK.0.get().cast::<u8>().add(64 * 1024);
            libc::clone(guard, top.cast(), libc::CLONE_VM, std::ptr::null_mut())
        })?;
        // SAFETY: the mapping just made.
        unsafe { &*shared }.pid.store(pid, Ordering::SeqCst);
        drop(read_end);
        Ok(Watchdog {
            pipe: Some(write_end),
        })
    }

    /// From now on, kill group `pgid` if the launcher dies.
    pub fn watch(&mut self, pgid: i32) {
        let Some(shared) = shared() else { return };
        let taken = shared.groups.iter().any(|slot| {
            slot.compare_exchange(0, pgid, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        });
        if !taken {
            tracing::warn!("the orphan guard watches {SLOTS} groups already; not group {pgid}");
        }
    }

    /// The group is gone (torn down and reaped); stop watching it.
    pub fn forget(&mut self, pgid: i32) {
        let Some(shared) = shared() else { return };
        if let Some(slot) = shared
            .groups
            .iter()
            .find(|s| s.load(Ordering::SeqCst) == pgid)
        {
            slot.store(0, Ordering::SeqCst);
        }
    }

    /// Normal exit: the guard leaves without killing anything. It is not waited for: `launch`
    /// exits next, and whoever adopts the guard then reaps it.
    pub fn disarm(mut self) {
        if let Some(shared) = shared() {
            shared.disarmed.store(true, Ordering::SeqCst);
        }
        self.pipe = None;
    }
}

/// A zeroed `MAP_SHARED` mapping for [`Shared`] (all zeros is its empty state), never unmapped.
fn map_shared() -> std::io::Result<*mut Shared> {
    // SAFETY: a fresh anonymous mapping of the struct's size; atomics of zero are valid.
    let mapped = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            std::mem::size_of::<Shared>(),
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if mapped == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(mapped.cast())
}

/// The guard: set-up, a wait until the launcher's end of the pipe closes (forking a copy
/// with its own memory once the launcher has run a while), then kill or leave.
extern "C" fn guard(_: *mut libc::c_void) -> libc::c_int {
    let (read_fd, write_fd) = (
        PIPE[0].load(Ordering::SeqCst),
        PIPE[1].load(Ordering::SeqCst),
    );
    // The mapping is made before the clone (`shared` is a plain atomic load, no per-thread
    // state).
    let Some(shared) = shared() else {
        // SAFETY: this process's end (cannot happen: the mapping is made first).
        unsafe { raw::exit(1) }
    };
    // SAFETY: raw system calls on this process's own descriptors and dispositions.
    unsafe { set_up(write_fd) };
    let ms = DETACH_AFTER.as_millis() as i64;
    // SAFETY: a poll on this process's descriptor.
    if unsafe { raw::wait_readable(read_fd, ms) } == 0 {
        // SAFETY: a fork of this single-threaded process; see `detach`.
        unsafe { detach(shared) };
    }
    let mut byte = 0u8;
    // Nothing is ever written: this returns at end of file, when the launcher has closed its
    // end or died. Signals that could interrupt it are blocked.
    // SAFETY: reads at most one byte into `byte`.
    while unsafe { raw::read_byte(read_fd, &mut byte) } > 0 {}
    // SAFETY: raw system calls.
    unsafe { launcher_ended(shared) }
}

/// Forks a copy of the guard with memory of its own, a child of the launcher as the guard is
/// and as unannounced (exit signal 0), makes it the guard and leaves; the copy returns from
/// here and goes on waiting. Where the fork fails, this guard goes on.
///
/// # Safety
/// Only in the guard, which has one thread.
unsafe fn detach(shared: &Shared) {
    match raw::fork_sibling_quiet() {
        0 => {}
        pid if pid > 0 => {
            // Named before this one leaves: the launcher never sees a guard it does not know.
            shared.pid.store(pid as i32, Ordering::SeqCst);
            raw::exit(0)
        }
        _ => {}
    }
}

/// The launcher closed its end: at a normal end it said so first and the guard leaves;
/// otherwise it kills every watched group, then execs a fresh `launch` for the sweep.
///
/// # Safety
/// Only in the guard.
unsafe fn launcher_ended(shared: &Shared) -> ! {
    if shared.disarmed.load(Ordering::SeqCst) {
        raw::exit(0)
    }
    for slot in &shared.groups {
        let pgid = slot.load(Ordering::SeqCst);
        if pgid > 0 {
            raw::kill(-pgid, libc::SIGKILL);
        }
    }
    // The launcher is gone: from here on nothing shares this memory, and a fresh program does
    // the sweep with all of Rust at hand.
    let argv = [
        c"launch-watchdog".as_ptr(),
        SWEEP_ARG.as_ptr(),
        std::ptr::null(),
    ];
    let envp = [std::ptr::null()];
    raw::execve(c"/proc/self/exe".as_ptr(), argv.as_ptr(), envp.as_ptr());
    raw::exit(0)
}

/// The guard's own set-up: its own session (`kill -9 -PGID`, a terminal's Ctrl-C / Ctrl-\ /
/// hang-up and `timeout` signal the launcher's whole process group, and the guard must outlive
/// the launcher to do its job), those signals blocked and no other, the console let go of, and
/// a name.
///
/// # Safety
/// Only in the guard.
unsafe fn set_up(write_fd: i32) {
    raw::close(write_fd);
    raw::setsid();
    let blocked = [
        libc::SIGINT,
        libc::SIGHUP,
        libc::SIGTERM,
        libc::SIGQUIT,
        libc::SIGTSTP,
        libc::SIGPIPE,
    ]
    .iter()
    .fold(0u64, |mask, &signal| mask | 1 << (signal - 1));
    raw::sigprocmask(libc::SIG_SETMASK, blocked);
    // Do not hold the console or a test harness's pipes open.
    let null = raw::open_read_write(c"/dev/null".as_ptr()) as i32;
    if null >= 0 {
        for fd in 0..3 {
            if null != fd {
                raw::dup_to(null, fd);
            }
        }
        if null > 2 {
            raw::close(null);
        }
    }
    raw::prctl(libc::PR_SET_NAME, c"launch-watchdog".as_ptr() as usize);
}

/// After the launcher was killed: what the killed workers had not unlinked yet, once they are
/// gone (reaped by init). Run as `launch --orphan-guard-sweep`, exec'd by the guard.
pub fn sweep_after_kill() -> ! {
    for wait_ms in [100, 400, 1500] {
        std::thread::sleep(std::time::Duration::from_millis(wait_ms));
        crate::shm_sweep::sweep_stale();
    }
    std::process::exit(0)
}
