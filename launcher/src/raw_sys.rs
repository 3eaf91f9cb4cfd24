//! System calls made without the C library, for code that runs in a process cloned with
//! `CLONE_VM` while the launcher goes on (the orphan guard, a worker between clone and exec):
//! such a process shares the launcher's memory and its main thread's thread-local storage, and
//! the C library's wrappers write `errno` there on failure, under the launcher's feet. These
//! return the kernel's answer instead: the result, or `-errno`.
//!
//! Owns: the calling convention (x86-64 and AArch64) and the kernel's own structures. Must not:
//! allocate, lock or panic (nothing here may touch per-thread state).

use std::ffi::c_char;

#[cfg(target_arch = "x86_64")]
unsafe fn call(n: libc::c_long, a: usize, b: usize, c: usize, d: usize) -> isize {
    let ret: isize;
    std::arch::asm!(
        "syscall",
        inlateout("rax") n as isize => ret,
        in("rdi") a, in("rsi") b, in("rdx") c, in("r10") d,
        lateout("rcx") _, lateout("r11") _,
        options(nostack),
    );
    ret
}

#[cfg(target_arch = "aarch64")]
unsafe fn call(n: libc::c_long, a: usize, b: usize, c: usize, d: usize) -> isize {
    let ret: isize;
    std::arch::asm!(
        "svc 0",
        in("x8") n,
        inlateout("x0") a as isize => ret,
        in("x1") b, in("x2") c, in("x3") d,
        options(nostack),
    );
    ret
}

/// The errno of a failed call's result, or 0.
pub fn errno_of(ret: isize) -> i32 {
    if (-4095..0).contains(&ret) {
        -ret as i32
    } else {
        0
    }
}

/// Reads at most one byte; an interrupted read is retried.
///
/// # Safety
/// A raw system call.
pub unsafe fn read_byte(fd: i32, byte: &mut u8) -> isize {
    loop {
        let n = call(libc::SYS_read, fd as usize, byte as *mut u8 as usize, 1, 0);
        if n != -(libc::EINTR as isize) {
            return n;
        }
    }
}

/// Waits until `fd` is readable (or at its end) for at most `ms` milliseconds: 1 if it is, 0
/// if the time ran out, `-errno` (an interrupted wait counts as time run out: the caller waits
/// again the blocking way).
///
/// # Safety
/// A raw system call.
pub unsafe fn wait_readable(fd: i32, ms: i64) -> isize {
    let mut poll = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let timeout = libc::timespec {
        tv_sec: ms / 1000,
        tv_nsec: (ms % 1000) * 1_000_000,
    };
    let ret = call(
        libc::SYS_ppoll,
        &mut poll as *mut libc::pollfd as usize,
        1,
        &timeout as *const libc::timespec as usize,
        0,
    );
    if ret == -(libc::EINTR as isize) {
        0
    } else {
        ret
    }
}

/// `fork`, but the copy is a child of the caller's parent (`CLONE_PARENT`), with exit signal 0
/// (the parent is sent nothing when it ends, and waits that do not ask for `__WALL` do not
/// see it): the copy's id in the caller, 0 in the copy, or `-errno`. No fork handlers run: the
/// copy may make raw system calls only, until it execs.
///
/// # Safety
/// In a process of one thread (the copy has only the calling one).
pub unsafe fn fork_sibling_quiet() -> isize {
    call(libc::SYS_clone, libc::CLONE_PARENT as usize, 0, 0, 0)
}

/// # Safety
/// A raw system call.
pub unsafe fn close(fd: i32) -> isize {
    call(libc::SYS_close, fd as usize, 0, 0, 0)
}

/// # Safety
/// A raw system call.
pub unsafe fn setsid() -> isize {
    call(libc::SYS_setsid, 0, 0, 0, 0)
}

/// # Safety
/// A raw system call.
pub unsafe fn setpgid_self() -> isize {
    call(libc::SYS_setpgid, 0, 0, 0, 0)
}

/// # Safety
/// A raw system call.
pub unsafe fn getppid() -> isize {
    call(libc::SYS_getppid, 0, 0, 0, 0)
}

/// Replaces the set of blocked signals (`how`: `SIG_BLOCK`, `SIG_SETMASK`) with `mask`, bit
/// `n - 1` for signal `n`.
///
/// # Safety
/// A raw system call.
pub unsafe fn sigprocmask(how: i32, mask: u64) -> isize {
    let set = [mask];
    call(
        libc::SYS_rt_sigprocmask,
        how as usize,
        set.as_ptr() as usize,
        0,
        8,
    )
}

/// The kernel's `struct sigaction`, big enough on both architectures (handler, flags,
/// restorer, mask); all zeros is SIG_DFL.
type KernelSigaction = [u64; 4];

/// The handler of `signal` (`SIG_DFL` 0, `SIG_IGN` 1, else a function), or `-errno`.
///
/// # Safety
/// A raw system call.
pub unsafe fn signal_handler(signal: i32) -> isize {
    let mut old: KernelSigaction = [0; 4];
    let ret = call(
        libc::SYS_rt_sigaction,
        signal as usize,
        0,
        old.as_mut_ptr() as usize,
        8,
    );
    if ret < 0 {
        ret
    } else {
        old[0] as isize
    }
}

/// Sets `signal` to `handler` (`SIG_DFL` or `SIG_IGN` only: no restorer, no flags).
///
/// # Safety
/// A raw system call.
pub unsafe fn set_signal(signal: i32, handler: libc::sighandler_t) -> isize {
    let action: KernelSigaction = [handler as u64, 0, 0, 0];
    call(
        libc::SYS_rt_sigaction,
        signal as usize,
        action.as_ptr() as usize,
        0,
        8,
    )
}

/// # Safety
/// A raw system call; `path` NUL-terminated.
pub unsafe fn open_read_write(path: *const c_char) -> isize {
    let flags = (libc::O_RDWR | libc::O_CLOEXEC) as usize;
    call(
        libc::SYS_openat,
        libc::AT_FDCWD as usize,
        path as usize,
        flags,
        0,
    )
}

/// `from` as `to` too, open across exec (`dup3`; `from` must differ from `to`).
///
/// # Safety
/// A raw system call.
pub unsafe fn dup_to(from: i32, to: i32) -> isize {
    call(libc::SYS_dup3, from as usize, to as usize, 0, 0)
}

/// Clears close-on-exec on `fd`.
///
/// # Safety
/// A raw system call.
pub unsafe fn keep_open_across_exec(fd: i32) -> isize {
    call(libc::SYS_fcntl, fd as usize, libc::F_SETFD as usize, 0, 0)
}

/// `prctl` with integer or pointer arguments.
///
/// # Safety
/// A raw system call; pointer arguments as `prctl(2)` wants them.
pub unsafe fn prctl(option: i32, arg: usize) -> isize {
    call(libc::SYS_prctl, option as usize, arg, 0, 0)
}

/// # Safety
/// A raw system call.
pub unsafe fn sched_setaffinity_self(cpus: &libc::cpu_set_t) -> isize {
    let size = std::mem::size_of::<libc::cpu_set_t>();
    call(
        libc::SYS_sched_setaffinity,
        0,
        size,
        cpus as *const libc::cpu_set_t as usize,
        0,
    )
}

/// # Safety
/// A raw system call.
pub unsafe fn kill(pid: i32, signal: i32) -> isize {
    call(libc::SYS_kill, pid as isize as usize, signal as usize, 0, 0)
}

/// Returns only on failure, with `-errno`.
///
/// # Safety
/// A raw system call; NUL-terminated strings, null-terminated pointer arrays.
pub unsafe fn execve(
    path: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
) -> isize {
    call(
        libc::SYS_execve,
        path as usize,
        argv as usize,
        envp as usize,
        0,
    )
}

/// Ends this process (of one thread).
///
/// # Safety
/// A raw system call.
pub unsafe fn exit(code: i32) -> ! {
    call(libc::SYS_exit_group, code as usize, 0, 0, 0);
    // `exit_group` does not return; this tells the compiler so without a panic path.
    loop {
        std::hint::spin_loop();
    }
}
