//! The elastic rendezvous (`--nnodes MIN:MAX`): which nodes form the worker group at each
//! (re)start, in what node-rank order, and when a running group must re-form.
//!
//! It runs over our rendezvous store, hosted by the launcher that bound `--rdzv-endpoint` (the
//! host): any other node may die and the job goes on; the host may not, and every other node
//! says so when its store connection breaks. The host's launcher also runs the
//! [`Coordinator`], the one writer of rounds, so that no compare-and-set is needed:
//!
//! - every launcher takes a node id (`elastic/next_id`) and beats `elastic/hb/<id>` twice a
//!   second (the coordinator tells live nodes from dead ones by whether their counter moves);
//! - to join round `r` a launcher writes its [`NodeInfo`] under `elastic/r<r>/join/<id>` and
//!   waits for `elastic/r<r>/members`, the [`Round`] the coordinator closes: the host first,
//!   then by node id, as many nodes (between MIN and MAX) as give a world that keeps the
//!   global batch; a node left out joins round `r + 1`;
//! - a member whose group finishes writes `elastic/r<r>/finished/<id>`; one whose group fails
//!   writes `elastic/r<r>/failed`; a newcomer waiting in round
//!   `r + 1` makes the coordinator write `elastic/r<r>/regroup`; either way every member tears
//!   its group down and joins round `r + 1`;
//! - `elastic/r<r>/end` is written with either (members wait for it: a running round costs the
//!   store nothing but the heartbeats);
//! - `elastic/done` ends the job for everyone still waiting ([`Done`]);
//! - before it joins, a launcher writes its job terms (`common::job_terms`: the config but
//!   for per-node paths, the data and the worker build) under `elastic/terms/<id>`, and their
//!   digest in its [`NodeInfo`]; the coordinator admits only nodes whose digest is the host's
//!   and writes `elastic/refused/<id>` (the differing keys, both values) for any other, which
//!   that node reports and leaves on: the running group never sees it;
//! - a node that dies before its round starts is not in it (only live nodes are formed), and
//!   every round's end is kept in `elastic/history` for the summaries.
//!
//! This module owns the keys and the protocol; it must not start or stop processes (the
//! elastic supervisor does, on its [`Event`]s).

mod coordinator;

use std::time::Duration;

use crossbeam_channel::Sender;
use serde::{Deserialize, Serialize};
use store::{StoreClient, StoreError};

use crate::event::Event;
pub use crate::round::{NodeInfo, Round};

pub use coordinator::Coordinator;

/// How often waiting loops look at the store.
const POLL: Duration = Duration::from_millis(100);
/// How long a member's monitor waits for its round's end before it looks at its stop flag (a
/// monitor of a round that ended lingers that long at most; each new wait is one request).
const MONITOR_WAIT: Duration = Duration::from_secs(5);
/// How often a launcher beats.
const BEAT: Duration = Duration::from_millis(500);
/// A node whose heartbeat did not move for this long is taken for dead.
const DEAD_AFTER: Duration = Duration::from_secs(3);
/// A store host that does not answer a heartbeat within this long is taken for lost (a cut
/// link, a machine gone): every node hears it in seconds, not after the 30 s request timeout.
pub const HOST_SILENT_AFTER: Duration = Duration::from_secs(5);

const NEXT_ID: &str = "elastic/next_id";
const DONE: &str = "elastic/done";
const HISTORY: &str = "elastic/history";

fn key(round: u64, what: &str) -> String {
    format!("elastic/r{round}/{what}")
}

fn heartbeat_key(id: u64) -> String {
    format!("elastic/hb/{id}")
}

fn alive_key(id: u64) -> String {
    format!("elastic/alive/{id}")
}

fn terms_key(id: u64) -> String {
    format!("elastic/terms/{id}")
}

fn refused_key(id: u64) -> String {
    format!("elastic/refused/{id}")
}

/// How the job ended, for the nodes that are not running it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Done {
    Finished,
    Failed(String),
}

/// What the rendezvous needs to know about the job.
pub struct Terms {
    pub min: u32,
    pub max: u32,
    pub last_call: Duration,
    pub join_timeout: Duration,
    pub max_restarts: u32,
    /// `Ok` when a world of this many processes keeps the global batch, else why not.
    pub feasible: Box<dyn Fn(u32) -> Result<(), String> + Send>,
    /// The host's job terms: a node with others is refused.
    pub job: common::job_terms::Terms,
}

/// How one round ended, for the summaries (`elastic/history`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoundEnd {
    pub round: u64,
    pub ids: Vec<u64>,
    pub world: u32,
    pub ended: String,
}

/// The rounds of the job so far and how each ended, one line each.
pub fn history(store: &mut StoreClient) -> Vec<String> {
    let rounds: Vec<RoundEnd> = store.get(HISTORY).ok().and_then(parse).unwrap_or_default();
    rounds
        .iter()
        .map(|r| {
            let ids: Vec<String> = r.ids.iter().map(u64::to_string).collect();
            format!(
                "round {} (node ids {}; world {}): {}",
                r.round,
                ids.join(", "),
                r.world,
                r.ended
            )
        })
        .collect()
}

/// Publishes this node's job terms; call before [`join`].
pub fn publish_terms(
    store: &mut StoreClient,
    id: u64,
    terms: &common::job_terms::Terms,
) -> Result<(), StoreError> {
    store.set(&terms_key(id), &json(terms))
}

/// How many launchers other than `id` still hold their connection to the store (alive or
/// stopped, but not exited).
pub fn others_connected(store: &mut StoreClient, id: u64) -> Result<usize, StoreError> {
    let next = counter(store.get(NEXT_ID)?).max(0) as u64;
    let keys: Vec<String> = (0..next).filter(|&o| o != id).map(alive_key).collect();
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    Ok(store
        .get_many(&keys)?
        .iter()
        .filter(|v| v.is_some())
        .count())
}

fn json<T: Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).unwrap_or_default()
}

fn parse<T: for<'de> Deserialize<'de>>(bytes: Option<Vec<u8>>) -> Option<T> {
    serde_json::from_slice(&bytes?).ok()
}

fn counter(bytes: Option<Vec<u8>>) -> i64 {
    bytes
        .and_then(|b| String::from_utf8(b).ok())
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(0)
}

/// A new node id for this launcher.
pub fn take_id(store: &mut StoreClient) -> Result<u64, StoreError> {
    Ok((store.add(NEXT_ID, 1)? - 1).max(0) as u64)
}

/// Beats for node `id` on its own connection until the store is gone, then sends
/// [`Event::StoreLost`] (once) and stops. The connection also holds the node's ephemeral
/// `elastic/alive/<id>` key: when this process dies the store drops it at once, so a killed
/// node is known dead without waiting for its heartbeat to go stale.
pub fn start_heartbeat(mut store: StoreClient, id: u64, tx: Sender<Event>) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("heartbeat".into())
        .spawn(move || {
            let lost = |e: StoreError| {
                let _ = tx.send(Event::StoreLost(e.to_string()));
            };
            if let Err(e) = store
                .set_io_timeout(HOST_SILENT_AFTER)
                .and_then(|()| store.set_ephemeral(&alive_key(id), b"1"))
            {
                return lost(e);
            }
            loop {
                if let Err(e) = store.add(&heartbeat_key(id), 1) {
                    return lost(e);
                }
                std::thread::sleep(BEAT);
            }
        })
        .map(|_| ())
}

/// Why [`join`] returned without a round.
#[derive(Debug)]
pub enum NotJoined {
    /// The job ended while this node waited.
    Done(Done),
    /// The launcher was signalled.
    Signal(i32),
    /// The store failed (the host is gone).
    Store(StoreError),
    /// The job refused this node: its terms differ from the job's (the line says how).
    Refused(String),
}

impl From<StoreError> for NotJoined {
    fn from(e: StoreError) -> Self {
        NotJoined::Store(e)
    }
}

/// Joins the first round after `after` (the open one on a first join) and waits until a round
/// takes this node. `say` gets one-line notices (waiting, not admitted); `signalled` is polled.
pub fn join(
    store: &mut StoreClient,
    info: &NodeInfo,
    after: Option<u64>,
    say: &mut dyn FnMut(String),
    signalled: &mut dyn FnMut() -> Option<i32>,
) -> Result<Round, NotJoined> {
    let mut round = match after {
        Some(r) => r + 1,
        None => counter(store.get("elastic/open")?) as u64,
    };
    let mut said_waiting = None;
    store.set(&key(round, &format!("join/{}", info.id)), &json(info))?;
    loop {
        if let Some(sig) = signalled() {
            return Err(NotJoined::Signal(sig));
        }
        // One request for all four (a thousand nodes poll while a round forms).
        let (members, waiting) = (key(round, "members"), key(round, "waiting"));
        let refused = refused_key(info.id);
        let [done, refused, members, waiting]: [Option<Vec<u8>>; 4] = store
            .get_many(&[DONE, &refused, &members, &waiting])?
            .try_into()
            .unwrap_or_default();
        if let Some(done) = parse::<Done>(done) {
            return Err(NotJoined::Done(done));
        }
        if let Some(why) = refused {
            return Err(NotJoined::Refused(
                String::from_utf8_lossy(&why).into_owned(),
            ));
        }
        if let Some(closed) = parse::<Round>(members) {
            if closed.node_rank_of(info.id).is_some() {
                return Ok(closed);
            }
            say(format!(
                "round {round} formed without this node ({} node(s)); waiting to join at the next restart",
                closed.nodes.len()
            ));
            round += 1;
            store.set(&key(round, &format!("join/{}", info.id)), &json(info))?;
            continue;
        }
        if let Some(why) = waiting {
            let why = String::from_utf8_lossy(&why).into_owned();
            if said_waiting.as_ref() != Some(&why) {
                say(why.clone());
                said_waiting = Some(why);
            }
        }
        std::thread::sleep(POLL);
    }
}

/// Tells the coordinator that this member's group of `round` failed (the first word stays).
pub fn report_failure(store: &mut StoreClient, round: u64, what: &str) -> Result<(), StoreError> {
    if store.get(&key(round, "failed"))?.is_none() {
        store.set(&key(round, "failed"), what.as_bytes())?;
        store.set(&key(round, "end"), b"failed")?;
    }
    Ok(())
}

/// Why `round` failed, once someone reports it within `within` (`None` if nobody did).
pub fn wait_failure(
    store: &mut StoreClient,
    round: u64,
    within: Duration,
) -> Result<Option<String>, StoreError> {
    match store.wait(&[&key(round, "failed")], within) {
        Ok(mut why) => Ok(Some(String::from_utf8_lossy(&why.remove(0)).into_owned())),
        Err(StoreError::WaitTimeout { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Tells the coordinator that node `id`'s group of `round` finished its work (it may then
/// leave without being taken for dead).
pub fn report_finished(store: &mut StoreClient, round: u64, id: u64) -> Result<(), StoreError> {
    store.set(&key(round, &format!("finished/{id}")), b"1")
}

/// Watches `round` for this member on its own connection until `stop` is set: sends
/// [`Event::Regroup`] once when the group must re-form (a member failed, or a newcomer waits).
/// It waits for the round's `end` key (parked at the store, no polling), looking at `stop`
/// between waits of [`MONITOR_WAIT`].
pub fn start_monitor(
    mut store: StoreClient,
    round: u64,
    tx: Sender<Event>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::io::Result<()> {
    use std::sync::atomic::Ordering;
    std::thread::Builder::new()
        .name("rendezvous-monitor".into())
        .spawn(move || {
            // A failure re-forms at once; a waiting node at the next checkpoint (and a failure
            // while waiting for it still at once): once a regroup is seen, only `failed` counts.
            let (end, failed, regroup) = (
                key(round, "end"),
                key(round, "failed"),
                key(round, "regroup"),
            );
            let mut asked = false;
            while !stop.load(Ordering::Relaxed) {
                let watched = if asked { &failed } else { &end };
                match store.wait(&[watched], MONITOR_WAIT) {
                    Ok(_) => {}
                    Err(StoreError::WaitTimeout { .. }) => continue,
                    Err(_) => return, // the heartbeat reports a lost store
                }
                let Ok(seen) = store.get_many(&[&failed, &regroup]) else {
                    return;
                };
                let (reason, at_checkpoint) = match (&seen[0], &seen[1]) {
                    (Some(why), _) => (why, false),
                    (None, Some(why)) if !asked => (why, true),
                    _ => {
                        // Not written yet by whoever wrote `end` (cannot be: same connection,
                        // in order); do not spin on it.
                        std::thread::sleep(POLL);
                        continue;
                    }
                };
                let _ = tx.send(Event::Regroup {
                    round: round as u32,
                    reason: String::from_utf8_lossy(reason).into_owned(),
                    at_checkpoint,
                });
                if !at_checkpoint {
                    return;
                }
                asked = true;
            }
        })
        .map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: u64, nproc: u32, hostname: &str) -> NodeInfo {
        NodeInfo {
            id,
            addr: format!("10.0.0.{id}"),
            nproc,
            port: 0,
            host: id == 0,
            terms: String::new(),
            hostname: hostname.into(),
        }
    }

    #[test]
    fn nodes_with_different_process_counts_take_consecutive_ranks_and_are_named_by_them() {
        let round = Round {
            round: 3,
            nodes: vec![node(0, 1, "h0"), node(4, 3, "h4"), node(2, 2, "")],
            failures: 0,
            previous_world: None,
        };
        assert_eq!(round.world_size(), 6);
        assert_eq!(
            (0..3).map(|r| round.first_rank_of(r)).collect::<Vec<_>>(),
            [0, 1, 4]
        );
        assert_eq!(round.describe(0), "node id 0 (host h0 at 10.0.0.0, rank 0)");
        assert_eq!(
            round.describe(4),
            "node id 4 (host h4 at 10.0.0.4, ranks 1..3)"
        );
        assert_eq!(round.describe(2), "node id 2 (10.0.0.2, ranks 4..5)");
        assert_eq!(round.describe(9), "node id 9");
    }
}
