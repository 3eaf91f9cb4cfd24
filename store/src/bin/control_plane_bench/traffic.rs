//! The store traffic of a job's start-up, rank by rank, in rounds: what every rank of a real
//! job sends to the rendezvous store between `store::rendezvous` and the end of the `tcp`
//! backend's set-up (hierarchical: shared memory within a host, a ring of the hosts' leaders),
//! re-coded from that code with its key names, its order, who does what, and its value sizes.
//!
//! One thread drives many simulated ranks one after the other, so the traffic is cut into
//! rounds: a thread does round k for all its ranks before round k + 1, and in each round a
//! rank's waits depend only on writes made in earlier rounds (never on a later rank of the same
//! thread in the same round), so nothing deadlocks whatever the split of ranks into threads.
//!
//! | round | who                      | requests                                                         |
//! |-------|--------------------------|------------------------------------------------------------------|
//! | R1    | all                      | connect (+ handshake); `add agree/claim/<r>`; r0: `set agree/terms/0` (2 KB) |
//! | R2    | all                      | r != 0: `wait [agree/terms/0]`; `set agree/rank/<r> ok`           |
//! | R3    | rank 0                   | `get agree/verdict`, `wait` all N `agree/rank/*` (200 ms windows), `add agree/verdict-claim`, `set agree/verdict ok` |
//! | R4    | all                      | `wait [agree/verdict]`; r0: `set tcp/secret` (32 B)               |
//! | R5    | all                      | r != 0: `wait [tcp/secret]`; `set tcp/peer/<r>` (nonce, address) |
//! | R6    | all                      | `wait [tcp/peer/<r+1>]`; `set shm/name/<r>`                      |
//! | R7    | all                      | `wait` the L `shm/name/*` of its host; `set shm/mapped/<r> ok`    |
//! | R8    | all                      | `wait` the L `shm/mapped/*` of its host; leader: `add tcp/hosts/shm/reported 1` (the last: `get .../without`, `set .../verdict`) |
//! | R9    | all                      | `wait [tcp/hosts/shm/verdict]`; leader: second connection; leader of host 0: `set tcp/leaders/secret` |
//! | R10   | leaders                  | g != 0: `wait [tcp/leaders/secret]`; `set tcp/leaders/peer/<g>`   |
//! | R11   | leaders                  | `wait [tcp/leaders/peer/<g+1>]`                                   |
//! | end   | all                      | every connection is closed                                       |
//!
//! (Rank r is on host g = r / L with local rank r % L; the leader of a host is its local rank 0.)
//! As in the real code, a one-rank job has no ring and no shared memory, a one-host job shares
//! memory among all its ranks and has no host keys nor leaders' ring, and a job of one rank per
//! host (L = 1) on several hosts has no shared memory either.
//!
//! `scripts/bench/control_plane_tcpstore.py` replays the same rounds against PyTorch's
//! `TCPStore`, function for function with the same names: change both together.

use std::net::{IpAddr, Ipv4Addr};
use std::ops::Range;
use std::time::{Duration, Instant};

use store::{StoreClient, StoreError};

/// The timeout of every wait (and the connect deadline).
pub const WAIT_TIMEOUT: Duration = Duration::from_secs(60);
/// `agreement.rs`'s `VERDICT_POLL`: rank 0 waits for every rank's answer in windows this long,
/// looking for a verdict published meanwhile between two.
const VERDICT_POLL: Duration = Duration::from_millis(200);
const OK: &[u8] = b"ok";

/// The simulated job.
pub struct Job {
    pub addr: String,
    pub run_id: String,
    /// N ranks in all.
    pub world: u32,
    /// L ranks per host.
    pub local: u32,
}

impl Job {
    /// G hosts.
    pub fn hosts(&self) -> u32 {
        self.world / self.local
    }

    /// `connect_ring` returns at once for a ring of one.
    fn ring(&self) -> bool {
        self.world > 1
    }

    /// The ranks that share memory with `rank` (`TcpCollective::connect_with`): all of them on
    /// one host, the host's ranks when there are several hosts of several ranks, none else.
    fn shm_group(&self, rank: u32) -> Option<Range<u32>> {
        if self.world <= 1 {
            None
        } else if self.hosts() <= 1 {
            Some(0..self.world)
        } else if self.local > 1 {
            let base = rank - rank % self.local;
            Some(base..base + self.local)
        } else {
            None
        }
    }

    /// Whether there are host verdicts and a leaders' ring (`connect_hosts`).
    fn hierarchical(&self) -> bool {
        self.hosts() > 1 && self.local > 1
    }
}

/// The loopback address that host `g` connects from (distinct hosts, as far as the server's
/// per-address limits can tell): 127.1.(g >> 8).(g & 255).
pub fn host_ip(g: u32) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 1, (g >> 8) as u8, g as u8))
}

/// One simulated rank: its connections (the second is a leader's, for the leaders' ring).
pub struct Rank {
    pub rank: u32,
    store: Option<StoreClient>,
    leader_store: Option<StoreClient>,
}

impl Rank {
    pub fn new(rank: u32) -> Rank {
        Rank {
            rank,
            store: None,
            leader_store: None,
        }
    }
}

/// What a thread counted.
#[derive(Default)]
pub struct Stats {
    /// Store requests after the handshake (each `set`, `get`, `add`, `wait`).
    pub ops: u64,
    /// Connections opened (each with its handshake).
    pub connects: u64,
    /// The longest request that does not wait for other ranks (`set`, `get`, `add`).
    pub max_op: Duration,
    /// The longest `wait`.
    pub max_wait: Duration,
    /// The longest connect with its handshake.
    pub max_connect: Duration,
}

impl Stats {
    pub fn merge(&mut self, other: &Stats) {
        self.ops += other.ops;
        self.connects += other.connects;
        self.max_op = self.max_op.max(other.max_op);
        self.max_wait = self.max_wait.max(other.max_wait);
        self.max_connect = self.max_connect.max(other.max_connect);
    }
}

/// One round for one rank; the error names the request and its keys.
pub type Round = fn(&Job, &mut Rank, &mut Stats) -> Result<(), String>;

/// The rounds, in order, with the names that errors show.
pub const ROUNDS: [(&str, Round); 11] = [
    ("R1 (rendezvous, agree: claim)", r1_connect_and_claim),
    ("R2 (agree: compare with rank 0)", r2_compare_terms),
    ("R3 (agreement::decide)", r3_decide),
    (
        "R4 (agree: verdict; tcp ring secret)",
        r4_verdict_and_ring_secret,
    ),
    ("R5 (connect_ring: nonce, address)", r5_ring_nonce_and_addr),
    (
        "R6 (connect_ring: next rank; shm name)",
        r6_ring_next_and_shm_name,
    ),
    ("R7 (shm: names; mapped)", r7_shm_names),
    ("R8 (shm: mapped; host verdict)", r8_shm_mapped),
    ("R9 (connect_hosts: host verdicts)", r9_host_verdicts),
    (
        "R10 (leaders' connect_ring: nonce, address)",
        r10_leaders_nonce_and_addr,
    ),
    ("R11 (leaders' connect_ring: next leader)", r11_leaders_next),
];

// ---------------------------------------------------------------------------------------------
// The rounds

/// `store::rendezvous` (every rank connects: our handshake) and the first step of
/// `agreement::agree` (`add agree/claim/<r>`; rank 0 publishes its terms, about 2 KB of JSON).
fn r1_connect_and_claim(job: &Job, me: &mut Rank, stats: &mut Stats) -> Result<(), String> {
    let rank = me.rank;
    me.store = Some(connect(job, rank / job.local, stats)?);
    let store = main(me)?;
    let claim = format!("agree/claim/{rank}");
    let claimed = add(stats, store, &claim, 1)?;
    if claimed != 1 {
        return Err(format!(
            "add {claim:?} gave {claimed}: the rank is taken twice"
        ));
    }
    if rank == 0 {
        set(stats, store, "agree/terms/0", &terms())?;
    }
    Ok(())
}

/// `agreement::agree` (`compare_with_rank0`: read rank 0's terms; publish `agree/rank/<r>`).
fn r2_compare_terms(_job: &Job, me: &mut Rank, stats: &mut Stats) -> Result<(), String> {
    let rank = me.rank;
    let store = main(me)?;
    if rank != 0 {
        let theirs = wait(stats, store, &["agree/terms/0".into()])?;
        if theirs[0] != terms() {
            return Err("agree/terms/0 is not what rank 0 wrote".into());
        }
    }
    set(stats, store, &format!("agree/rank/{rank}"), OK)
}

/// `agreement::decide` on rank 0: look for a verdict, wait for every rank's answer in 200 ms
/// windows (looking for a verdict between two), then `publish_verdict` (claim, then write).
fn r3_decide(job: &Job, me: &mut Rank, stats: &mut Stats) -> Result<(), String> {
    if me.rank != 0 {
        return Ok(());
    }
    let store = main(me)?;
    let keys: Vec<String> = (0..job.world).map(|r| format!("agree/rank/{r}")).collect();
    let deadline = Instant::now() + WAIT_TIMEOUT;
    let answers = loop {
        if get(stats, store, "agree/verdict")?.is_some() {
            return Err("agree/verdict was already published".into());
        }
        let left = deadline.saturating_duration_since(Instant::now());
        match wait_within(stats, store, &keys, left.min(VERDICT_POLL)) {
            Ok(answers) => break answers,
            Err(StoreError::WaitTimeout { .. }) if !left.is_zero() => continue,
            Err(e) => return Err(format!("wait for the {} agree/rank/*: {e}", keys.len())),
        }
    };
    if let Some(r) = answers.iter().position(|a| a.as_slice() != OK) {
        return Err(format!("agree/rank/{r} is not ok"));
    }
    if add(stats, store, "agree/verdict-claim", 1)? == 1 {
        set(stats, store, "agree/verdict", OK)?;
    }
    Ok(())
}

/// The end of `agreement::agree` (every rank reads the verdict), then `connect_ring`'s
/// `ring_secret` on rank 0 (32 random bytes under `tcp/secret`).
fn r4_verdict_and_ring_secret(job: &Job, me: &mut Rank, stats: &mut Stats) -> Result<(), String> {
    let rank = me.rank;
    let store = main(me)?;
    let verdict = wait(stats, store, &["agree/verdict".into()])?;
    if verdict[0] != OK {
        return Err("agree/verdict is not ok".into());
    }
    if job.ring() && rank == 0 {
        set(stats, store, "tcp/secret", &random_bytes())?;
    }
    Ok(())
}

/// `connect_ring` (`tcp` scope): the others read the secret; every rank publishes its nonce
/// (32 bytes) and its listening address.
fn r5_ring_nonce_and_addr(job: &Job, me: &mut Rank, stats: &mut Stats) -> Result<(), String> {
    if !job.ring() {
        return Ok(());
    }
    let rank = me.rank;
    let store = main(me)?;
    if rank != 0 {
        wait(stats, store, &["tcp/secret".into()])?;
    }
    let addr = listen_addr(rank / job.local, 40000 + rank % 20000);
    set(stats, store, &format!("tcp/peer/{rank}"), &peer(&addr))
}

/// `connect_ring`: the next rank's address and nonce; then `ShmGroup::connect` ->
/// `segment::share` -> `exchange` publishes this rank's segment name (`shm/name/<r>`).
fn r6_ring_next_and_shm_name(job: &Job, me: &mut Rank, stats: &mut Stats) -> Result<(), String> {
    let rank = me.rank;
    let store = main(me)?;
    if job.ring() {
        let next = (rank + 1) % job.world;
        let key = format!("tcp/peer/{next}");
        let got = wait(stats, store, std::slice::from_ref(&key))?;
        check_peer(&got[0], &key)?;
    }
    if job.shm_group(rank).is_some() {
        set(
            stats,
            store,
            &format!("shm/name/{rank}"),
            shm_name().as_bytes(),
        )?;
    }
    Ok(())
}

/// `segment::share`: `exchange` waits for every member's name (the segments are mapped), then
/// `settle` publishes `shm/mapped/<r>`.
fn r7_shm_names(job: &Job, me: &mut Rank, stats: &mut Stats) -> Result<(), String> {
    let rank = me.rank;
    let Some(group) = job.shm_group(rank) else {
        return Ok(());
    };
    let store = main(me)?;
    let keys: Vec<String> = group.map(|r| format!("shm/name/{r}")).collect();
    wait(stats, store, &keys)?;
    set(stats, store, &format!("shm/mapped/{rank}"), OK)
}

/// `segment::settle`: waits for every member's `shm/mapped/*`; then `connect_hosts`: each
/// host's leader reports (`publish_host_verdict`: counted, the last one writes the verdict).
fn r8_shm_mapped(job: &Job, me: &mut Rank, stats: &mut Stats) -> Result<(), String> {
    let rank = me.rank;
    let Some(group) = job.shm_group(rank) else {
        return Ok(());
    };
    let store = main(me)?;
    let keys: Vec<String> = group.map(|r| format!("shm/mapped/{r}")).collect();
    let mapped = wait(stats, store, &keys)?;
    if let Some(i) = mapped.iter().position(|v| v.as_slice() != OK) {
        return Err(format!("{} is not ok", keys[i]));
    }
    if job.hierarchical() && rank % job.local == 0 {
        // `publish_host_verdict`: every host has shared memory here, so no `without` count;
        // the last leader to report publishes the verdict (how many hosts lack it).
        if add(stats, store, "tcp/hosts/shm/reported", 1)? == i64::from(job.hosts()) {
            let without = get(stats, store, "tcp/hosts/shm/without")?.unwrap_or(b"0".to_vec());
            set(stats, store, "tcp/hosts/shm/verdict", &without)?;
        }
    }
    Ok(())
}

/// `connect_hosts`: every rank waits for the hosts' verdict (one key); each leader opens a
/// second connection for the leaders' ring, and the leader of host 0 (ring position 0) draws
/// that ring's secret (`ring_secret`, scope `tcp/leaders`).
fn r9_host_verdicts(job: &Job, me: &mut Rank, stats: &mut Stats) -> Result<(), String> {
    if !job.hierarchical() {
        return Ok(());
    }
    let (rank, g) = (me.rank, me.rank / job.local);
    let store = main(me)?;
    let verdict = wait(stats, store, &["tcp/hosts/shm/verdict".into()])?;
    if verdict[0].as_slice() != b"0" {
        return Err("tcp/hosts/shm/verdict is not 0".into());
    }
    if rank % job.local == 0 {
        let mut leader = connect(job, g, stats)?;
        if g == 0 {
            set(stats, &mut leader, "tcp/leaders/secret", &random_bytes())?;
        }
        me.leader_store = Some(leader);
    }
    Ok(())
}

/// `connect_ring` of the leaders (scope `tcp/leaders`, position g): the others read the
/// secret; every leader publishes its nonce and address.
fn r10_leaders_nonce_and_addr(job: &Job, me: &mut Rank, stats: &mut Stats) -> Result<(), String> {
    let g = me.rank / job.local;
    let Some(store) = me.leader_store.as_mut() else {
        return Ok(());
    };
    if g != 0 {
        wait(stats, store, &["tcp/leaders/secret".into()])?;
    }
    let addr = listen_addr(g, 20000 + g % 20000);
    set(stats, store, &format!("tcp/leaders/peer/{g}"), &peer(&addr))
}

/// `connect_ring` of the leaders: the next leader's address and nonce.
fn r11_leaders_next(job: &Job, me: &mut Rank, stats: &mut Stats) -> Result<(), String> {
    let g = me.rank / job.local;
    let Some(store) = me.leader_store.as_mut() else {
        return Ok(());
    };
    let next = (g + 1) % job.hosts();
    let key = format!("tcp/leaders/peer/{next}");
    let got = wait(stats, store, std::slice::from_ref(&key))?;
    check_peer(&got[0], &key)
}

// ---------------------------------------------------------------------------------------------
// Values

/// Rank 0's terms as `agree` publishes them: a JSON object of about 2 KB (40 entries).
pub fn terms() -> Vec<u8> {
    let entries: Vec<String> = (0..40)
        .map(|i| format!("\"term.{i:02}\":\"{}\"", "0123456789".repeat(4)))
        .collect();
    format!("{{{}}}", entries.join(",")).into_bytes()
}

/// A listening address as `connect_ring` publishes it ("127.0.0.1:40000"-like).
fn listen_addr(g: u32, port: u32) -> String {
    format!("{}:{port}", host_ip(g))
}

/// A segment name as `common::shm_segments::segment_name` makes it: `/gptrec-<pid>-<32 hex>`.
fn shm_name() -> String {
    let hex: String = random_bytes()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("/gptrec-{}-{hex}", std::process::id())
}

fn random_bytes() -> [u8; 32] {
    let mut bytes = [0u8; 32];
    // The values' contents do not matter to the store; only a failing OS source would leave
    // them zero.
    let _ = getrandom::fill(&mut bytes);
    bytes
}

/// What `connect_ring` publishes for a ring position: its nonce (32 bytes), then its address.
fn peer(addr: &str) -> Vec<u8> {
    let mut value = random_bytes().to_vec();
    value.extend_from_slice(addr.as_bytes());
    value
}

/// Checks a published nonce and address, as `connect_ring` reads them.
fn check_peer(value: &[u8], key: &str) -> Result<(), String> {
    value
        .get(32..)
        .and_then(|addr| std::str::from_utf8(addr).ok())
        .and_then(|text| text.parse::<std::net::SocketAddr>().ok())
        .map(|_| ())
        .ok_or_else(|| format!("{key} is not a nonce and an address"))
}

// ---------------------------------------------------------------------------------------------
// Requests, counted and timed

fn main(me: &mut Rank) -> Result<&mut StoreClient, String> {
    me.store
        .as_mut()
        .ok_or_else(|| "no store connection".to_string())
}

fn connect(job: &Job, g: u32, stats: &mut Stats) -> Result<StoreClient, String> {
    let started = Instant::now();
    let source = host_ip(g);
    let client = StoreClient::connect_from(&job.addr, &job.run_id, WAIT_TIMEOUT, source)
        .map_err(|e| format!("connect from {source}: {e}"))?;
    stats.connects += 1;
    stats.max_connect = stats.max_connect.max(started.elapsed());
    Ok(client)
}

fn timed<T>(stats: &mut Stats, waits: bool, request: impl FnOnce() -> T) -> T {
    let started = Instant::now();
    let result = request();
    let took = started.elapsed();
    stats.ops += 1;
    let max = if waits {
        &mut stats.max_wait
    } else {
        &mut stats.max_op
    };
    *max = (*max).max(took);
    result
}

fn set(stats: &mut Stats, store: &mut StoreClient, key: &str, value: &[u8]) -> Result<(), String> {
    timed(stats, false, || store.set(key, value)).map_err(|e| format!("set {key:?}: {e}"))
}

fn get(stats: &mut Stats, store: &mut StoreClient, key: &str) -> Result<Option<Vec<u8>>, String> {
    timed(stats, false, || store.get(key)).map_err(|e| format!("get {key:?}: {e}"))
}

fn add(stats: &mut Stats, store: &mut StoreClient, key: &str, delta: i64) -> Result<i64, String> {
    timed(stats, false, || store.add(key, delta)).map_err(|e| format!("add {key:?}: {e}"))
}

/// `wait` for `keys` (at most [`WAIT_TIMEOUT`]); their values. The error names the keys (the
/// first few, and how many in all).
fn wait(
    stats: &mut Stats,
    store: &mut StoreClient,
    keys: &[String],
) -> Result<Vec<Vec<u8>>, String> {
    wait_within(stats, store, keys, WAIT_TIMEOUT)
        .map_err(|e| format!("wait for {}: {e}", shown(keys)))
}

fn wait_within(
    stats: &mut Stats,
    store: &mut StoreClient,
    keys: &[String],
    timeout: Duration,
) -> Result<Vec<Vec<u8>>, StoreError> {
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    timed(stats, true, || store.wait(&keys, timeout))
}

/// Up to 4 keys, and how many more.
fn shown(keys: &[String]) -> String {
    if keys.len() <= 4 {
        format!("{keys:?}")
    } else {
        format!("{:?} and {} more", &keys[..4], keys.len() - 4)
    }
}
