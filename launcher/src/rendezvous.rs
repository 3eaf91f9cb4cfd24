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
//! - `elastic/done` ends the job for everyone still waiting ([`Done`]).
//!
//! This module owns the keys and the protocol; it must not start or stop processes (the
//! elastic supervisor does, on its [`Event`]s).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use serde::{Deserialize, Serialize};
use store::{StoreClient, StoreError};

use crate::supervisor::Event;

/// How often waiting loops look at the store.
const POLL: Duration = Duration::from_millis(100);
/// How often a launcher beats.
const BEAT: Duration = Duration::from_millis(500);
/// A node whose heartbeat did not move for this long is taken for dead.
const DEAD_AFTER: Duration = Duration::from_secs(3);

const NEXT_ID: &str = "elastic/next_id";
const DONE: &str = "elastic/done";

fn key(round: u64, what: &str) -> String {
    format!("elastic/r{round}/{what}")
}

fn heartbeat_key(id: u64) -> String {
    format!("elastic/hb/{id}")
}

fn alive_key(id: u64) -> String {
    format!("elastic/alive/{id}")
}

/// What a node says about itself when it joins a round.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    pub id: u64,
    /// Where the other nodes reach it (its workers' store, when it is node rank 0).
    pub addr: String,
    pub nproc: u32,
    /// A free port on this node for the workers' store, should it become node rank 0.
    pub port: u16,
    /// Whether it hosts the rendezvous store (it then always comes first).
    pub host: bool,
}

/// A closed round: the nodes of the worker group in node-rank order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Round {
    pub round: u64,
    pub nodes: Vec<NodeInfo>,
    /// Rounds that ended in a failure before this one.
    pub failures: u32,
}

impl Round {
    pub fn world_size(&self) -> u32 {
        self.nodes.iter().map(|n| n.nproc).sum()
    }

    /// This node's rank in the round, if it is a member.
    pub fn node_rank_of(&self, id: u64) -> Option<u32> {
        self.nodes.iter().position(|n| n.id == id).map(|r| r as u32)
    }

    /// The workers' store: node rank 0's address and port.
    pub fn master(&self) -> (&str, u16) {
        let first = &self.nodes[0];
        (&first.addr, first.port)
    }

    pub fn ids(&self) -> Vec<u64> {
        self.nodes.iter().map(|n| n.id).collect()
    }
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
    /// `Ok` when `n` nodes give a world that keeps the global batch, else why not.
    pub feasible: Box<dyn Fn(u32) -> Result<(), String> + Send>,
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
            if let Err(e) = store.set_ephemeral(&alive_key(id), b"1") {
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
        if let Some(done) = parse::<Done>(store.get(DONE)?) {
            return Err(NotJoined::Done(done));
        }
        if let Some(closed) = parse::<Round>(store.get(&key(round, "members"))?) {
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
        if let Some(why) = store.get(&key(round, "waiting"))? {
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
    }
    Ok(())
}

/// Tells the coordinator that node `id`'s group of `round` finished its work (it may then
/// leave without being taken for dead).
pub fn report_finished(store: &mut StoreClient, round: u64, id: u64) -> Result<(), StoreError> {
    store.set(&key(round, &format!("finished/{id}")), b"1")
}

/// Watches `round` for this member on its own connection until `stop` is set: sends
/// [`Event::Regroup`] once when the group must re-form (a member failed, or a newcomer waits).
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
            let mut asked = false;
            while !stop.load(Ordering::Relaxed) {
                // A failure re-forms at once; a waiting node at the next checkpoint (and a
                // failure while waiting for it still at once).
                let seen = (|| -> Result<Option<(String, bool)>, StoreError> {
                    for (what, at_checkpoint) in [("failed", false), ("regroup", true)] {
                        if at_checkpoint && asked {
                            continue;
                        }
                        if let Some(v) = store.get(&key(round, what))? {
                            let reason = String::from_utf8_lossy(&v).into_owned();
                            return Ok(Some((reason, at_checkpoint)));
                        }
                    }
                    Ok(None)
                })();
                match seen {
                    Ok(Some((reason, at_checkpoint))) => {
                        let _ = tx.send(Event::Regroup {
                            round: round as u32,
                            reason,
                            at_checkpoint,
                        });
                        if !at_checkpoint {
                            return;
                        }
                        asked = true;
                    }
                    Ok(None) => std::thread::sleep(POLL),
                    Err(_) => return, // the heartbeat reports a lost store
                }
            }
        })
        .map(|_| ())
}

/// The host's coordinator: forms every round, watches it, ends the job.
pub struct Coordinator {
    store: StoreClient,
    terms: Terms,
    /// Heartbeat counter of each node id and when it last moved.
    beats: HashMap<u64, (i64, Instant)>,
}

/// How a running round ended, as the coordinator sees it.
enum Outcome {
    Finished,
    Failed,
    Regroup,
}

impl Coordinator {
    pub fn new(store: StoreClient, terms: Terms) -> Coordinator {
        Coordinator {
            store,
            terms,
            beats: HashMap::new(),
        }
    }

    /// Runs on its own thread until the job is done (or the store fails).
    pub fn start(mut self) -> std::io::Result<std::thread::JoinHandle<()>> {
        std::thread::Builder::new()
            .name("rendezvous-coordinator".into())
            .spawn(move || {
                if let Err(e) = self.run() {
                    tracing::warn!("elastic rendezvous coordinator stopped: {e}");
                }
            })
    }

    fn run(&mut self) -> Result<(), StoreError> {
        let mut failures = 0u32;
        let mut previous: Vec<u64> = Vec::new();
        for round in 0u64.. {
            self.store
                .set("elastic/open", round.to_string().as_bytes())?;
            let Some(formed) = self.form(round, &previous, failures)? else {
                return Ok(());
            };
            self.store.set(&key(round, "members"), &json(&formed))?;
            previous = formed.ids();
            match self.watch(&formed)? {
                Outcome::Finished => {
                    self.store.set(DONE, &json(&Done::Finished))?;
                    return Ok(());
                }
                Outcome::Failed => {
                    failures += 1;
                    if failures > self.terms.max_restarts {
                        let why = format!(
                            "the worker group failed {failures} time(s), more than --max-restarts {}",
                            self.terms.max_restarts
                        );
                        self.store.set(DONE, &json(&Done::Failed(why)))?;
                        return Ok(());
                    }
                }
                Outcome::Regroup => {}
            }
        }
        Ok(())
    }

    /// Known node ids.
    fn ids(&mut self) -> Result<Vec<u64>, StoreError> {
        let next = counter(self.store.get(NEXT_ID)?).max(0) as u64;
        Ok((0..next).collect())
    }

    /// Reads every heartbeat; returns the ids that are alive: the connection that holds their
    /// ephemeral key is open (a process that died has closed it), and their heartbeat moved
    /// within [`DEAD_AFTER`] (a machine that vanished without closing it).
    fn alive(&mut self) -> Result<Vec<u64>, StoreError> {
        let now = Instant::now();
        let mut alive = Vec::new();
        for id in self.ids()? {
            if self.store.get(&alive_key(id))?.is_none() {
                continue;
            }
            let beat = counter(self.store.get(&heartbeat_key(id))?);
            let entry = self.beats.entry(id).or_insert((beat, now));
            if entry.0 != beat {
                *entry = (beat, now);
            }
            if now.duration_since(entry.1) < DEAD_AFTER {
                alive.push(id);
            }
        }
        Ok(alive)
    }

    fn joined(&mut self, round: u64) -> Result<Vec<NodeInfo>, StoreError> {
        let mut joined = Vec::new();
        for id in self.ids()? {
            if let Some(info) =
                parse::<NodeInfo>(self.store.get(&key(round, &format!("join/{id}")))?)
            {
                joined.push(info);
            }
        }
        // The host first, then by id: node ranks stay put across rounds where they can.
        joined.sort_by_key(|n| (!n.host, n.id));
        Ok(joined)
    }

    /// Waits for the nodes of `round` and closes it; `None` when the job ended instead.
    ///
    /// The first round closes when MAX nodes joined, or a last call after MIN did. A re-formed
    /// round closes once every live node joined (a member still running its group until the
    /// next checkpoint is waited for, and the timeouts start only after it), or a last call
    /// after that. Without a node count that keeps the global batch it waits, saying why,
    /// up to the join timeout.
    fn form(
        &mut self,
        round: u64,
        previous: &[u64],
        failures: u32,
    ) -> Result<Option<Round>, StoreError> {
        let mut opened = Instant::now();
        let mut enough_since: Option<Instant> = None;
        let mut told = String::new();
        loop {
            let alive = self.alive()?;
            let joined = self.joined(round)?;
            let has_joined = |id: &u64| joined.iter().any(|j| j.id == *id);
            let still_running = previous
                .iter()
                .any(|id| alive.contains(id) && !has_joined(id));
            if still_running {
                opened = Instant::now();
                enough_since = None;
            }
            let choice = self.largest_feasible(&joined);
            if let (Ok(n), false) = (&choice, still_running) {
                let since = *enough_since.get_or_insert_with(Instant::now);
                let all_in = !previous.is_empty() && alive.iter().all(has_joined);
                let full = joined.len() as u32 >= self.terms.max;
                if all_in || full || since.elapsed() >= self.terms.last_call {
                    let nodes = joined.into_iter().take(*n as usize).collect();
                    return Ok(Some(Round {
                        round,
                        nodes,
                        failures,
                    }));
                }
            }
            if choice.is_err() {
                enough_since = None;
            }
            if let Err(why) = &choice {
                if *why != told && !still_running && !joined.is_empty() {
                    self.store.set(&key(round, "waiting"), why.as_bytes())?;
                    told = why.clone();
                }
            }
            if opened.elapsed() >= self.terms.join_timeout {
                let why = format!(
                    "no worker group formed within {:.0} s of rendezvous: {}",
                    self.terms.join_timeout.as_secs_f64(),
                    choice.err().unwrap_or_default()
                );
                self.store.set(DONE, &json(&Done::Failed(why)))?;
                return Ok(None);
            }
            std::thread::sleep(POLL);
        }
    }

    /// The most of `joined` (in order, at most MAX, at least MIN) whose world keeps the global
    /// batch, or why none.
    fn largest_feasible(&self, joined: &[NodeInfo]) -> Result<u32, String> {
        let (min, max) = (self.terms.min, self.terms.max);
        let have = (joined.len() as u32).min(max);
        if have < min {
            return Err(format!(
                "waiting for nodes: {} of at least {min} have joined",
                joined.len()
            ));
        }
        let mut reasons = Vec::new();
        for n in (min..=have).rev() {
            match (self.terms.feasible)(n) {
                Ok(()) => return Ok(n),
                Err(why) => reasons.push(format!("{n} node(s): {why}")),
            }
        }
        let works: Vec<String> = (min..=max)
            .filter(|&n| (self.terms.feasible)(n).is_ok())
            .map(|n| n.to_string())
            .collect();
        Err(format!(
            "{} node(s) joined, but no group of them keeps the global batch ({}); waiting for a node count that does: {}",
            joined.len(),
            reasons.join("; "),
            if works.is_empty() { "none in range".to_string() } else { works.join(", ") }
        ))
    }

    /// Until the round's group finishes, fails, or must re-form for a waiting node.
    fn watch(&mut self, formed: &Round) -> Result<Outcome, StoreError> {
        let round = formed.round;
        let members = formed.ids();
        loop {
            if self.store.get(&key(round, "failed"))?.is_some() {
                return Ok(Outcome::Failed);
            }
            let mut finished = Vec::new();
            for id in &members {
                if self
                    .store
                    .get(&key(round, &format!("finished/{id}")))?
                    .is_some()
                {
                    finished.push(*id);
                }
            }
            if finished.len() == members.len() {
                return Ok(Outcome::Finished);
            }
            let alive = self.alive()?;
            let dead = members
                .iter()
                .find(|id| !alive.contains(id) && !finished.contains(id));
            if let Some(dead) = dead {
                let what = format!(
                    "node id {dead} is gone (its launcher ended, or sent no heartbeat for {} s)",
                    DEAD_AFTER.as_secs()
                );
                report_failure(&mut self.store, round, &what)?;
                return Ok(Outcome::Failed);
            }
            let waiting: Vec<NodeInfo> = self
                .joined(round + 1)?
                .into_iter()
                .filter(|n| alive.contains(&n.id) && !members.contains(&n.id))
                .collect();
            let bigger = (members.len() + waiting.len()).min(self.terms.max as usize) as u32;
            if !waiting.is_empty()
                && bigger > members.len() as u32
                && (self.terms.feasible)(bigger).is_ok()
            {
                let ids: Vec<String> = waiting.iter().map(|n| n.id.to_string()).collect();
                let why = format!(
                    "node(s) {} waiting to join: re-forming with {bigger} nodes",
                    ids.join(", ")
                );
                self.store.set(&key(round, "regroup"), why.as_bytes())?;
                return Ok(Outcome::Regroup);
            }
            std::thread::sleep(POLL);
        }
    }
}
