//! The server's defences against strangers: the connections that have not proven the run id yet
//! (capped in all and per address; to make room, the address holding the most loses its silent
//! and oldest first), and warnings about refused connections gathered into one line per interval.

use std::net::{IpAddr, Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// A connection that has not proven the run id yet.
struct Pending {
    ticket: u64,
    peer: SocketAddr,
    since: Instant,
    /// Its `Hello` arrived: it is doing the handshake, so it loses its slot after silent ones.
    greeting: bool,
    /// Shuts the connection down when it loses its slot (the same socket as its thread's).
    stream: Arc<TcpStream>,
}

/// A connection closed to make room for a newer one.
pub(crate) struct Evicted {
    pub(crate) peer: SocketAddr,
    /// Connections of its address that were waiting when it was closed, itself included.
    pub(crate) held_by_its_address: usize,
}

/// The connections that have not proven the run id yet.
pub(crate) struct Gate {
    pending: Mutex<Vec<Pending>>,
    next_ticket: AtomicU64,
    max: usize,
    max_per_ip: usize,
}

impl Gate {
    pub(crate) fn new(max: usize, max_per_ip: usize) -> Gate {
        Gate {
            pending: Mutex::new(Vec::new()),
            next_ticket: AtomicU64::new(0),
            max: max.max(1),
            max_per_ip: max_per_ip.clamp(1, max.max(1)),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Pending>> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts a new connection as waiting and returns its ticket, closing (shutting down) the
    /// connection that lost its slot to it, if one had to.
    pub(crate) fn admit(&self, peer: SocketAddr, stream: Arc<TcpStream>) -> (u64, Option<Evicted>) {
        let mut pending = self.lock();
        let evicted = self.victim(&pending, peer.ip()).map(|index| {
            let ip = pending[index].peer.ip();
            let held = pending.iter().filter(|p| p.peer.ip() == ip).count();
            (pending.swap_remove(index), held)
        });
        let ticket = self.next_ticket.fetch_add(1, Ordering::Relaxed);
        pending.push(Pending {
            ticket,
            peer,
            since: Instant::now(),
            greeting: false,
            stream,
        });
        let evicted = evicted.map(|(victim, held)| {
            let _ = victim.stream.shutdown(Shutdown::Both);
            Evicted {
                peer: victim.peer,
                held_by_its_address: held,
            }
        });
        (ticket, evicted)
    }

    /// Which waiting connection must make room for a new one from `ip`: none while there is
    /// room; else one of `ip`'s own when it holds its share, else one of the address that holds
    /// the most; among those, the silent before those doing the handshake, the oldest first.
    fn victim(&self, pending: &[Pending], ip: IpAddr) -> Option<usize> {
        let count = |ip: IpAddr| pending.iter().filter(|p| p.peer.ip() == ip).count();
        let target = if count(ip) >= self.max_per_ip {
            ip
        } else if pending.len() >= self.max {
            pending
                .iter()
                .map(|p| p.peer.ip())
                .max_by_key(|&ip| count(ip))?
        } else {
            return None;
        };
        pending
            .iter()
            .enumerate()
            .filter(|(_, p)| p.peer.ip() == target)
            .min_by_key(|(_, p)| (p.greeting, p.since))
            .map(|(index, _)| index)
    }

    /// The connection of `ticket` sent its `Hello`.
    pub(crate) fn greeting(&self, ticket: u64) {
        if let Some(p) = self.lock().iter_mut().find(|p| p.ticket == ticket) {
            p.greeting = true;
        }
    }

    /// The connection of `ticket` proved the run id or ended; false when it had already lost its
    /// slot (closed to make room, and reported then).
    pub(crate) fn leave(&self, ticket: u64) -> bool {
        let mut pending = self.lock();
        match pending.iter().position(|p| p.ticket == ticket) {
            Some(index) => {
                pending.swap_remove(index);
                true
            }
            None => false,
        }
    }

    /// Connections waiting now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().len()
    }
}

/// Lines about one kind of event, at most one per interval: the first at once, the ones after it
/// counted and written as one line when the interval has passed (by [`Throttle::tick`]).
pub(crate) struct Throttle {
    /// The line's head for a count of events, e.g. "refused 3 connections ...".
    head: fn(u64) -> String,
    interval: Duration,
    state: Mutex<ThrottleState>,
}

#[derive(Default)]
struct ThrottleState {
    last_line: Option<Instant>,
    count: u64,
    latest: String,
}

impl Throttle {
    pub(crate) fn new(head: fn(u64) -> String, interval: Duration) -> Throttle {
        Throttle {
            head,
            interval,
            state: Mutex::new(ThrottleState::default()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, ThrottleState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// One more event; `detail` says what the latest was.
    pub(crate) fn note(&self, detail: String) {
        let mut state = self.lock();
        state.count += 1;
        state.latest = detail;
        self.write_if_due(&mut state);
    }

    /// Writes the gathered events if the interval has passed since the last line.
    pub(crate) fn tick(&self) {
        self.write_if_due(&mut self.lock());
    }

    /// Writes the gathered events now (the server is stopping).
    pub(crate) fn flush(&self) {
        let mut state = self.lock();
        self.write(&mut state);
    }

    fn write_if_due(&self, state: &mut ThrottleState) {
        if state
            .last_line
            .is_none_or(|at| at.elapsed() >= self.interval)
        {
            self.write(state);
        }
    }

    fn write(&self, state: &mut ThrottleState) {
        if state.count == 0 {
            return;
        }
        let head = (self.head)(state.count);
        match state.last_line {
            Some(at) if state.count > 1 => tracing::warn!(
                "rendezvous store: {head} in the last {:.1} s; the latest {}",
                at.elapsed().as_secs_f64(),
                state.latest
            ),
            _ => tracing::warn!("rendezvous store: {head}: {}", state.latest),
        }
        state.last_line = Some(Instant::now());
        state.count = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::thread;

    fn socket(listener: &TcpListener) -> Arc<TcpStream> {
        Arc::new(TcpStream::connect(listener.local_addr().unwrap()).unwrap())
    }

    #[test]
    fn the_address_holding_the_most_makes_room_silent_and_oldest_first() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let gate = Gate::new(4, 3);
        let a: SocketAddr = "10.0.0.1:1".parse().unwrap();
        let b: SocketAddr = "10.0.0.2:1".parse().unwrap();
        let c: SocketAddr = "10.0.0.3:1".parse().unwrap();
        let (first, none) = gate.admit(a, socket(&listener));
        assert!(none.is_none());
        let (second, _) = gate.admit(a, socket(&listener));
        gate.greeting(first);
        let (_, none) = gate.admit(a, socket(&listener));
        assert!(none.is_none());
        // `a` holds its share: its own silent, oldest connection makes room, not the greeting one.
        let (_, evicted) = gate.admit(a, socket(&listener));
        assert_eq!(evicted.unwrap().peer, a);
        assert!(!gate.leave(second), "the second lost its slot");
        assert!(gate.leave(first), "the greeting one kept its slot");
        // Full with three of `a` and one of `b`: a newcomer from `c` takes one of `a`'s.
        gate.admit(b, socket(&listener));
        assert_eq!(gate.len(), 3);
        gate.admit(a, socket(&listener));
        let (_, evicted) = gate.admit(c, socket(&listener));
        let evicted = evicted.unwrap();
        assert_eq!(evicted.peer, a);
        assert_eq!(evicted.held_by_its_address, 3);
        assert_eq!(gate.len(), 4);
    }

    /// Captures the lines written while `f` runs on this thread.
    fn lines_of(f: impl FnOnce()) -> Vec<String> {
        #[derive(Clone, Default)]
        struct Buffer(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Buffer {
            fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(bytes);
                Ok(bytes.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buffer = Buffer::default();
        let writer = buffer.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .without_time()
            .finish();
        tracing::subscriber::with_default(subscriber, f);
        let text = String::from_utf8(buffer.0.lock().unwrap().clone()).unwrap();
        text.lines().map(str::to_string).collect()
    }

    #[test]
    fn a_thousand_refusals_make_two_lines_with_a_count() {
        let lines = lines_of(|| {
            let throttle = Throttle::new(
                |n| format!("refused {n} connections"),
                Duration::from_millis(300),
            );
            for i in 0..1000 {
                throttle.note(format!("from 10.0.0.1:{i}, silent"));
                throttle.tick();
            }
            thread::sleep(Duration::from_millis(350));
            throttle.tick();
            throttle.tick();
            throttle.flush();
        });
        assert_eq!(lines.len(), 2, "{lines:#?}");
        assert!(
            lines[0].ends_with("rendezvous store: refused 1 connections: from 10.0.0.1:0, silent"),
            "{}",
            lines[0]
        );
        assert!(
            lines[1].contains("rendezvous store: refused 999 connections in the last 0."),
            "{}",
            lines[1]
        );
        assert!(
            lines[1].ends_with("s; the latest from 10.0.0.1:999, silent"),
            "{}",
            lines[1]
        );
    }
}
