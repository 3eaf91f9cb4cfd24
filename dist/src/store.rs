//! The rendezvous key-value store (PyTorch's `TCPStore`, as `env://` uses it): rank 0 hosts a
//! [`StoreServer`] on `MASTER_ADDR:MASTER_PORT` and every rank, rank 0 included, talks to it
//! through one [`StoreClient`] connection (`set`, `get`, `wait`, `add`).
//!
//! This module owns the wire protocol (length-prefixed bincode frames and the run-id handshake),
//! the server's key space, and the client's connect-retry and timeout policy. It must not know
//! what the keys mean (the collectives and the engine built on top decide that), must not choose
//! addresses or ports (the launcher's plan does, through the worker environment contract), and
//! must never let a peer's misbehaviour panic or hang either side: every failure is a
//! [`StoreError`] whose one-line message names the address (and the keys, where there are some),
//! and every blocking call is bounded by a timeout.
//!
//! Wire format: every message is a frame, a `u32` little-endian body length (at most
//! [`MAX_FRAME_BYTES`]) followed by the bincode 2 (`standard()` config, serde) encoding of a
//! `Request` or a `Response`. The first request of a connection must be a `Hello` carrying the
//! protocol tag and the run id (`TORCHELASTIC_RUN_ID`); the server answers a mismatch with the run
//! id it serves and closes the connection. Counters written by `add` are stored as decimal text,
//! as PyTorch does.

use std::collections::HashMap;
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use common::env_contract::WorkerEnv;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// The largest frame body either side sends or accepts (64 MiB); a longer frame is an error.
pub const MAX_FRAME_BYTES: usize = 64 << 20;

/// Tag in the `Hello` request, so that a stranger speaking another protocol is told apart.
const PROTOCOL: u32 = 0x6770_7331;
/// How long a client waits for the answer to `set`, `get` and `add`.
const IO_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a client waits for the answer to its `Hello`.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Extra time a client gives the server beyond a `wait`'s own timeout before giving up on it.
const WAIT_SLACK: Duration = Duration::from_secs(10);
/// Longest pause between two connection attempts.
const MAX_BACKOFF: Duration = Duration::from_millis(250);
/// Read timeout of a server connection: how often an idle connection checks for shutdown.
const SERVER_TICK: Duration = Duration::from_millis(100);
/// A server connection whose peer stops sending in the middle of a frame for this long is dropped.
const STALL_LIMIT: Duration = Duration::from_secs(30);
/// Write timeout of a server connection (a peer that does not read its answers is dropped).
const SERVER_WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// How often the (non-blocking) listener is polled for new connections.
const ACCEPT_POLL: Duration = Duration::from_millis(5);
/// A connection must present the run id within this long, or it is closed.
const HELLO_DEADLINE: Duration = Duration::from_secs(10);
/// The largest frame accepted before the `Hello` (which is a few dozen bytes): a stranger
/// cannot make the server allocate more.
const PRE_HELLO_MAX_FRAME: usize = 4 << 10;
/// Connections that have not yet presented the run id, at most; more are closed at once (each
/// costs a thread and two file descriptors until its deadline).
const MAX_UNGREETED: usize = 32;

/// What a client asks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum Request {
    /// First message of every connection.
    Hello {
        protocol: u32,
        run_id: String,
    },
    Set {
        key: String,
        value: Vec<u8>,
    },
    Get {
        key: String,
    },
    /// Blocks (server side) until every key exists or `timeout_ms` passes.
    Wait {
        keys: Vec<String>,
        timeout_ms: u64,
    },
    Add {
        key: String,
        delta: i64,
    },
}

/// What the server answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum Response {
    /// The `Hello` was accepted.
    Welcome,
    /// `Set` done.
    Done,
    Value(Option<Vec<u8>>),
    Values(Vec<Vec<u8>>),
    Counter(i64),
    /// The `Hello` named another run. The store answers with its own run id's
    /// [`run_fingerprint`], never the id itself (the id is the secret that admits a connection).
    /// The connection closes.
    WrongRun {
        fingerprint: String,
    },
    WaitTimedOut {
        missing: Vec<String>,
    },
    /// The request was invalid (not a counter, overflow, protocol violation, shutting down).
    Refused {
        reason: String,
    },
}

impl Response {
    /// The variant's name, for error messages (never the payload, which may be large).
    fn kind(&self) -> &'static str {
        match self {
            Response::Welcome => "Welcome",
            Response::Done => "Done",
            Response::Value(_) => "Value",
            Response::Values(_) => "Values",
            Response::Counter(_) => "Counter",
            Response::WrongRun { .. } => "WrongRun",
            Response::WaitTimedOut { .. } => "WaitTimedOut",
            Response::Refused { .. } => "Refused",
        }
    }
}

/// Everything that can go wrong with the store; every message is one line naming the address.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The server could not listen on its address.
    #[error("cannot start the rendezvous store on {addr}: {}", describe_bind(.addr, .cause))]
    Bind { addr: SocketAddr, cause: io::Error },
    /// The address is malformed or cannot be resolved.
    #[error("invalid rendezvous store address {addr:?}: {reason}")]
    BadAddress { addr: String, reason: String },
    /// Nobody answered at the address before the connect deadline.
    #[error(
        "cannot reach the rendezvous store at {addr} after {:.1} s ({reason}); is rank 0 running?",
        .waited.as_secs_f64()
    )]
    Unreachable {
        addr: String,
        waited: Duration,
        reason: String,
    },
    /// The store at the address serves another run (both named by [`run_fingerprint`]).
    #[error("rendezvous store at {addr} belongs to another run (run id fingerprint {found}; ours is {expected}): check that every node has the same run id (--run-id / LAUNCH_RUN_ID)")]
    WrongRun {
        addr: String,
        found: String,
        expected: String,
    },
    /// `wait` gave up; `missing` are the keys that still did not exist.
    #[error(
        "timed out after {:.1} s waiting for store keys {missing:?} at {addr}",
        .timeout.as_secs_f64()
    )]
    WaitTimeout {
        addr: String,
        timeout: Duration,
        missing: Vec<String>,
    },
    /// The store did not answer a request in time.
    #[error(
        "the rendezvous store at {addr} did not answer {op} within {:.1} s",
        .waited.as_secs_f64()
    )]
    NoAnswer {
        addr: String,
        op: String,
        waited: Duration,
    },
    /// The connection failed (closed, reset, ...) during a request.
    #[error("lost the connection to the rendezvous store at {addr} during {op}: {}", describe_io(.cause))]
    Connection {
        addr: String,
        op: String,
        cause: io::Error,
    },
    /// A frame longer than [`MAX_FRAME_BYTES`] was about to be sent or was announced by the peer.
    #[error(
        "a {len}-byte message to or from the rendezvous store at {addr} exceeds the {limit}-byte frame limit"
    )]
    FrameTooLarge {
        addr: String,
        len: usize,
        limit: usize,
    },
    /// The peer answered something that is not a valid reply.
    #[error("unexpected reply from the rendezvous store at {addr}: {detail}")]
    Protocol { addr: String, detail: String },
    /// The store refused a request (e.g. `add` on a value that is not a decimal integer).
    #[error("rendezvous store at {addr} refused {op}: {reason}")]
    Refused {
        addr: String,
        op: String,
        reason: String,
    },
    /// An earlier error left the connection in an unknown state; `reason` is that error.
    #[error("the rendezvous store connection is unusable after an earlier error: {reason}")]
    Broken { addr: String, reason: String },
    /// The operating system refused a thread for the server.
    #[error("cannot start a rendezvous store thread: {cause}")]
    Thread { cause: io::Error },
}

fn describe_bind(addr: &SocketAddr, cause: &io::Error) -> String {
    match cause.kind() {
        io::ErrorKind::AddrInUse => format!(
            "port {} is already in use (another job, or a previous run still exiting?)",
            addr.port()
        ),
        io::ErrorKind::AddrNotAvailable => {
            format!("{} is not an address of this machine", addr.ip())
        }
        _ => cause.to_string(),
    }
}

/// A short, lower-case description of a socket error.
fn describe_io(err: &io::Error) -> String {
    match err.kind() {
        io::ErrorKind::ConnectionRefused => "connection refused".into(),
        io::ErrorKind::ConnectionReset => "connection reset".into(),
        io::ErrorKind::ConnectionAborted => "connection aborted".into(),
        io::ErrorKind::BrokenPipe => "connection closed by the store".into(),
        io::ErrorKind::UnexpectedEof => "connection closed by the store".into(),
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => "timed out".into(),
        _ => err.to_string(),
    }
}

// ---------------------------------------------------------------------------------------------
// Framing

fn wire_config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<MAX_FRAME_BYTES>()
}

/// Header plus body of one message, or the body length when it is over the limit.
fn encode_frame<T: Serialize>(msg: &T) -> Result<Vec<u8>, usize> {
    // Encoding plain enums of strings, integers and byte vectors cannot fail.
    let body = bincode::serde::encode_to_vec(msg, wire_config()).map_err(|_| usize::MAX)?;
    if body.len() > MAX_FRAME_BYTES {
        return Err(body.len());
    }
    let len = u32::try_from(body.len()).map_err(|_| body.len())?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&len.to_le_bytes());
    frame.extend_from_slice(&body);
    Ok(frame)
}

/// Decodes a whole frame body; trailing bytes are an error.
fn decode_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, String> {
    let (msg, used): (T, usize) = bincode::serde::decode_from_slice(body, wire_config())
        .map_err(|e| format!("undecodable frame ({e})"))?;
    if used != body.len() {
        return Err(format!(
            "frame has {} trailing bytes after its message",
            body.len() - used
        ));
    }
    Ok(msg)
}

/// A failure to read a frame with a blocking read.
enum FrameReadError {
    Io(io::Error),
    TooLarge(usize),
}

/// Reads one frame with the stream's own read timeout (client side).
fn read_frame(stream: &mut TcpStream) -> Result<Vec<u8>, FrameReadError> {
    let mut header = [0u8; 4];
    stream.read_exact(&mut header).map_err(FrameReadError::Io)?;
    let len = u32::from_le_bytes(header) as usize;
    if len > MAX_FRAME_BYTES {
        return Err(FrameReadError::TooLarge(len));
    }
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body).map_err(FrameReadError::Io)?;
    Ok(body)
}

// ---------------------------------------------------------------------------------------------
// Server

/// State shared by the acceptor and the connection threads.
struct Shared {
    run_id: String,
    keys: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
    stopping: AtomicBool,
    /// Connections that have not presented the run id yet.
    ungreeted: std::sync::atomic::AtomicUsize,
    /// How long a new connection has to present the run id ([`HELLO_DEADLINE`]).
    hello_deadline: Duration,
}

/// Counts a connection as ungreeted until it presents the run id or ends.
struct Ungreeted<'a>(Option<&'a Shared>);

impl Ungreeted<'_> {
    fn greeted(&mut self) {
        if let Some(shared) = self.0.take() {
            shared.ungreeted.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl Drop for Ungreeted<'_> {
    fn drop(&mut self) {
        self.greeted();
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, Vec<u8>>> {
        // No code panics while holding the lock; if one ever did, the map is still consistent.
        self.keys.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        // Taking the lock orders the flag before any waiter's next check: no lost wake-up.
        let _keys = self.lock();
        self.changed.notify_all();
    }

    /// Executes one request of a greeted connection.
    fn answer(&self, request: Request) -> Response {
        match request {
            Request::Hello { .. } => Response::Refused {
                reason: "this connection has already presented its run id".into(),
            },
            Request::Set { key, value } => {
                self.lock().insert(key, value);
                self.changed.notify_all();
                Response::Done
            }
            Request::Get { key } => Response::Value(self.lock().get(&key).cloned()),
            Request::Wait { keys, timeout_ms } => self.wait(&keys, timeout_ms),
            Request::Add { key, delta } => {
                let mut map = self.lock();
                let current = match map.get(&key) {
                    None => 0,
                    Some(bytes) => match std::str::from_utf8(bytes)
                        .ok()
                        .and_then(|text| text.trim().parse::<i64>().ok())
                    {
                        Some(value) => value,
                        None => {
                            return Response::Refused {
                                reason: format!(
                                    "the value of key {key:?} is not a decimal integer"
                                ),
                            }
                        }
                    },
                };
                let Some(next) = current.checked_add(delta) else {
                    return Response::Refused {
                        reason: format!("adding {delta} to {current} (key {key:?}) overflows i64"),
                    };
                };
                map.insert(key, next.to_string().into_bytes());
                drop(map);
                self.changed.notify_all();
                Response::Counter(next)
            }
        }
    }

    fn wait(&self, keys: &[String], timeout_ms: u64) -> Response {
        let deadline = Instant::now().checked_add(Duration::from_millis(timeout_ms));
        let mut map = self.lock();
        loop {
            if self.stopping() {
                return Response::Refused {
                    reason: "the store is shutting down".into(),
                };
            }
            let missing: Vec<String> = keys
                .iter()
                .filter(|key| !map.contains_key(key.as_str()))
                .cloned()
                .collect();
            if missing.is_empty() {
                let values = keys
                    .iter()
                    .map(|key| map.get(key.as_str()).cloned().unwrap_or_default())
                    .collect();
                return Response::Values(values);
            }
            match deadline {
                None => {
                    map = self
                        .changed
                        .wait(map)
                        .unwrap_or_else(PoisonError::into_inner)
                }
                Some(deadline) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Response::WaitTimedOut { missing };
                    }
                    map = self
                        .changed
                        .wait_timeout(map, deadline - now)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                }
            }
        }
    }
}

/// The store rank 0 hosts: a listener thread plus one thread per connection. It serves until it
/// is dropped; dropping it closes every connection (clients then get errors, never a hang).
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

impl fmt::Debug for StoreServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreServer")
            .field("addr", &self.addr)
            .field("run", &run_fingerprint(&self.shared.run_id))
            .finish()
    }
}

impl StoreServer {
    /// Listens on exactly `addr` (port 0 picks a free port; see [`StoreServer::local_addr`]) and
    /// serves connections that present `run_id`, on background threads.
    pub fn start(addr: SocketAddr, run_id: &str) -> Result<StoreServer, StoreError> {
        Self::start_with(addr, run_id, HELLO_DEADLINE)
    }

    /// [`StoreServer::start`] with another deadline for the run id (tests).
    fn start_with(
        addr: SocketAddr,
        run_id: &str,
        hello_deadline: Duration,
    ) -> Result<StoreServer, StoreError> {
        let bind_err = |cause| StoreError::Bind { addr, cause };
        // std sets SO_REUSEADDR on Unix listeners, so a restart does not trip over TIME_WAIT.
        let listener = TcpListener::bind(addr).map_err(bind_err)?;
        let local = listener.local_addr().map_err(bind_err)?;
        listener.set_nonblocking(true).map_err(bind_err)?;
        let shared = Arc::new(Shared {
            run_id: run_id.to_string(),
            keys: Mutex::new(HashMap::new()),
            changed: Condvar::new(),
            stopping: AtomicBool::new(false),
            ungreeted: std::sync::atomic::AtomicUsize::new(0),
            hello_deadline,
        });
        let for_acceptor = Arc::clone(&shared);
        let acceptor = thread::Builder::new()
            .name("store-accept".into())
            .spawn(move || accept_loop(listener, for_acceptor))
            .map_err(|cause| StoreError::Thread { cause })?;
        tracing::debug!(addr = %local, run = %run_fingerprint(run_id), "rendezvous store listening");
        Ok(StoreServer {
            addr: local,
            shared,
            acceptor: Some(acceptor),
        })
    }

    /// The address the server actually listens on (with the real port when started on port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shared.stop();
        if let Some(acceptor) = self.acceptor.take() {
            let _ = acceptor.join();
        }
        tracing::debug!(addr = %self.addr, "rendezvous store stopped");
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    // Each connection's thread, with a second handle on its socket to unblock it at shutdown.
    let mut connections: Vec<(JoinHandle<()>, Option<TcpStream>)> = Vec::new();
    while !shared.stopping() {
        match listener.accept() {
            Ok((stream, peer)) => {
                connections.retain(|(thread, _)| !thread.is_finished());
                if shared.ungreeted.load(Ordering::SeqCst) >= MAX_UNGREETED {
                    // Dropped unanswered: a flood of silent sockets costs nothing more.
                    tracing::warn!(%peer, "rendezvous store: {MAX_UNGREETED} connections have not presented the run id yet; closing this one");
                    drop(stream);
                    continue;
                }
                shared.ungreeted.fetch_add(1, Ordering::SeqCst);
                let closer = stream.try_clone().ok();
                let for_connection = Arc::clone(&shared);
                let spawned = thread::Builder::new()
                    .name(format!("store-conn-{peer}"))
                    .spawn(move || serve_connection(stream, peer, &for_connection));
                match spawned {
                    Ok(thread) => connections.push((thread, closer)),
                    Err(err) => {
                        shared.ungreeted.fetch_sub(1, Ordering::SeqCst);
                        tracing::warn!(%peer, "rendezvous store cannot start a thread: {err}")
                    }
                }
            }
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => thread::sleep(ACCEPT_POLL),
            Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
            Err(err) => {
                // E.g. out of file descriptors: keep serving the connections we have.
                tracing::warn!("rendezvous store accept failed: {err}");
                thread::sleep(Duration::from_millis(50));
            }
        }
    }
    for (_, closer) in &connections {
        if let Some(stream) = closer {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }
    for (thread, _) in connections {
        let _ = thread.join();
    }
}

/// Why a server connection ends.
enum ConnEnd {
    /// The peer closed between frames, or the server is stopping.
    Quiet,
    /// The peer misbehaved or the socket failed; the reason is logged (and sent, if possible).
    Bad(String),
}

struct ServerConn<'a> {
    stream: TcpStream,
    peer: SocketAddr,
    shared: &'a Shared,
    /// Until the run id is presented: when the connection must have done so.
    hello_by: Option<Instant>,
}

impl Drop for ServerConn<'_> {
    fn drop(&mut self) {
        // The acceptor holds a duplicate of this socket, so dropping ours would not close it.
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

impl ServerConn<'_> {
    /// Fills `buf`, polling the shutdown flag on every read timeout. Between frames
    /// (`between_frames` and nothing read yet) the peer may stay silent forever; inside a frame it
    /// may not pause longer than [`STALL_LIMIT`].
    fn fill(&mut self, buf: &mut [u8], between_frames: bool) -> Result<(), ConnEnd> {
        let mut filled = 0;
        let mut last_progress = Instant::now();
        while filled < buf.len() {
            if self.shared.stopping() {
                return Err(ConnEnd::Quiet);
            }
            match self.stream.read(&mut buf[filled..]) {
                Ok(0) if filled == 0 && between_frames => return Err(ConnEnd::Quiet),
                Ok(0) => {
                    return Err(ConnEnd::Bad(format!(
                        "connection closed in the middle of a frame ({filled} of {} bytes)",
                        buf.len()
                    )))
                }
                Ok(n) => {
                    filled += n;
                    last_progress = Instant::now();
                }
                Err(err)
                    if matches!(
                        err.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    let idle = between_frames && filled == 0;
                    if self.hello_by.is_some_and(|by| Instant::now() > by) {
                        return Err(ConnEnd::Bad(format!(
                            "no run id presented within {:.1} s",
                            self.shared.hello_deadline.as_secs_f64()
                        )));
                    }
                    if !idle && last_progress.elapsed() > STALL_LIMIT {
                        return Err(ConnEnd::Bad(format!(
                            "peer stalled for {} s in the middle of a frame",
                            STALL_LIMIT.as_secs()
                        )));
                    }
                }
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                Err(err) => return Err(ConnEnd::Bad(describe_io(&err))),
            }
        }
        Ok(())
    }

    fn read_request(&mut self) -> Result<Request, ConnEnd> {
        let mut header = [0u8; 4];
        self.fill(&mut header, true)?;
        let len = u32::from_le_bytes(header) as usize;
        let limit = if self.hello_by.is_some() {
            PRE_HELLO_MAX_FRAME
        } else {
            MAX_FRAME_BYTES
        };
        if len > limit {
            return Err(ConnEnd::Bad(format!(
                "frame of {len} bytes exceeds the {limit}-byte limit{}",
                if self.hello_by.is_some() {
                    " before the run id"
                } else {
                    ""
                }
            )));
        }
        let mut body = vec![0u8; len];
        self.fill(&mut body, false)?;
        decode_body(&body).map_err(ConnEnd::Bad)
    }

    fn send(&mut self, response: &Response) -> Result<(), ConnEnd> {
        let frame = encode_frame(response).map_err(|len| {
            ConnEnd::Bad(format!(
                "answer of {len} bytes exceeds the {MAX_FRAME_BYTES}-byte limit"
            ))
        })?;
        self.stream
            .write_all(&frame)
            .map_err(|err| ConnEnd::Bad(describe_io(&err)))
    }

    /// Logs why the connection ends and, for a misbehaving peer, tells it (best effort).
    fn end(mut self, end: ConnEnd) {
        if let ConnEnd::Bad(reason) = end {
            tracing::warn!(peer = %self.peer, "dropping a rendezvous store connection: {reason}");
            let _ = self.send(&Response::Refused { reason });
        }
    }
}

fn serve_connection(stream: TcpStream, peer: SocketAddr, shared: &Shared) {
    // Counted by the acceptor before this thread started; uncounted however this ends.
    let mut ungreeted = Ungreeted(Some(shared));
    let configured = stream
        .set_nonblocking(false)
        .and_then(|()| stream.set_nodelay(true))
        .and_then(|()| stream.set_read_timeout(Some(SERVER_TICK)))
        .and_then(|()| stream.set_write_timeout(Some(SERVER_WRITE_TIMEOUT)));
    if let Err(err) = configured {
        tracing::warn!(%peer, "cannot configure a rendezvous store connection: {err}");
        return;
    }
    let mut conn = ServerConn {
        stream,
        peer,
        shared,
        hello_by: Some(Instant::now() + shared.hello_deadline),
    };
    match conn.read_request() {
        Ok(Request::Hello { protocol, run_id }) if protocol == PROTOCOL => {
            if run_id != shared.run_id {
                tracing::warn!(
                    %peer,
                    "refusing a rendezvous connection for another run (run id fingerprint {}; this store serves {})",
                    run_fingerprint(&run_id),
                    run_fingerprint(&shared.run_id)
                );
                let _ = conn.send(&Response::WrongRun {
                    fingerprint: run_fingerprint(&shared.run_id),
                });
                return;
            }
            conn.hello_by = None;
            ungreeted.greeted();
            if let Err(end) = conn.send(&Response::Welcome) {
                return conn.end(end);
            }
        }
        Ok(Request::Hello { protocol, .. }) => {
            return conn.end(ConnEnd::Bad(format!(
                "unknown protocol tag {protocol:#x} (expected {PROTOCOL:#x})"
            )))
        }
        Ok(_) => {
            return conn.end(ConnEnd::Bad(
                "the first message must present the run id".into(),
            ))
        }
        Err(end) => return conn.end(end),
    }
    loop {
        let request = match conn.read_request() {
            Ok(request) => request,
            Err(end) => return conn.end(end),
        };
        let response = shared.answer(request);
        if let Err(end) = conn.send(&response) {
            return conn.end(end);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Client

/// One rank's connection to the store. Requests are answered in order, one at a time. After a
/// transport error (timeout, closed connection, bad reply) the connection is given up and every
/// later call fails with [`StoreError::Broken`].
pub struct StoreClient {
    stream: TcpStream,
    addr: String,
    broken: Option<String>,
}

impl fmt::Debug for StoreClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreClient")
            .field("addr", &self.addr)
            .field("broken", &self.broken)
            .finish()
    }
}

/// Outcome of one connection attempt.
enum Attempt {
    /// Worth another try (nobody listening yet, connection dropped during the handshake).
    Retry(String),
    /// Final (wrong run, not a store).
    Fatal(StoreError),
}

impl StoreClient {
    /// Connects to the store at `addr` (`"host:port"`, `"[v6]:port"`) and presents `run_id`,
    /// retrying with backoff for up to `deadline` while nobody answers. Fails with
    /// [`StoreError::Unreachable`] naming the address and the time spent, or at once with
    /// [`StoreError::WrongRun`] when the store serves another run.
    pub fn connect(
        addr: &str,
        run_id: &str,
        deadline: Duration,
    ) -> Result<StoreClient, StoreError> {
        check_host_port(addr)?;
        let start = Instant::now();
        let end = start.checked_add(deadline);
        let mut backoff = Duration::from_millis(10);
        loop {
            let reason = match Self::attempt(addr, run_id, end) {
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

    fn attempt(addr: &str, run_id: &str, end: Option<Instant>) -> Result<StoreClient, Attempt> {
        let remaining = || {
            end.map_or(Duration::MAX, |e| {
                e.saturating_duration_since(Instant::now())
            })
        };
        let targets: Vec<SocketAddr> = match addr.to_socket_addrs() {
            Ok(targets) => targets.collect(),
            Err(err) => return Err(Attempt::Retry(format!("cannot resolve it: {err}"))),
        };
        let mut reason = "the host name resolves to no address".to_string();
        let mut connected = None;
        for target in targets {
            let limit = remaining().clamp(Duration::from_millis(50), Duration::from_secs(2));
            match TcpStream::connect_timeout(&target, limit) {
                Ok(stream) => {
                    connected = Some(stream);
                    break;
                }
                Err(err) => reason = describe_io(&err),
            }
        }
        let Some(stream) = connected else {
            return Err(Attempt::Retry(reason));
        };
        let retry_io = |err: io::Error| Attempt::Retry(describe_io(&err));
        stream.set_nodelay(true).map_err(retry_io)?;
        stream
            .set_write_timeout(Some(IO_TIMEOUT))
            .map_err(retry_io)?;
        let handshake_limit = remaining().clamp(Duration::from_secs(1), HANDSHAKE_TIMEOUT);
        stream
            .set_read_timeout(Some(handshake_limit))
            .map_err(retry_io)?;
        let mut client = StoreClient {
            stream,
            addr: addr.to_string(),
            broken: None,
        };
        let hello = Request::Hello {
            protocol: PROTOCOL,
            run_id: run_id.to_string(),
        };
        let frame = encode_frame(&hello).map_err(|len| {
            Attempt::Fatal(StoreError::FrameTooLarge {
                addr: addr.to_string(),
                len,
                limit: MAX_FRAME_BYTES,
            })
        })?;
        if let Err(err) = client.stream.write_all(&frame) {
            return Err(Attempt::Retry(format!(
                "{} during the handshake",
                describe_io(&err)
            )));
        }
        let body = match read_frame(&mut client.stream) {
            Ok(body) => body,
            Err(FrameReadError::Io(err)) => {
                return Err(Attempt::Retry(format!(
                    "{} during the handshake",
                    describe_io(&err)
                )))
            }
            Err(FrameReadError::TooLarge(len)) => {
                return Err(Attempt::Fatal(StoreError::Protocol {
                    addr: addr.to_string(),
                    detail: format!(
                        "a {len}-byte frame in answer to the handshake; is something other than \
                         the store listening there?"
                    ),
                }))
            }
        };
        match decode_body::<Response>(&body) {
            Ok(Response::Welcome) => {
                tracing::debug!(addr, "connected to the rendezvous store");
                Ok(client)
            }
            Ok(Response::WrongRun { fingerprint }) => Err(Attempt::Fatal(StoreError::WrongRun {
                addr: addr.to_string(),
                found: fingerprint,
                expected: run_fingerprint(run_id),
            })),
            Ok(Response::Refused { reason }) => Err(Attempt::Fatal(StoreError::Refused {
                addr: addr.to_string(),
                op: "the handshake".into(),
                reason,
            })),
            Ok(other) => Err(Attempt::Fatal(StoreError::Protocol {
                addr: addr.to_string(),
                detail: format!("{} in answer to the handshake", other.kind()),
            })),
            Err(detail) => Err(Attempt::Fatal(StoreError::Protocol {
                addr: addr.to_string(),
                detail: format!(
                    "{detail} in answer to the handshake; is something other than the store \
                     listening there?"
                ),
            })),
        }
    }

    /// Stores `value` under `key`, replacing any previous value, and wakes the ranks waiting on it.
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let request = Request::Set {
            key: key.to_string(),
            value: value.to_vec(),
        };
        let op = || format!("set {key:?}");
        match self.exchange(&op, &request, IO_TIMEOUT)? {
            Response::Done => Ok(()),
            other => Err(self.unexpected(op(), other)),
        }
    }

    /// The value under `key`, or `None` if nobody has set it yet (does not block).
    pub fn get(&mut self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let request = Request::Get {
            key: key.to_string(),
        };
        let op = || format!("get {key:?}");
        match self.exchange(&op, &request, IO_TIMEOUT)? {
            Response::Value(value) => Ok(value),
            other => Err(self.unexpected(op(), other)),
        }
    }

    /// Blocks until every key exists and returns their values in the order of `keys`. After
    /// `timeout` it fails with [`StoreError::WaitTimeout`] naming the keys still missing.
    pub fn wait(&mut self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>, StoreError> {
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
    pub fn add(&mut self, key: &str, delta: i64) -> Result<i64, StoreError> {
        let request = Request::Add {
            key: key.to_string(),
            delta,
        };
        let op = || format!("add {key:?}");
        match self.exchange(&op, &request, IO_TIMEOUT)? {
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

/// Checks that `addr` has the `host:port` shape (the host itself is resolved on every attempt).
fn check_host_port(addr: &str) -> Result<(), StoreError> {
    let bad = |reason: &str| StoreError::BadAddress {
        addr: addr.to_string(),
        reason: reason.to_string(),
    };
    let (host, port) = addr
        .rsplit_once(':')
        .ok_or_else(|| bad("expected HOST:PORT"))?;
    if host.is_empty() || host == "[]" {
        return Err(bad("the host is empty"));
    }
    port.parse::<u16>()
        .map_err(|_| bad("the port is not a number from 0 to 65535"))?;
    Ok(())
}

/// `host:port`, bracketing a bare IPv6 address.
fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// What logs and refusals show instead of a run id: `sha256:` and the first 12 hex digits of its
/// SHA-256. Equal ids give equal fingerprints, so a mismatch can be diagnosed, but a secret id
/// (`LAUNCH_RUN_ID`) cannot be read back from a log, a job's output or a refusal.
pub fn run_fingerprint(run_id: &str) -> String {
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(run_id.as_bytes());
    let hex: String = digest.iter().take(6).map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

/// The port of our store. Under `launch` it is `MASTER_PORT`. Under torchrun, whose agent hosts
/// its own (PyTorch-protocol) store on `MASTER_PORT` and says so with
/// `TORCHELASTIC_USE_AGENT_STORE=True`, ours takes the next port, so the worker runs unchanged.
pub fn store_port(env: &WorkerEnv) -> u16 {
    let agent_store =
        std::env::var("TORCHELASTIC_USE_AGENT_STORE").is_ok_and(|v| v.eq_ignore_ascii_case("true"));
    if agent_store {
        env.master_port.wrapping_add(1)
    } else {
        env.master_port
    }
}

/// The address rank 0 listens on: `MASTER_ADDR` resolved (IPv4 preferred), [`store_port`].
fn listen_addr(env: &WorkerEnv) -> Result<SocketAddr, StoreError> {
    let port = store_port(env);
    let shown = join_host_port(&env.master_addr, port);
    let host = env
        .master_addr
        .trim_start_matches('[')
        .trim_end_matches(']');
    let bad = |reason: String| StoreError::BadAddress {
        addr: shown.clone(),
        reason,
    };
    if host.is_empty() {
        return Err(bad("MASTER_ADDR is empty".into()));
    }
    let candidates: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|err| bad(format!("cannot resolve MASTER_ADDR: {err}")))?
        .collect();
    candidates
        .iter()
        .find(|addr| addr.is_ipv4())
        .or_else(|| candidates.first())
        .copied()
        .ok_or_else(|| bad("MASTER_ADDR resolves to no address".into()))
}

/// Rank 0 starts the server on env.master_addr:[`store_port`], then every rank (rank 0 included)
/// connects a client, all within `timeout`. Rank 0 gets the server back and must keep it alive
/// for as long as any rank may use the store.
pub fn rendezvous(
    env: &WorkerEnv,
    timeout: Duration,
) -> Result<(Option<StoreServer>, StoreClient), StoreError> {
    if env.rank == 0 {
        let server = StoreServer::start(listen_addr(env)?, &env.run_id)?;
        let client = StoreClient::connect(&server.local_addr().to_string(), &env.run_id, timeout)?;
        Ok((Some(server), client))
    } else {
        let addr = join_host_port(&env.master_addr, store_port(env));
        let client = StoreClient::connect(&addr, &env.run_id, timeout)?;
        Ok((None, client))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn server(run_id: &str) -> StoreServer {
        StoreServer::start("127.0.0.1:0".parse().unwrap(), run_id).unwrap()
    }

    fn client(server: &StoreServer, run_id: &str) -> StoreClient {
        StoreClient::connect(
            &server.local_addr().to_string(),
            run_id,
            Duration::from_secs(2),
        )
        .unwrap()
    }

    fn free_port() -> u16 {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    }

    fn worker_env(rank: u32, world_size: u32, port: u16, run_id: &str) -> WorkerEnv {
        WorkerEnv::single_node(rank, world_size, "127.0.0.1", port, run_id)
    }

    /// A raw, greeted-or-not socket to the server, for sending malformed bytes.
    fn raw(server: &StoreServer) -> TcpStream {
        let stream = TcpStream::connect(server.local_addr()).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(2)))
            .unwrap();
        stream
    }

    /// Reads until the server closes the connection; fails if it stays open for 2 s.
    fn assert_closed_by_server(mut stream: TcpStream) {
        let mut sink = Vec::new();
        match stream.read_to_end(&mut sink) {
            Ok(_) => {}
            Err(err) => assert!(
                !matches!(
                    err.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ),
                "the server kept a bad connection open: {err}"
            ),
        }
    }

    fn hello(run_id: &str) -> Vec<u8> {
        encode_frame(&Request::Hello {
            protocol: PROTOCOL,
            run_id: run_id.into(),
        })
        .unwrap()
    }

    #[test]
    fn set_get_wait_add_round_trip() {
        let server = server("run");
        let mut store = client(&server, "run");
        assert_eq!(store.get("missing").unwrap(), None);
        store.set("a", b"alpha").unwrap();
        store.set("b", b"").unwrap();
        assert_eq!(store.get("a").unwrap(), Some(b"alpha".to_vec()));
        store.set("a", b"again").unwrap();
        assert_eq!(
            store.wait(&["b", "a"], Duration::from_millis(100)).unwrap(),
            vec![b"".to_vec(), b"again".to_vec()]
        );
        assert_eq!(
            store.wait(&[], Duration::ZERO).unwrap(),
            Vec::<Vec<u8>>::new()
        );
        assert_eq!(store.add("n", 3).unwrap(), 3);
        assert_eq!(store.add("n", -5).unwrap(), -2);
        // Counters are decimal text, as in PyTorch's TCPStore.
        assert_eq!(store.get("n").unwrap(), Some(b"-2".to_vec()));
        store.set("m", b"40").unwrap();
        assert_eq!(store.add("m", 2).unwrap(), 42);

        // A refused request names the key and leaves the connection usable.
        let err = store.add("a", 1).unwrap_err().to_string();
        assert!(err.contains("\"a\" is not a decimal integer"), "{err}");
        store.set("max", i64::MAX.to_string().as_bytes()).unwrap();
        let err = store.add("max", 1).unwrap_err().to_string();
        assert!(err.contains("overflows"), "{err}");
        assert_eq!(store.get("n").unwrap(), Some(b"-2".to_vec()));

        // A second client sees the same key space.
        let mut other = client(&server, "run");
        assert_eq!(other.get("a").unwrap(), Some(b"again".to_vec()));
    }

    #[test]
    fn wait_is_satisfied_later_by_another_client() {
        let server = server("run");
        let mut waiter = client(&server, "run");
        let mut setter = client(&server, "run");
        let started = Instant::now();
        let writer = thread::spawn(move || {
            thread::sleep(Duration::from_millis(150));
            setter.set("rank/1/addr", b"10.0.0.2:4000").unwrap();
            thread::sleep(Duration::from_millis(50));
            setter.set("rank/2/addr", b"10.0.0.3:4000").unwrap();
        });
        let values = waiter
            .wait(&["rank/1/addr", "rank/2/addr"], Duration::from_secs(3))
            .unwrap();
        assert!(started.elapsed() >= Duration::from_millis(190));
        assert_eq!(
            values,
            vec![b"10.0.0.2:4000".to_vec(), b"10.0.0.3:4000".to_vec()]
        );
        writer.join().unwrap();
    }

    #[test]
    fn concurrent_adds_from_eight_threads_are_exact() {
        let server = server("run");
        let addr = server.local_addr().to_string();
        let threads: Vec<_> = (0..8)
            .map(|i| {
                let addr = addr.clone();
                thread::spawn(move || {
                    let mut store =
                        StoreClient::connect(&addr, "run", Duration::from_secs(2)).unwrap();
                    let mut seen = Vec::new();
                    for _ in 0..50 {
                        seen.push(store.add("counter", i + 1).unwrap());
                    }
                    seen
                })
            })
            .collect();
        let mut all: Vec<i64> = Vec::new();
        for thread in threads {
            all.extend(thread.join().unwrap());
        }
        let expected: i64 = (1..=8).map(|d| d * 50).sum();
        let mut store = client(&server, "run");
        assert_eq!(store.add("counter", 0).unwrap(), expected);
        assert_eq!(*all.iter().max().unwrap(), expected);
        // Every add saw a distinct intermediate total: they were serialized.
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 400);
    }

    #[test]
    fn wrong_run_id_is_refused_with_fingerprints_never_the_id() {
        let server = server("job-a");
        let addr = server.local_addr().to_string();
        let started = Instant::now();
        let err = StoreClient::connect(&addr, "job-b", Duration::from_secs(5)).unwrap_err();
        // Refused at once, not retried until the deadline.
        assert!(started.elapsed() < Duration::from_secs(1));
        let text = err.to_string();
        assert!(
            text.starts_with(&format!(
                "rendezvous store at {addr} belongs to another run (run id fingerprint {}; ours is {})",
                run_fingerprint("job-a"),
                run_fingerprint("job-b")
            )),
            "{text}"
        );
        // The refusal never carries the store's run id: it is the secret that admits.
        assert!(!text.contains("job-a"), "{text}");
        assert_ne!(run_fingerprint("job-a"), run_fingerprint("job-b"));
        assert_eq!(run_fingerprint("job-a").len(), "sha256:".len() + 12);
        // The server keeps serving its own run.
        let mut store = client(&server, "job-a");
        store.set("k", b"v").unwrap();
        assert_eq!(store.get("k").unwrap(), Some(b"v".to_vec()));
    }

    #[test]
    fn wait_for_a_key_nobody_sets_times_out_naming_it() {
        let server = server("run");
        let mut store = client(&server, "run");
        store.set("rank/0/addr", b"x").unwrap();
        let timeout = Duration::from_millis(300);
        let started = Instant::now();
        let err = store
            .wait(&["rank/0/addr", "rank/2/addr"], timeout)
            .unwrap_err();
        let elapsed = started.elapsed();
        assert!(elapsed >= timeout, "{elapsed:?}");
        assert!(elapsed < timeout + Duration::from_secs(1), "{elapsed:?}");
        assert!(matches!(err, StoreError::WaitTimeout { .. }));
        let text = err.to_string();
        assert!(
            text.starts_with("timed out after 0.3 s waiting for store keys [\"rank/2/addr\"]"),
            "{text}"
        );
        assert!(text.contains(&server.local_addr().to_string()), "{text}");
        // A timed-out wait leaves the connection usable.
        assert_eq!(store.get("rank/0/addr").unwrap(), Some(b"x".to_vec()));
    }

    #[test]
    fn connect_to_a_silent_port_fails_after_the_deadline_naming_the_address() {
        let addr = format!("127.0.0.1:{}", free_port());
        let deadline = Duration::from_millis(300);
        let started = Instant::now();
        let err = StoreClient::connect(&addr, "run", deadline).unwrap_err();
        let elapsed = started.elapsed();
        assert!(elapsed >= deadline, "{elapsed:?}");
        assert!(elapsed < deadline + Duration::from_secs(1), "{elapsed:?}");
        let text = err.to_string();
        assert!(
            text.starts_with(&format!(
                "cannot reach the rendezvous store at {addr} after 0."
            )),
            "{text}"
        );
        assert!(
            text.ends_with(" s (connection refused); is rank 0 running?"),
            "{text}"
        );
    }

    #[test]
    fn malformed_addresses_fail_at_once() {
        for addr in ["no-port", "host:http", ":29500", "host:70000"] {
            let err = StoreClient::connect(addr, "run", Duration::from_secs(5)).unwrap_err();
            assert!(
                matches!(err, StoreError::BadAddress { .. }),
                "{addr}: {err}"
            );
            assert!(err.to_string().contains(addr), "{err}");
        }
    }

    #[test]
    fn connect_retries_until_the_server_starts() {
        let port = free_port();
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let host = thread::spawn(move || {
            thread::sleep(Duration::from_millis(200));
            StoreServer::start(addr, "run").unwrap()
        });
        let mut store =
            StoreClient::connect(&addr.to_string(), "run", Duration::from_secs(3)).unwrap();
        store.set("k", b"v").unwrap();
        let server = host.join().unwrap();
        assert_eq!(server.local_addr(), addr);
    }

    #[test]
    fn garbage_and_truncated_frames_do_not_break_the_server() {
        let server = server("run");
        let mut good = client(&server, "run");
        good.set("k", b"before").unwrap();

        // Random bytes as the first frame.
        let mut stream = raw(&server);
        stream
            .write_all(&[7, 0, 0, 0, 0xff, 0xfe, 0xfd, 0x00, 0x13, 0x37, 0x42])
            .unwrap();
        assert_closed_by_server(stream);

        // An HTTP request (its first four bytes read as a huge length).
        let mut stream = raw(&server);
        stream.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        assert_closed_by_server(stream);

        // A request before the hello.
        let mut stream = raw(&server);
        let frame = encode_frame(&Request::Get { key: "k".into() }).unwrap();
        stream.write_all(&frame).unwrap();
        assert_closed_by_server(stream);

        // Garbage after a good hello.
        let mut stream = raw(&server);
        stream.write_all(&hello("run")).unwrap();
        let body = read_frame(&mut stream).ok().unwrap();
        assert_eq!(decode_body::<Response>(&body).unwrap(), Response::Welcome);
        stream.write_all(&[3, 0, 0, 0, 0xee, 0xee, 0xee]).unwrap();
        assert_closed_by_server(stream);

        // A truncated frame, then the peer hangs up.
        let mut stream = raw(&server);
        stream.write_all(&[100, 0, 0, 0, 1, 2, 3]).unwrap();
        stream.shutdown(Shutdown::Write).unwrap();
        assert_closed_by_server(stream);

        // A truncated frame whose sender stays silent: only its own connection waits.
        let mut stalled = raw(&server);
        stalled.write_all(&[100, 0, 0, 0, 1, 2, 3]).unwrap();
        let mut half_header = raw(&server);
        half_header.write_all(&[1, 0]).unwrap();

        // Everyone else is served as before.
        assert_eq!(good.get("k").unwrap(), Some(b"before".to_vec()));
        let mut late = client(&server, "run");
        late.set("k", b"after").unwrap();
        assert_eq!(good.get("k").unwrap(), Some(b"after".to_vec()));
        drop(stalled);
        drop(half_header);
    }

    #[test]
    fn oversized_frames_are_rejected_on_both_sides() {
        let server = server("run");
        let mut store = client(&server, "run");

        // The server drops a connection that announces more than the limit.
        let mut stream = raw(&server);
        stream.write_all(&hello("run")).unwrap();
        assert!(read_frame(&mut stream).is_ok());
        let too_long = (MAX_FRAME_BYTES as u32 + 1).to_le_bytes();
        stream.write_all(&too_long).unwrap();
        assert_closed_by_server(stream);

        // The client refuses to send one, and its connection stays usable.
        let huge = vec![0u8; MAX_FRAME_BYTES + 1];
        let err = store.set("big", &huge).unwrap_err();
        assert!(matches!(err, StoreError::FrameTooLarge { .. }), "{err}");
        assert!(err.to_string().contains("frame limit"), "{err}");
        store.set("small", b"ok").unwrap();
        assert_eq!(store.get("small").unwrap(), Some(b"ok".to_vec()));

        // The client rejects a reply that announces more than the limit.
        let fake = TcpListener::bind("127.0.0.1:0").unwrap();
        let fake_addr = fake.local_addr().unwrap().to_string();
        let imposter = thread::spawn(move || {
            let (mut peer, _) = fake.accept().unwrap();
            let mut header = [0u8; 4];
            peer.read_exact(&mut header).unwrap();
            let mut body = vec![0u8; u32::from_le_bytes(header) as usize];
            peer.read_exact(&mut body).unwrap();
            peer.write_all(&u32::MAX.to_le_bytes()).unwrap();
            peer
        });
        let err = StoreClient::connect(&fake_addr, "run", Duration::from_secs(2)).unwrap_err();
        assert!(matches!(err, StoreError::Protocol { .. }), "{err}");
        assert!(err.to_string().contains(&fake_addr), "{err}");
        drop(imposter.join().unwrap());
    }

    #[test]
    fn a_large_frame_before_the_run_id_is_refused_at_once() {
        let server = server("run");
        let mut stream = raw(&server);
        // 63 MiB announced: refused from the header, nothing allocated.
        stream.write_all(&(63u32 << 20).to_le_bytes()).unwrap();
        let started = Instant::now();
        assert_closed_by_server(stream);
        assert!(started.elapsed() < Duration::from_secs(1));
        client(&server, "run").set("k", b"v").unwrap();
    }

    #[test]
    fn silent_connections_are_capped_and_closed_at_the_deadline() {
        let deadline = Duration::from_millis(800);
        let server =
            StoreServer::start_with("127.0.0.1:0".parse().unwrap(), "run", deadline).unwrap();
        let silent: Vec<TcpStream> = (0..100).map(|_| raw(&server)).collect();
        thread::sleep(Duration::from_millis(300));
        // Beyond the cap, connections are closed at once (EOF without waiting).
        let closed_now = silent
            .iter()
            .filter(|s| {
                s.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
                matches!((&**s).read(&mut [0u8; 1]), Ok(0))
            })
            .count();
        assert!(closed_now >= 100 - MAX_UNGREETED, "{closed_now} closed");
        assert!(server.shared.ungreeted.load(Ordering::SeqCst) <= MAX_UNGREETED);
        // The rest are closed when their deadline passes; then the run's own ranks get in.
        thread::sleep(deadline + Duration::from_millis(500));
        assert_eq!(server.shared.ungreeted.load(Ordering::SeqCst), 0);
        for stream in silent {
            assert_closed_by_server(stream);
        }
        client(&server, "run").set("k", b"v").unwrap();
    }

    #[test]
    fn dropping_the_server_fails_clients_cleanly() {
        let server = server("run");
        let mut idle = client(&server, "run");
        let mut waiting = client(&server, "run");
        idle.set("k", b"v").unwrap();
        let waiter = thread::spawn(move || {
            let started = Instant::now();
            let result = waiting.wait(&["never"], Duration::from_secs(20));
            (result, started.elapsed())
        });
        thread::sleep(Duration::from_millis(100));
        let started = Instant::now();
        drop(server);
        assert!(started.elapsed() < Duration::from_secs(1));
        let (result, elapsed) = waiter.join().unwrap();
        assert!(result.is_err());
        assert!(elapsed < Duration::from_secs(2), "{elapsed:?}");
        let err = idle.get("k").unwrap_err();
        assert!(
            matches!(err, StoreError::Connection { .. }),
            "{err:?}: {err}"
        );
        // The connection is given up from now on.
        let again = idle.get("k").unwrap_err();
        assert!(matches!(again, StoreError::Broken { .. }), "{again}");
    }

    #[test]
    fn a_taken_port_is_named() {
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        let err = StoreServer::start(addr, "run").unwrap_err().to_string();
        assert!(
            err.contains(&format!("port {} is already in use", addr.port())),
            "{err}"
        );
        let err = rendezvous(
            &worker_env(0, 2, addr.port(), "run"),
            Duration::from_secs(1),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains(&addr.to_string()), "{err}");
    }

    #[test]
    fn rendezvous_connects_three_ranks_through_one_store() {
        let port = free_port();
        let ranks: Vec<_> = (0..3u32)
            .map(|rank| {
                let env = worker_env(rank, 3, port, "job-42");
                thread::spawn(move || {
                    if rank == 0 {
                        // The other ranks start first and must retry until the store is up.
                        thread::sleep(Duration::from_millis(200));
                    }
                    let (server, mut store) = rendezvous(&env, Duration::from_secs(3)).unwrap();
                    assert_eq!(server.is_some(), rank == 0);
                    store
                        .set(
                            &format!("rank/{rank}/addr"),
                            format!("host{rank}").as_bytes(),
                        )
                        .unwrap();
                    let joined = store.add("joined", 1).unwrap();
                    let all = store
                        .wait(
                            &["rank/0/addr", "rank/1/addr", "rank/2/addr"],
                            Duration::from_secs(3),
                        )
                        .unwrap();
                    (server, store, joined, all)
                })
            })
            .collect();
        let results: Vec<_> = ranks.into_iter().map(|r| r.join().unwrap()).collect();
        let mut joined: Vec<i64> = results.iter().map(|r| r.2).collect();
        joined.sort_unstable();
        assert_eq!(joined, vec![1, 2, 3]);
        for (_, _, _, all) in &results {
            assert_eq!(
                all,
                &vec![b"host0".to_vec(), b"host1".to_vec(), b"host2".to_vec()]
            );
        }
        let server = results[0].0.as_ref().unwrap();
        assert_eq!(server.local_addr().port(), port);
        assert!(server.local_addr().ip().is_loopback());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        #[test]
        fn arbitrary_bytes_never_panic_the_decoders(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode_body::<Request>(&bytes);
            let _ = decode_body::<Response>(&bytes);
        }

        #[test]
        fn requests_round_trip_through_frames(
            key in ".{0,20}",
            value in proptest::collection::vec(any::<u8>(), 0..100),
            delta in any::<i64>(),
            timeout_ms in any::<u64>(),
        ) {
            for request in [
                Request::Hello { protocol: PROTOCOL, run_id: key.clone() },
                Request::Set { key: key.clone(), value: value.clone() },
                Request::Get { key: key.clone() },
                Request::Wait { keys: vec![key.clone(), String::new()], timeout_ms },
                Request::Add { key: key.clone(), delta },
            ] {
                let frame = encode_frame(&request).unwrap();
                let len = u32::from_le_bytes([frame[0], frame[1], frame[2], frame[3]]) as usize;
                prop_assert_eq!(len, frame.len() - 4);
                prop_assert_eq!(decode_body::<Request>(&frame[4..]).unwrap(), request);
            }
        }
    }
}
