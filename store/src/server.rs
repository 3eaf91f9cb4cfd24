//! The store's server: the key space, the acceptor (with its limits on connections that have
//! not proven the run id, see [`guard`](super::guard)) and one thread per connection.

use std::collections::HashMap;
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::guard::{Gate, Throttle};
use super::*;

/// State shared by the acceptor and the connection threads.
struct Shared {
    /// Derived from the run id, which the server does not keep.
    key: auth::Key,
    /// [`run_fingerprint`] of the run id, sent in the challenge.
    fingerprint: String,
    keys: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
    stopping: AtomicBool,
    /// Connections that have not proven the run id yet.
    gate: Gate,
    /// Warnings about connections refused before they proved the run id.
    refused: Throttle,
    /// Warnings about failed `accept`s (e.g. out of file descriptors).
    accept_failures: Throttle,
    /// How long a new connection has to prove the run id ([`HELLO_DEADLINE`]).
    hello_deadline: Duration,
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

/// Holds a connection's place in the [`Gate`] until it proves the run id or ends.
struct Ticket<'a> {
    shared: &'a Shared,
    ticket: Option<u64>,
}

impl Ticket<'_> {
    /// Gives the place up; false when the connection had already lost it to a newer one.
    fn leave(&mut self) -> bool {
        self.ticket
            .take()
            .is_some_and(|ticket| self.shared.gate.leave(ticket))
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        self.leave();
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
            Request::Hello { .. } | Request::Proof { .. } => Response::Refused {
                reason: "this connection has already proven the run id".into(),
            },
            Request::Set { key, value } | Request::SetEphemeral { key, value } => {
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
            .field("run", &self.shared.fingerprint)
            .finish()
    }
}

impl StoreServer {
    /// Listens on exactly `addr` (port 0 picks a free port; see [`StoreServer::local_addr`]) and
    /// serves connections that prove they know `run_id`, on background threads.
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
        let shared = Arc::new(Shared {
            key: auth::Key::new(run_id),
            fingerprint: run_fingerprint(run_id),
            keys: Mutex::new(HashMap::new()),
            changed: Condvar::new(),
            stopping: AtomicBool::new(false),
            gate: Gate::new(MAX_UNGREETED, MAX_UNGREETED_PER_IP),
            refused: Throttle::new(refused_head, WARN_INTERVAL),
            accept_failures: Throttle::new(accept_failure_head, WARN_INTERVAL),
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

    /// Connections that have not proven the run id yet (tests).
    #[cfg(test)]
    pub(super) fn ungreeted(&self) -> usize {
        self.shared.gate.len()
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

/// A connection's thread, with the connection's socket to unblock it at shutdown.
type Connection = (JoinHandle<()>, Arc<TcpStream>);

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut connections: Vec<Connection> = Vec::new();
    while !shared.stopping() {
        shared.refused.tick();
        shared.accept_failures.tick();
        match listener.accept() {
            Ok((stream, peer)) => {
                connections.retain(|(thread, _)| !thread.is_finished());
                connections.extend(admit(stream, peer, &shared));
            }
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => thread::sleep(ACCEPT_POLL),
            Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
            Err(err) => {
                // E.g. out of file descriptors: keep serving the connections we have.
                shared.accept_failures.note(err.to_string());
                thread::sleep(Duration::from_millis(50));
            }
        }
    }
    for (_, stream) in &connections {
        let _ = stream.shutdown(Shutdown::Both);
    }
    for (thread, _) in connections {
        let _ = thread.join();
    }
    shared.refused.flush();
    shared.accept_failures.flush();
}

/// Starts serving a new connection. It counts as waiting in the gate until it proves the run id;
/// when the gate is full, it takes the place of another waiting connection (never sleeping or
/// logging per connection, so that a flood costs a real peer nothing).
fn admit(stream: TcpStream, peer: SocketAddr, shared: &Arc<Shared>) -> Option<Connection> {
    let stream = Arc::new(stream);
    let (ticket, evicted) = shared.gate.admit(peer, Arc::clone(&stream));
    if let Some(evicted) = evicted {
        shared.refused.note(format!(
            "from {}, closed to make room for a newer connection ({} from its address had not \
             proven the run id yet)",
            evicted.peer, evicted.held_by_its_address
        ));
    }
    let for_connection = Arc::clone(shared);
    let conn_stream = Arc::clone(&stream);
    let spawned = thread::Builder::new()
        .name(format!("store-conn-{peer}"))
        .spawn(move || serve_connection(conn_stream, peer, ticket, &for_connection));
    match spawned {
        Ok(thread) => Some((thread, stream)),
        Err(err) => {
            shared.gate.leave(ticket);
            shared
                .refused
                .note(format!("from {peer}, no thread to serve it: {err}"));
            None
        }
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
    /// Shared with the acceptor (and the gate, until the run id is proven), which shut it down.
    stream: Arc<TcpStream>,
    peer: SocketAddr,
    shared: &'a Shared,
    /// Until the run id is proven: when the connection must have done so.
    hello_by: Option<Instant>,
}

impl Drop for ServerConn<'_> {
    fn drop(&mut self) {
        // The acceptor holds the socket too, so dropping ours would not close it.
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

impl ServerConn<'_> {
    /// Fills `buf`, polling the shutdown flag on every read timeout. Between frames
    /// (`between_frames` and nothing read yet) the peer may stay silent forever; inside a frame it
    /// may not pause longer than [`STALL_LIMIT`]; until it proves the run id, not past `hello_by`.
    fn fill(&mut self, buf: &mut [u8], between_frames: bool) -> Result<(), ConnEnd> {
        let mut filled = 0;
        let mut last_progress = Instant::now();
        while filled < buf.len() {
            if self.shared.stopping() {
                return Err(ConnEnd::Quiet);
            }
            // Checked before every read, so that a peer trickling bytes cannot outstay it.
            if self.hello_by.is_some_and(|by| Instant::now() > by) {
                return Err(ConnEnd::Bad(format!(
                    "the run id was not proven within {:.1} s",
                    self.shared.hello_deadline.as_secs_f64()
                )));
            }
            match (&*self.stream).read(&mut buf[filled..]) {
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
                    " before the run id is proven"
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
        (&*self.stream)
            .write_all(&frame)
            .map_err(|err| ConnEnd::Bad(describe_io(&err)))
    }

    /// Logs why the connection of a peer that proved the run id ends and, for a misbehaving
    /// peer, tells it (best effort).
    fn end(mut self, end: ConnEnd) {
        if let ConnEnd::Bad(reason) = end {
            tracing::warn!(peer = %self.peer, "dropping a rendezvous store connection: {reason}");
            let _ = self.send(&Response::Refused { reason });
        }
    }

    /// Ends a connection that did not prove the run id: tells the peer why (best effort) and
    /// counts it in the server's gathered warnings, unless `reported` already (closed to make
    /// room). A peer that hangs up before saying anything is not reported (a port probe).
    fn refuse(mut self, end: ConnEnd, reported: bool) {
        if let ConnEnd::Bad(reason) = end {
            if !reported {
                self.shared
                    .refused
                    .note(format!("from {}, {reason}", self.peer));
            }
            let _ = self.send(&Response::Refused { reason });
        }
    }

    /// The server's side of the handshake (see the crate's documentation), up to a proof of the
    /// run id; a wrong proof gets a refusal that says nothing more.
    fn authenticate(&mut self, ticket: u64) -> Result<(), ConnEnd> {
        let client_nonce = match self.read_request()? {
            Request::Hello { protocol, nonce } if protocol == PROTOCOL => nonce,
            Request::Hello { protocol, .. } => {
                return Err(ConnEnd::Bad(format!(
                    "unknown protocol tag {protocol:#x} (expected {PROTOCOL:#x})"
                )))
            }
            _ => {
                return Err(ConnEnd::Bad(
                    "the first message must be the handshake's hello".into(),
                ))
            }
        };
        self.shared.gate.greeting(ticket);
        let server_nonce = auth::nonce().map_err(ConnEnd::Bad)?;
        self.send(&Response::Challenge {
            nonce: server_nonce,
            proof: self.shared.key.server_proof(&client_nonce, &server_nonce),
            fingerprint: self.shared.fingerprint.clone(),
        })?;
        let request = self.read_request().map_err(|end| match end {
            ConnEnd::Quiet if !self.shared.stopping() => ConnEnd::Bad(
                "closed during the handshake (a node of another run, which this store could not \
                 prove its run id to?)"
                    .into(),
            ),
            end => end,
        })?;
        match request {
            Request::Proof { proof }
                if self
                    .shared
                    .key
                    .client_proved(&client_nonce, &server_nonce, &proof) =>
            {
                Ok(())
            }
            Request::Proof { .. } => Err(ConnEnd::Bad("the run id was not proven".into())),
            _ => Err(ConnEnd::Bad(
                "the second message must be the handshake's proof".into(),
            )),
        }
    }
}

/// The keys a connection set with `SetEphemeral`: removed when it ends.
struct EphemeralKeys<'a> {
    shared: &'a Shared,
    keys: Vec<String>,
}

impl Drop for EphemeralKeys<'_> {
    fn drop(&mut self) {
        if self.keys.is_empty() {
            return;
        }
        let mut map = self.shared.lock();
        for key in &self.keys {
            map.remove(key);
        }
        drop(map);
        self.shared.changed.notify_all();
    }
}

fn serve_connection(stream: Arc<TcpStream>, peer: SocketAddr, ticket_id: u64, shared: &Shared) {
    // Counted in the gate by the acceptor before this thread started; out of it however this ends.
    let mut ticket = Ticket {
        shared,
        ticket: Some(ticket_id),
    };
    let configured = stream
        .set_nonblocking(false)
        .and_then(|()| stream.set_nodelay(true))
        .and_then(|()| stream.set_read_timeout(Some(SERVER_TICK)))
        .and_then(|()| stream.set_write_timeout(Some(SERVER_WRITE_TIMEOUT)));
    if let Err(err) = configured {
        shared
            .refused
            .note(format!("from {peer}, cannot configure its socket: {err}"));
        return;
    }
    let mut conn = ServerConn {
        stream,
        peer,
        shared,
        hello_by: Some(Instant::now() + shared.hello_deadline),
    };
    let proven = conn.authenticate(ticket_id);
    let kept_its_place = ticket.leave();
    if let Err(end) = proven {
        return conn.refuse(end, !kept_its_place);
    }
    if !kept_its_place {
        // Closed to make room for a newer connection just as it proved the run id.
        return;
    }
    conn.hello_by = None;
    if let Err(end) = conn.send(&Response::Welcome) {
        return conn.end(end);
    }
    serve_requests(conn, shared);
}

/// Answers the requests of a connection that proved the run id, until it ends.
fn serve_requests(mut conn: ServerConn<'_>, shared: &Shared) {
    let mut ephemeral = EphemeralKeys {
        shared,
        keys: Vec::new(),
    };
    loop {
        let request = match conn.read_request() {
            Ok(request) => request,
            Err(end) => return conn.end(end),
        };
        if let Request::SetEphemeral { key, .. } = &request {
            ephemeral.keys.push(key.clone());
        }
        let response = shared.answer(request);
        if let Err(end) = conn.send(&response) {
            return conn.end(end);
        }
    }
}
