//! The store's client: one rank's connection, in our protocol (connect with retries and the
//! run-id handshake: mutual proofs, the id never sent) or, under torchrun's agent store, in
//! PyTorch's ([`c10d`](super::c10d)); then one request at a time, each bounded by a timeout.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use super::c10d::C10dClient;
use super::connect::{
    connect_any, connect_with_retries, request_timeout, Attempt, Patience, Silence,
};
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
            None => Link::Own(OwnClient::connect(addr, run_id, deadline, None)?),
        };
        Ok(StoreClient { link })
    }

    /// [`StoreClient::connect`] from the local address `source` (the socket is bound to it before
    /// it connects; the port is the system's choice): same retries, same handshake, always in our
    /// protocol. A benchmark gives the simulated ranks of each host their own loopback address
    /// (any of 127/8 on Linux), as the server limits unproven connections per source address.
    /// A `source` this machine does not have fails at once with [`StoreError::BadAddress`].
    pub fn connect_from(
        addr: &str,
        run_id: &str,
        deadline: Duration,
        source: IpAddr,
    ) -> Result<StoreClient, StoreError> {
        let client = connect_with_retries(addr, deadline, |end| {
            OwnClient::attempt(addr, run_id, end, Some(source), None)
        })?;
        Ok(StoreClient {
            link: Link::Own(client),
        })
    }

    /// [`StoreClient::connect`] in our protocol to the store whose listener `launch` holds for
    /// rank 0 at `held`: a connection that lands there and meets silence waits for rank 0 until
    /// `deadline` ([`StoreError::NotServing`] then) instead of failing after 10 s.
    pub(crate) fn connect_held(
        addr: &str,
        run_id: &str,
        deadline: Duration,
        held: HeldListener,
    ) -> Result<StoreClient, StoreError> {
        let client = OwnClient::connect(addr, run_id, deadline, Some(held))?;
        Ok(StoreClient {
            link: Link::Own(client),
        })
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

    /// Leaves the will `name`: if this connection ends before the will is revoked (the process
    /// dies, however), the server writes `value` under `key` unless it has a value by then. Not
    /// in PyTorch's protocol (torchrun's agent store): there it is refused.
    pub fn set_will(&mut self, name: &str, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let request = Request::Will {
            name: name.to_string(),
            key: key.to_string(),
            value: value.to_vec(),
        };
        self.own("leaving a will")?
            .write_unanswered(format!("will {name:?}"), &request)
    }

    /// Voids the will `name` (left by this connection or another: one parked in a wait, say).
    pub fn revoke_will(&mut self, name: &str) -> Result<(), StoreError> {
        let request = Request::Revoke {
            name: name.to_string(),
        };
        self.own("revoking a will")?
            .write_unanswered(format!("revoke {name:?}"), &request)
    }

    /// A handle that closes this connection from another thread (this one may be parked in a
    /// wait, which then fails at once); `None` under torchrun's agent store.
    pub fn closer(&self) -> Option<StoreCloser> {
        match &self.link {
            Link::Own(client) => client.stream.try_clone().ok().map(StoreCloser),
            Link::C10d(_) => None,
        }
    }

    /// Our protocol's connection, or a refusal of `op` under torchrun's agent store.
    fn own(&mut self, op: &str) -> Result<&mut OwnClient, StoreError> {
        match &mut self.link {
            Link::Own(client) => Ok(client),
            Link::C10d(client) => Err(StoreError::Refused {
                addr: client.addr().to_string(),
                op: op.into(),
                reason: "torchrun's agent store (PyTorch's protocol) has no such request".into(),
            }),
        }
    }

    /// The value under `key`, or `None` if nobody has set it yet (does not block).
    pub fn get(&mut self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        match &mut self.link {
            Link::Own(client) => client.get(key),
            Link::C10d(client) => client.get(key),
        }
    }

    /// The value under each of `keys` (`None` where nobody has set it), in one round trip in
    /// our protocol (one `get` each in PyTorch's). Does not block.
    pub fn get_many(&mut self, keys: &[&str]) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
        match &mut self.link {
            Link::Own(client) => client.get_many(keys),
            Link::C10d(client) => keys.iter().map(|key| client.get(key)).collect(),
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

/// Closes a [`StoreClient`]'s connection from another thread ([`StoreClient::closer`]).
#[derive(Debug)]
pub struct StoreCloser(TcpStream);

impl StoreCloser {
    /// Shuts the connection down both ways: for the server, as if its process had ended.
    pub fn close(&self) {
        let _ = self.0.shutdown(std::net::Shutdown::Both);
    }
}

/// A connection in our own protocol (see the crate's documentation).
///
/// A `set` is written and not waited for: the server does not answer writes (as PyTorch's
/// `SET`), so a rank's writes followed by a wait cost one round trip, not one each. The server
/// executes a connection's requests in order, so a write is in effect before anything this
/// connection asks next; a broken connection surfaces at the next request that has an answer.
struct OwnClient {
    stream: TcpStream,
    addr: String,
    broken: Option<String>,
    /// How long `set`, `get` and `add` wait for their answer (default 30 s).
    io_timeout: Duration,
    /// Bytes read from the socket that are not yet a whole answer (answers to pipelined writes
    /// come together: one read takes them all).
    incoming: Vec<u8>,
    /// The socket's read timeout as last set (set again only when it changes).
    read_timeout: Option<Duration>,
}

impl fmt::Debug for OwnClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreClient")
            .field("addr", &self.addr)
            .field("broken", &self.broken)
            .finish()
    }
}

impl OwnClient {
    fn connect(
        addr: &str,
        run_id: &str,
        deadline: Duration,
        held: Option<HeldListener>,
    ) -> Result<OwnClient, StoreError> {
        connect_with_retries(addr, deadline, |end| {
            Self::attempt(addr, run_id, end, None, held)
        })
    }

    /// One connection and handshake, from `source` when there is one; `held`: where `launch`
    /// holds rank 0's listener (silence there is waited for until `end`).
    fn attempt(
        addr: &str,
        run_id: &str,
        end: Option<Instant>,
        source: Option<IpAddr>,
        held: Option<HeldListener>,
    ) -> Result<OwnClient, Attempt> {
        let remaining = || {
            end.map_or(Duration::MAX, |e| {
                e.saturating_duration_since(Instant::now())
            })
        };
        let stream = connect_any(addr, remaining, source)?;
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
            incoming: Vec::new(),
            read_timeout: Some(handshake_limit),
        };
        client.handshake(run_id, &mut Patience::new(held, end))?;
        tracing::debug!(addr, "connected to the rendezvous store");
        Ok(client)
    }

    /// The handshake (see the crate's documentation): the server proves that it knows the run id
    /// before the client proves it; only a welcome lets the connection be used.
    fn handshake(&mut self, run_id: &str, patience: &mut Patience) -> Result<(), Attempt> {
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
        let server_nonce = match self.read_handshake(patience)? {
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
        match self.read_handshake(patience)? {
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
    /// the port, which no retry will change, unless it is rank 0's own listener that `launch`
    /// holds (see [`Patience`]).
    fn read_handshake(&mut self, patience: &mut Patience) -> Result<Response, Attempt> {
        let addr = self.addr.clone();
        let body = loop {
            match self.next_body() {
                Ok(body) => break body,
                Err(FrameReadError::Io(err))
                    if matches!(
                        err.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    let peer: Option<SocketAddr> = self.stream.peer_addr().ok();
                    match patience.after_silence(&addr, peer) {
                        Silence::Give(err) => return Err(Attempt::Fatal(err)),
                        Silence::Wait(left) => {
                            let limit = Some(left.max(Duration::from_millis(1)));
                            self.stream
                                .set_read_timeout(limit)
                                .map_err(|err| Attempt::Retry(describe_io(&err)))?;
                            self.read_timeout = limit;
                        }
                    }
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
                            "a {len}-byte frame in answer to the handshake; is something other \
                             than the store listening there?"
                        ),
                    }))
                }
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

    /// Stores `value` under `key`, replacing any previous value, and wakes the ranks waiting on it
    /// (written; the server does not answer writes).
    fn set(&mut self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let request = Request::Set {
            key: key.to_string(),
            value: value.to_vec(),
        };
        self.write_unanswered(format!("set {key:?}"), &request)
    }

    /// Stores `value` under `key` for as long as this connection lives: the server removes the
    /// key when the connection closes (this client is dropped, or its process dies).
    fn set_ephemeral(&mut self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let request = Request::SetEphemeral {
            key: key.to_string(),
            value: value.to_vec(),
        };
        self.write_unanswered(format!("set {key:?} (ephemeral)"), &request)
    }

    /// Sends a write, which has no answer (see [`OwnClient`]).
    fn write_unanswered(&mut self, op: String, request: &Request) -> Result<(), StoreError> {
        self.usable()?;
        let frame = self.frame(request)?;
        let result = self
            .stream
            .write_all(&frame)
            .map_err(|cause| StoreError::Connection {
                addr: self.addr.clone(),
                op,
                cause,
            });
        if let Err(err) = &result {
            self.broken = Some(err.to_string());
        }
        result
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

    fn get_many(&mut self, keys: &[&str]) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let request = Request::GetMany {
            keys: keys.iter().map(|key| key.to_string()).collect(),
        };
        let op = || format!("get {} keys ({:?}...)", keys.len(), keys[0]);
        match self.exchange(&op, &request, self.io_timeout)? {
            Response::Found(values) if values.len() == keys.len() => Ok(values),
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

    /// An error when the connection was given up.
    fn usable(&self) -> Result<(), StoreError> {
        match &self.broken {
            Some(reason) => Err(StoreError::Broken {
                addr: self.addr.clone(),
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }

    /// `request`'s frame; checked before anything is sent, so an oversized value leaves the
    /// connection usable.
    fn frame(&self, request: &Request) -> Result<Vec<u8>, StoreError> {
        encode_frame(request).map_err(|len| StoreError::FrameTooLarge {
            addr: self.addr.clone(),
            len,
            limit: MAX_FRAME_BYTES,
        })
    }

    /// Sends one request and reads its answer, giving the connection up on transport errors.
    fn exchange(
        &mut self,
        op: &dyn Fn() -> String,
        request: &Request,
        answer_within: Duration,
    ) -> Result<Response, StoreError> {
        self.usable()?;
        let frame = self.frame(request)?;
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
        self.stream.write_all(frame).map_err(connection)?;
        let limit = Some(answer_within.max(Duration::from_millis(1)));
        if self.read_timeout != limit {
            self.stream.set_read_timeout(limit).map_err(connection)?;
            self.read_timeout = limit;
        }
        let body = match self.next_body() {
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

    /// The body of the next frame from the server, reading the socket only when what is
    /// buffered is not a whole frame (with the socket's read timeout).
    fn next_body(&mut self) -> Result<Vec<u8>, FrameReadError> {
        loop {
            let mut want = 4 << 10;
            if let [a, b, c, d, ..] = self.incoming[..] {
                let len = u32::from_le_bytes([a, b, c, d]) as usize;
                if len > MAX_FRAME_BYTES {
                    return Err(FrameReadError::TooLarge(len));
                }
                if self.incoming.len() >= 4 + len {
                    let body = self.incoming[4..4 + len].to_vec();
                    self.incoming.drain(..4 + len);
                    return Ok(body);
                }
                want = want.max(4 + len - self.incoming.len());
            }
            let old = self.incoming.len();
            self.incoming.resize(old + want, 0);
            let read = self.stream.read(&mut self.incoming[old..]);
            self.incoming.truncate(old + *read.as_ref().unwrap_or(&0));
            match read {
                Ok(0) => return Err(FrameReadError::Io(io::ErrorKind::UnexpectedEof.into())),
                Ok(_) => {}
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                Err(err) => return Err(FrameReadError::Io(err)),
            }
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, TcpListener};

    const SOURCE: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 1, 2, 3));

    #[test]
    fn connect_from_speaks_to_a_store_and_fails_like_connect() {
        let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), "run").unwrap();
        let addr = server.local_addr().to_string();
        let t = Duration::from_secs(2);
        let mut a = StoreClient::connect_from(&addr, "run", t, SOURCE).unwrap();
        let mut b =
            StoreClient::connect_from(&addr, "run", t, IpAddr::V4(Ipv4Addr::LOCALHOST)).unwrap();
        a.set("k", b"v").unwrap();
        assert_eq!(
            b.wait(&["k"], Duration::from_secs(1)).unwrap(),
            vec![b"v".to_vec()]
        );
        let err = StoreClient::connect_from(&addr, "other", t, SOURCE).unwrap_err();
        assert!(matches!(err, StoreError::WrongRun { .. }), "{err}");

        // Nobody listening: retried until the deadline, as `connect`.
        let free = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let started = Instant::now();
        let err =
            StoreClient::connect_from(&free.to_string(), "run", Duration::from_millis(300), SOURCE)
                .unwrap_err();
        assert!(matches!(err, StoreError::Unreachable { .. }), "{err}");
        assert!(started.elapsed() >= Duration::from_millis(300));

        // A source this machine does not have fails at once, naming it.
        let started = Instant::now();
        let foreign = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1));
        let err = StoreClient::connect_from(&addr, "run", Duration::from_secs(5), foreign)
            .unwrap_err()
            .to_string();
        assert!(err.contains("192.0.2.1"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(2), "{err}");
    }
}
