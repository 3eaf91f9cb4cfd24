//! The rendezvous key-value store (PyTorch's `TCPStore`, as `env://` uses it): rank 0 hosts a
//! [`StoreServer`] on `MASTER_ADDR:MASTER_PORT` and every rank, rank 0 included, talks to it
//! through one [`StoreClient`] connection (`set`, `get`, `get_many`, `wait`, `add`,
//! `set_ephemeral`: a key that lives as long as the connection that set it, and `set_will`: a
//! line the server writes if the connection ends before the will is revoked). One thread serves
//! every connection (an epoll loop), so a store holds thousands of ranks. `launch` hosts one for
//! an elastic job's rendezvous; this crate does not link libtorch.
//!
//! This module owns the wire protocol (length-prefixed bincode frames and the run-id handshake),
//! the server's key space, and the client's connect-retry and timeout policy. It must not know
//! what the keys mean (the collectives and the engine built on top decide that), must not choose
//! addresses or ports (the launcher's plan does, through the worker environment contract), and
//! must never let a peer's misbehaviour panic or hang either side: every failure is a
//! [`StoreError`] whose one-line message names the address (and the keys, where there are some),
//! and every blocking call is bounded by a timeout.
//!
//! Wire format: every message is a frame, a `u32` little-endian body length (at most
//! [`MAX_FRAME_BYTES`]) followed by the bincode 2 (`standard()` config, serde) encoding of a
//! `Request` or a `Response`. The server executes a connection's requests in order and answers
//! each with one frame, except writes (`Set`, `SetEphemeral`), which it does not answer (as
//! PyTorch's `SET`): a client may send writes and a request after them without waiting, and
//! pays one round trip for all. Counters written by `add` are stored as decimal text, as
//! PyTorch does.
//!
//! Handshake: the run id (`TORCHELASTIC_RUN_ID`) is the secret that admits a connection, and it
//! never goes on the wire. Both sides derive `key = HMAC-SHA256(run id, "gptrec-store-v2")` and
//! prove that they know it over a fresh 32-byte nonce from each side:
//!
//! 1. client: `Hello { protocol, nonce: cn }` (the protocol tag tells a stranger apart);
//! 2. server: `Challenge { nonce: sn, proof: HMAC(key, "server" || cn || sn), fingerprint }`;
//! 3. the client checks the server's proof (in constant time). A server that cannot prove the id
//!    is another job or an impostor: the client fails at once, in one line naming the address,
//!    without sending anything more and without retrying;
//! 4. client: `Proof { proof: HMAC(key, "client" || sn || cn) }`;
//! 5. server: `Welcome`, or `Refused` (and it closes) for a wrong proof.
//!
//! The labels keep one side's proof from being reflected as the other's; the server's fresh
//! nonce keeps a recorded client proof from being replayed on another connection. The
//! `fingerprint` is [`run_fingerprint`] of the server's id, shown next to ours when the proof
//! fails, so that two nodes given different ids can be told apart from an impostor. Neither it nor
//! the proofs let an observer or a fake server recover an id with the entropy of the ones `launch`
//! generates (a guessable id can be tested offline against any proof; choose ids that are not).
//! Until its proof is accepted a connection may send only small frames (4 KiB) and must finish
//! the whole handshake within 10 s; the server's warnings about connections it refuses are
//! gathered into one line per 5 s with a count.
//!
//! Under torchrun (`TORCHELASTIC_USE_AGENT_STORE=True`), [`rendezvous`] starts no store: every
//! rank speaks PyTorch's c10d `TCPStore` protocol to the agent's store on `MASTER_PORT` (see
//! `c10d.rs`), which authenticates nobody. There every value is sealed with a key derived from
//! the run id (see `seal.rs`), so that reading or writing that store is not enough to learn the
//! ring's secret or to slip a value into the run; counters (`add`) stay in the clear, and the
//! guarantee is only as good as the run id is secret (torchrun's default id is "none").

mod auth;
mod c10d;
mod client;
mod connect;
mod guard;
mod seal;
mod server;

use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

use common::env_contract::WorkerEnv;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

pub use client::{StoreClient, StoreCloser};
use connect::HeldListener;
pub use server::StoreServer;

/// The largest frame body either side sends or accepts (64 MiB); a longer frame is an error.
pub const MAX_FRAME_BYTES: usize = 64 << 20;

/// Tag in the `Hello` request, so that a stranger speaking another protocol (or an older version
/// of this one) is told apart.
/// (`gps3`: writes have no answer.)
const PROTOCOL: u32 = 0x6770_7333;
/// How long a client waits for the answer to `set`, `get` and `add`.
const IO_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a client waits for each answer of the handshake; a peer that accepts the connection
/// and stays silent this long is not a store (the client does not retry it).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Extra time a client gives the server beyond a `wait`'s own timeout before giving up on it.
const WAIT_SLACK: Duration = Duration::from_secs(10);
/// Longest pause between two connection attempts.
const MAX_BACKOFF: Duration = Duration::from_millis(250);
/// A server connection whose peer stops sending in the middle of a frame for this long is dropped.
const STALL_LIMIT: Duration = Duration::from_secs(30);
/// Write timeout of a server connection (a peer that does not read its answers is dropped).
const SERVER_WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// A connection must finish the handshake (prove the run id) within this long, or it is closed.
const HELLO_DEADLINE: Duration = Duration::from_secs(10);
/// The largest frame accepted before the run id is proven (the handshake's frames are about a
/// hundred bytes): a stranger cannot make the server allocate more.
const PRE_HELLO_MAX_FRAME: usize = 4 << 10;
/// Connections that have not yet proven the run id, at most (each costs a descriptor and a few
/// hundred bytes until its deadline; thousands of ranks connect at once). A new connection beyond
/// this closes one of them, silent ones (no `Hello` yet) and the oldest first, whatever their
/// address: a flood of idle sockets delays nobody, since a real peer greets within a millisecond
/// and finishes its handshake within a few.
const MAX_UNGREETED: usize = 1024;
/// Connections from one IP address that have not yet proven the run id, at most (so that one
/// address cannot take every slot; a host's ranks and its launcher fit well within it); a new one
/// beyond this closes that address's own.
const MAX_UNGREETED_PER_IP: usize = 64;
/// Warnings about refused connections are gathered into one line per this long, with a count.
const WARN_INTERVAL: Duration = Duration::from_secs(5);

/// What a client asks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum Request {
    /// First message of every connection: the client's nonce (the run id is never sent).
    Hello {
        protocol: u32,
        nonce: auth::Nonce,
    },
    /// Second message: the client's proof that it knows the run id, over both nonces.
    Proof {
        proof: auth::Proof,
    },
    /// Not answered: the client goes on at once (a broken connection shows at its next
    /// request), and the server executes a connection's requests in order.
    Set {
        key: String,
        value: Vec<u8>,
    },
    Get {
        key: String,
    },
    /// Several `Get`s in one round trip (e.g. a coordinator reading every node's heartbeat).
    GetMany {
        keys: Vec<String>,
    },
    /// Blocks (server side) until every key exists or `timeout_ms` passes.
    Wait {
        keys: Vec<String>,
        timeout_ms: u64,
    },
    Add {
        key: String,
        delta: i64,
    },
    /// A last word, named: when this connection ends before the will is revoked (its process
    /// died, its host's processes did), the server writes `value` under `key` unless the key
    /// has a value by then (the first will written stays). A newer will of the same name
    /// replaces it. Not answered.
    Will {
        name: String,
        key: String,
        value: Vec<u8>,
    },
    /// Voids the will `name`, from any connection (its own may be parked in a wait). Not
    /// answered.
    Revoke {
        name: String,
    },
    /// `Set` (not answered either), and the server removes the key when this connection ends (however it ends: a
    /// process that dies closes its sockets), as ZooKeeper's ephemeral nodes.
    SetEphemeral {
        key: String,
        value: Vec<u8>,
    },
}

/// What the server answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum Response {
    /// The answer to `Hello`: the server's nonce and its proof that it knows the run id, with the
    /// [`run_fingerprint`] of its id (never the id) for telling a mismatch apart.
    Challenge {
        nonce: auth::Nonce,
        proof: auth::Proof,
        fingerprint: String,
    },
    /// The client's proof was accepted.
    Welcome,
    Value(Option<Vec<u8>>),
    /// The answer to `GetMany`: each key's value, or `None`, in the order asked.
    Found(Vec<Option<Vec<u8>>>),
    Values(Vec<Vec<u8>>),
    Counter(i64),
    WaitTimedOut {
        missing: Vec<String>,
    },
    /// The request was invalid (not a counter, overflow, protocol violation, shutting down).
    Refused {
        reason: String,
    },
}

impl Response {
    /// The variant's name, for error messages (never the payload, which may be large).
    fn kind(&self) -> &'static str {
        match self {
            Response::Challenge { .. } => "Challenge",
            Response::Welcome => "Welcome",
            Response::Value(_) => "Value",
            Response::Found(_) => "Found",
            Response::Values(_) => "Values",
            Response::Counter(_) => "Counter",
            Response::WaitTimedOut { .. } => "WaitTimedOut",
            Response::Refused { .. } => "Refused",
        }
    }
}

/// Everything that can go wrong with the store; every message is one line naming the address.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The server could not listen on its address.
    #[error("cannot start the rendezvous store on {addr}: {}", describe_bind(.addr, .cause))]
    Bind { addr: SocketAddr, cause: io::Error },
    /// The address is malformed or cannot be resolved.
    #[error("invalid rendezvous store address {addr:?}: {reason}")]
    BadAddress { addr: String, reason: String },
    /// Nobody answered at the address before the connect deadline.
    #[error(
        "cannot reach the rendezvous store at {addr} after {:.1} s ({reason}); is rank 0 running?",
        .waited.as_secs_f64()
    )]
    Unreachable {
        addr: String,
        waited: Duration,
        reason: String,
    },
    /// What answers at the address could not prove that it knows our run id: a store of another
    /// run, or an impostor. `found` is the [`run_fingerprint`] it claims (unverified), `expected`
    /// ours.
    #[error("{addr} does not know this job's run id (it could not prove it): another job or an impostor holds that port (it claims run id fingerprint {found}; ours is {expected}; every node needs the same run id: --run-id / LAUNCH_RUN_ID)")]
    WrongRun {
        addr: String,
        found: String,
        expected: String,
    },
    /// Something accepted the connection but never answered the handshake.
    #[error(
        "{addr} accepted the connection but did not answer the rendezvous store's handshake within {:.1} s: another program holds that port, or the store is stuck",
        .waited.as_secs_f64()
    )]
    Silent { addr: String, waited: Duration },
    /// Rank 0's own listener (the port `launch` holds for it, [`common::env_contract::STORE_HELD_VAR`])
    /// took the connection, but rank 0 did not serve it before the rendezvous deadline.
    #[error(
        "rank 0's rendezvous store at {addr} (the port launch holds for it) took the connection but did not answer within {:.1} s: rank 0 is stopped, stuck or still starting; see its log",
        .waited.as_secs_f64()
    )]
    NotServing { addr: String, waited: Duration },
    /// `wait` gave up; `missing` are the keys that still did not exist.
    #[error(
        "timed out after {:.1} s waiting for store keys {missing:?} at {addr}",
        .timeout.as_secs_f64()
    )]
    WaitTimeout {
        addr: String,
        timeout: Duration,
        missing: Vec<String>,
    },
    /// The store did not answer a request in time.
    #[error(
        "the rendezvous store at {addr} did not answer {op} within {:.1} s",
        .waited.as_secs_f64()
    )]
    NoAnswer {
        addr: String,
        op: String,
        waited: Duration,
    },
    /// The connection failed (closed, reset, ...) during a request.
    #[error("lost the connection to the rendezvous store at {addr} during {op}: {}", describe_io(.cause))]
    Connection {
        addr: String,
        op: String,
        cause: io::Error,
    },
    /// A frame longer than [`MAX_FRAME_BYTES`] was about to be sent or was announced by the peer.
    #[error(
        "a {len}-byte message to or from the rendezvous store at {addr} exceeds the {limit}-byte frame limit"
    )]
    FrameTooLarge {
        addr: String,
        len: usize,
        limit: usize,
    },
    /// The peer answered something that is not a valid reply.
    #[error("unexpected reply from the rendezvous store at {addr}: {detail}")]
    Protocol { addr: String, detail: String },
    /// The store refused a request (e.g. `add` on a value that is not a decimal integer).
    #[error("rendezvous store at {addr} refused {op}: {reason}")]
    Refused {
        addr: String,
        op: String,
        reason: String,
    },
    /// A value read from torchrun's agent store did not open with this run's key: written by
    /// someone who does not know the run id (that store lets anyone who reaches it write), or a
    /// counter (`add`), which is read back with `add(key, 0)`.
    #[error("the value under store key {key:?} at {addr} is not sealed with this run's id: someone outside the run wrote it (torchrun's store admits anyone who can reach it), or it is a counter")]
    Unsealed { addr: String, key: String },
    /// An earlier error left the connection in an unknown state; `reason` is that error.
    #[error("the rendezvous store connection is unusable after an earlier error: {reason}")]
    Broken { addr: String, reason: String },
    /// The operating system refused a thread for the server.
    #[error("cannot start a rendezvous store thread: {cause}")]
    Thread { cause: io::Error },
}

fn describe_bind(addr: &SocketAddr, cause: &io::Error) -> String {
    match cause.kind() {
        io::ErrorKind::AddrInUse => format!(
            "port {} is already in use (another job, or a previous run still exiting?)",
            addr.port()
        ),
        io::ErrorKind::AddrNotAvailable => {
            format!("{} is not an address of this machine", addr.ip())
        }
        _ => cause.to_string(),
    }
}

/// A short, lower-case description of a socket error.
fn describe_io(err: &io::Error) -> String {
    match err.kind() {
        io::ErrorKind::ConnectionRefused => "connection refused".into(),
        io::ErrorKind::ConnectionReset => "connection reset".into(),
        io::ErrorKind::ConnectionAborted => "connection aborted".into(),
        io::ErrorKind::BrokenPipe => "connection closed by the store".into(),
        io::ErrorKind::UnexpectedEof => "connection closed by the store".into(),
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => "timed out".into(),
        _ => err.to_string(),
    }
}

// ---------------------------------------------------------------------------------------------
// Framing

fn wire_config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<MAX_FRAME_BYTES>()
}

/// Header plus body of one message, or the body length when it is over the limit.
fn encode_frame<T: Serialize>(msg: &T) -> Result<Vec<u8>, usize> {
    // Encoding plain enums of strings, integers and byte vectors cannot fail.
    let body = bincode::serde::encode_to_vec(msg, wire_config()).map_err(|_| usize::MAX)?;
    if body.len() > MAX_FRAME_BYTES {
        return Err(body.len());
    }
    let len = u32::try_from(body.len()).map_err(|_| body.len())?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&len.to_le_bytes());
    frame.extend_from_slice(&body);
    Ok(frame)
}

/// Decodes a whole frame body; trailing bytes are an error.
fn decode_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, String> {
    let (msg, used): (T, usize) = bincode::serde::decode_from_slice(body, wire_config())
        .map_err(|e| format!("undecodable frame ({e})"))?;
    if used != body.len() {
        return Err(format!(
            "frame has {} trailing bytes after its message",
            body.len() - used
        ));
    }
    Ok(msg)
}

/// A failure to read a frame with a blocking read.
enum FrameReadError {
    Io(io::Error),
    TooLarge(usize),
}

/// Reads one frame with the stream's own read timeout (the tests' raw peers).
#[cfg(test)]
fn read_frame(stream: &mut std::net::TcpStream) -> Result<Vec<u8>, FrameReadError> {
    use std::io::Read as _;
    let mut header = [0u8; 4];
    stream.read_exact(&mut header).map_err(FrameReadError::Io)?;
    let len = u32::from_le_bytes(header) as usize;
    if len > MAX_FRAME_BYTES {
        return Err(FrameReadError::TooLarge(len));
    }
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body).map_err(FrameReadError::Io)?;
    Ok(body)
}

/// Checks that `addr` has the `host:port` shape (the host itself is resolved on every attempt).
fn check_host_port(addr: &str) -> Result<(), StoreError> {
    let bad = |reason: &str| StoreError::BadAddress {
        addr: addr.to_string(),
        reason: reason.to_string(),
    };
    let (host, port) = addr
        .rsplit_once(':')
        .ok_or_else(|| bad("expected HOST:PORT"))?;
    if host.is_empty() || host == "[]" {
        return Err(bad("the host is empty"));
    }
    port.parse::<u16>()
        .map_err(|_| bad("the port is not a number from 0 to 65535"))?;
    Ok(())
}

pub use common::hostlist::join_host_port;

/// What logs and refusals show instead of a run id: `sha256:` and the first 12 hex digits of its
/// SHA-256. Equal ids give equal fingerprints, so a mismatch can be diagnosed, but a secret id
/// (`LAUNCH_RUN_ID`) cannot be read back from a log, a job's output or a refusal.
pub fn run_fingerprint(run_id: &str) -> String {
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(run_id.as_bytes());
    let hex: String = digest.iter().take(6).map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

/// Whether torchrun's agent serves the store this worker is to use: the value of
/// `TORCHELASTIC_USE_AGENT_STORE` is `True` (as torchrun writes it) or `1`, in any case.
pub fn agent_store_requested(value: Option<&str>) -> bool {
    value.is_some_and(|v| {
        let v = v.trim();
        v.eq_ignore_ascii_case("true") || v == "1"
    })
}

/// The prefix of every key this worker writes in torchrun's agent store, which outlives a
/// restart of the worker group: one per attempt, so that nobody reads a predecessor's keys.
fn agent_store_prefix(env: &WorkerEnv) -> String {
    format!("gptrec/attempt-{}/", env.restart_count)
}

/// The address rank 0 listens on: `MASTER_ADDR` resolved (IPv4 preferred), `MASTER_PORT`.
fn listen_addr(env: &WorkerEnv) -> Result<SocketAddr, StoreError> {
    let port = env.master_port;
    let shown = join_host_port(&env.master_addr, port);
    let host = env
        .master_addr
        .trim_start_matches('[')
        .trim_end_matches(']');
    let bad = |reason: String| StoreError::BadAddress {
        addr: shown.clone(),
        reason,
    };
    if host.is_empty() {
        return Err(bad("MASTER_ADDR is empty".into()));
    }
    let candidates: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|err| bad(format!("cannot resolve MASTER_ADDR: {err}")))?
        .collect();
    candidates
        .iter()
        .find(|addr| addr.is_ipv4())
        .or_else(|| candidates.first())
        .copied()
        .ok_or_else(|| bad("MASTER_ADDR resolves to no address".into()))
}

/// The listening socket `launch` handed rank 0 ([`common::env_contract::STORE_FD_VAR`]), checked
/// to be a TCP listener on `MASTER_PORT`; `None` when there is none.
fn inherited_listener(env: &WorkerEnv) -> Result<Option<std::net::TcpListener>, StoreError> {
    use std::os::fd::{FromRawFd, RawFd};
    let var = common::env_contract::STORE_FD_VAR;
    let Ok(text) = std::env::var(var) else {
        return Ok(None);
    };
    let bad = |reason: String| StoreError::BadAddress {
        addr: format!("{var}={text}"),
        reason,
    };
    let fd: RawFd = text
        .trim()
        .parse()
        .map_err(|_| bad("not a descriptor number".into()))?;
    // SAFETY: fstat only reads the descriptor's metadata; an invalid one is an error.
    let mut stat: libc::stat = unsafe { std::mem::zeroed() };
    if fd < 3
        || unsafe { libc::fstat(fd, &mut stat) } != 0
        || stat.st_mode & libc::S_IFMT != libc::S_IFSOCK
    {
        return Err(bad("not an open socket".into()));
    }
    // SAFETY: an open socket handed to this process for the store alone; nothing else owns it.
    let listener = unsafe { std::net::TcpListener::from_raw_fd(fd) };
    let port = listener.local_addr().map(|a| a.port());
    if port.as_ref().ok() != Some(&env.master_port) {
        std::mem::forget(listener); // not ours to close
        return Err(bad(format!(
            "the socket is not listening on the store's port {} ({port:?})",
            env.master_port
        )));
    }
    // Not passed on to anything this process starts.
    unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    Ok(Some(listener))
}

/// Where `launch` holds rank 0's listener ([`common::env_contract::STORE_HELD_VAR`]), when it
/// says so (only on rank 0's node); local rank 1 says when it waits for rank 0 (one line, not
/// one per rank).
fn held_listener(env: &WorkerEnv) -> Result<Option<HeldListener>, StoreError> {
    let var = common::env_contract::STORE_HELD_VAR;
    let Ok(text) = std::env::var(var) else {
        return Ok(None);
    };
    let addr = text
        .trim()
        .parse::<SocketAddr>()
        .map_err(|_| StoreError::BadAddress {
            addr: format!("{var}={text}"),
            reason: "expected IP:PORT, as launch sets it".into(),
        })?;
    Ok(Some(HeldListener {
        addr,
        announce: env.local_rank == 1,
    }))
}

/// Rank 0 starts the server on `MASTER_ADDR:MASTER_PORT`, then every rank (rank 0 included)
/// connects a client, all within `timeout`. Rank 0 gets the server back and must keep it alive
/// for as long as any rank may use the store.
///
/// Under torchrun, when `TORCHELASTIC_USE_AGENT_STORE` says so ([`agent_store_requested`]),
/// no store is started: every rank connects to the agent's on `MASTER_ADDR:MASTER_PORT` in
/// PyTorch's protocol, its keys under one prefix per restart attempt.
pub fn rendezvous(
    env: &WorkerEnv,
    timeout: Duration,
) -> Result<(Option<StoreServer>, StoreClient), StoreError> {
    let agent_store = std::env::var("TORCHELASTIC_USE_AGENT_STORE").ok();
    rendezvous_with(env, agent_store_requested(agent_store.as_deref()), timeout)
}

/// [`rendezvous`], with whether torchrun's agent serves the store decided by the caller.
fn rendezvous_with(
    env: &WorkerEnv,
    agent_store: bool,
    timeout: Duration,
) -> Result<(Option<StoreServer>, StoreClient), StoreError> {
    let addr = join_host_port(&env.master_addr, env.master_port);
    if agent_store {
        let prefix = agent_store_prefix(env);
        let client = StoreClient::connect_agent_store(&addr, &env.run_id, &prefix, timeout)?;
        // A second connection of this rank (`StoreClient::connect`) speaks PyTorch's protocol too.
        c10d::remember_agent_store(&addr, &prefix);
        if env.local_rank == 0 {
            say_agent_store(&addr, &env.run_id);
        }
        return Ok((None, client));
    }
    if env.rank == 0 {
        let server = match inherited_listener(env)? {
            Some(listener) => StoreServer::from_listener(listener, &env.run_id)?,
            None => StoreServer::start(listen_addr(env)?, &env.run_id)?,
        };
        let (world, hosts) = (u64::from(env.world_size), u64::from(env.group_world_size));
        if let Some(warning) = server.descriptor_warning(world, hosts) {
            tracing::warn!("{warning}");
        }
        let client = StoreClient::connect(&server.local_addr().to_string(), &env.run_id, timeout)?;
        Ok((Some(server), client))
    } else {
        let client = match held_listener(env)? {
            Some(held) => StoreClient::connect_held(&addr, &env.run_id, timeout, held)?,
            None => StoreClient::connect(&addr, &env.run_id, timeout)?,
        };
        Ok((None, client))
    }
}

/// Each node's line about torchrun's agent store (from its local rank 0), and a warning when
/// the run id that seals the values is torchrun's public default.
fn say_agent_store(addr: &str, run_id: &str) {
    tracing::info!(
        "rendezvous through torchrun's agent store at {addr} (TORCHELASTIC_USE_AGENT_STORE): \
         PyTorch's TCPStore protocol, values sealed with the run id"
    );
    if run_id.is_empty() || run_id == "none" {
        tracing::warn!(
            "the run id is torchrun's default {run_id:?}: this run's traffic is unauthenticated, \
             anyone who can reach {addr} can read and forge what the ranks exchange there and \
             join their collectives; give torchrun a secret id (--standalone draws one; \
             PET_RDZV_ID=... is not shown by ps; LAUNCH_REQUIRE_SECRET=1 or \
             dist.require_secret = true makes this an error)"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::io::{Read, Write};
    use std::net::{Shutdown, TcpListener, TcpStream};
    use std::thread;
    use std::time::Instant;

    mod agent_store;
    mod event_loop;
    mod handshake;

    fn server(run_id: &str) -> StoreServer {
        StoreServer::start("127.0.0.1:0".parse().unwrap(), run_id).unwrap()
    }

    fn client(server: &StoreServer, run_id: &str) -> StoreClient {
        StoreClient::connect(
            &server.local_addr().to_string(),
            run_id,
            Duration::from_secs(2),
        )
        .unwrap()
    }

    fn free_port() -> u16 {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    }

    fn worker_env(rank: u32, world_size: u32, port: u16, run_id: &str) -> WorkerEnv {
        WorkerEnv::single_node(rank, world_size, "127.0.0.1", port, run_id)
    }

    /// A raw, greeted-or-not socket to the server, for sending malformed bytes.
    fn raw(server: &StoreServer) -> TcpStream {
        let stream = TcpStream::connect(server.local_addr()).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(2)))
            .unwrap();
        stream
    }

    /// Reads until the server closes the connection; fails if it stays open for 2 s.
    fn assert_closed_by_server(mut stream: TcpStream) {
        let mut sink = Vec::new();
        match stream.read_to_end(&mut sink) {
            Ok(_) => {}
            Err(err) => assert!(
                !matches!(
                    err.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ),
                "the server kept a bad connection open: {err}"
            ),
        }
    }

    fn send(stream: &mut TcpStream, request: &Request) {
        stream.write_all(&encode_frame(request).unwrap()).unwrap();
    }

    fn receive(stream: &mut TcpStream) -> Response {
        let body = read_frame(stream).ok().expect("a frame from the server");
        decode_body(&body).unwrap()
    }

    /// Says hello on a raw socket: the client nonce, and the server's nonce from its challenge
    /// (whose proof is checked).
    fn hello(stream: &mut TcpStream, run_id: &str) -> (auth::Nonce, auth::Nonce) {
        let client_nonce = auth::nonce().unwrap();
        send(
            stream,
            &Request::Hello {
                protocol: PROTOCOL,
                nonce: client_nonce,
            },
        );
        match receive(stream) {
            Response::Challenge {
                nonce,
                proof,
                fingerprint,
            } => {
                let key = auth::Key::new(run_id);
                assert!(key.server_proved(&client_nonce, &nonce, &proof));
                assert_eq!(fingerprint, run_fingerprint(run_id));
                (client_nonce, nonce)
            }
            other => panic!("{other:?} in answer to a hello"),
        }
    }

    /// The whole handshake on a raw socket, as a client of `run_id`.
    fn prove(stream: &mut TcpStream, run_id: &str) {
        let (client_nonce, server_nonce) = hello(stream, run_id);
        let proof = auth::Key::new(run_id).client_proof(&client_nonce, &server_nonce);
        send(stream, &Request::Proof { proof });
        assert_eq!(receive(stream), Response::Welcome);
    }

    #[test]
    fn set_get_wait_add_round_trip() {
        let server = server("run");
        let mut store = client(&server, "run");
        assert_eq!(store.get("missing").unwrap(), None);
        store.set("a", b"alpha").unwrap();
        store.set("b", b"").unwrap();
        assert_eq!(store.get("a").unwrap(), Some(b"alpha".to_vec()));
        store.set("a", b"again").unwrap();
        assert_eq!(
            store.wait(&["b", "a"], Duration::from_millis(100)).unwrap(),
            vec![b"".to_vec(), b"again".to_vec()]
        );
        assert_eq!(
            store.wait(&[], Duration::ZERO).unwrap(),
            Vec::<Vec<u8>>::new()
        );
        assert_eq!(store.add("n", 3).unwrap(), 3);
        assert_eq!(store.add("n", -5).unwrap(), -2);
        // Counters are decimal text, as in PyTorch's TCPStore.
        assert_eq!(store.get("n").unwrap(), Some(b"-2".to_vec()));
        store.set("m", b"40").unwrap();
        assert_eq!(store.add("m", 2).unwrap(), 42);

        // A refused request names the key and leaves the connection usable.
        let err = store.add("a", 1).unwrap_err().to_string();
        assert!(err.contains("\"a\" is not a decimal integer"), "{err}");
        store.set("max", i64::MAX.to_string().as_bytes()).unwrap();
        let err = store.add("max", 1).unwrap_err().to_string();
        assert!(err.contains("overflows"), "{err}");
        assert_eq!(store.get("n").unwrap(), Some(b"-2".to_vec()));

        // A second client sees the same key space.
        let mut other = client(&server, "run");
        assert_eq!(other.get("a").unwrap(), Some(b"again".to_vec()));
    }

    #[test]
    fn an_ephemeral_key_lives_as_long_as_the_connection_that_set_it() {
        let server = server("run");
        let mut watcher = client(&server, "run");
        let mut owner = client(&server, "run");
        owner.set_ephemeral("alive/0", b"yes").unwrap();
        owner.set("kept", b"1").unwrap();
        assert_eq!(watcher.get("alive/0").unwrap(), Some(b"yes".to_vec()));
        drop(owner); // as a process that dies: its socket closes
        let start = Instant::now();
        while watcher.get("alive/0").unwrap().is_some() {
            assert!(
                start.elapsed() < Duration::from_secs(2),
                "the key outlived its connection"
            );
            thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(watcher.get("kept").unwrap(), Some(b"1".to_vec()));
    }

    #[test]
    fn wait_is_satisfied_later_by_another_client() {
        let server = server("run");
        let mut waiter = client(&server, "run");
        let mut setter = client(&server, "run");
        let started = Instant::now();
        let writer = thread::spawn(move || {
            thread::sleep(Duration::from_millis(150));
            setter.set("rank/1/addr", b"10.0.0.2:4000").unwrap();
            thread::sleep(Duration::from_millis(50));
            setter.set("rank/2/addr", b"10.0.0.3:4000").unwrap();
        });
        let values = waiter
            .wait(&["rank/1/addr", "rank/2/addr"], Duration::from_secs(3))
            .unwrap();
        assert!(started.elapsed() >= Duration::from_millis(190));
        assert_eq!(
            values,
            vec![b"10.0.0.2:4000".to_vec(), b"10.0.0.3:4000".to_vec()]
        );
        writer.join().unwrap();
    }

    #[test]
    fn concurrent_adds_from_eight_threads_are_exact() {
        let server = server("run");
        let addr = server.local_addr().to_string();
        let threads: Vec<_> = (0..8)
            .map(|i| {
                let addr = addr.clone();
                thread::spawn(move || {
                    let mut store =
                        StoreClient::connect(&addr, "run", Duration::from_secs(2)).unwrap();
                    let mut seen = Vec::new();
                    for _ in 0..50 {
                        seen.push(store.add("counter", i + 1).unwrap());
                    }
                    seen
                })
            })
            .collect();
        let mut all: Vec<i64> = Vec::new();
        for thread in threads {
            all.extend(thread.join().unwrap());
        }
        let expected: i64 = (1..=8).map(|d| d * 50).sum();
        let mut store = client(&server, "run");
        assert_eq!(store.add("counter", 0).unwrap(), expected);
        assert_eq!(*all.iter().max().unwrap(), expected);
        // Every add saw a distinct intermediate total: they were serialized.
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 400);
    }

    #[test]
    fn wait_for_a_key_nobody_sets_times_out_naming_it() {
        let server = server("run");
        let mut store = client(&server, "run");
        store.set("rank/0/addr", b"x").unwrap();
        let timeout = Duration::from_millis(300);
        let started = Instant::now();
        let err = store
            .wait(&["rank/0/addr", "rank/2/addr"], timeout)
            .unwrap_err();
        let elapsed = started.elapsed();
        assert!(elapsed >= timeout, "{elapsed:?}");
        assert!(elapsed < timeout + Duration::from_secs(1), "{elapsed:?}");
        assert!(matches!(err, StoreError::WaitTimeout { .. }));
        let text = err.to_string();
        assert!(
            text.starts_with("timed out after 0.3 s waiting for store keys [\"rank/2/addr\"]"),
            "{text}"
        );
        assert!(text.contains(&server.local_addr().to_string()), "{text}");
        // A timed-out wait leaves the connection usable.
        assert_eq!(store.get("rank/0/addr").unwrap(), Some(b"x".to_vec()));
    }

    #[test]
    fn connect_to_a_silent_port_fails_after_the_deadline_naming_the_address() {
        let addr = format!("127.0.0.1:{}", free_port());
        let deadline = Duration::from_millis(300);
        let started = Instant::now();
        let err = StoreClient::connect(&addr, "run", deadline).unwrap_err();
        let elapsed = started.elapsed();
        assert!(elapsed >= deadline, "{elapsed:?}");
        assert!(elapsed < deadline + Duration::from_secs(1), "{elapsed:?}");
        let text = err.to_string();
        assert!(
            text.starts_with(&format!(
                "cannot reach the rendezvous store at {addr} after 0."
            )),
            "{text}"
        );
        assert!(
            text.ends_with(" s (connection refused); is rank 0 running?"),
            "{text}"
        );
    }

    #[test]
    fn malformed_addresses_fail_at_once() {
        for addr in ["no-port", "host:http", ":29500", "host:70000"] {
            let err = StoreClient::connect(addr, "run", Duration::from_secs(5)).unwrap_err();
            assert!(
                matches!(err, StoreError::BadAddress { .. }),
                "{addr}: {err}"
            );
            assert!(err.to_string().contains(addr), "{err}");
        }
    }

    #[test]
    fn connect_retries_until_the_server_starts() {
        let port = free_port();
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let host = thread::spawn(move || {
            thread::sleep(Duration::from_millis(200));
            StoreServer::start(addr, "run").unwrap()
        });
        let mut store =
            StoreClient::connect(&addr.to_string(), "run", Duration::from_secs(3)).unwrap();
        store.set("k", b"v").unwrap();
        let server = host.join().unwrap();
        assert_eq!(server.local_addr(), addr);
    }

    #[test]
    fn garbage_and_truncated_frames_do_not_break_the_server() {
        let server = server("run");
        let mut good = client(&server, "run");
        good.set("k", b"before").unwrap();

        // Random bytes as the first frame.
        let mut stream = raw(&server);
        stream
            .write_all(&[7, 0, 0, 0, 0xff, 0xfe, 0xfd, 0x00, 0x13, 0x37, 0x42])
            .unwrap();
        assert_closed_by_server(stream);

        // An HTTP request (its first four bytes read as a huge length).
        let mut stream = raw(&server);
        stream.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        assert_closed_by_server(stream);

        // A request before the hello.
        let mut stream = raw(&server);
        let frame = encode_frame(&Request::Get { key: "k".into() }).unwrap();
        stream.write_all(&frame).unwrap();
        assert_closed_by_server(stream);

        // Garbage after a good handshake.
        let mut stream = raw(&server);
        prove(&mut stream, "run");
        stream.write_all(&[3, 0, 0, 0, 0xee, 0xee, 0xee]).unwrap();
        assert_closed_by_server(stream);

        // A truncated frame, then the peer hangs up.
        let mut stream = raw(&server);
        stream.write_all(&[100, 0, 0, 0, 1, 2, 3]).unwrap();
        stream.shutdown(Shutdown::Write).unwrap();
        assert_closed_by_server(stream);

        // A truncated frame whose sender stays silent: only its own connection waits.
        let mut stalled = raw(&server);
        stalled.write_all(&[100, 0, 0, 0, 1, 2, 3]).unwrap();
        let mut half_header = raw(&server);
        half_header.write_all(&[1, 0]).unwrap();

        // Everyone else is served as before.
        assert_eq!(good.get("k").unwrap(), Some(b"before".to_vec()));
        let mut late = client(&server, "run");
        late.set("k", b"after").unwrap();
        assert_eq!(good.get("k").unwrap(), Some(b"after".to_vec()));
        drop(stalled);
        drop(half_header);
    }

    #[test]
    fn oversized_frames_are_rejected_on_both_sides() {
        let server = server("run");
        let mut store = client(&server, "run");

        // The server drops a connection that announces more than the limit.
        let mut stream = raw(&server);
        prove(&mut stream, "run");
        let too_long = (MAX_FRAME_BYTES as u32 + 1).to_le_bytes();
        stream.write_all(&too_long).unwrap();
        assert_closed_by_server(stream);

        // The client refuses to send one, and its connection stays usable.
        let huge = vec![0u8; MAX_FRAME_BYTES + 1];
        let err = store.set("big", &huge).unwrap_err();
        assert!(matches!(err, StoreError::FrameTooLarge { .. }), "{err}");
        assert!(err.to_string().contains("frame limit"), "{err}");
        store.set("small", b"ok").unwrap();
        assert_eq!(store.get("small").unwrap(), Some(b"ok".to_vec()));

        // The client rejects a reply that announces more than the limit.
        let fake = TcpListener::bind("127.0.0.1:0").unwrap();
        let fake_addr = fake.local_addr().unwrap().to_string();
        let imposter = thread::spawn(move || {
            let (mut peer, _) = fake.accept().unwrap();
            let mut header = [0u8; 4];
            peer.read_exact(&mut header).unwrap();
            let mut body = vec![0u8; u32::from_le_bytes(header) as usize];
            peer.read_exact(&mut body).unwrap();
            peer.write_all(&u32::MAX.to_le_bytes()).unwrap();
            peer
        });
        let err = StoreClient::connect(&fake_addr, "run", Duration::from_secs(2)).unwrap_err();
        assert!(matches!(err, StoreError::Protocol { .. }), "{err}");
        assert!(err.to_string().contains(&fake_addr), "{err}");
        drop(imposter.join().unwrap());
    }

    #[test]
    fn a_large_frame_before_the_run_id_is_refused_at_once() {
        let server = server("run");
        let mut stream = raw(&server);
        // 63 MiB announced: refused from the header, nothing allocated.
        stream.write_all(&(63u32 << 20).to_le_bytes()).unwrap();
        let started = Instant::now();
        assert_closed_by_server(stream);
        assert!(started.elapsed() < Duration::from_secs(1));
        client(&server, "run").set("k", b"v").unwrap();
    }

    #[test]
    fn silent_connections_are_capped_and_closed_at_the_deadline() {
        let deadline = Duration::from_millis(800);
        let server =
            StoreServer::start_with("127.0.0.1:0".parse().unwrap(), "run", deadline).unwrap();
        let silent: Vec<TcpStream> = (0..100).map(|_| raw(&server)).collect();
        thread::sleep(Duration::from_millis(300));
        // Beyond the cap of one address, the oldest are closed at once (EOF without waiting).
        let closed_now = silent
            .iter()
            .filter(|s| {
                s.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
                matches!((&**s).read(&mut [0u8; 1]), Ok(0))
            })
            .count();
        assert!(
            closed_now >= 100 - MAX_UNGREETED_PER_IP,
            "{closed_now} closed"
        );
        assert!(server.ungreeted() <= MAX_UNGREETED_PER_IP);
        // The rest are closed when their deadline passes; then the run's own ranks get in.
        thread::sleep(deadline + Duration::from_millis(500));
        assert_eq!(server.ungreeted(), 0);
        for stream in silent {
            assert_closed_by_server(stream);
        }
        client(&server, "run").set("k", b"v").unwrap();
    }

    #[test]
    fn dropping_the_server_fails_clients_cleanly() {
        let server = server("run");
        let mut idle = client(&server, "run");
        let mut waiting = client(&server, "run");
        idle.set("k", b"v").unwrap();
        let waiter = thread::spawn(move || {
            let started = Instant::now();
            let result = waiting.wait(&["never"], Duration::from_secs(20));
            (result, started.elapsed())
        });
        thread::sleep(Duration::from_millis(100));
        let started = Instant::now();
        drop(server);
        assert!(started.elapsed() < Duration::from_secs(1));
        let (result, elapsed) = waiter.join().unwrap();
        assert!(result.is_err());
        assert!(elapsed < Duration::from_secs(2), "{elapsed:?}");
        let err = idle.get("k").unwrap_err();
        assert!(
            matches!(err, StoreError::Connection { .. }),
            "{err:?}: {err}"
        );
        // The connection is given up from now on.
        let again = idle.get("k").unwrap_err();
        assert!(matches!(again, StoreError::Broken { .. }), "{again}");
    }

    #[test]
    fn a_taken_port_is_named() {
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        let err = StoreServer::start(addr, "run").unwrap_err().to_string();
        assert!(
            err.contains(&format!("port {} is already in use", addr.port())),
            "{err}"
        );
        let err = rendezvous(
            &worker_env(0, 2, addr.port(), "run"),
            Duration::from_secs(1),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains(&addr.to_string()), "{err}");
    }

    #[test]
    fn rendezvous_connects_three_ranks_through_one_store() {
        let port = free_port();
        let ranks: Vec<_> = (0..3u32)
            .map(|rank| {
                let env = worker_env(rank, 3, port, "job-42");
                thread::spawn(move || {
                    if rank == 0 {
                        // The other ranks start first and must retry until the store is up.
                        thread::sleep(Duration::from_millis(200));
                    }
                    let (server, mut store) = rendezvous(&env, Duration::from_secs(3)).unwrap();
                    assert_eq!(server.is_some(), rank == 0);
                    store
                        .set(
                            &format!("rank/{rank}/addr"),
                            format!("host{rank}").as_bytes(),
                        )
                        .unwrap();
                    let joined = store.add("joined", 1).unwrap();
                    let all = store
                        .wait(
                            &["rank/0/addr", "rank/1/addr", "rank/2/addr"],
                            Duration::from_secs(3),
                        )
                        .unwrap();
                    (server, store, joined, all)
                })
            })
            .collect();
        let results: Vec<_> = ranks.into_iter().map(|r| r.join().unwrap()).collect();
        let mut joined: Vec<i64> = results.iter().map(|r| r.2).collect();
        joined.sort_unstable();
        assert_eq!(joined, vec![1, 2, 3]);
        for (_, _, _, all) in &results {
            assert_eq!(
                all,
                &vec![b"host0".to_vec(), b"host1".to_vec(), b"host2".to_vec()]
            );
        }
        let server = results[0].0.as_ref().unwrap();
        assert_eq!(server.local_addr().port(), port);
        assert!(server.local_addr().ip().is_loopback());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        #[test]
        fn arbitrary_bytes_never_panic_the_decoders(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode_body::<Request>(&bytes);
            let _ = decode_body::<Response>(&bytes);
        }

        #[test]
        fn requests_round_trip_through_frames(
            key in ".{0,20}",
            value in proptest::collection::vec(any::<u8>(), 0..100),
            delta in any::<i64>(),
            timeout_ms in any::<u64>(),
        ) {
            for request in [
                Request::Hello { protocol: PROTOCOL, nonce: [delta as u8; 32] },
                Request::Proof { proof: [timeout_ms as u8; 32] },
                Request::Set { key: key.clone(), value: value.clone() },
                Request::Get { key: key.clone() },
                Request::Wait { keys: vec![key.clone(), String::new()], timeout_ms },
                Request::Add { key: key.clone(), delta },
            ] {
                let frame = encode_frame(&request).unwrap();
                let len = u32::from_le_bytes([frame[0], frame[1], frame[2], frame[3]]) as usize;
                prop_assert_eq!(len, frame.len() - 4);
                prop_assert_eq!(decode_body::<Request>(&frame[4..]).unwrap(), request);
            }
        }
    }
}
