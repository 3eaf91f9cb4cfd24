//! The orphan guard. Workers die with the launcher through PR_SET_PDEATHSIG, but their own
//! children would not: this small process holds the set of worker process groups and, if the
//! launcher vanishes without saying goodbye (e.g. SIGKILL), kills every one of those groups and
//! then sweeps what the killed workers left in `/dev/shm`.
//!
//! It is cloned with `CLONE_VM`: a process of its own (its own descriptors, signal
//! dispositions and session) that shares the launcher's memory instead of a copy of it. Its start
//! then costs no page-table copy and the launcher no copy-on-write faults afterwards (a `fork`
//! here was about a tenth of `launch`'s whole start-up), and the set of groups is read straight
//! from the launcher's memory ([`GROUPS`]), which the guard keeps alive after the launcher died.
//! The guard's only signal is the end of a pipe whose other end only the launcher holds.
//!
//! Owns: the guard's life, and the list of groups it kills. Must not: run any code that touches
//! the C library's or Rust's per-thread state (it shares the launcher's main thread's: no
//! allocation, no `errno`, no panic) while the launcher lives; it makes raw system calls only
//! ([`crate::raw_sys`]), and execs a fresh `launch` ([`SWEEP_ARG`]) for the sweep once the
//! launcher is gone.

use std::cell::UnsafeCell;
use std::ffi::CStr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

use crate::raw_sys as raw;

/// Worker process groups watched at once: every worker a launcher runs, with room for the
/// groups of a round being torn down while the next starts.
const SLOTS: usize = 4 * common::job_shape::MAX_PROCESSES as usize;

/// The groups to kill (0: a free slot), in memory the guard shares.
static GROUPS: [AtomicI32; SLOTS] = [const { AtomicI32::new(0) }; SLOTS];

/// Set before the launcher closes its end of the pipe at a normal end: the guard then leaves.
static DISARMED: AtomicBool = AtomicBool::new(false);

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

/// The launcher's end of the pipe to the guard.
pub struct Watchdog {
    pipe: Option<OwnedFd>,
    pid: i32,
}

impl Watchdog {
    /// Starts the guard (once per process).
    pub fn start() -> std::io::Result<Watchdog> {
        if STARTED.swap(true, Ordering::SeqCst) {
            return Err(std::io::Error::other("the orphan guard runs already"));
        }
        let (read_end, write_end) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
        PIPE[0].store(read_end.as_raw_fd(), Ordering::SeqCst);
        PIPE[1].store(write_end.as_raw_fd(), Ordering::SeqCst);
        // SAFETY: `guard` makes raw system calls only, on the pipe's descriptors (its own
        // copies: no CLONE_FILES), and reads statics; its stack is `STACK`, used by nothing else.
        // Exit signal 0: the guard's end sends no SIGCHLD, and waits that do not ask for
        // `__WALL` or `__WCLONE` do not see it, so it does not count among the launcher's
        // children ("no child left" is then one `waitid`, see [`crate::adopted`]).
        let pid = unsafe {
            let top = STACK.0.get().cast::<u8>().add(64 * 1024);
            libc::clone(guard, top.cast(), libc::CLONE_VM, std::ptr::null_mut())
        };
        if pid == -1 {
            return Err(std::io::Error::last_os_error());
        }
        drop(read_end);
        Ok(Watchdog {
            pipe: Some(write_end),
            pid,
        })
    }

    /// The guard's pid (a child of the launcher that must be left alone).
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// From now on, kill group `pgid` if the launcher dies.
    pub fn watch(&mut self, pgid: i32) {
        let taken = GROUPS.iter().any(|slot| {
            slot.compare_exchange(0, pgid, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        });
        if !taken {
            tracing::warn!("the orphan guard watches {SLOTS} groups already; not group {pgid}");
        }
    }

    /// The group is gone (torn down and reaped); stop watching it.
    pub fn forget(&mut self, pgid: i32) {
        if let Some(slot) = GROUPS.iter().find(|s| s.load(Ordering::SeqCst) == pgid) {
            slot.store(0, Ordering::SeqCst);
        }
    }

    /// Normal exit: the guard leaves without killing anything. It is not waited for: `launch`
    /// exits next, and whoever adopts the guard then reaps it.
    pub fn disarm(mut self) {
        DISARMED.store(true, Ordering::SeqCst);
        self.pipe = None;
    }
}

/// The guard: set-up, a blocking read until the launcher's end closes, then kill or leave.
extern "C" fn guard(_: *mut libc::c_void) -> libc::c_int {
    let (read_fd, write_fd) = (
        PIPE[0].load(Ordering::SeqCst),
        PIPE[1].load(Ordering::SeqCst),
    );
    // SAFETY: raw system calls on this process's own descriptors and dispositions.
    unsafe { set_up(write_fd) };
    let mut byte = 0u8;
    // Nothing is ever written: this returns at end of file, when the launcher has closed its
    // end or died. Signals that could interrupt it are blocked.
    // SAFETY: reads at most one byte into `byte`.
    while unsafe { raw::read_byte(read_fd, &mut byte) } > 0 {}
    if DISARMED.load(Ordering::SeqCst) {
        // SAFETY: this process's end.
        unsafe { raw::exit(0) }
    }
    for slot in &GROUPS {
        let pgid = slot.load(Ordering::SeqCst);
        if pgid > 0 {
            // SAFETY: a signal to a process group.
            unsafe { raw::kill(-pgid, libc::SIGKILL) };
        }
    }
    // The launcher is gone: from here on nothing shares this memory, and a fresh program does
    // the sweep with all of Rust at hand.
    // SAFETY: NUL-terminated strings and null-terminated pointer arrays.
    unsafe {
        let argv = [
            c"launch-watchdog".as_ptr(),
            SWEEP_ARG.as_ptr(),
            std::ptr::null(),
        ];
        let envp = [std::ptr::null()];
        raw::execve(c"/proc/self/exe".as_ptr(), argv.as_ptr(), envp.as_ptr());
        raw::exit(0)
    }
}

/// The guard's own set-up: its own session (`kill -9 -PGID`, a terminal's Ctrl-C / Ctrl-\ /
/// hang-up and `timeout` signal the launcher's whole process group, and the guard must outlive
/// the launcher to do its job), those signals blocked, the console let go of, and a name.
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
    raw::sigprocmask(libc::SIG_BLOCK, blocked);
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
