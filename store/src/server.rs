//! The store's server: the key space, the acceptor (with its limits on connections that have
//! not presented the run id) and one thread per connection.

use std::collections::HashMap;
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::*;

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
    pub(super) fn start_with(
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

    /// Connections that have not presented the run id yet (tests).
    #[cfg(test)]
    pub(super) fn ungreeted(&self) -> usize {
        self.shared.ungreeted.load(Ordering::SeqCst)
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
