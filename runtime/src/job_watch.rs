//! Tells every rank, within milliseconds and whatever the job's size, that another rank ended
//! before the job finished: each rank opens one more connection to the rendezvous store, leaves
//! a *will* on it (a line the store writes under `job/failed` if the connection ends before the
//! will is revoked: a crash, a kill, out of memory, its host's processes dying) and waits there
//! for that key, parked at the store (no polling, no heartbeat traffic). The first will written
//! reaches every waiting rank at once, and names the rank that ended.
//!
//! It owns the keys `job/failed`, `job/finished` and `job/all-finished`. It must not decide what
//! a rank does when another ended (the caller's `on_end` does: the worker stops), nor what a
//! rank does about its own errors (it ends as before, and its will tells the others). A rank
//! that finishes says so first ([`JobWatch::finish`]), so that a slower rank never takes a
//! planned end for a death; rank 0, which hosts the store, keeps it until every rank finished.
//! A rank failing on its own drops its watch: it then reports its own error, not another's.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use store::{StoreClient, StoreCloser, StoreError};

/// The line of the first rank that ended before the job finished.
const FAILED: &str = "job/failed";
/// How many ranks finished (a counter).
const FINISHED: &str = "job/finished";
/// Written by the last rank to finish.
const ALL_FINISHED: &str = "job/all-finished";
/// One wait of the watching connection (parked at the store; it is simply asked again).
const WATCH_WAIT: Duration = Duration::from_secs(3600);
/// How often rank 0, waiting for the others to finish, looks whether one ended instead.
const FINISH_POLL: Duration = Duration::from_millis(500);
/// How long a rank that lost the store (rank 0's process ended) waits before it stops: rank
/// 0's own report, or its launcher's teardown, comes first; a rank still running then stops.
const STORE_LOSS_GRACE: Duration = Duration::from_secs(1);
/// How long connecting to the store may take.
const CONNECT: Duration = Duration::from_secs(30);

/// The line `env`'s rank leaves as its will: who it is, for the others' messages. No other
/// "rank N" in it: the launcher's summary reads the ranks a line names.
pub fn will_line(env: &common::env_contract::WorkerEnv) -> String {
    format!(
        "rank {} (host {}, node {}, pid {}) ended before the job finished",
        env.rank,
        crate::agreement::host_name(),
        env.group_rank,
        std::process::id()
    )
}

/// The name of `rank`'s will.
fn will_name(rank: u32) -> String {
    format!("job/will/{rank}")
}

/// This rank's will and watch (see the module documentation).
pub struct JobWatch {
    addr: String,
    run_id: String,
    rank: u32,
    world: u32,
    /// Set before this rank's will is revoked: from then on nothing the watch sees is acted on.
    finishing: Arc<AtomicBool>,
    /// Closes the watching connection (parked in its wait).
    closer: StoreCloser,
}

impl JobWatch {
    /// Leaves this rank's will (`line`: who it is, for the others' messages) at the store at
    /// `addr` and starts watching, on its own thread, for the first will of another rank (or
    /// the store's end): `on_end` gets that line, once, unless this rank is finishing.
    pub fn start(
        addr: &str,
        run_id: &str,
        (rank, world): (u32, u32),
        line: &str,
        on_end: impl FnOnce(String) + Send + 'static,
    ) -> Result<JobWatch, StoreError> {
        let mut watcher = StoreClient::connect(addr, run_id, CONNECT)?;
        watcher.set_will(&will_name(rank), FAILED, line.as_bytes())?;
        let closer = watcher.closer().ok_or_else(|| StoreError::Refused {
            addr: addr.to_string(),
            op: "watching the other ranks".into(),
            reason: "torchrun's agent store has no wills".into(),
        })?;
        let finishing = Arc::new(AtomicBool::new(false));
        let stop = Arc::clone(&finishing);
        let store = addr.to_string();
        let spawned = std::thread::Builder::new()
            .name("job-watch".into())
            .spawn(move || {
                let seen = loop {
                    match watcher.wait(&[FAILED], WATCH_WAIT) {
                        Ok(mut line) => {
                            break String::from_utf8_lossy(&line.remove(0)).into_owned()
                        }
                        Err(StoreError::WaitTimeout { .. }) => continue,
                        Err(e) => {
                            std::thread::sleep(STORE_LOSS_GRACE);
                            break format!(
                                "the rendezvous store at {store} (rank 0's) is gone: {e}"
                            );
                        }
                    }
                };
                if !stop.load(Ordering::SeqCst) {
                    on_end(seen);
                }
            });
        spawned.map_err(|cause| StoreError::Thread { cause })?;
        Ok(JobWatch {
            addr: addr.to_string(),
            run_id: run_id.to_string(),
            rank,
            world,
            finishing,
            closer,
        })
    }

    /// Ends the watch as this rank's death would: its connection closes holding the will (tests).
    #[cfg(test)]
    fn die(self) {
        // A dead process says nothing more.
        self.finishing.store(true, Ordering::SeqCst);
        self.closer.close();
    }

    /// This rank ends as planned (the job finished, or the group re-forms): its will is void.
    /// Rank 0 then keeps the store up until every rank finished (at most `timeout`, or until
    /// one ended instead), so that none of them takes the store's end for rank 0's death.
    /// The watching connection stays parked: the will is revoked from a connection of its own.
    pub fn finish(self, timeout: Duration) -> Result<(), StoreError> {
        self.finishing.store(true, Ordering::SeqCst);
        let mut store = StoreClient::connect(&self.addr, &self.run_id, CONNECT)?;
        store.revoke_will(&will_name(self.rank))?;
        // In effect once this connection's next request is answered; then the watching one
        // may close.
        let counted = store.add(FINISHED, 1)?;
        self.closer.close();
        if counted >= i64::from(self.world) {
            store.set(ALL_FINISHED, b"1")?;
        }
        if self.rank != 0 {
            return Ok(());
        }
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            match store.wait(&[ALL_FINISHED], FINISH_POLL) {
                Ok(_) => return Ok(()),
                Err(StoreError::WaitTimeout { .. }) if store.get(FAILED)?.is_none() => {}
                Err(StoreError::WaitTimeout { .. }) => return Ok(()),
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// Dropped without [`JobWatch::finish`]: this rank is failing on its own (an error unwinds
/// past it) and will say why itself; the watch stops acting, and the will stays, for the store
/// to write when this process ends.
impl Drop for JobWatch {
    fn drop(&mut self) {
        self.finishing.store(true, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use store::StoreServer;

    /// `world` watches on one store; each reports what it saw on the channel.
    fn watches(world: u32) -> (StoreServer, Vec<JobWatch>, mpsc::Receiver<(u32, String)>) {
        let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), "watch").unwrap();
        let addr = server.local_addr().to_string();
        let (tx, rx) = mpsc::channel();
        let all = (0..world)
            .map(|rank| {
                let tx = tx.clone();
                let line = format!("rank {rank} (host h, pid {}) ended", 100 + rank);
                JobWatch::start(&addr, "watch", (rank, world), &line, move |seen| {
                    let _ = tx.send((rank, seen));
                })
                .unwrap()
            })
            .collect();
        (server, all, rx)
    }

    #[test]
    fn a_rank_that_ends_unannounced_is_named_to_every_other_at_once() {
        let (_server, mut all, rx) = watches(4);
        let started = Instant::now();
        all.remove(2).die(); // its connection closes holding the will, as in a crash
        let mut told: Vec<(u32, String)> = (0..3)
            .map(|_| rx.recv_timeout(Duration::from_secs(5)).unwrap())
            .collect();
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{:?}",
            started.elapsed()
        );
        told.sort();
        let ranks: Vec<u32> = told.iter().map(|(r, _)| *r).collect();
        assert_eq!(ranks, vec![0, 1, 3]);
        for (_, line) in told {
            assert_eq!(line, "rank 2 (host h, pid 102) ended");
        }
    }

    #[test]
    fn ranks_that_finish_tell_nobody_and_rank_0_waits_for_the_last() {
        let (server, mut all, rx) = watches(3);
        let rank0 = all.remove(0);
        let last = all.pop().unwrap();
        all.pop().unwrap().finish(Duration::from_secs(5)).unwrap();
        let waiting = std::thread::spawn(move || {
            let started = Instant::now();
            rank0.finish(Duration::from_secs(5)).unwrap();
            started.elapsed()
        });
        std::thread::sleep(Duration::from_millis(300));
        last.finish(Duration::from_secs(5)).unwrap();
        let waited = waiting.join().unwrap();
        assert!(waited >= Duration::from_millis(250), "{waited:?}");
        // The store's end after everyone finished is nobody's death.
        drop(server);
        assert!(rx.recv_timeout(Duration::from_millis(300)).is_err());
    }
}
