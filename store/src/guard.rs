//! The server's defences against strangers: the connections that have not proven the run id yet
//! (capped in all and per address; to make room, the connection that has made the least progress
//! in the handshake goes, silent before greeting, the oldest first, wherever it comes from: a
//! flood from many addresses loses its own idle sockets, not the real peers of one busy
//! address), and warnings about refused connections gathered into one line per interval.
//! The gate only keeps the books: the event loop that owns the sockets closes the ones it names.

use std::collections::{BTreeSet, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// A connection closed to make room for a newer one.
pub(crate) struct Evicted {
    /// The event loop's name for the connection to close.
    pub(crate) id: usize,
    pub(crate) peer: SocketAddr,
    /// Connections of its address that were waiting when it was closed, itself included.
    pub(crate) held_by_its_address: usize,
}

/// Where a waiting connection stands in its address's queue: silent ones (no `Hello` yet) before
/// those doing the handshake, then the oldest first; the id breaks ties.
type Place = (bool, Instant, usize);

/// The connections that have not proven the run id yet, by the event loop's connection id.
pub(crate) struct Gate {
    pending: HashMap<usize, (SocketAddr, Place)>,
    by_address: HashMap<IpAddr, BTreeSet<Place>>,
    /// Every waiting connection, least progress and oldest first.
    order: BTreeSet<Place>,
    max: usize,
    max_per_ip: usize,
}

impl Gate {
    pub(crate) fn new(max: usize, max_per_ip: usize) -> Gate {
        Gate {
            pending: HashMap::new(),
            by_address: HashMap::new(),
            order: BTreeSet::new(),
            max: max.max(1),
            max_per_ip: max_per_ip.clamp(1, max.max(1)),
        }
    }

    /// Counts the new connection `id` as waiting; returns the one that lost its slot to it, if
    /// one had to (the caller closes it).
    pub(crate) fn admit(&mut self, id: usize, peer: SocketAddr) -> Option<Evicted> {
        let evicted = self.victim(peer.ip()).map(|victim| {
            let (victim_peer, _) = self.pending[&victim];
            let held = self.by_address[&victim_peer.ip()].len();
            self.leave(victim);
            Evicted {
                id: victim,
                peer: victim_peer,
                held_by_its_address: held,
            }
        });
        let place = (false, Instant::now(), id);
        self.pending.insert(id, (peer, place));
        self.by_address.entry(peer.ip()).or_default().insert(place);
        self.order.insert(place);
        evicted
    }

    /// Which waiting connection must make room for a new one from `ip`: none while there is
    /// room; else one of `ip`'s own when it holds its share, else any; among those, the silent
    /// before those doing the handshake, the oldest first. (Choosing the address that holds the
    /// most, as before, let silent sockets from many loopback addresses evict the real ranks of
    /// the one address that was busy: any local user has all of 127/8.)
    fn victim(&self, ip: IpAddr) -> Option<usize> {
        let held = self.by_address.get(&ip).map_or(0, BTreeSet::len);
        let first = if held >= self.max_per_ip {
            self.by_address[&ip].first()
        } else if self.pending.len() >= self.max {
            self.order.first()
        } else {
            return None;
        };
        first.map(|&(_, _, id)| id)
    }

    /// The connection `id` sent its `Hello`.
    pub(crate) fn greeting(&mut self, id: usize) {
        let Some((peer, place)) = self.pending.get_mut(&id) else {
            return;
        };
        if let Some(queue) = self.by_address.get_mut(&peer.ip()) {
            queue.remove(place);
            self.order.remove(place);
            place.0 = true;
            queue.insert(*place);
            self.order.insert(*place);
        }
    }

    /// The connection `id` proved the run id or ended; false when it was not waiting.
    pub(crate) fn leave(&mut self, id: usize) -> bool {
        let Some((peer, place)) = self.pending.remove(&id) else {
            return false;
        };
        self.order.remove(&place);
        if let Some(queue) = self.by_address.get_mut(&peer.ip()) {
            queue.remove(&place);
            if queue.is_empty() {
                self.by_address.remove(&peer.ip());
            }
        }
        true
    }

    /// Connections waiting now.
    pub(crate) fn len(&self) -> usize {
        self.pending.len()
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
    use std::sync::Arc;
    use std::thread;

    #[test]
    fn the_least_advanced_and_oldest_makes_room_its_own_address_first_when_full() {
        let mut gate = Gate::new(4, 3);
        let a: SocketAddr = "10.0.0.1:1".parse().unwrap();
        let b: SocketAddr = "10.0.0.2:1".parse().unwrap();
        let c: SocketAddr = "10.0.0.3:1".parse().unwrap();
        assert!(gate.admit(1, a).is_none());
        assert!(gate.admit(2, a).is_none());
        gate.greeting(1);
        assert!(gate.admit(3, a).is_none());
        // `a` holds its share: its own silent, oldest connection makes room, not the greeting one.
        let evicted = gate.admit(4, a).unwrap();
        assert_eq!((evicted.id, evicted.peer), (2, a));
        assert!(!gate.leave(2), "the second lost its slot");
        assert!(gate.leave(1), "the greeting one kept its slot");
        // Full with three of `a` and one of `b`: a newcomer from `c` takes the oldest silent one.
        assert!(gate.admit(5, b).is_none());
        assert_eq!(gate.len(), 3);
        assert!(gate.admit(6, a).is_none());
        let evicted = gate.admit(7, c).unwrap();
        assert_eq!((evicted.id, evicted.peer), (3, a));
        assert_eq!(evicted.held_by_its_address, 3);
        assert_eq!(gate.len(), 4);
    }

    #[test]
    fn silent_sockets_from_many_addresses_make_room_before_a_busy_address_s_real_peers() {
        // A flood of silent sockets from distinct addresses fills the gate before one host's
        // ranks connect; the ranks' connections are newer (and about to greet): the flood's
        // oldest go, not the ranks of the address that holds the most.
        let mut gate = Gate::new(4, 3);
        let flood = |i: u8| SocketAddr::from(([127, 0, 1, i], 1));
        let ranks: SocketAddr = "127.0.0.1:1".parse().unwrap();
        assert!(gate.admit(1, flood(1)).is_none());
        assert!(gate.admit(2, flood(2)).is_none());
        assert!(gate.admit(3, ranks).is_none());
        assert!(gate.admit(4, ranks).is_none());
        let evicted = gate.admit(5, flood(3)).unwrap();
        assert_eq!((evicted.id, evicted.peer), (1, flood(1)));
        gate.greeting(3);
        let evicted = gate.admit(6, ranks).unwrap();
        assert_eq!((evicted.id, evicted.peer), (2, flood(2)));
        // Only silent ones of the ranks' address and newer floods are left to go, oldest first;
        // the greeting one goes last.
        let evicted = gate.admit(7, flood(4)).unwrap();
        assert_eq!(evicted.id, 4);
        assert!(gate.leave(3), "the greeting rank kept its slot");
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
