//! The store's client: one rank's connection, in our protocol (connect with retries and the
//! run-id handshake: mutual proofs, the id never sent) or, under torchrun's agent store, in
//! PyTorch's ([`c10d`](super::c10d)); then one request at a time, each bounded by a timeout.

use std::fmt;
use std::io::{self, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::thread;
use std::time::{Duration, Instant};

use super::c10d::C10dClient;
use super::*;

/// One rank's connection to the store. Requests are answered in order, one at a time. After a
/// transport error (timeout, closed connection, bad reply) the connection is given up and every
/// later call fails with [`StoreError::Broken`].
///
/// It speaks one of two protocols, chosen when it connects and the same for every method: ours
/// (a [`StoreServer`], authenticated with the run id), or PyTorch's c10d `TCPStore` protocol
/// when [`rendezvous`] found torchrun's agent store (`TORCHELASTIC_USE_AGENT_STORE`), where
/// values are sealed with the run id instead (see `store/src/c10d.rs`).
pub struct StoreClient {
    link: Link,
}

/// The protocol a [`StoreClient`] speaks.
enum Link {
    Own(OwnClient),
    C10d(Box<C10dClient>),
}

impl fmt::Debug for StoreClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.link {
            Link::Own(client) => client.fmt(f),
            Link::C10d(client) => client.fmt(f),
        }
    }
}

impl StoreClient {
    /// Connects to the store at `addr` (`"host:port"`, `"[v6]:port"`) and presents `run_id`,
    /// retrying with backoff for up to `deadline` while nobody answers. Fails with
    /// [`StoreError::Unreachable`] naming the address and the time spent, or at once with
    /// [`StoreError::WrongRun`] when what answers cannot prove that it knows `run_id` (a store of
    /// another run, an impostor), or [`StoreError::Silent`] when it never answers the handshake.
    /// `run_id` itself is never sent.
    ///
    /// An address that [`rendezvous`] connected to as torchrun's agent store in this process is
    /// spoken to in PyTorch's protocol again (a second connection of the same rank).
    pub fn connect(
        addr: &str,
        run_id: &str,
        deadline: Duration,
    ) -> Result<StoreClient, StoreError> {
        let link = match c10d::agent_store_prefix(addr) {
            Some(prefix) => Link::C10d(Box::new(C10dClient::connect(
                addr, run_id, &prefix, deadline,
            )?)),
            None => Link::Own(OwnClient::connect(addr, run_id, deadline)?),
        };
        Ok(StoreClient { link })
    }

    /// Connects to torchrun's agent store at `addr` in PyTorch's protocol, every key under
    /// `prefix`, every value sealed with `run_id`.
    pub(crate) fn connect_agent_store(
        addr: &str,
        run_id: &str,
        prefix: &str,
        deadline: Duration,
    ) -> Result<StoreClient, StoreError> {
        let client = C10dClient::connect(addr, run_id, prefix, deadline)?;
        Ok(StoreClient {
            link: Link::C10d(Box::new(client)),
        })
    }

    /// Whether this connection speaks PyTorch's protocol to torchrun's agent store.
    pub fn is_agent_store(&self) -> bool {
        matches!(self.link, Link::C10d(_))
    }

    /// The store's address, as given to [`StoreClient::connect`].
    pub fn addr(&self) -> &str {
        match &self.link {
            Link::Own(client) => &client.addr,
            Link::C10d(client) => client.addr(),
        }
    }

    /// How long `set`, `get` and `add` wait for their answer before failing (default 30 s): a
    /// heartbeat sets a short one, so that a store host that vanished is noticed in seconds.
    pub fn set_io_timeout(&mut self, timeout: Duration) -> Result<(), StoreError> {
        match &mut self.link {
            Link::Own(client) => client.set_io_timeout(timeout),
            Link::C10d(client) => client.set_io_timeout(timeout),
        }
    }

    /// Stores `value` under `key`, replacing any previous value, and wakes the ranks waiting on it.
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        match &mut self.link {
            Link::Own(client) => client.set(key, value),
            Link::C10d(client) => client.set(key, value),
        }
    }

    /// Stores `value` under `key` for as long as this connection lives: the server removes the
    /// key when the connection closes (this client is dropped, or its process dies). PyTorch's
    /// protocol has no such keys: there this client deletes them when it is dropped, and a
    /// process that dies leaves them behind.
    pub fn set_ephemeral(&mut self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        match &mut self.link {
            Link::Own(client) => client.set_ephemeral(key, value),
            Link::C10d(client) => client.set_ephemeral(key, value),
        }
    }

    /// The value under `key`, or `None` if nobody has set it yet (does not block).
    pub fn get(&mut self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        match &mut self.link {
            Link::Own(client) => client.get(key),
            Link::C10d(client) => client.get(key),
        }
    }

    /// Blocks until every key exists and returns their values in the order of `keys`. After
    /// `timeout` it fails with [`StoreError::WaitTimeout`] naming the keys still missing.
    pub fn wait(&mut self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>, StoreError> {
        match &mut self.link {
            Link::Own(client) => client.wait(keys, timeout),
            Link::C10d(client) => client.wait(keys, timeout),
        }
    }

    /// Atomically adds `delta` to the counter under `key` (a missing key counts as 0; the value
    /// is stored as decimal text) and returns the new value.
    pub fn add(&mut self, key: &str, delta: i64) -> Result<i64, StoreError> {
        match &mut self.link {
            Link::Own(client) => client.add(key, delta),
            Link::C10d(client) => client.add(key, delta),
        }
    }
}

/// A connection in our own protocol (see the crate's documentation).
struct OwnClient {
    stream: TcpStream,
    addr: String,
    broken: Option<String>,
    /// How long `set`, `get` and `add` wait for their answer (default 30 s).
    io_timeout: Duration,
}

impl fmt::Debug for OwnClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreClient")
            .field("addr", &self.addr)
            .field("broken", &self.broken)
            .finish()
    }
}

/// Outcome of one connection attempt.
pub(crate) enum Attempt {
    /// Worth another try (nobody listening yet, connection dropped during the handshake).
    Retry(String),
    /// Final (cannot prove the run id, silent, not a store).
    Fatal(StoreError),
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

impl OwnClient {
    fn connect(addr: &str, run_id: &str, deadline: Duration) -> Result<OwnClient, StoreError> {
        connect_with_retries(addr, deadline, |end| Self::attempt(addr, run_id, end))
    }

    fn attempt(addr: &str, run_id: &str, end: Option<Instant>) -> Result<OwnClient, Attempt> {
        let remaining = || {
            end.map_or(Duration::MAX, |e| {
                e.saturating_duration_since(Instant::now())
            })
        };
        let stream = connect_any(addr, remaining)?;
        let retry_io = |err: io::Error| Attempt::Retry(describe_io(&err));
        stream.set_nodelay(true).map_err(retry_io)?;
        stream
            .set_write_timeout(Some(IO_TIMEOUT))
            .map_err(retry_io)?;
        let handshake_limit = remaining().clamp(Duration::from_secs(1), HANDSHAKE_TIMEOUT);
        stream
            .set_read_timeout(Some(handshake_limit))
            .map_err(retry_io)?;
        let mut client = OwnClient {
            stream,
            addr: addr.to_string(),
            broken: None,
            io_timeout: IO_TIMEOUT,
        };
        client.handshake(run_id)?;
        tracing::debug!(addr, "connected to the rendezvous store");
        Ok(client)
    }

    /// The handshake (see the crate's documentation): the server proves that it knows the run id
    /// before the client proves it; only a welcome lets the connection be used.
    fn handshake(&mut self, run_id: &str) -> Result<(), Attempt> {
        let key = auth::Key::new(run_id);
        let client_nonce = auth::nonce().map_err(|reason| {
            Attempt::Fatal(StoreError::Protocol {
                addr: self.addr.clone(),
                detail: format!("cannot start the handshake: {reason}"),
            })
        })?;
        self.send_handshake(&Request::Hello {
            protocol: PROTOCOL,
            nonce: client_nonce,
        })?;
        let server_nonce = match self.read_handshake()? {
            Response::Challenge { nonce, proof, .. }
                if key.server_proved(&client_nonce, &nonce, &proof) =>
            {
                nonce
            }
            Response::Challenge { fingerprint, .. } => {
                return Err(Attempt::Fatal(StoreError::WrongRun {
                    addr: self.addr.clone(),
                    found: shown_fingerprint(&fingerprint),
                    expected: run_fingerprint(run_id),
                }))
            }
            other => return Err(self.not_a_store(other)),
        };
        self.send_handshake(&Request::Proof {
            proof: key.client_proof(&client_nonce, &server_nonce),
        })?;
        match self.read_handshake()? {
            Response::Welcome => Ok(()),
            other => Err(self.not_a_store(other)),
        }
    }

    /// Sends one frame of the handshake; a failure is worth another connection.
    fn send_handshake(&mut self, request: &Request) -> Result<(), Attempt> {
        let frame = encode_frame(request).map_err(|len| {
            Attempt::Fatal(StoreError::FrameTooLarge {
                addr: self.addr.clone(),
                len,
                limit: MAX_FRAME_BYTES,
            })
        })?;
        self.stream
            .write_all(&frame)
            .map_err(|err| Attempt::Retry(format!("{} during the handshake", describe_io(&err))))
    }

    /// Reads one answer of the handshake. A closed connection is worth another try (a store
    /// that is full closes new connections); silence or garbage means something else holds
    /// the port, which no retry will change.
    fn read_handshake(&mut self) -> Result<Response, Attempt> {
        let addr = self.addr.clone();
        let body = match read_frame(&mut self.stream) {
            Ok(body) => body,
            Err(FrameReadError::Io(err))
                if matches!(
                    err.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                let waited = self.stream.read_timeout().ok().flatten();
                return Err(Attempt::Fatal(StoreError::Silent {
                    addr,
                    waited: waited.unwrap_or(HANDSHAKE_TIMEOUT),
                }));
            }
            Err(FrameReadError::Io(err)) => {
                return Err(Attempt::Retry(format!(
                    "{} during the handshake",
                    describe_io(&err)
                )))
            }
            Err(FrameReadError::TooLarge(len)) => {
                return Err(Attempt::Fatal(StoreError::Protocol {
                    addr,
                    detail: format!(
                        "a {len}-byte frame in answer to the handshake; is something other than \
                         the store listening there?"
                    ),
                }))
            }
        };
        decode_body::<Response>(&body).map_err(|detail| {
            Attempt::Fatal(StoreError::Protocol {
                addr,
                detail: format!(
                    "{detail} in answer to the handshake; is something other than the store \
                     listening there?"
                ),
            })
        })
    }

    /// The final error for an answer that has no place at this step of the handshake.
    fn not_a_store(&self, response: Response) -> Attempt {
        let addr = self.addr.clone();
        Attempt::Fatal(match response {
            Response::Refused { reason } => StoreError::Refused {
                addr,
                op: "the handshake".into(),
                reason,
            },
            other => StoreError::Protocol {
                addr,
                detail: format!("{} in answer to the handshake", other.kind()),
            },
        })
    }

    fn set_io_timeout(&mut self, timeout: Duration) -> Result<(), StoreError> {
        self.io_timeout = request_timeout(&self.stream, &self.addr, timeout)?;
        Ok(())
    }

    /// Stores `value` under `key`, replacing any previous value, and wakes the ranks waiting on it.
    fn set(&mut self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let request = Request::Set {
            key: key.to_string(),
            value: value.to_vec(),
        };
        let op = || format!("set {key:?}");
        match self.exchange(&op, &request, self.io_timeout)? {
            Response::Done => Ok(()),
            other => Err(self.unexpected(op(), other)),
        }
    }

    /// Stores `value` under `key` for as long as this connection lives: the server removes the
    /// key when the connection closes (this client is dropped, or its process dies).
    fn set_ephemeral(&mut self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let request = Request::SetEphemeral {
            key: key.to_string(),
            value: value.to_vec(),
        };
        let op = || format!("set {key:?} (ephemeral)");
        match self.exchange(&op, &request, self.io_timeout)? {
            Response::Done => Ok(()),
            other => Err(self.unexpected(op(), other)),
        }
    }

    /// The value under `key`, or `None` if nobody has set it yet (does not block).
    fn get(&mut self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let request = Request::Get {
            key: key.to_string(),
        };
        let op = || format!("get {key:?}");
        match self.exchange(&op, &request, self.io_timeout)? {
            Response::Value(value) => Ok(value),
            other => Err(self.unexpected(op(), other)),
        }
    }

    /// Blocks until every key exists and returns their values in the order of `keys`. After
    /// `timeout` it fails with [`StoreError::WaitTimeout`] naming the keys still missing.
    fn wait(&mut self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>, StoreError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let mut timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        if timeout_ms == 0 && !timeout.is_zero() {
            timeout_ms = 1;
        }
        let request = Request::Wait {
            keys: keys.iter().map(|key| key.to_string()).collect(),
            timeout_ms,
        };
        let op = || format!("wait for {keys:?}");
        match self.exchange(&op, &request, timeout.saturating_add(WAIT_SLACK))? {
            Response::Values(values) if values.len() == keys.len() => Ok(values),
            Response::WaitTimedOut { missing } => Err(StoreError::WaitTimeout {
                addr: self.addr.clone(),
                timeout,
                missing,
            }),
            other => Err(self.unexpected(op(), other)),
        }
    }

    /// Atomically adds `delta` to the counter under `key` (a missing key counts as 0; the value
    /// is stored as decimal text) and returns the new value.
    fn add(&mut self, key: &str, delta: i64) -> Result<i64, StoreError> {
        let request = Request::Add {
            key: key.to_string(),
            delta,
        };
        let op = || format!("add {key:?}");
        match self.exchange(&op, &request, self.io_timeout)? {
            Response::Counter(value) => Ok(value),
            other => Err(self.unexpected(op(), other)),
        }
    }

    /// Sends one request and reads its answer, giving the connection up on transport errors.
    fn exchange(
        &mut self,
        op: &dyn Fn() -> String,
        request: &Request,
        answer_within: Duration,
    ) -> Result<Response, StoreError> {
        if let Some(reason) = &self.broken {
            return Err(StoreError::Broken {
                addr: self.addr.clone(),
                reason: reason.clone(),
            });
        }
        // Checked before anything is sent, so an oversized value leaves the connection usable.
        let frame = encode_frame(request).map_err(|len| StoreError::FrameTooLarge {
            addr: self.addr.clone(),
            len,
            limit: MAX_FRAME_BYTES,
        })?;
        let result = self.transport(op, &frame, answer_within);
        if let Err(err) = &result {
            self.broken = Some(err.to_string());
        }
        result
    }

    fn transport(
        &mut self,
        op: &dyn Fn() -> String,
        frame: &[u8],
        answer_within: Duration,
    ) -> Result<Response, StoreError> {
        let addr = self.addr.clone();
        let connection = |cause| StoreError::Connection {
            addr: addr.clone(),
            op: op(),
            cause,
        };
        self.stream
            .set_read_timeout(Some(answer_within.max(Duration::from_millis(1))))
            .map_err(connection)?;
        self.stream.write_all(frame).map_err(connection)?;
        let body = match read_frame(&mut self.stream) {
            Ok(body) => body,
            Err(FrameReadError::Io(err))
                if matches!(
                    err.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Err(StoreError::NoAnswer {
                    addr: self.addr.clone(),
                    op: op(),
                    waited: answer_within,
                })
            }
            Err(FrameReadError::Io(err)) => return Err(connection(err)),
            Err(FrameReadError::TooLarge(len)) => {
                return Err(StoreError::FrameTooLarge {
                    addr: self.addr.clone(),
                    len,
                    limit: MAX_FRAME_BYTES,
                })
            }
        };
        decode_body(&body).map_err(|detail| StoreError::Protocol {
            addr: self.addr.clone(),
            detail: format!("{detail} in answer to {}", op()),
        })
    }

    /// The error for an answer that does not fit the request. A refusal leaves the connection
    /// usable; anything else means the two sides disagree, so the connection is given up.
    fn unexpected(&mut self, op: String, response: Response) -> StoreError {
        if let Response::Refused { reason } = response {
            return StoreError::Refused {
                addr: self.addr.clone(),
                op,
                reason,
            };
        }
        let err = StoreError::Protocol {
            addr: self.addr.clone(),
            detail: format!("{} in answer to {op}", response.kind()),
        };
        self.broken = Some(err.to_string());
        err
    }
}

/// A TCP connection to the first address of `addr` that answers, each tried for at most 2 s
/// (and what is left of the deadline); why none did, to retry.
pub(crate) fn connect_any(
    addr: &str,
    remaining: impl Fn() -> Duration,
) -> Result<TcpStream, Attempt> {
    let targets: Vec<SocketAddr> = match addr.to_socket_addrs() {
        Ok(targets) => targets.collect(),
        Err(err) => return Err(Attempt::Retry(format!("cannot resolve it: {err}"))),
    };
    let mut reason = "the host name resolves to no address".to_string();
    for target in targets {
        let limit = remaining().clamp(Duration::from_millis(50), Duration::from_secs(2));
        match TcpStream::connect_timeout(&target, limit) {
            Ok(stream) => return Ok(stream),
            Err(err) => reason = describe_io(&err),
        }
    }
    Err(Attempt::Retry(reason))
}

/// A fingerprint a peer claims, fit for a one-line message whatever it sent.
fn shown_fingerprint(claimed: &str) -> String {
    let looks_right = claimed.len() <= 32
        && claimed
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == ':');
    if looks_right {
        claimed.to_string()
    } else {
        "(malformed)".into()
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
