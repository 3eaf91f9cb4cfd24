//! The elastic supervisor (`--nnodes MIN:MAX`): around the supervisor's group runs, it hosts or
//! reaches the rendezvous store, joins each round, runs this node's part of the group the round
//! formed, and on a failure or a newcomer re-forms instead of ending. The job ends when the
//! group finishes, when the coordinator says the restarts are spent, on a signal, or when the
//! host node (its store) is lost — said in one line, with every worker of this node stopped.
//!
//! What a round is and when it closes is the rendezvous module's; what to start, the plan's.

use std::net::{IpAddr, SocketAddr, TcpListener, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::batch::BatchPlan;
use crossbeam_channel::{Receiver, Sender};
use store::{join_host_port, StoreClient, StoreServer};
use tracing::{info, warn};

use crate::output::Sinks;
use crate::plan::Plan;
use crate::rendezvous::{self, Coordinator, Done, NodeInfo, NotJoined, Round, Terms};
use crate::supervisor::{self, Event, GroupEnd};
use crate::watchdog::Watchdog;

/// How long the host keeps its store up after its own group finished, for the other nodes to
/// report and the waiting ones to hear that the job is done.
const HOST_LINGER: Duration = Duration::from_secs(30);
/// How long a launcher whose workers stopped for another node's rank waits for the coordinator
/// to name that node before it reports its own failure.
const PEER_NAMED_WITHIN: Duration = Duration::from_millis(500);

/// Whether `worker` stopped because a rank of another node ended first (its last line says so).
fn stopped_for_peer(worker: &crate::report::WorkerRecord) -> bool {
    worker
        .stderr_tail
        .last()
        .is_some_and(|line| line.starts_with(common::env_contract::STOPPED_FOR_PEER))
}

/// The store, hosted here or reached, and what the job needs from it.
struct Rendezvous {
    addr: String,
    run_id: String,
    timeout: Duration,
    /// Kept alive for as long as the job runs on this node.
    server: Option<StoreServer>,
    coordinator: Option<std::thread::JoinHandle<()>>,
    store: StoreClient,
}

impl Rendezvous {
    /// Hosts the store when this node can bind the endpoint (the first launcher there does),
    /// else connects to it.
    fn open(plan: &Plan, events: &Sender<Event>) -> Result<(Rendezvous, NodeInfo), String> {
        let elastic = plan.shape.elastic.as_ref().ok_or("not an elastic job")?;
        let (host, port) = elastic.endpoint.value.clone();
        let addr = join_host_port(&host, port);
        let server =
            local_endpoint(&host, port).and_then(|at| StoreServer::start(at, &plan.run_id).ok());
        let timeout = elastic.join_timeout.value;
        let job = plan.job_terms();
        let connect = || connect_to_store(&addr, &plan.run_id, timeout).map_err(|e| e.to_string());
        let mut store = connect()?;
        let coordinator = match &server {
            Some(server) => {
                info!(
                    "elastic job: this node hosts the rendezvous store on {} ({}..{} nodes); the job ends if this node is lost",
                    server.local_addr(),
                    elastic.min,
                    elastic.max
                );
                let spec = plan.config.as_ref().map(|t| t.config.batch.clone());
                let terms = Terms {
                    min: elastic.min,
                    max: elastic.max,
                    last_call: elastic.last_call.value,
                    join_timeout: timeout,
                    max_restarts: plan.max_restarts,
                    feasible: Box::new(move |world| {
                        crate::plan::feasible_world(spec.as_ref(), world)
                    }),
                    job: job.clone(),
                };
                let handle = Coordinator::new(connect()?, terms)
                    .start()
                    .map_err(|e| format!("cannot start the rendezvous coordinator: {e}"))?;
                Some(handle)
            }
            None => None,
        };
        let id = rendezvous::take_id(&mut store).map_err(|e| e.to_string())?;
        rendezvous::publish_terms(&mut store, id, &job).map_err(|e| e.to_string())?;
        rendezvous::start_heartbeat(connect()?, id, events.clone())
            .map_err(|e| format!("cannot start the heartbeat thread: {e}"))?;
        let node = NodeInfo {
            id,
            addr: plan.local_addr.clone(),
            nproc: plan.nproc,
            port: 0,
            host: server.is_some(),
            terms: common::job_terms::digest(&job),
            hostname: nix::unistd::gethostname()
                .map(|h| h.to_string_lossy().into_owned())
                .unwrap_or_default(),
        };
        let rdzv = Rendezvous {
            addr,
            run_id: plan.run_id.clone(),
            timeout,
            server,
            coordinator,
            store,
        };
        Ok((rdzv, node))
    }

    fn connect(&self) -> Result<StoreClient, String> {
        connect_to_store(&self.addr, &self.run_id, self.timeout).map_err(|e| e.to_string())
    }

    /// The message for a lost store: which node it was on, and that the job cannot go on.
    fn lost(&self, why: &str) -> String {
        format!(
            "lost the rendezvous store at {} ({why}): the node that hosts it is gone, and an elastic job cannot go on without it; this node's workers were stopped",
            self.addr
        )
    }
}

/// Runs an elastic job on this node; returns the launcher's exit code.
pub fn run(plan: &Plan, mut watchdog: Watchdog, events: (Sender<Event>, Receiver<Event>)) -> i32 {
    let code = match open_interruptibly(plan, &events) {
        Ok(Ok((mut rdzv, node))) => run_rounds(plan, &mut rdzv, node, &mut watchdog, &events),
        Ok(Err(e)) => {
            warn!("elastic rendezvous: {e}");
            1
        }
        Err(signal) => {
            let endpoint = plan
                .shape
                .elastic
                .as_ref()
                .map(|e| e.endpoint.value.clone());
            let (host, port) = endpoint.unwrap_or_default();
            warn!(
                "stopped by {} while reaching the rendezvous store at {}: nothing was started; exit code {}",
                crate::report::signal_name(signal),
                join_host_port(&host, port),
                128 + signal
            );
            128 + signal
        }
    };
    watchdog.report_peaks();
    watchdog.disarm();
    code
}

/// [`Rendezvous::open`], ended at once by a signal (`Err(signal)`) however long the store
/// takes to connect or answer (a listener that accepts and stays silent, a store still
/// starting).
fn open_interruptibly(
    plan: &Plan,
    events: &(Sender<Event>, Receiver<Event>),
) -> Result<Result<(Rendezvous, NodeInfo), String>, i32> {
    let (plan_copy, tx) = (plan.clone(), events.0.clone());
    match until_signal(events, move || Rendezvous::open(&plan_copy, &tx)) {
        Waited::Done(opened) => Ok(opened.unwrap_or_else(|e| Err(e.to_string()))),
        Waited::Signal(signal) => Err(signal),
        Waited::StoreLost(why) => Ok(Err(why)),
    }
}

/// How [`until_signal`] ended.
enum Waited<T> {
    Done(std::io::Result<T>),
    Signal(i32),
    /// The heartbeat found the store gone: waiting on is pointless.
    StoreLost(String),
}

/// Runs `work` on its own thread and waits for it, for a signal, or for the heartbeat to find
/// the store gone (the thread is then left to end with the process). Other events (stale ones
/// of the last group run) are dropped.
fn until_signal<T: Send + 'static>(
    events: &(Sender<Event>, Receiver<Event>),
    work: impl FnOnce() -> T + Send + 'static,
) -> Waited<T> {
    let (done_tx, done_rx) = crossbeam_channel::bounded(1);
    let spawned = std::thread::Builder::new()
        .name("rendezvous-wait".into())
        .spawn(move || {
            let _ = done_tx.send(work());
        });
    if let Err(e) = spawned {
        return Waited::Done(Err(e));
    }
    loop {
        crossbeam_channel::select! {
            recv(done_rx) -> done => {
                let done = done.map_err(|_| std::io::Error::other("the rendezvous thread ended"));
                return Waited::Done(done);
            }
            recv(events.1) -> event => match event {
                Ok(Event::Signal(signal)) => return Waited::Signal(signal),
                Ok(Event::StoreLost(why)) => return Waited::StoreLost(why),
                _ => {}
            },
        }
    }
}

fn run_rounds(
    plan: &Plan,
    rdzv: &mut Rendezvous,
    mut node: NodeInfo,
    watchdog: &mut Watchdog,
    events: &(Sender<Event>, Receiver<Event>),
) -> i32 {
    let sinks = Sinks::new(plan.world_size.max(plan.nnodes * plan.nproc));
    let mut after = None;
    let mut last_failure: Option<(Plan, Vec<supervisor::WorkerRecord>, usize)> = None;
    loop {
        node.port = match free_port(&node.addr) {
            Ok(port) => port,
            Err(e) => {
                warn!("cannot find a free port on {}: {e}", node.addr);
                return 1;
            }
        };
        let round = match join(rdzv, &node, after, events) {
            Ok(round) => round,
            Err(code) => return finish_failed(code, last_failure.as_ref()),
        };
        let round_plan = match plan.for_round(&round, node.id) {
            Ok(p) => p,
            Err(e) => {
                warn!("round {}: {e}", round.round);
                return 1;
            }
        };
        let previous = round.previous_world.map(|world| {
            let batch = plan
                .config
                .as_ref()
                .and_then(|t| t.config.batch.resolve_elastic(u64::from(world)).ok());
            (world, batch)
        });
        announce(&round, &round_plan, previous);
        let stop = Arc::new(AtomicBool::new(false));
        let monitor = rdzv.connect().and_then(|store| {
            rendezvous::start_monitor(store, round.round, events.0.clone(), stop.clone())
                .map_err(|e| e.to_string())
        });
        if let Err(e) = monitor {
            warn!("cannot watch the rendezvous: {e}");
            return 1;
        }
        let end = supervisor::run_once(&round_plan, round.round as u32, &sinks, watchdog, events);
        stop.store(true, Ordering::Relaxed);
        after = Some(round.round);
        match end {
            GroupEnd::Success => return finished(rdzv, round.round, node.id),
            GroupEnd::Interrupted { signal } => return crate::report::interrupted(signal),
            GroupEnd::SpawnFailed { code } => return code,
            GroupEnd::Stopped => return crate::report::stopped_at_checkpoint(),
            GroupEnd::StoreLost { why } => {
                warn!("{}", rdzv.lost(&why));
                return 1;
            }
            GroupEnd::Regroup { reason } => {
                info!("round {}: {reason}; re-forming the group", round.round);
            }
            GroupEnd::Failed {
                records,
                root,
                interrupted,
            } => {
                if let Some(signal) = interrupted {
                    return crate::report::interrupted(signal);
                }
                let r = &records[root];
                if stopped_for_peer(r) {
                    // A rank of another node ended first: the coordinator, which sees that node's
                    // launcher gone, names it in a moment (its pass is every 100 ms).
                    if let Ok(Some(why)) =
                        rendezvous::wait_failure(&mut rdzv.store, round.round, PEER_NAMED_WITHIN)
                    {
                        info!("round {}: {why}; re-forming the group", round.round);
                        last_failure = Some((round_plan, records, root));
                        continue;
                    }
                }
                let what = format!("rank {} (node id {}) failed: {}", r.rank, node.id, r.ending);
                warn!("{what}; re-forming the group");
                if let Err(e) = rendezvous::report_failure(&mut rdzv.store, round.round, &what) {
                    warn!("{}", rdzv.lost(&e.to_string()));
                    return supervisor::report_failure(&round_plan, &records, root, 1);
                }
                last_failure = Some((round_plan, records, root));
            }
        }
    }
}

/// Joins the next round on a connection of its own, so that a signal ends the wait at once
/// even while a store that stopped answering holds a request; the exit code when the job
/// ended for this node instead.
fn join(
    rdzv: &mut Rendezvous,
    node: &NodeInfo,
    after: Option<u64>,
    events: &(Sender<Event>, Receiver<Event>),
) -> Result<Round, Result<i32, String>> {
    let (addr, run_id, timeout, info) = (
        rdzv.addr.clone(),
        rdzv.run_id.clone(),
        rdzv.timeout,
        node.clone(),
    );
    let joined = until_signal(events, move || {
        let mut store = connect_to_store(&addr, &run_id, timeout).map_err(NotJoined::Store)?;
        let mut say = |line: String| info!("{line}");
        rendezvous::join(&mut store, &info, after, &mut say, &mut || None)
    });
    let joined = match joined {
        Waited::Done(Ok(joined)) => joined,
        Waited::Done(Err(e)) => {
            warn!("cannot wait for the rendezvous: {e}");
            return Err(Ok(1));
        }
        Waited::Signal(sig) => return Err(Ok(crate::report::interrupted(sig))),
        Waited::StoreLost(why) => {
            warn!("{}", rdzv.lost(&why));
            return Err(Ok(1));
        }
    };
    match joined {
        Ok(round) => Ok(round),
        Err(NotJoined::Signal(sig)) => Err(Ok(crate::report::interrupted(sig))),
        Err(NotJoined::Done(Done::Finished)) => {
            match after {
                Some(round) => info!(
                    "the job finished without this node (it left the group after round {round}); nothing left to do here"
                ),
                None => info!("the job finished before this node could join it"),
            }
            Err(Ok(0))
        }
        Err(NotJoined::Done(Done::Failed(why))) => {
            say_history(&mut rdzv.store);
            Err(Err(why))
        }
        Err(NotJoined::Refused(line)) => {
            warn!("{line}; start it with the job's config, data and worker build");
            Err(Ok(2))
        }
        Err(NotJoined::Store(e)) => {
            warn!("{}", rdzv.lost(&e.to_string()));
            Err(Ok(1))
        }
    }
}

/// The job ended without this node running: 0 or a code as said, or a failure (`Err`) with the
/// last failure's report.
fn finish_failed(
    outcome: Result<i32, String>,
    last: Option<&(Plan, Vec<supervisor::WorkerRecord>, usize)>,
) -> i32 {
    match outcome {
        Ok(code) => code,
        Err(why) => {
            warn!("elastic job failed: {why}");
            match last {
                Some((plan, records, root)) => supervisor::report_failure(plan, records, *root, 1),
                None => 1,
            }
        }
    }
}

/// This node's group finished: tell the coordinator; the host waits for it to close the job.
fn finished(rdzv: &mut Rendezvous, round: u64, id: u64) -> i32 {
    if let Err(e) = rendezvous::report_finished(&mut rdzv.store, round, id) {
        // Finished here; the host may already be gone after finishing too.
        tracing::debug!("could not report the finish: {e}");
    }
    if let Some(coordinator) = rdzv.coordinator.take() {
        linger(rdzv, &coordinator, id);
    }
    drop(rdzv.server.take());
    0
}

/// The host, done: keeps the store up until the coordinator closed the job and every other
/// launcher has heard it and left (a node dropped while stopped learns the job finished
/// without it, instead of finding the store gone), at most [`HOST_LINGER`].
fn linger(rdzv: &mut Rendezvous, coordinator: &std::thread::JoinHandle<()>, id: u64) {
    let deadline = std::time::Instant::now() + HOST_LINGER;
    let others = |rdzv: &mut Rendezvous| rendezvous::others_connected(&mut rdzv.store, id);
    while std::time::Instant::now() < deadline
        && (!coordinator.is_finished() || others(rdzv).is_ok_and(|n| n > 0))
    {
        std::thread::sleep(Duration::from_millis(50));
    }
    if !coordinator.is_finished() {
        warn!(
            "other nodes did not report their finish within {} s; closing the rendezvous store",
            HOST_LINGER.as_secs()
        );
    } else if let Ok(n @ 1..) = others(rdzv) {
        warn!(
            "{n} other node(s) still connected {} s after the job finished; closing the rendezvous store",
            HOST_LINGER.as_secs()
        );
    }
    let rounds = rendezvous::history(&mut rdzv.store);
    if rounds.len() > 1 {
        info!("the job's rounds: {}", rounds.join("; "));
    }
}

/// The job's rounds and how each ended, in one line (on a failure).
fn say_history(store: &mut StoreClient) {
    let rounds = rendezvous::history(store);
    if !rounds.is_empty() {
        warn!("the job's rounds: {}", rounds.join("; "));
    }
}

fn announce(round: &Round, plan: &Plan, previous: Option<(u32, Option<BatchPlan>)>) {
    let first = plan.first_rank;
    let ids: Vec<String> = round.nodes.iter().map(|n| n.id.to_string()).collect();
    let counts: Vec<String> = round.nodes.iter().map(|n| n.nproc.to_string()).collect();
    let processes = if counts.iter().all(|c| *c == counts[0]) {
        format!("x {} process(es)", counts[0])
    } else {
        format!("with {} process(es)", counts.join(" + "))
    };
    info!(
        "round {}: {} node(s) (ids {}) {processes}, {}; this node is node rank {} (ranks {}..{})",
        round.round,
        round.nodes.len(),
        ids.join(", "),
        plan.round_change(previous),
        plan.node_rank,
        first,
        first + plan.nproc - 1
    );
}

/// A connection to the rendezvous store whose requests give up after
/// [`rendezvous::HOST_SILENT_AFTER`]: a store host that stops answering (a cut link) is taken
/// for lost in seconds, wherever this node is waiting on it.
fn connect_to_store(
    addr: &str,
    run_id: &str,
    timeout: Duration,
) -> Result<StoreClient, store::StoreError> {
    let mut store = StoreClient::connect(addr, run_id, timeout)?;
    store.set_io_timeout(rendezvous::HOST_SILENT_AFTER)?;
    Ok(store)
}

/// The endpoint's socket address when `host` is an address of this machine (binding tells).
fn local_endpoint(host: &str, port: u16) -> Option<SocketAddr> {
    let addrs: Vec<SocketAddr> = (host, port).to_socket_addrs().ok()?.collect();
    let at = addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()?;
    // Only try to host where the address is ours: binding elsewhere fails anyway.
    TcpListener::bind(SocketAddr::new(at.ip(), 0)).ok()?;
    Some(at)
}

/// A port that is free on `addr` now (the workers' store binds it if this node is node rank 0).
fn free_port(addr: &str) -> std::io::Result<u16> {
    let ip = (addr, 0)
        .to_socket_addrs()?
        .map(|a| a.ip())
        .find(IpAddr::is_ipv4)
        .unwrap_or(IpAddr::from([0, 0, 0, 0]));
    let listener = TcpListener::bind(SocketAddr::new(ip, 0))
        .or_else(|_| TcpListener::bind(SocketAddr::new(IpAddr::from([0, 0, 0, 0]), 0)))?;
    Ok(listener.local_addr()?.port())
}
