//! The server's one thread: an event loop (epoll through `mio`) over the listener and every
//! connection. Requests are answered as they come; a `wait` parks its connection (no thread) until
//! its keys are written or its deadline passes; deadlines sit in one timer heap. Per request the
//! work is O(1) in the number of connections, and an idle connection costs nothing.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mio::net::TcpListener;
use mio::{Events, Interest, Poll, Token};

use super::super::*;
use super::conn::{Conn, ConnEnd, Stage};
use super::keys::{KeySpace, PendingWait, Wills};
use super::Shared;
use crate::guard::Gate;

pub(super) const LISTENER: Token = Token(0);
pub(super) const WAKER: Token = Token(1);
/// Connection ids start here (the tokens below are the listener's and the waker's) and are never
/// reused, so that a stale timer or event cannot reach a newer connection.
const FIRST_CONN: usize = 2;
/// After a failed `accept` (out of descriptors), the listener rests this long.
const ACCEPT_REST: Duration = Duration::from_millis(50);

pub(super) struct EventLoop {
    poll: Poll,
    listener: TcpListener,
    shared: Arc<Shared>,
    conns: HashMap<usize, Conn>,
    keys: KeySpace,
    wills: Wills,
    gate: Gate,
    timers: BinaryHeap<Reverse<(Instant, usize)>>,
    /// Connections to serve again this turn, and whether to read their socket: more to read,
    /// or a wait that ended (what they sent meanwhile is already read).
    again: Vec<(usize, bool)>,
    next_id: usize,
    next_wait: u64,
    accept_rest_until: Option<Instant>,
    /// Where sockets are read into before their bytes join a connection's input.
    scratch: Vec<u8>,
}

impl EventLoop {
    pub(super) fn new(
        poll: Poll,
        mut listener: TcpListener,
        shared: Arc<Shared>,
    ) -> io::Result<Self> {
        poll.registry()
            .register(&mut listener, LISTENER, Interest::READABLE)?;
        Ok(EventLoop {
            poll,
            listener,
            shared,
            conns: HashMap::new(),
            keys: KeySpace::default(),
            wills: Wills::default(),
            gate: Gate::new(MAX_UNGREETED, MAX_UNGREETED_PER_IP),
            timers: BinaryHeap::new(),
            again: Vec::new(),
            next_id: FIRST_CONN,
            next_wait: 0,
            accept_rest_until: None,
            scratch: vec![0; 64 << 10],
        })
    }

    pub(super) fn run(mut self) {
        let mut events = Events::with_capacity(1024);
        while !self.shared.stopping() {
            let timeout = self.poll_timeout();
            if let Err(err) = self.poll.poll(&mut events, timeout) {
                if err.kind() != io::ErrorKind::Interrupted {
                    tracing::error!("rendezvous store: the event loop failed: {err}");
                    break;
                }
            }
            for event in events.iter() {
                match event.token() {
                    LISTENER => self.accept_all(),
                    WAKER => {}
                    Token(id) => {
                        if event.is_writable() {
                            self.on_writable(id);
                        }
                        if event.is_read_closed() || event.is_error() {
                            if let Some(conn) = self.conns.get_mut(&id) {
                                conn.peer_closed = true;
                            }
                        }
                        if event.is_readable() || event.is_read_closed() || event.is_error() {
                            self.serve(id, true);
                        }
                    }
                }
            }
            // Timers first: a wait that timed out is answered by serving its connection again.
            self.fire_timers();
            while !self.again.is_empty() {
                for (id, read) in std::mem::take(&mut self.again) {
                    self.serve(id, read);
                }
            }
            self.shared.refused.tick();
            self.shared.accept_failures.tick();
        }
        self.shut_down();
    }

    fn poll_timeout(&self) -> Option<Duration> {
        let now = Instant::now();
        let timer = self.timers.peek().map(|Reverse((at, _))| *at);
        let next = [timer, self.accept_rest_until].into_iter().flatten().min();
        // The throttled warnings are written within a second of being due.
        let tick = Duration::from_secs(1);
        Some(next.map_or(tick, |at| at.saturating_duration_since(now).min(tick)))
    }

    fn publish_gate(&self) {
        self.shared
            .ungreeted
            .store(self.gate.len(), Ordering::Relaxed);
    }

    /// Accepts every waiting connection (the listener is edge-triggered).
    fn accept_all(&mut self) {
        if self
            .accept_rest_until
            .is_some_and(|until| Instant::now() < until)
        {
            return;
        }
        self.accept_rest_until = None;
        loop {
            match self.listener.accept() {
                Ok((stream, peer)) => self.admit(stream, peer),
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => break,
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                Err(err) => {
                    // E.g. out of file descriptors: keep serving the connections we have.
                    self.shared.accept_failures.note(err.to_string());
                    self.accept_rest_until = Some(Instant::now() + ACCEPT_REST);
                    break;
                }
            }
        }
        self.publish_gate();
    }

    /// Starts serving a new connection. It counts as waiting in the gate until it proves the run
    /// id; when the gate is full, it takes the place of another waiting connection.
    fn admit(&mut self, mut stream: mio::net::TcpStream, peer: std::net::SocketAddr) {
        let id = self.next_id;
        self.next_id += 1;
        let registered = stream.set_nodelay(true).and_then(|()| {
            self.poll.registry().register(
                &mut stream,
                Token(id),
                Interest::READABLE | Interest::WRITABLE,
            )
        });
        if let Err(err) = registered {
            self.shared
                .refused
                .note(format!("from {peer}, cannot serve its socket: {err}"));
            return;
        }
        if let Some(evicted) = self.gate.admit(id, peer) {
            self.shared.refused.note(format!(
                "from {}, closed to make room for a newer connection ({} from its address had not \
                 proven the run id yet)",
                evicted.peer, evicted.held_by_its_address
            ));
            self.conns.remove(&evicted.id);
        }
        let hello_by = Instant::now() + self.shared.hello_deadline;
        self.conns.insert(id, Conn::new(stream, peer, hello_by));
        self.schedule(id);
        // What it sent before it was registered raises no event of its own.
        self.again.push((id, true));
    }

    /// Reads what connection `id` sent (when `read`), answers its requests while it may, and
    /// writes the answers together.
    fn serve(&mut self, id: usize, read: bool) {
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        let read = read || conn.read_held;
        let more = match read.then(|| conn.read(&mut self.scratch)) {
            Some(Ok(more)) => more,
            Some(Err(end)) => return self.close(id, end),
            None => false,
        };
        loop {
            let Some(conn) = self.conns.get_mut(&id) else {
                return;
            };
            if !conn.ready_for_request() {
                break;
            }
            match conn.next_request() {
                Ok(Some(request)) => self.handle(id, request),
                Ok(None) => break,
                Err(end) => return self.close(id, end),
            }
        }
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        if let Err(end) = conn.flush() {
            return self.close(id, end);
        }
        // A peer that closed is gone once its requests are served, or at once while it waits
        // (nobody would read the answer; its will, if any, is due now).
        if conn.eof && (conn.ready_for_request() || conn.wait.is_some()) {
            let end = conn.end_of_input();
            return self.close(id, end);
        }
        if more {
            self.again.push((id, true));
        }
        self.schedule(id);
    }

    fn on_writable(&mut self, id: usize) {
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        let was_sending = conn.sending();
        if let Err(end) = conn.flush() {
            return self.close(id, end);
        }
        if was_sending && !conn.sending() {
            // Its next requests may have been held back until it took its answers.
            self.again.push((id, true));
        }
    }

    fn handle(&mut self, id: usize, request: Request) {
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        let answered = match &conn.stage {
            Stage::Hello { .. } => self.hello(id, request),
            Stage::Proof { .. } => self.proof(id, request),
            Stage::Ready => self.answer(id, request),
        };
        if let Err(end) = answered {
            self.close(id, end);
        }
    }

    fn send(&mut self, id: usize, response: &Response) -> Result<(), ConnEnd> {
        match self.conns.get_mut(&id) {
            Some(conn) => conn.send(response),
            None => Ok(()),
        }
    }

    /// The server's side of the handshake's first step: the challenge.
    fn hello(&mut self, id: usize, request: Request) -> Result<(), ConnEnd> {
        let client = match request {
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
        self.gate.greeting(id);
        let server = auth::nonce().map_err(ConnEnd::Bad)?;
        let challenge = Response::Challenge {
            nonce: server,
            proof: self.shared.key.server_proof(&client, &server),
            fingerprint: self.shared.fingerprint.clone(),
        };
        if let Some(conn) = self.conns.get_mut(&id) {
            let by = match conn.stage {
                Stage::Hello { by } | Stage::Proof { by, .. } => by,
                Stage::Ready => Instant::now(),
            };
            conn.stage = Stage::Proof { by, client, server };
        }
        self.send(id, &challenge)
    }

    /// The handshake's last step: a proof of the run id, or a refusal that says nothing more.
    fn proof(&mut self, id: usize, request: Request) -> Result<(), ConnEnd> {
        let Some(conn) = self.conns.get_mut(&id) else {
            return Ok(());
        };
        let Stage::Proof { client, server, .. } = conn.stage else {
            return Ok(());
        };
        match request {
            Request::Proof { proof } if self.shared.key.client_proved(&client, &server, &proof) => {
                conn.stage = Stage::Ready;
                self.gate.leave(id);
                self.publish_gate();
                self.send(id, &Response::Welcome)
            }
            Request::Proof { .. } => Err(ConnEnd::Bad("the run id was not proven".into())),
            _ => Err(ConnEnd::Bad(
                "the second message must be the handshake's proof".into(),
            )),
        }
    }

    /// Executes one request of a connection that proved the run id.
    fn answer(&mut self, id: usize, request: Request) -> Result<(), ConnEnd> {
        let response = match request {
            Request::Hello { .. } | Request::Proof { .. } => Response::Refused {
                reason: "this connection has already proven the run id".into(),
            },
            // Writes are not answered (the client does not wait for them).
            Request::Set { key, value } => {
                let woken = self.keys.set(key, value);
                self.wake(woken);
                return Ok(());
            }
            Request::SetEphemeral { key, value } => {
                if let Some(conn) = self.conns.get_mut(&id) {
                    conn.ephemeral.push(key.clone());
                }
                let woken = self.keys.set(key, value);
                self.wake(woken);
                return Ok(());
            }
            Request::Will { name, key, value } => {
                if let Some(conn) = self.conns.get_mut(&id) {
                    conn.wills.push(name.clone());
                }
                self.wills.leave(name, id, key, value);
                return Ok(());
            }
            Request::Revoke { name } => {
                self.wills.revoke(&name);
                return Ok(());
            }
            Request::Get { key } => Response::Value(self.keys.get(&key).cloned()),
            Request::GetMany { keys } => match self.keys.too_big(&keys) {
                Some(reason) => Response::Refused { reason },
                None => Response::Found(keys.iter().map(|k| self.keys.get(k).cloned()).collect()),
            },
            Request::Add { key, delta } => match self.keys.add(key, delta) {
                Ok((next, woken)) => {
                    self.wake(woken);
                    Response::Counter(next)
                }
                Err(reason) => Response::Refused { reason },
            },
            Request::Wait { keys, timeout_ms } => match self.keys.too_big(&keys) {
                Some(reason) => Response::Refused { reason },
                None => match self.keys.values(&keys) {
                    Some(values) => Response::Values(values),
                    None => return self.park(id, keys, timeout_ms),
                },
            },
        };
        self.send(id, &response)
    }

    /// Parks connection `id` until every key of `keys` exists or `timeout_ms` passes.
    fn park(&mut self, id: usize, keys: Vec<String>, timeout_ms: u64) -> Result<(), ConnEnd> {
        let wait_id = self.next_wait;
        self.next_wait += 1;
        let missing = self.keys.register((id, wait_id), &keys);
        let deadline = Instant::now().checked_add(Duration::from_millis(timeout_ms));
        if let Some(conn) = self.conns.get_mut(&id) {
            conn.wait = Some(PendingWait {
                id: wait_id,
                keys,
                missing,
                deadline,
            });
        }
        Ok(())
    }

    /// Counts the registrations a write woke; answers the waits that have every key now.
    fn wake(&mut self, woken: Vec<(usize, u64)>) {
        for (id, wait_id) in woken {
            let Some(conn) = self.conns.get_mut(&id) else {
                continue;
            };
            let Some(wait) = conn.wait.as_mut().filter(|w| w.id == wait_id) else {
                continue;
            };
            wait.missing -= 1;
            if wait.missing > 0 {
                continue;
            }
            let answer = match self.keys.too_big(&wait.keys) {
                Some(reason) => Some(Response::Refused { reason }),
                None => self.keys.values(&wait.keys).map(Response::Values),
            };
            match answer {
                Some(answer) => {
                    conn.wait = None;
                    // Written now: the first of many woken waits is not held behind the last.
                    let sent = conn.send(&answer).and_then(|()| conn.flush());
                    match sent {
                        Ok(()) => self.again.push((id, false)),
                        Err(end) => self.close(id, end),
                    }
                }
                // An ephemeral key it had counted is gone since: wait for it again.
                None => wait.missing = self.keys.register((id, wait_id), &wait.keys.clone()),
            }
        }
    }

    /// Keeps the timer heap holding connection `id`'s earliest deadline.
    fn schedule(&mut self, id: usize) {
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        let Some(deadline) = conn.deadline() else {
            return;
        };
        // A later deadline is found when the earlier one fires; only an earlier one is pushed.
        if conn.scheduled.is_none_or(|at| deadline < at) {
            conn.scheduled = Some(deadline);
            self.timers.push(Reverse((deadline, id)));
        }
    }

    fn fire_timers(&mut self) {
        let now = Instant::now();
        if self.accept_rest_until.is_some_and(|until| now >= until) {
            self.accept_all();
        }
        while let Some(&Reverse((at, id))) = self.timers.peek() {
            if at > now {
                break;
            }
            self.timers.pop();
            let Some(conn) = self.conns.get_mut(&id) else {
                continue;
            };
            if conn.scheduled != Some(at) {
                continue;
            }
            conn.scheduled = None;
            if let Some(reason) = conn.expired(now, self.shared.hello_deadline) {
                self.close(id, ConnEnd::Bad(reason));
                continue;
            }
            self.time_out_wait(id, now);
            self.schedule(id);
        }
    }

    /// Answers connection `id`'s wait with the keys still missing, if its deadline has passed.
    fn time_out_wait(&mut self, id: usize, now: Instant) {
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        let due = conn.wait.as_ref().and_then(|w| w.deadline);
        if due.is_none_or(|at| now < at) {
            return;
        }
        let Some(wait) = conn.wait.take() else {
            return;
        };
        self.keys.forget((id, wait.id), &wait.keys);
        let missing = self.keys.missing(&wait.keys);
        match self.send(id, &Response::WaitTimedOut { missing }) {
            Ok(()) => self.again.push((id, false)),
            Err(end) => self.close(id, end),
        }
    }

    /// Ends connection `id`: out of the gate, its wait and ephemeral keys dropped, the reason
    /// logged or counted as the handshake's stage says (and sent to the peer, best effort).
    fn close(&mut self, id: usize, end: ConnEnd) {
        let Some(mut conn) = self.conns.remove(&id) else {
            return;
        };
        let was_waiting = self.gate.leave(id);
        self.publish_gate();
        if let Some(wait) = conn.wait.take() {
            self.keys.forget((id, wait.id), &wait.keys);
        }
        for key in std::mem::take(&mut conn.ephemeral) {
            self.keys.remove(&key);
        }
        // A connection that ends holding wills leaves them (the first value written stays).
        for name in std::mem::take(&mut conn.wills) {
            let Some((key, value)) = self.wills.take(&name, id) else {
                continue;
            };
            if self.keys.get(&key).is_none() {
                let woken = self.keys.set(key, value);
                self.wake(woken);
            }
        }
        if let ConnEnd::Bad(reason) = end {
            if conn.proven() {
                tracing::warn!(peer = %conn.peer, "dropping a rendezvous store connection: {reason}");
            } else if was_waiting {
                self.shared
                    .refused
                    .note(format!("from {}, {reason}", conn.peer));
            }
            if conn.send(&Response::Refused { reason }).is_ok() {
                let _ = conn.flush();
            }
        }
        let _ = self.poll.registry().deregister(&mut conn.stream);
    }

    /// The server is stopping: waits in progress are told so; every connection is closed.
    fn shut_down(&mut self) {
        for conn in self.conns.values_mut() {
            if conn.wait.take().is_some() {
                let refused = Response::Refused {
                    reason: "the store is shutting down".into(),
                };
                if conn.send(&refused).is_ok() {
                    let _ = conn.flush();
                }
            }
            let _ = conn.stream.shutdown(std::net::Shutdown::Both);
        }
        self.conns.clear();
        self.shared.refused.flush();
        self.shared.accept_failures.flush();
    }
}
