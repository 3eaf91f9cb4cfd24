//! The host's coordinator: the one writer of rounds. It admits nodes (live ones whose job
//! terms are the host's), forms each round, watches it, counts every failure once against
//! `--max-restarts`, keeps the history of rounds, and ends the job. It starts no processes.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use common::job_terms;
use store::{StoreClient, StoreError};

use super::{
    alive_key, counter, heartbeat_key, json, key, parse, refused_key, report_failure, terms_key,
    Done, NodeInfo, Round, RoundEnd, Terms, DEAD_AFTER, DONE, HISTORY, NEXT_ID, POLL,
};

/// How many differing keys a refusal names before "and N more" (and node counts a waiting
/// line explains).
const NAMED_KEYS: usize = 8;

/// The host's coordinator: forms every round, watches it, ends the job.
pub struct Coordinator {
    store: StoreClient,
    terms: Terms,
    /// Digest of the host's job terms.
    digest: String,
    /// Heartbeat counter of each node id and when it last moved.
    beats: HashMap<u64, (i64, Instant)>,
    /// Nodes refused for other terms (never admitted, never read again).
    refused: HashSet<u64>,
    /// Failures counted against `--max-restarts`, and the rounds they ended.
    failures: u32,
    failed_rounds: HashSet<u64>,
    history: Vec<RoundEnd>,
}

/// How a running round ended, as the coordinator sees it.
enum Outcome {
    Finished,
    Failed(String),
    Regroup(String),
}

impl Coordinator {
    pub fn new(store: StoreClient, terms: Terms) -> Coordinator {
        let digest = job_terms::digest(&terms.job);
        Coordinator {
            store,
            terms,
            digest,
            beats: HashMap::new(),
            refused: HashSet::new(),
            failures: 0,
            failed_rounds: HashSet::new(),
            history: Vec::new(),
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
        let mut previous: Option<Round> = None;
        for round in 0u64.. {
            self.store
                .set("elastic/open", round.to_string().as_bytes())?;
            let Some(formed) = self.form(round, previous.as_ref())? else {
                return Ok(());
            };
            self.store.set(&key(round, "members"), &json(&formed))?;
            let outcome = self.watch(&formed)?;
            match outcome {
                Outcome::Finished => {
                    self.ended(&formed, "finished".into())?;
                    self.store.set(DONE, &json(&Done::Finished))?;
                    return Ok(());
                }
                Outcome::Failed(why) => {
                    if self.count_failure(&formed, why)? {
                        return Ok(());
                    }
                }
                Outcome::Regroup(why) => self.ended(&formed, why)?,
            }
            previous = Some(formed);
        }
        Ok(())
    }

    /// Records how `round` ended in `elastic/history`.
    fn ended(&mut self, round: &Round, ended: String) -> Result<(), StoreError> {
        self.history.push(RoundEnd {
            round: round.round,
            ids: round.ids(),
            world: round.world_size(),
            ended,
        });
        self.store.set(HISTORY, &json(&self.history))
    }

    /// Counts the failure of `round` (once, whenever it is seen); `true` when that spent the
    /// restarts and the job was ended.
    fn count_failure(&mut self, round: &Round, why: String) -> Result<bool, StoreError> {
        if !self.failed_rounds.insert(round.round) {
            return Ok(false);
        }
        self.failures += 1;
        self.ended(round, format!("failed: {why}"))?;
        if self.failures <= self.terms.max_restarts {
            return Ok(false);
        }
        let why = format!(
            "the worker group failed {} time(s), more than --max-restarts {}",
            self.failures, self.terms.max_restarts
        );
        self.store.set(DONE, &json(&Done::Failed(why)))?;
        Ok(true)
    }

    /// Known node ids.
    fn ids(&mut self) -> Result<Vec<u64>, StoreError> {
        let next = counter(self.store.get(NEXT_ID)?).max(0) as u64;
        Ok((0..next).collect())
    }

    /// Reads every heartbeat (one request for all nodes); returns the ids that are alive: the
    /// connection that holds their ephemeral key is open (a process that died has closed it),
    /// and their heartbeat moved within [`DEAD_AFTER`] (a machine that vanished without closing
    /// it).
    fn alive(&mut self) -> Result<Vec<u64>, StoreError> {
        let now = Instant::now();
        let ids: Vec<u64> = self
            .ids()?
            .into_iter()
            .filter(|id| !self.refused.contains(id))
            .collect();
        let keys: Vec<String> = ids
            .iter()
            .flat_map(|&id| [alive_key(id), heartbeat_key(id)])
            .collect();
        let values = self.get_many(&keys)?;
        let mut alive = Vec::new();
        for (&id, pair) in ids.iter().zip(values.chunks(2)) {
            let [holder, beat] = pair else { continue };
            if holder.is_none() {
                continue;
            }
            let beat = counter(beat.clone());
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

    /// The live nodes that joined `round` with the job's terms, the host first, then by id
    /// (node ranks stay put across rounds where they can). A joiner with other terms is
    /// refused here, once, before any round can take it.
    fn joined(&mut self, round: u64, alive: &[u64]) -> Result<Vec<NodeInfo>, StoreError> {
        let keys: Vec<String> = alive
            .iter()
            .map(|id| key(round, &format!("join/{id}")))
            .collect();
        let mut joined = Vec::new();
        for entry in self.get_many(&keys)? {
            let Some(info) = parse::<NodeInfo>(entry) else {
                continue;
            };
            if info.terms != self.digest {
                self.refuse(&info)?;
                continue;
            }
            joined.push(info);
        }
        joined.sort_by_key(|n| (!n.host, n.id));
        Ok(joined)
    }

    /// Refuses `node`: the keys that differ, both values, for it to report and leave on.
    fn refuse(&mut self, node: &NodeInfo) -> Result<(), StoreError> {
        let theirs: Option<job_terms::Terms> = parse(self.store.get(&terms_key(node.id))?);
        let why = match theirs {
            Some(theirs) => job_terms::describe_difference(
                &theirs,
                &self.terms.job,
                NAMED_KEYS,
                ("here", "in the job"),
            ),
            None => "its job terms could not be read".to_string(),
        };
        let line = format!(
            "node id {} ({}) is not admitted: its settings differ from the job's: {why}",
            node.id, node.addr
        );
        tracing::warn!("{line}");
        self.store.set(&refused_key(node.id), line.as_bytes())?;
        self.refused.insert(node.id);
        Ok(())
    }

    /// Waits for the nodes of `round` and closes it; `None` when the job ended instead.
    ///
    /// The first round closes when MAX nodes joined, or a last call after MIN did. A re-formed
    /// round closes once every live node joined (a member still running its group until the
    /// next checkpoint is waited for, and the timeouts start only after it), or a last call
    /// after that. Without a node count that keeps the global batch it waits, saying why,
    /// up to the join timeout. A member of the previous round that fails meanwhile is counted.
    fn form(&mut self, round: u64, previous: Option<&Round>) -> Result<Option<Round>, StoreError> {
        let members = previous.map(Round::ids).unwrap_or_default();
        let mut opened = Instant::now();
        let mut enough_since: Option<Instant> = None;
        let mut told = String::new();
        loop {
            let alive = self.alive()?;
            let joined = self.joined(round, &alive)?;
            if let Some(previous) = previous {
                let finished = self.finished(previous)?;
                if finished.len() == previous.nodes.len() {
                    // The group reached its end before the checkpoint it was asked to stop at.
                    self.ended(previous, "finished".into())?;
                    self.store.set(DONE, &json(&Done::Finished))?;
                    return Ok(None);
                }
                if self.previous_failed(previous, &alive, &joined, &finished)? {
                    return Ok(None);
                }
            }
            let has_joined = |id: &u64| joined.iter().any(|j| j.id == *id);
            let still_running = members
                .iter()
                .any(|id| alive.contains(id) && !has_joined(id));
            if still_running {
                opened = Instant::now();
                enough_since = None;
            }
            let choice = self.largest_feasible(&joined);
            if let (Ok(n), false) = (&choice, still_running) {
                let since = *enough_since.get_or_insert_with(Instant::now);
                let all_in = !members.is_empty() && alive.iter().all(has_joined);
                let full = joined.len() as u32 >= self.terms.max;
                if all_in || full || since.elapsed() >= self.terms.last_call {
                    let nodes = joined.into_iter().take(*n as usize).collect();
                    return Ok(Some(Round {
                        round,
                        nodes,
                        failures: self.failures,
                        previous_world: previous.map(Round::world_size),
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

    /// Counts a failure of the `previous` round that happens while the next one forms: a
    /// member that reports one, or one that is gone without joining. `true` when that spent
    /// the restarts (the job is ended).
    fn previous_failed(
        &mut self,
        previous: &Round,
        alive: &[u64],
        joined: &[NodeInfo],
        finished: &[u64],
    ) -> Result<bool, StoreError> {
        if self.failed_rounds.contains(&previous.round) {
            return Ok(false);
        }
        let mut why = self
            .store
            .get(&key(previous.round, "failed"))?
            .map(|w| String::from_utf8_lossy(&w).into_owned());
        let gone = previous.ids().into_iter().find(|id| {
            !alive.contains(id) && !finished.contains(id) && !joined.iter().any(|j| j.id == *id)
        });
        if let (None, Some(gone)) = (&why, gone) {
            let what = format!(
                "{} is gone (its launcher ended, or sent no heartbeat for {} s) while the group re-formed",
                previous.describe(gone),
                DEAD_AFTER.as_secs()
            );
            report_failure(&mut self.store, previous.round, &what)?;
            why = Some(what);
        }
        match why {
            Some(why) => self.count_failure(previous, why),
            None => Ok(false),
        }
    }

    /// The most of `joined` (in order, at most MAX, at least MIN) whose world keeps the global
    /// batch, or why none. Nodes may run different numbers of processes: the world is theirs.
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
            let world = world_of(&joined[..n as usize]);
            match (self.terms.feasible)(world) {
                Ok(()) => return Ok(n),
                Err(why) if reasons.len() < NAMED_KEYS => {
                    reasons.push(format!("{n} node(s), world {world}: {why}"))
                }
                Err(_) => {}
            }
        }
        // Counts that would do, taking nodes yet to come to run as many processes as the host.
        let each = joined.first().map_or(1, |n| n.nproc);
        let works = crate::plan::list_counts((min..=max).filter(|&n| {
            let known = &joined[..(n as usize).min(joined.len())];
            let more = n.saturating_sub(known.len() as u32);
            (self.terms.feasible)(world_of(known) + more * each).is_ok()
        }));
        Err(format!(
            "{} node(s) joined, but no group of them keeps the global batch ({}); waiting for a node count that does: {works}",
            joined.len(),
            reasons.join("; "),
        ))
    }

    /// Until the round's group finishes, fails, or must re-form for a waiting node.
    fn watch(&mut self, formed: &Round) -> Result<Outcome, StoreError> {
        let round = formed.round;
        let members = formed.ids();
        loop {
            if let Some(why) = self.store.get(&key(round, "failed"))? {
                return Ok(Outcome::Failed(String::from_utf8_lossy(&why).into_owned()));
            }
            let finished = self.finished(formed)?;
            if finished.len() == members.len() {
                return Ok(Outcome::Finished);
            }
            let alive = self.alive()?;
            let dead = members
                .iter()
                .find(|id| !alive.contains(id) && !finished.contains(id));
            if let Some(dead) = dead {
                let what = format!(
                    "{} is gone (its launcher ended, or sent no heartbeat for {} s)",
                    formed.describe(*dead),
                    DEAD_AFTER.as_secs()
                );
                report_failure(&mut self.store, round, &what)?;
                return Ok(Outcome::Failed(what));
            }
            if let Some(why) = self.newcomers(formed, &alive)? {
                self.store.set(&key(round, "regroup"), why.as_bytes())?;
                self.store.set(&key(round, "end"), b"regroup")?;
                return Ok(Outcome::Regroup(why));
            }
            std::thread::sleep(POLL);
        }
    }

    /// The members of `round` whose group finished its work.
    fn finished(&mut self, round: &Round) -> Result<Vec<u64>, StoreError> {
        let ids = round.ids();
        let keys: Vec<String> = ids
            .iter()
            .map(|id| key(round.round, &format!("finished/{id}")))
            .collect();
        let done = self.get_many(&keys)?;
        Ok(ids
            .into_iter()
            .zip(done)
            .filter_map(|(id, done)| done.map(|_| id))
            .collect())
    }

    /// [`StoreClient::get_many`] of owned keys.
    fn get_many(&mut self, keys: &[String]) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        self.store.get_many(&keys)
    }

    /// Why the running `formed` round should re-form for live nodes waiting in the next one,
    /// if a bigger group of them keeps the global batch.
    fn newcomers(&mut self, formed: &Round, alive: &[u64]) -> Result<Option<String>, StoreError> {
        let members = formed.ids();
        let waiting: Vec<NodeInfo> = self
            .joined(formed.round + 1, alive)?
            .into_iter()
            .filter(|n| !members.contains(&n.id))
            .collect();
        let room = (self.terms.max as usize).saturating_sub(members.len());
        let taken = &waiting[..waiting.len().min(room)];
        if taken.is_empty() {
            return Ok(None);
        }
        let world = formed.world_size() + world_of(taken);
        if (self.terms.feasible)(world).is_err() {
            return Ok(None);
        }
        let ids: Vec<String> = taken.iter().map(|n| n.id.to_string()).collect();
        Ok(Some(format!(
            "node(s) {} waiting to join: re-forming with {} nodes",
            ids.join(", "),
            members.len() + taken.len()
        )))
    }
}

/// The processes of `nodes` together.
fn world_of(nodes: &[NodeInfo]) -> u32 {
    nodes.iter().map(|n| n.nproc).sum()
}
