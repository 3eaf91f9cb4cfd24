//! `control-plane-bench launchers`: M simulated elastic launchers (`launch --nnodes MIN:MAX`
//! nodes that are not the host) against a real host `launch`'s rendezvous store and its
//! coordinator (`launcher/src/rendezvous/coordinator.rs`), in one process with a few threads.
//!
//! The launcher crate is a binary, so its side of the protocol is re-coded here, request for
//! request, with its keys, its cadence and its value shapes (`launcher/src/rendezvous.rs`,
//! `launcher/src/elastic.rs`, `launcher/src/round.rs`); change both together. Per simulated
//! launcher, as the real one:
//!
//! | step | real function | connection | requests |
//! |------|---------------|------------|----------|
//! | start | `elastic::Rendezvous::open` | main (kept) | connect; `add elastic/next_id 1` (`take_id`); `set elastic/terms/<id>` (`publish_terms`) |
//! | beat | `rendezvous::start_heartbeat` | heartbeat (kept) | connect; `set_ephemeral elastic/alive/<id> 1`; then `add elastic/hb/<id> 1` every [`BEAT`] (after the previous one) |
//! | join | `elastic::join` -> `rendezvous::join` | one per join (closed when a round takes it) | connect; `get elastic/open` (first join only); `set elastic/r<r>/join/<id>` (NodeInfo JSON); then every [`POLL`] one `get_many [elastic/done, elastic/refused/<id>, elastic/r<r>/members, elastic/r<r>/waiting]` |
//! | run | `rendezvous::start_monitor` | one per round (closed when it ends) | connect; `wait [elastic/r<r>/end]` in windows of [`MONITOR_WAIT`] (after a regroup: `wait [elastic/r<r>/failed]`); when it is there, `get_many [elastic/r<r>/failed, elastic/r<r>/regroup]` |
//!
//! The start, heartbeats and join polls of every launcher are driven by a few threads (each
//! owning a share of the launchers and running their due actions). The monitor parks a `wait`
//! at the store and the store's client blocks in it, so each running launcher's monitor is a
//! thread of its own (small stack), as in the real launcher: it costs one wake-up per
//! [`MONITOR_WAIT`].
//!
//! A simulated node "runs" a round that takes it by heartbeating and monitoring only (its
//! workers are imaginary); on `failed` or `regroup` of that round it joins the next one at once
//! (a plain command's group stops at once, `supervisor.rs`), and on `elastic/done` it exits
//! (every connection closed). Its job terms and its NodeInfo are the host's (read before the
//! start line: `elastic/terms/<host id>` and the `terms` digest of the host's join entry) but
//! for its own fields (id, address 127.2.x.y, host name, port, `host: false`), so the real
//! coordinator admits it.
//!
//! ```text
//! control-plane-bench launchers --addr 127.0.0.1:P --run-id ID --count M --threads T
//! ```
//!
//! Prints `ready` once it found the host; then reads commands on stdin, one a line:
//!
//! - `go`: every launcher starts (prints `started <unix s>`);
//! - `kill`: one simulated launcher dies as soon as one runs a round (at once in a running
//!   round): every connection from its address is shut down at once (its monitor's too, parked
//!   in a wait), as a process death closes them (prints `killed <node id> <unix s>`);
//! - `stats`: prints `stats <requests so far> <latest lateness ms> <unix s>`, where the
//!   lateness is how far behind its due time the latest action ran since the last `stats` (it
//!   shows whether the simulator keeps the real cadence);
//! - EOF: every connection is closed; prints one line of JSON and exits.
//!
//! An observer connection of its own waits for each round's `elastic/r<k>/members` and then
//! its `elastic/r<k>/failed` and prints `round <k> members <n> <unix s>` and
//! `round <k> failed <unix s>`; when every live simulated launcher has written its join entry
//! of round k, it prints `joined <k> <n> <unix s>` (the simulator's share of forming it). A
//! store error of a simulated launcher is one line on stderr (it then exits, as a real one that
//! lost its store does) and is counted in the JSON.

use std::collections::HashMap;
use std::io::{self, BufRead};
use std::net::{IpAddr, Ipv4Addr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use store::{StoreClient, StoreError};

/// `rendezvous.rs`'s `POLL`: how often the join loop looks at the store.
pub const POLL: Duration = Duration::from_millis(100);
/// `rendezvous.rs`'s `MONITOR_WAIT`: how long a member's monitor waits for its round's end
/// before it looks at its stop flag.
pub const MONITOR_WAIT: Duration = Duration::from_secs(5);
/// The stack of a monitor thread (it only waits and reads two keys).
const MONITOR_STACK: usize = 128 * 1024;
/// `rendezvous.rs`'s `BEAT`: how often a launcher beats.
pub const BEAT: Duration = Duration::from_millis(500);
/// `rendezvous.rs`'s `HOST_SILENT_AFTER`: every launcher connection's request timeout.
const HOST_SILENT_AFTER: Duration = Duration::from_secs(5);
/// The connect deadline (the real one is the join timeout, 900 s by default).
const CONNECT_DEADLINE: Duration = Duration::from_secs(60);
/// The longest a driving thread sleeps before it looks at the `kill` and stop flags.
const TICK: Duration = Duration::from_millis(5);
/// How long `ready` waits for the host to have joined round 0.
const HOST_WAIT: Duration = Duration::from_secs(60);

const NEXT_ID: &str = "elastic/next_id";
const DONE: &str = "elastic/done";
const OPEN: &str = "elastic/open";

/// `round.rs`'s `NodeInfo`, field for field (same JSON).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeInfo {
    pub id: u64,
    pub addr: String,
    pub nproc: u32,
    pub port: u16,
    pub host: bool,
    #[serde(default)]
    pub terms: String,
    #[serde(default)]
    pub hostname: String,
}

/// The part of `round.rs`'s `Round` that a launcher reads: its nodes.
#[derive(Debug, Deserialize)]
struct Round {
    nodes: Vec<NodeInfo>,
}

fn key(round: u64, what: &str) -> String {
    format!("elastic/r{round}/{what}")
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The loopback address simulated launcher `i` connects from: 127.2.x.y (i + 1 = x * 256 + y).
fn launcher_ip(i: u32) -> IpAddr {
    let n = i + 1;
    IpAddr::V4(Ipv4Addr::new(127, 2, (n >> 8) as u8, n as u8))
}

/// What every simulated launcher shares: the store, and what it copies from the host.
struct Job {
    addr: String,
    run_id: String,
    /// The host's `elastic/terms/<id>`, as published.
    terms: Vec<u8>,
    /// The host's NodeInfo (its digest and process count are copied).
    host: NodeInfo,
    /// M.
    count: u32,
    /// Simulated launchers killed so far.
    killed: AtomicU64,
    /// How many simulated launchers have written their join entry of each round.
    joins: Mutex<HashMap<u64, u64>>,
}

impl Job {
    /// Counts a join entry of `round`; prints `joined <round> <n> <unix s>` when every live
    /// simulated launcher has written one (the simulator's share of forming that round).
    fn joined(&self, round: u64) {
        let mut joins = self.joins.lock().unwrap_or_else(|e| e.into_inner());
        let n = joins.entry(round).or_insert(0);
        *n += 1;
        if *n == u64::from(self.count) - self.killed.load(Ordering::Relaxed) {
            println!("joined {round} {n} {:.6}", unix_now());
        }
    }
}

/// Where a simulated launcher is.
enum Phase {
    /// Not started yet.
    Start,
    /// In `rendezvous::join`, on its own connection, joined to `round`.
    Joining { round: u64, store: StoreClient },
    /// Member of `round`; its monitor (`start_monitor`) waits on its own connection and
    /// thread until `stop`.
    Running { round: u64, stop: Arc<AtomicBool> },
    /// Exited (the job is done, it was killed, or its store failed): no connection left.
    Gone,
}

/// One simulated launcher.
struct Launcher {
    index: u32,
    id: u64,
    info: Option<NodeInfo>,
    main: Option<StoreClient>,
    heartbeat: Option<StoreClient>,
    phase: Phase,
    /// When its next heartbeat is due (`None` before the start and once gone).
    beat_due: Option<Instant>,
    /// When its next start / join / monitor step is due.
    step_due: Option<Instant>,
}

/// What the driving threads count together.
#[derive(Default)]
struct Shared {
    requests: Arc<AtomicU64>,
    /// The latest an action ran past its due time, in microseconds, since the last `stats`.
    late_us: AtomicU64,
    errors: AtomicU64,
    kill: AtomicBool,
    stop: AtomicBool,
    rounds_joined: AtomicU64,
}

impl Shared {
    /// The request counter, for a monitor thread.
    fn requests_counter(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.requests)
    }
}

/// `launchers`: see the module's documentation.
pub fn launchers(options: &HashMap<String, String>) -> Result<(), String> {
    let addr = super::text(options, "addr")?.to_string();
    let run_id = super::text(options, "run-id")?.to_string();
    let count = super::number(options, "count")?;
    let threads = super::number(options, "threads")?.clamp(1, count.max(1));
    if count == 0 || count >= (1 << 16) - 1 {
        return Err(format!(
            "--count {count}: between 1 and 65534 (one 127.2.x.y address each)"
        ));
    }
    let mut observer = StoreClient::connect(&addr, &run_id, CONNECT_DEADLINE)
        .map_err(|e| format!("connect to {addr}: {e}"))?;
    let (host, terms) = find_host(&mut observer)?;
    let job = Arc::new(Job {
        addr,
        run_id,
        terms,
        host,
        count,
        killed: AtomicU64::new(0),
        joins: Mutex::new(HashMap::new()),
    });
    let shared = Arc::new(Shared::default());
    println!("ready");

    let mut lines = io::stdin().lock().lines();
    match lines.next() {
        Some(Ok(line)) if line.trim() == "go" => {}
        other => {
            return Err(format!(
                "expected the start line `go` on stdin, got {other:?}"
            ))
        }
    }
    println!("started {:.6}", unix_now());
    thread::Builder::new()
        .name("observer".into())
        .spawn(move || observe(observer))
        .map_err(|e| format!("cannot start the observer thread: {e}"))?;
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let lo = (u64::from(count) * u64::from(t) / u64::from(threads)) as u32;
            let hi = (u64::from(count) * u64::from(t + 1) / u64::from(threads)) as u32;
            let (job, shared) = (Arc::clone(&job), Arc::clone(&shared));
            thread::Builder::new()
                .name(format!("launchers-{lo}"))
                .spawn(move || drive(&job, &shared, lo..hi))
        })
        .collect::<Result<_, _>>()
        .map_err(|e| format!("cannot start a thread: {e}"))?;
    for line in lines {
        let line = line.map_err(|e| format!("stdin: {e}"))?;
        match line.trim() {
            "kill" => shared.kill.store(true, Ordering::Relaxed),
            "stats" => println!(
                "stats {} {:.3} {:.6}",
                shared.requests.load(Ordering::Relaxed),
                shared.late_us.swap(0, Ordering::Relaxed) as f64 / 1e3,
                unix_now()
            ),
            other => eprintln!("control-plane-bench: unknown command {other:?} (kill, stats)"),
        }
    }
    shared.stop.store(true, Ordering::Relaxed);
    for handle in handles {
        handle
            .join()
            .map_err(|_| "a launcher thread panicked".to_string())?;
    }
    println!(
        "{{\"launchers\":{count},\"requests\":{},\"errors\":{},\"rounds_joined\":{}}}",
        shared.requests.load(Ordering::Relaxed),
        shared.errors.load(Ordering::Relaxed),
        shared.rounds_joined.load(Ordering::Relaxed),
    );
    Ok(())
}

/// The host's NodeInfo (its join entry in the open round) and its published job terms.
fn find_host(store: &mut StoreClient) -> Result<(NodeInfo, Vec<u8>), String> {
    let deadline = Instant::now() + HOST_WAIT;
    let err = |e: StoreError| format!("reading the host's entries: {e}");
    loop {
        let open = counter(store.get(OPEN).map_err(err)?);
        let next = counter(store.get(NEXT_ID).map_err(err)?);
        for id in 0..next {
            let entry = store.get(&key(open, &format!("join/{id}"))).map_err(err)?;
            let Some(info) = entry.and_then(|e| serde_json::from_slice::<NodeInfo>(&e).ok()) else {
                continue;
            };
            if !info.host {
                continue;
            }
            if let Some(terms) = store.get(&format!("elastic/terms/{id}")).map_err(err)? {
                return Ok((info, terms));
            }
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "the host did not join round {open} within {} s",
                HOST_WAIT.as_secs()
            ));
        }
        thread::sleep(Duration::from_millis(10));
    }
}

fn counter(bytes: Option<Vec<u8>>) -> u64 {
    bytes
        .and_then(|b| String::from_utf8(b).ok())
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(0)
}

/// Prints when each round forms (and with how many nodes) and when it failed.
fn observe(mut store: StoreClient) {
    let forever = Duration::from_secs(24 * 3600);
    for round in 0u64.. {
        let members = key(round, "members");
        let formed = match store.wait(&[members.as_str()], forever) {
            Ok(mut values) => values.pop().unwrap_or_default(),
            Err(e) => return eprintln!("control-plane-bench: observer: wait {members}: {e}"),
        };
        let at = unix_now();
        let nodes = serde_json::from_slice::<Round>(&formed).map_or(0, |r| r.nodes.len());
        println!("round {round} members {nodes} {at:.6}");
        let failed = key(round, "failed");
        if let Err(e) = store.wait(&[failed.as_str()], forever) {
            return eprintln!("control-plane-bench: observer: wait {failed}: {e}");
        }
        println!("round {round} failed {:.6}", unix_now());
    }
}

/// Runs the due actions of `range`'s launchers until told to stop, and `kill` when one of them
/// runs.
fn drive(job: &Job, shared: &Shared, range: std::ops::Range<u32>) {
    let now = Instant::now();
    let mut sims: Vec<Launcher> = range
        .map(|index| Launcher {
            index,
            id: 0,
            info: None,
            main: None,
            heartbeat: None,
            phase: Phase::Start,
            beat_due: None,
            step_due: Some(now),
        })
        .collect();
    // A monitor tells its driving thread that its round ended: (the launcher's place, round).
    let (ended_tx, ended) = mpsc::channel::<(usize, u64)>();
    while !shared.stop.load(Ordering::Relaxed) {
        for (i, round) in ended.try_iter() {
            let sim = &mut sims[i];
            let mut requests = 0u64;
            let result = regroup(job, sim, round, &mut requests);
            shared.requests.fetch_add(requests, Ordering::Relaxed);
            if let Err(e) = result {
                failed(shared, sim, &e);
            }
        }
        // `kill`: the first thread that has a running launcher takes the order.
        if shared.kill.load(Ordering::Relaxed)
            && sims
                .iter()
                .any(|s| matches!(s.phase, Phase::Running { .. }))
            && shared.kill.swap(false, Ordering::Relaxed)
        {
            kill_one(job, &mut sims);
        }
        // The launcher whose next action is due first (heartbeats before steps on a tie).
        let next = sims
            .iter()
            .enumerate()
            .flat_map(|(i, s)| {
                [(s.beat_due, i, true), (s.step_due, i, false)]
                    .into_iter()
                    .filter_map(|(due, i, beat)| due.map(|d| (d, !beat, i)))
            })
            .min();
        let now = Instant::now();
        let Some((due, not_beat, i)) = next else {
            thread::sleep(TICK);
            continue;
        };
        if due > now {
            thread::sleep((due - now).min(TICK));
            continue;
        }
        let late = (now - due).as_micros() as u64;
        shared.late_us.fetch_max(late, Ordering::Relaxed);
        let sim = &mut sims[i];
        let mut requests = 0u64;
        let result = if not_beat {
            step(job, sim, i, &ended_tx, &mut requests, shared)
        } else {
            beat(sim, &mut requests)
        };
        shared.requests.fetch_add(requests, Ordering::Relaxed);
        if let Err(e) = result {
            failed(shared, sim, &e);
        }
    }
    // Every connection closes as the launchers are dropped (and their monitors stop).
    for sim in &mut sims {
        gone(sim);
    }
}

/// A store error: the launcher says so and exits, as a real one that lost its store does.
fn failed(shared: &Shared, sim: &mut Launcher, e: &str) {
    shared.errors.fetch_add(1, Ordering::Relaxed);
    eprintln!(
        "control-plane-bench: simulated launcher {} (node id {}): {e}; it exits",
        sim.index, sim.id
    );
    gone(sim);
}

/// Closes every connection of `sim` (its monitor's when its wait returns) and forgets its due
/// actions.
fn gone(sim: &mut Launcher) {
    if let Phase::Running { stop, .. } = &sim.phase {
        stop.store(true, Ordering::Relaxed);
    }
    sim.main = None;
    sim.heartbeat = None;
    sim.phase = Phase::Gone;
    sim.beat_due = None;
    sim.step_due = None;
}

/// `kill`: the first running launcher of this thread dies (all its connections close at once).
fn kill_one(job: &Job, sims: &mut [Launcher]) {
    let Some(sim) = sims
        .iter_mut()
        .find(|s| matches!(s.phase, Phase::Running { .. }))
    else {
        return;
    };
    job.killed.fetch_add(1, Ordering::Relaxed);
    let ip = launcher_ip(sim.index);
    shut_down_sockets_from(ip);
    let at = unix_now();
    gone(sim);
    println!("killed {} {at:.6}", sim.id);
}

/// Shuts down (both ways) every TCP socket of this process bound to `ip`: a killed launcher's
/// connections, its monitor's included (that thread is parked in a wait and owns its client).
/// The descriptors stay open until their owners drop them, so none is reused meanwhile.
fn shut_down_sockets_from(ip: IpAddr) {
    let IpAddr::V4(ip) = ip else { return };
    let Ok(fds) = std::fs::read_dir("/proc/self/fd") else {
        return;
    };
    for fd in fds.flatten() {
        let Some(fd) = fd.file_name().to_str().and_then(|f| f.parse::<i32>().ok()) else {
            continue;
        };
        // SAFETY: getsockname writes at most `len` bytes into `addr`; shutdown only changes the
        // state of a socket (a descriptor that is not one fails harmlessly).
        unsafe {
            let mut addr: libc::sockaddr_in = std::mem::zeroed();
            let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            let got = libc::getsockname(fd, (&raw mut addr).cast(), &raw mut len);
            if got == 0
                && i32::from(addr.sin_family) == libc::AF_INET
                && u32::from_be(addr.sin_addr.s_addr) == u32::from(ip)
            {
                libc::shutdown(fd, libc::SHUT_RDWR);
            }
        }
    }
}

/// A connection as `elastic::connect_to_store` opens it (its requests give up after
/// [`HOST_SILENT_AFTER`]), from this launcher's own loopback address.
fn connect(job: &Job, index: u32) -> Result<StoreClient, String> {
    let source = launcher_ip(index);
    let mut store = StoreClient::connect_from(&job.addr, &job.run_id, CONNECT_DEADLINE, source)
        .map_err(|e| format!("connect from {source}: {e}"))?;
    store
        .set_io_timeout(HOST_SILENT_AFTER)
        .map_err(|e| format!("set_io_timeout: {e}"))?;
    Ok(store)
}

/// One request, counted; the error names it.
fn req<T>(
    requests: &mut u64,
    what: impl FnOnce() -> String,
    request: impl FnOnce() -> Result<T, StoreError>,
) -> Result<T, String> {
    *requests += 1;
    request().map_err(|e| format!("{}: {e}", what()))
}

/// `rendezvous::start_heartbeat`'s loop body: `add elastic/hb/<id> 1`, then [`BEAT`].
fn beat(sim: &mut Launcher, requests: &mut u64) -> Result<(), String> {
    let id = sim.id;
    let store = sim.heartbeat.as_mut().ok_or("no heartbeat connection")?;
    let hb = format!("elastic/hb/{id}");
    req(requests, || format!("add {hb}"), || store.add(&hb, 1))?;
    sim.beat_due = Some(Instant::now() + BEAT);
    Ok(())
}

/// The launcher's next start or join step.
fn step(
    job: &Job,
    sim: &mut Launcher,
    place: usize,
    ended: &Sender<(usize, u64)>,
    requests: &mut u64,
    shared: &Shared,
) -> Result<(), String> {
    match std::mem::replace(&mut sim.phase, Phase::Gone) {
        Phase::Start => start(job, sim, requests),
        Phase::Joining { round, store } => {
            join_poll(job, sim, place, ended, round, store, requests, shared)
        }
        running @ Phase::Running { .. } => {
            sim.phase = running;
            sim.step_due = None;
            Ok(())
        }
        Phase::Gone => {
            sim.step_due = None;
            Ok(())
        }
    }
}

/// `elastic::Rendezvous::open` (main connection: `take_id`, `publish_terms`; the heartbeat's
/// connection: `set_ephemeral elastic/alive/<id>` and its first beat), then the first
/// `elastic::join` (`join` with `after == None`).
fn start(job: &Job, sim: &mut Launcher, requests: &mut u64) -> Result<(), String> {
    let mut main = connect(job, sim.index)?;
    // `rendezvous::take_id`.
    let next = req(
        requests,
        || format!("add {NEXT_ID}"),
        || main.add(NEXT_ID, 1),
    )?;
    let id = (next - 1).max(0) as u64;
    sim.id = id;
    // `rendezvous::publish_terms`.
    let terms = format!("elastic/terms/{id}");
    req(
        requests,
        || format!("set {terms}"),
        || main.set(&terms, &job.terms),
    )?;
    sim.main = Some(main);
    // `rendezvous::start_heartbeat`: the connection holds the ephemeral key, then beats.
    let mut heartbeat = connect(job, sim.index)?;
    let alive = format!("elastic/alive/{id}");
    req(
        requests,
        || format!("set_ephemeral {alive}"),
        || heartbeat.set_ephemeral(&alive, b"1"),
    )?;
    sim.heartbeat = Some(heartbeat);
    beat(sim, requests)?;
    // `NodeInfo` as `Rendezvous::open` makes it: the host's terms digest and process count.
    sim.info = Some(NodeInfo {
        id,
        addr: launcher_ip(sim.index).to_string(),
        nproc: job.host.nproc,
        port: 0,
        host: false,
        terms: job.host.terms.clone(),
        hostname: format!("sim-{}", sim.index),
    });
    join(job, sim, None, requests)
}

/// `elastic::join` -> `rendezvous::join` up to its first look: a connection of its own, the
/// round (`elastic/open` on a first join, else the one after `after`), `free_port` for the
/// NodeInfo, and its join entry.
fn join(
    job: &Job,
    sim: &mut Launcher,
    after: Option<u64>,
    requests: &mut u64,
) -> Result<(), String> {
    let info = sim.info.as_mut().ok_or("no NodeInfo")?;
    // `elastic::free_port` (each join, on the node's address).
    info.port = TcpListener::bind((launcher_ip(sim.index), 0))
        .and_then(|l| l.local_addr())
        .map_or(0, |a| a.port());
    let mut store = connect(job, sim.index)?;
    let round = match after {
        Some(r) => r + 1,
        None => counter(req(requests, || format!("get {OPEN}"), || store.get(OPEN))?),
    };
    set_join(&mut store, info, round, requests)?;
    job.joined(round);
    sim.phase = Phase::Joining { round, store };
    sim.step_due = Some(Instant::now());
    Ok(())
}

fn set_join(
    store: &mut StoreClient,
    info: &NodeInfo,
    round: u64,
    requests: &mut u64,
) -> Result<(), String> {
    let entry = key(round, &format!("join/{}", info.id));
    let value = serde_json::to_vec(info).unwrap_or_default();
    req(
        requests,
        || format!("set {entry}"),
        || store.set(&entry, &value),
    )
}

/// One pass of `rendezvous::join`'s loop: one `get_many` of done, refused, the round's members
/// and its waiting line, then [`POLL`]. A round that formed without this node: the next one at
/// once. A round that takes it: its monitor starts.
#[allow(clippy::too_many_arguments)]
fn join_poll(
    job: &Job,
    sim: &mut Launcher,
    place: usize,
    ended: &Sender<(usize, u64)>,
    mut round: u64,
    mut store: StoreClient,
    requests: &mut u64,
    shared: &Shared,
) -> Result<(), String> {
    let id = sim.id;
    let (members, waiting) = (key(round, "members"), key(round, "waiting"));
    let refused = format!("elastic/refused/{id}");
    let keys = [DONE, refused.as_str(), members.as_str(), waiting.as_str()];
    let values = req(
        requests,
        || format!("get_many {keys:?}"),
        || store.get_many(&keys),
    )?;
    let [done, refused, members, _waiting]: [Option<Vec<u8>>; 4] =
        values.try_into().unwrap_or_default();
    if done.is_some() {
        // The job ended while it waited: the launcher exits.
        gone(sim);
        return Ok(());
    }
    if let Some(why) = refused {
        return Err(format!("not admitted: {}", String::from_utf8_lossy(&why)));
    }
    if let Some(closed) = members.and_then(|c| serde_json::from_slice::<Round>(&c).ok()) {
        if closed.nodes.iter().any(|n| n.id == id) {
            // Taken: the join connection closes; `elastic::run_rounds` opens the monitor's and
            // starts the group (imaginary here).
            drop(store);
            shared.rounds_joined.fetch_add(1, Ordering::Relaxed);
            let monitor = connect(job, sim.index)?;
            let stop = Arc::new(AtomicBool::new(false));
            start_monitor(
                monitor,
                round,
                place,
                ended.clone(),
                Arc::clone(&stop),
                shared,
            )?;
            sim.phase = Phase::Running { round, stop };
            sim.step_due = None;
            return Ok(());
        }
        round += 1;
        let info = sim.info.as_ref().ok_or("no NodeInfo")?;
        set_join(&mut store, info, round, requests)?;
        job.joined(round);
        sim.phase = Phase::Joining { round, store };
        sim.step_due = Some(Instant::now());
        return Ok(());
    }
    sim.phase = Phase::Joining { round, store };
    sim.step_due = Some(Instant::now() + POLL);
    Ok(())
}

/// `rendezvous::start_monitor`: on a thread of its own, waits for the round's `end` (after a
/// regroup, for its `failed`) in windows of [`MONITOR_WAIT`], looking at `stop` between them;
/// when it is there, reads `failed` and `regroup` together and tells the driving thread (the
/// real one sends `Event::Regroup`); it returns after a failure, and goes on waiting for one
/// after a regroup until stopped.
fn start_monitor(
    mut store: StoreClient,
    round: u64,
    place: usize,
    ended: Sender<(usize, u64)>,
    stop: Arc<AtomicBool>,
    shared: &Shared,
) -> Result<(), String> {
    let requests = shared.requests_counter();
    thread::Builder::new()
        .name("monitor".into())
        .stack_size(MONITOR_STACK)
        .spawn(move || {
            let (end, failed, regroup) = (
                key(round, "end"),
                key(round, "failed"),
                key(round, "regroup"),
            );
            let mut asked = false;
            while !stop.load(Ordering::Relaxed) {
                let watched = if asked { &failed } else { &end };
                requests.fetch_add(1, Ordering::Relaxed);
                match store.wait(&[watched.as_str()], MONITOR_WAIT) {
                    Ok(_) => {}
                    Err(StoreError::WaitTimeout { .. }) => continue,
                    Err(_) => return, // the heartbeat reports a lost store
                }
                requests.fetch_add(1, Ordering::Relaxed);
                let Ok(seen) = store.get_many(&[failed.as_str(), regroup.as_str()]) else {
                    return;
                };
                let at_checkpoint = match (&seen[0], &seen[1]) {
                    (Some(_), _) => false,
                    (None, Some(_)) if !asked => true,
                    _ => {
                        thread::sleep(POLL);
                        continue;
                    }
                };
                let _ = ended.send((place, round));
                if !at_checkpoint {
                    return;
                }
                asked = true;
            }
        })
        .map(|_| ())
        .map_err(|e| format!("cannot start a monitor thread: {e}"))
}

/// `elastic::run_rounds` on the monitor's word: the group (a plain command) stops at once, the
/// monitor is told to stop, and the launcher joins the round after `round`.
fn regroup(job: &Job, sim: &mut Launcher, round: u64, requests: &mut u64) -> Result<(), String> {
    match &sim.phase {
        Phase::Running { round: r, stop } if *r == round => stop.store(true, Ordering::Relaxed),
        _ => return Ok(()),
    }
    join(job, sim, Some(round), requests)
}
