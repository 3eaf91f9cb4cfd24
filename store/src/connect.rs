//! How a client reaches the store: connection attempts retried with a backoff until a deadline,
//! the first address of a name that answers, and (for a benchmark's simulated hosts) a chosen
//! local source address. It must not speak any protocol: the clients do, on what it returns.

use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs};
use std::thread;
use std::time::{Duration, Instant};

use super::*;

/// Outcome of one connection attempt.
pub(crate) enum Attempt {
    /// Worth another try (nobody listening yet, connection dropped during the handshake).
    Retry(String),
    /// Final (cannot prove the run id, silent, not a store).
    Fatal(StoreError),
}

/// Where `launch` holds the store's listening socket for rank 0
/// ([`common::env_contract::STORE_HELD_VAR`]): a connection that lands there reached rank 0's
/// own listener (the kernel accepts for it before rank 0 serves), so a silent handshake means
/// that rank 0 is not serving yet (still starting, stopped, a loaded machine), not a stranger
/// on the port, and is waited for until the connect deadline instead of failing after
/// [`HANDSHAKE_TIMEOUT`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct HeldListener {
    pub(crate) addr: SocketAddr,
    /// Whether this client says that it waits (one rank of a node does, not every rank).
    pub(crate) announce: bool,
}

impl HeldListener {
    /// Whether a connection to `peer` reached the held listener (one bound to every address of
    /// the machine holds the port on all of them).
    pub(crate) fn holds(&self, peer: SocketAddr) -> bool {
        peer.port() == self.addr.port()
            && (self.addr.ip().is_unspecified() || self.addr.ip() == peer.ip())
    }
}

/// How long one connection's handshake may stay silent: [`HANDSHAKE_TIMEOUT`], or, on the
/// listener `launch` holds for rank 0, until the connect deadline (said once when it starts).
pub(crate) struct Patience {
    pub(crate) held: Option<HeldListener>,
    pub(crate) end: Option<Instant>,
    pub(crate) started: Instant,
    said: bool,
}

/// What a silent handshake comes to, from [`Patience::after_silence`].
pub(crate) enum Silence {
    /// Keep reading for at most this long.
    Wait(Duration),
    /// The final error.
    Give(StoreError),
}

impl Patience {
    pub(crate) fn new(held: Option<HeldListener>, end: Option<Instant>) -> Patience {
        Patience {
            held,
            end,
            started: Instant::now(),
            said: false,
        }
    }

    /// After a read of the handshake on the connection to `peer` timed out: wait on (the held
    /// listener, before the deadline) or give up, naming why.
    pub(crate) fn after_silence(&mut self, addr: &str, peer: Option<SocketAddr>) -> Silence {
        let waited = self.started.elapsed();
        let Some(held) = self.held.filter(|h| peer.is_some_and(|p| h.holds(p))) else {
            return Silence::Give(StoreError::Silent {
                addr: addr.to_string(),
                waited,
            });
        };
        let left = self.end.map_or(Duration::MAX, |end| {
            end.saturating_duration_since(Instant::now())
        });
        if left.is_zero() {
            return Silence::Give(StoreError::NotServing {
                addr: addr.to_string(),
                waited,
            });
        }
        if !self.said {
            self.said = true;
            let more = self.end.map_or("for it".into(), |_| {
                format!("{:.0} s more", left.as_secs_f64())
            });
            let log = format!(
                "rank 0 has not answered the rendezvous store's handshake at {addr} after {:.0} s \
                 (its port, held by launch, took the connection): still starting, stopped or \
                 loaded; waiting until the rendezvous deadline ({more})",
                waited.as_secs_f64()
            );
            if held.announce {
                tracing::warn!("{log}");
            } else {
                tracing::debug!("{log}");
            }
        }
        Silence::Wait(left.min(Duration::from_secs(3600)))
    }
}

/// Calls `attempt` with the deadline's instant (`None`: no end) until it succeeds, fails for
/// good, or the `deadline` passes (then [`StoreError::Unreachable`] with the last reason),
/// sleeping with an exponential backoff between tries.
pub(crate) fn connect_with_retries<T>(
    addr: &str,
    deadline: Duration,
    mut attempt: impl FnMut(Option<Instant>) -> Result<T, Attempt>,
) -> Result<T, StoreError> {
    check_host_port(addr)?;
    let start = Instant::now();
    let end = start.checked_add(deadline);
    let mut backoff = Duration::from_millis(10);
    loop {
        let reason = match attempt(end) {
            Ok(client) => return Ok(client),
            Err(Attempt::Fatal(err)) => return Err(err),
            Err(Attempt::Retry(reason)) => reason,
        };
        let remaining = end.map_or(MAX_BACKOFF, |end| {
            end.saturating_duration_since(Instant::now())
        });
        if remaining.is_zero() {
            return Err(StoreError::Unreachable {
                addr: addr.to_string(),
                waited: start.elapsed(),
                reason,
            });
        }
        tracing::debug!(
            addr,
            "rendezvous store not reachable yet ({reason}); retrying"
        );
        thread::sleep(backoff.min(remaining));
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// A TCP connection to the first address of `addr` that answers, each tried for at most 2 s
/// (and what is left of the deadline); why none did, to retry. From the local address `source`
/// when there is one: then only the targets of its family are tried, and a `source` that cannot
/// be bound (not an address of this machine) is final.
pub(crate) fn connect_any(
    addr: &str,
    remaining: impl Fn() -> Duration,
    source: Option<IpAddr>,
) -> Result<TcpStream, Attempt> {
    let targets: Vec<SocketAddr> = match addr.to_socket_addrs() {
        Ok(targets) => targets.collect(),
        Err(err) => return Err(Attempt::Retry(format!("cannot resolve it: {err}"))),
    };
    let mut reason = match source {
        None => "the host name resolves to no address".to_string(),
        Some(source) => format!("the host name resolves to no address of {source}'s family"),
    };
    let family = |t: &SocketAddr| source.is_none_or(|s| t.is_ipv4() == s.is_ipv4());
    for target in targets.into_iter().filter(family) {
        let limit = remaining().clamp(Duration::from_millis(50), Duration::from_secs(2));
        let connected = match source {
            None => {
                TcpStream::connect_timeout(&target, limit).map_err(bound_socket::Failure::Connect)
            }
            Some(source) => bound_socket::connect(source, target, limit),
        };
        match connected {
            Ok(stream) => return Ok(stream),
            Err(bound_socket::Failure::Bind(err)) => {
                return Err(Attempt::Fatal(StoreError::BadAddress {
                    addr: addr.to_string(),
                    reason: format!(
                        "cannot connect from the source address {}: {err}",
                        source.map_or(String::new(), |s| s.to_string())
                    ),
                }))
            }
            Err(bound_socket::Failure::Connect(err)) => reason = describe_io(&err),
        }
    }
    Err(Attempt::Retry(reason))
}

/// A TCP connection from a chosen local address (`std` cannot bind before it connects).
mod bound_socket {
    use std::io;
    use std::mem;
    use std::net::{IpAddr, SocketAddr, TcpStream};
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::time::{Duration, Instant};

    pub(super) enum Failure {
        /// The socket could not be made or bound to the source: no retry will help.
        Bind(io::Error),
        /// The connection failed or timed out: worth another try.
        Connect(io::Error),
    }

    /// Connects to `target` from `source` (port chosen by the system), within `limit`; the
    /// stream is blocking and close-on-exec, as `TcpStream::connect_timeout`'s.
    pub(super) fn connect(
        source: IpAddr,
        target: SocketAddr,
        limit: Duration,
    ) -> Result<TcpStream, Failure> {
        let family = if target.is_ipv4() {
            libc::AF_INET
        } else {
            libc::AF_INET6
        };
        let flags = libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK;
        // SAFETY: a plain socket(2) call; the descriptor is owned at once below.
        let fd = unsafe { libc::socket(family, flags, 0) };
        if fd < 0 {
            return Err(Failure::Bind(io::Error::last_os_error()));
        }
        // SAFETY: a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let raw = fd.as_raw_fd();
        // The port is picked at connect(2), knowing the destination, so that many sockets of one
        // source address do not use up its ports (best effort: an older kernel ignores it).
        let one: libc::c_int = 1;
        // SAFETY: setsockopt with a pointer to a c_int of the size given.
        unsafe {
            libc::setsockopt(
                raw,
                libc::IPPROTO_IP,
                libc::IP_BIND_ADDRESS_NO_PORT,
                (&one as *const libc::c_int).cast(),
                mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        let (local, local_len) = sockaddr(SocketAddr::new(source, 0));
        // SAFETY: `local` is a valid socket address of `local_len` bytes.
        if unsafe {
            libc::bind(
                raw,
                (&local as *const libc::sockaddr_storage).cast(),
                local_len,
            )
        } != 0
        {
            return Err(Failure::Bind(io::Error::last_os_error()));
        }
        let (remote, remote_len) = sockaddr(target);
        // SAFETY: `remote` is a valid socket address of `remote_len` bytes.
        let started = unsafe {
            libc::connect(
                raw,
                (&remote as *const libc::sockaddr_storage).cast(),
                remote_len,
            )
        };
        if started != 0 {
            let err = io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EINPROGRESS) {
                return Err(Failure::Connect(err));
            }
            wait_connected(raw, limit).map_err(Failure::Connect)?;
        }
        let stream = TcpStream::from(fd);
        stream.set_nonblocking(false).map_err(Failure::Connect)?;
        Ok(stream)
    }

    /// Waits for a non-blocking connect(2) to finish, for at most `limit`; its outcome.
    fn wait_connected(fd: libc::c_int, limit: Duration) -> io::Result<()> {
        let end = Instant::now() + limit;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::from(io::ErrorKind::TimedOut));
            }
            let mut poll = libc::pollfd {
                fd,
                events: libc::POLLOUT,
                revents: 0,
            };
            let ms = left.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
            // SAFETY: one valid pollfd.
            match unsafe { libc::poll(&mut poll, 1, ms) } {
                0 => continue,
                n if n < 0 => {
                    let err = io::Error::last_os_error();
                    if err.kind() == io::ErrorKind::Interrupted {
                        continue;
                    }
                    return Err(err);
                }
                _ => break,
            }
        }
        let mut error: libc::c_int = 0;
        let mut len = mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt into a c_int of the size given.
        let rc = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_ERROR,
                (&mut error as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        if error != 0 {
            return Err(io::Error::from_raw_os_error(error));
        }
        Ok(())
    }

    /// `addr` as the C structure the socket calls take, and its length.
    fn sockaddr(addr: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
        // SAFETY: all-zero bytes are a valid sockaddr_storage (and sockaddr_in / _in6).
        let mut storage: libc::sockaddr_storage = unsafe { mem::zeroed() };
        let len = match addr {
            SocketAddr::V4(v4) => {
                // SAFETY: sockaddr_storage is large and aligned enough for any socket address.
                let sin = unsafe {
                    &mut *(&mut storage as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in>()
                };
                sin.sin_family = libc::AF_INET as libc::sa_family_t;
                sin.sin_port = v4.port().to_be();
                sin.sin_addr.s_addr = u32::from_ne_bytes(v4.ip().octets());
                mem::size_of::<libc::sockaddr_in>()
            }
            SocketAddr::V6(v6) => {
                // SAFETY: as above.
                let sin6 = unsafe {
                    &mut *(&mut storage as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in6>()
                };
                sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
                sin6.sin6_port = v6.port().to_be();
                sin6.sin6_flowinfo = v6.flowinfo();
                sin6.sin6_addr.s6_addr = v6.ip().octets();
                sin6.sin6_scope_id = v6.scope_id();
                mem::size_of::<libc::sockaddr_in6>()
            }
        };
        (storage, len as libc::socklen_t)
    }
}

/// Makes `timeout` (at least 1 ms) the limit of every write on `stream` to the store at `addr`,
/// for either protocol's client; the limit its reads are to take too.
pub(crate) fn request_timeout(
    stream: &TcpStream,
    addr: &str,
    timeout: Duration,
) -> Result<Duration, StoreError> {
    let timeout = timeout.max(Duration::from_millis(1));
    stream
        .set_write_timeout(Some(timeout))
        .map_err(|cause| StoreError::Connection {
            addr: addr.to_string(),
            op: "setting the request timeout".into(),
            cause,
        })?;
    Ok(timeout)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{self, Read};
    use std::net::{Ipv4Addr, TcpListener};

    const SOURCE: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 1, 2, 3));

    #[test]
    fn a_bound_connection_comes_from_the_source_asked_for() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let stream = connect_any(&addr, || Duration::from_secs(2), Some(SOURCE))
            .ok()
            .expect("a connection");
        let (_peer_side, peer) = listener.accept().unwrap();
        assert_eq!(peer.ip(), SOURCE);
        assert_eq!(stream.local_addr().unwrap(), peer);
        assert_eq!(stream.peer_addr().unwrap().to_string(), addr);
        // Blocking, as `TcpStream::connect` gives it.
        let mut byte = [0u8; 1];
        stream
            .set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        let err = (&stream).read(&mut byte).unwrap_err();
        assert!(
            matches!(
                err.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ),
            "{err}"
        );
    }
}
