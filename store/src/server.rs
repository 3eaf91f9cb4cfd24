//! The store's server: one thread running an event loop over the listener and every connection
//! (see `event_loop.rs`), the key space with its waiting connections (`keys.rs`), and the limits
//! on connections that have not proven the run id (see [`guard`](super::guard)). A connection
//! costs a few hundred bytes and a descriptor, not a thread, so one server holds thousands of
//! ranks; a write wakes only the connections waiting for its key.

mod conn;
mod event_loop;
mod keys;

use std::fmt;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::Duration;

use super::guard::Throttle;
use super::*;

/// Connections the kernel may hold for the server before it accepts them: a job's ranks connect
/// all at once, and a SYN dropped from a full queue is retried only a second later. The kernel
/// caps it at `net.core.somaxconn`.
const LISTEN_BACKLOG: i32 = 8192;

/// What the server's thread and its handle share.
struct Shared {
    /// Derived from the run id, which the server does not keep.
    key: auth::Key,
    /// [`run_fingerprint`] of the run id, sent in the challenge.
    fingerprint: String,
    stopping: AtomicBool,
    /// Connections that have not proven the run id yet (the gate's count, for tests).
    ungreeted: AtomicUsize,
    /// Warnings about connections refused before they proved the run id.
    refused: Throttle,
    /// Warnings about failed `accept`s (e.g. out of file descriptors).
    accept_failures: Throttle,
    /// How long a new connection has to prove the run id ([`HELLO_DEADLINE`]).
    hello_deadline: Duration,
}

impl Shared {
    fn stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }
}

fn refused_head(count: u64) -> String {
    if count == 1 {
        "refused a connection that did not prove the run id".into()
    } else {
        format!("refused {count} connections that did not prove the run id")
    }
}

fn accept_failure_head(count: u64) -> String {
    if count == 1 {
        "could not accept a connection".into()
    } else {
        format!("could not accept {count} connections")
    }
}

/// The store rank 0 hosts: one thread serving every connection. It serves until it is dropped;
/// dropping it closes every connection (clients then get errors, never a hang).
pub struct StoreServer {
    addr: SocketAddr,
    /// How many descriptors its process may open, once raised (unknown or unlimited: `None`).
    descriptors: Option<u64>,
    shared: Arc<Shared>,
    waker: mio::Waker,
    thread: Option<JoinHandle<()>>,
}

impl fmt::Debug for StoreServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreServer")
            .field("addr", &self.addr)
            .field("run", &self.shared.fingerprint)
            .finish()
    }
}

impl StoreServer {
    /// Listens on exactly `addr` (port 0 picks a free port; see [`StoreServer::local_addr`]) and
    /// serves connections that prove they know `run_id`, on a background thread.
    pub fn start(addr: SocketAddr, run_id: &str) -> Result<StoreServer, StoreError> {
        Self::start_with(addr, run_id, HELLO_DEADLINE)
    }

    /// [`StoreServer::start`] with another deadline for the run id (tests).
    pub(super) fn start_with(
        addr: SocketAddr,
        run_id: &str,
        hello_deadline: Duration,
    ) -> Result<StoreServer, StoreError> {
        // std sets SO_REUSEADDR on Unix listeners, so a restart does not trip over TIME_WAIT.
        let listener = TcpListener::bind(addr).map_err(|cause| StoreError::Bind { addr, cause })?;
        Self::serve(listener, run_id, hello_deadline)
    }

    /// Serves on `listener`, a socket already listening: the one `launch` binds and holds for the
    /// whole job and hands to rank 0, so that no other process can take the port in between.
    /// The listener is shared with whoever passed it: it is never shut down, only left.
    pub fn from_listener(listener: TcpListener, run_id: &str) -> Result<StoreServer, StoreError> {
        Self::serve(listener, run_id, HELLO_DEADLINE)
    }

    fn serve(
        listener: TcpListener,
        run_id: &str,
        hello_deadline: Duration,
    ) -> Result<StoreServer, StoreError> {
        let unknown = SocketAddr::from(([0, 0, 0, 0], 0));
        let local = listener.local_addr().map_err(|cause| StoreError::Bind {
            addr: unknown,
            cause,
        })?;
        let bind_err = |cause| StoreError::Bind { addr: local, cause };
        listener.set_nonblocking(true).map_err(bind_err)?;
        // Listening again only raises the queue (std listens with a small one).
        // SAFETY: listen(2) on a descriptor we own, with an integer argument.
        unsafe { libc::listen(listener.as_raw_fd(), LISTEN_BACKLOG) };
        let descriptors = raise_descriptor_limit();
        let poll = mio::Poll::new().map_err(bind_err)?;
        let waker = mio::Waker::new(poll.registry(), event_loop::WAKER).map_err(bind_err)?;
        let shared = Arc::new(Shared {
            key: auth::Key::new(run_id),
            fingerprint: run_fingerprint(run_id),
            stopping: AtomicBool::new(false),
            ungreeted: AtomicUsize::new(0),
            refused: Throttle::new(refused_head, WARN_INTERVAL),
            accept_failures: Throttle::new(accept_failure_head, WARN_INTERVAL),
            hello_deadline,
        });
        let listener = mio::net::TcpListener::from_std(listener);
        let event_loop =
            event_loop::EventLoop::new(poll, listener, Arc::clone(&shared)).map_err(bind_err)?;
        let thread = thread::Builder::new()
            .name("store".into())
            .spawn(move || event_loop.run())
            .map_err(|cause| StoreError::Thread { cause })?;
        tracing::debug!(addr = %local, run = %run_fingerprint(run_id), "rendezvous store listening");
        Ok(StoreServer {
            addr: local,
            descriptors,
            shared,
            waker,
            thread: Some(thread),
        })
    }

    /// Connections that have not proven the run id yet (tests).
    #[cfg(test)]
    pub(super) fn ungreeted(&self) -> usize {
        self.shared.ungreeted.load(Ordering::Relaxed)
    }

    /// The warning for a job of `world` ranks on `hosts` hosts if this process may open too few
    /// descriptors for it ([`descriptor_warning`]).
    pub(crate) fn descriptor_warning(&self, world: u64, hosts: u64) -> Option<String> {
        self.descriptors
            .and_then(|limit| descriptor_warning(limit, world, hosts))
    }

    /// The address the server actually listens on (with the real port when started on port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

/// Raises this process's limit on open descriptors to its hard limit: the server holds one per
/// connection (two per rank, with the ranks' watches, and one more per host's leader), and the
/// common soft limit of 1024 would refuse the ranks of a job of a few hundred. The limit now in
/// force, if it is known and finite.
fn raise_descriptor_limit() -> Option<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid rlimit struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            return None;
        }
        if limit.rlim_cur < limit.rlim_max {
            let soft = limit.rlim_cur;
            limit.rlim_cur = limit.rlim_max;
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) == 0 {
                tracing::debug!(
                    "open descriptors: limit raised from {soft} to {}",
                    limit.rlim_max
                );
            } else {
                limit.rlim_cur = soft;
            }
        }
    }
    (limit.rlim_cur != libc::RLIM_INFINITY).then_some(limit.rlim_cur)
}

/// The warning for a store whose process may open `limit` descriptors, serving a job of
/// `world` ranks on `hosts` hosts: each rank holds two connections (its own and its watch's),
/// each host's leader one more, and the process needs some of its own.
pub(crate) fn descriptor_warning(limit: u64, world: u64, hosts: u64) -> Option<String> {
    let needed = 2 * world + hosts + 64;
    (limit < needed).then(|| {
        format!(
            "the rendezvous store may run out of descriptors: this process may open {limit} \
             (the hard limit, `ulimit -Hn`) and a job of {world} ranks needs about {needed} (two \
             connections a rank); raise the hard limit on rank 0's node (limits.conf, or the \
             scheduler's setting)"
        )
    })
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shared.stopping.store(true, Ordering::SeqCst);
        let _ = self.waker.wake();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        tracing::debug!(addr = %self.addr, "rendezvous store stopped");
    }
}
