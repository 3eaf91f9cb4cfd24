//! Handing one of the launcher's descriptors to a worker under a fixed number (the progress
//! pipe as 3, the store's listening socket as 4), open across its exec.
//!
//! Must not: decide what is handed down, or to which worker (the callers do).

use std::os::fd::RawFd;
use std::os::unix::process::CommandExt;
use std::process::Command;

/// Makes `fd` descriptor number `number` in the child `command` starts, without close-on-exec.
pub fn hand_down(command: &mut Command, fd: RawFd, number: RawFd) {
    // SAFETY: only async-signal-safe calls (dup2, fcntl) between fork and exec.
    unsafe {
        command.pre_exec(move || {
            if fd == number {
                // Already in place: only the close-on-exec flag must go.
                if libc::fcntl(fd, libc::F_SETFD, 0) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
            } else if libc::dup2(fd, number) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}
