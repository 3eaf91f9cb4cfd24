//! Setting up the `tcp` backend: the ring's connections (each proving it belongs to the run)
//! and, when options allow, shared memory between the ranks of a host, with a ring of the
//! hosts' leaders when there are several hosts. It must not move tensors: the operations are
//! in the parent module.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::time::{Duration, Instant};

use common::env_contract::WorkerEnv;

use super::{Hosts, RingSpec, TcpCollective, TcpOptions, PIECE_BYTES};
use crate::collective::shm::ShmGroup;
use crate::collective::CollectiveError;
use crate::store::{StoreClient, StoreError};

impl TcpCollective {
    /// [`TcpCollective::connect_with`] the default options (shared memory on one host).
    pub fn connect(
        env: &WorkerEnv,
        store: StoreClient,
        timeout: Duration,
    ) -> Result<TcpCollective, CollectiveError> {
        Self::connect_with(env, store, timeout, TcpOptions::default())
    }

    /// Sets up the ring: listen, publish our address in the store, connect to the next rank,
    /// accept the previous one; then, when `options` allow, shared memory: between all ranks
    /// when they run on one host, or between the ranks of each host plus a ring of the hosts'
    /// leaders when there are several hosts with several ranks each. `store` becomes this
    /// communicator's own client.
    pub fn connect_with(
        env: &WorkerEnv,
        store: StoreClient,
        timeout: Duration,
        options: TcpOptions,
    ) -> Result<TcpCollective, CollectiveError> {
        let world = env.world_size as usize;
        let spec = RingSpec {
            pos: env.rank as usize,
            ranks: (0..world).collect(),
            scope: "tcp",
        };
        let mut comm = Self::connect_ring(env, store, timeout, spec)?;
        if !options.shared_memory || world <= 1 {
            return Ok(comm);
        }
        if env.group_world_size <= 1 {
            let ranks: Vec<usize> = (0..world).collect();
            comm.shm = comm.connect_shm(&ranks, timeout)?;
        } else if env.local_world_size > 1
            && world == (env.local_world_size * env.group_world_size) as usize
        {
            comm.connect_hosts(env, timeout)?;
        }
        Ok(comm)
    }

    fn connect_shm(
        &mut self,
        ranks: &[usize],
        timeout: Duration,
    ) -> Result<Option<ShmGroup>, CollectiveError> {
        ShmGroup::connect(&mut self.store, self.rank, ranks, timeout).map_err(|detail| {
            CollectiveError::Setup {
                backend: "tcp",
                detail: format!("setting up shared memory: {detail}"),
            }
        })
    }

    /// The hierarchical set-up: shared memory among this host's ranks (`RANK = GROUP_RANK x
    /// LOCAL_WORLD_SIZE + LOCAL_RANK`), used only when every host has it (each leader publishes
    /// its host's verdict), then the leaders' ring.
    fn connect_hosts(&mut self, env: &WorkerEnv, timeout: Duration) -> Result<(), CollectiveError> {
        let setup = |detail: String| CollectiveError::Setup {
            backend: "tcp",
            detail,
        };
        let per_host = env.local_world_size as usize;
        let base = self.rank - env.local_rank as usize;
        let local: Vec<usize> = (base..base + per_host).collect();
        let shm = self.connect_shm(&local, timeout)?;
        let hosts = env.group_world_size as usize;
        if env.local_rank == 0 {
            self.publish_host_verdict(shm.is_some(), hosts)
                .map_err(|e| setup(format!("publishing this host's shared-memory verdict: {e}")))?;
        }
        let verdict = self
            .store
            .wait(&[HOSTS_VERDICT], timeout)
            .map_err(|e| {
                setup(format!(
                    "waiting for every host's shared-memory verdict: {e}"
                ))
            })?
            .remove(0);
        if verdict.as_slice() != b"0" {
            tracing::warn!(
                "shared memory is unavailable on {} of {hosts} hosts; all-reduce uses the socket ring",
                String::from_utf8_lossy(&verdict)
            );
            return Ok(());
        }
        self.shm = shm;
        self.hosts = Some(if env.local_rank == 0 {
            let store =
                StoreClient::connect(self.store.addr(), &env.run_id, timeout).map_err(|e| {
                    setup(format!(
                        "second store connection for the leaders' ring: {e}"
                    ))
                })?;
            let spec = RingSpec {
                pos: env.group_rank as usize,
                ranks: (0..hosts).map(|h| h * per_host).collect(),
                scope: "tcp/leaders",
            };
            Hosts::Leader(Box::new(Self::connect_ring(env, store, timeout, spec)?))
        } else {
            Hosts::Member
        });
        Ok(())
    }

    /// A host's leader reports whether its host has shared memory. Counted, not listed, so that
    /// every rank reads one key however many hosts there are: the last leader to report
    /// publishes how many hosts lack it (each leader counts itself in `without` before
    /// `reported`, so the last one sees every host's).
    fn publish_host_verdict(&mut self, has_shm: bool, hosts: usize) -> Result<(), StoreError> {
        if !has_shm {
            self.store.add(HOSTS_WITHOUT_SHM, 1)?;
        }
        if self.store.add(HOSTS_REPORTED, 1)? == hosts as i64 {
            let without = match self.store.get(HOSTS_WITHOUT_SHM)? {
                Some(count) => count,
                None => b"0".to_vec(),
            };
            self.store.set(HOSTS_VERDICT, &without)?;
        }
        Ok(())
    }

    fn connect_ring(
        env: &WorkerEnv,
        store: StoreClient,
        timeout: Duration,
        spec: RingSpec,
    ) -> Result<TcpCollective, CollectiveError> {
        let RingSpec {
            pos: rank,
            ranks,
            scope,
        } = spec;
        let world = ranks.len();
        let setup = |detail: String| CollectiveError::Setup {
            backend: "tcp",
            detail,
        };
        let mut comm = TcpCollective {
            rank,
            world,
            ring_ranks: ranks,
            scope,
            links: None,
            shm: None,
            hosts: None,
            store,
            seq: 0,
            scratch: Vec::new(),
            sent: 0,
        };
        if world == 1 {
            return Ok(comm);
        }
        let deadline = Instant::now() + timeout;
        let ip = local_ip(env).map_err(|e| {
            setup(format!(
                "cannot find this node's address towards MASTER_ADDR {}: {e}",
                env.master_addr
            ))
        })?;
        let listener = TcpListener::bind(SocketAddr::new(ip, 0))
            .map_err(|e| setup(format!("cannot listen on {ip}: {e}")))?;
        let addr = listener
            .local_addr()
            .map_err(|e| setup(format!("listener address: {e}")))?;
        let secret = ring_secret(rank, scope, &mut comm.store, timeout).map_err(&setup)?;
        let nonce = random_bytes().map_err(&setup)?;
        // One key per position: its nonce (32 bytes), then its address.
        let mut peer = nonce.to_vec();
        peer.extend_from_slice(addr.to_string().as_bytes());
        comm.store
            .set(&format!("{scope}/peer/{rank}"), &peer)
            .map_err(|e| setup(format!("publishing our nonce and address: {e}")))?;
        let next = (rank + 1) % world;
        let prev = (rank + world - 1) % world;
        let (next_rank, prev_rank) = (comm.ring_ranks[next], comm.ring_ranks[prev]);
        let published = comm
            .store
            .wait(&[format!("{scope}/peer/{next}").as_str()], timeout)
            .map_err(|e| setup(format!("waiting for rank {next_rank}'s address: {e}")))?
            .remove(0);
        if published.len() < nonce.len() {
            return Err(setup(format!(
                "rank {next_rank} published {} bytes for its nonce and address",
                published.len()
            )));
        }
        let (next_nonce, next_addr) = published.split_at(nonce.len());
        let next_addr = String::from_utf8_lossy(next_addr).into_owned();
        let proof = ring_proof(&secret, next_nonce, rank, next);
        let to_next =
            connect_next(&next_addr, next_rank, rank, &proof, deadline).map_err(&setup)?;

        let proof = ring_proof(&secret, &nonce, prev, rank);
        let from_prev =
            accept_prev(&listener, prev, prev_rank, &proof, deadline, timeout).map_err(setup)?;
        for stream in [&to_next, &from_prev] {
            stream
                .set_nodelay(true)
                .map_err(|e| setup(format!("socket option: {e}")))?;
        }
        comm.links = Some((to_next, from_prev));
        comm.scratch = vec![0.0; PIECE_BYTES / 4];
        Ok(comm)
    }
}

/// Connects to the next ring position at `addr` (global rank `next_rank`, named in errors),
/// retrying until `deadline` (it may not listen yet), and greets it with our position `pos` and
/// `proof`.
fn connect_next(
    addr: &str,
    next_rank: usize,
    pos: usize,
    proof: &[u8],
    deadline: Instant,
) -> Result<TcpStream, String> {
    let sock: SocketAddr = addr
        .parse()
        .map_err(|e| format!("rank {next_rank} published a bad address {addr:?}: {e}"))?;
    let mut stream = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(&sock, left.max(Duration::from_millis(10))) {
            Ok(stream) => break stream,
            Err(e) if Instant::now() >= deadline => {
                return Err(format!("cannot connect to rank {next_rank} at {addr}: {e}"))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    };
    let mut greeting = (pos as u64).to_le_bytes().to_vec();
    greeting.extend_from_slice(proof);
    stream
        .write_all(&greeting)
        .map_err(|e| format!("greeting rank {next_rank}: {e}"))?;
    Ok(stream)
}

/// Accepts the connection of the previous ring position `prev` (global rank `prev_rank`, named
/// in errors): the first that greets with `prev` and `proof` (others are dropped), by `deadline`.
fn accept_prev(
    listener: &TcpListener,
    prev: usize,
    prev_rank: usize,
    proof: &[u8; 32],
    deadline: Instant,
    timeout: Duration,
) -> Result<TcpStream, String> {
    listener
        .set_nonblocking(true)
        .map_err(|e| format!("listener: {e}"))?;
    loop {
        match listener.accept() {
            Ok((mut stream, peer)) => {
                let _ = stream.set_nonblocking(false);
                let _ = stream.set_read_timeout(Some(GREETING_TIMEOUT));
                let mut hello = [0u8; 40];
                if stream.read_exact(&mut hello).is_ok()
                    && u64::from_le_bytes(hello[..8].try_into().unwrap_or_default()) == prev as u64
                    && hello[8..] == proof[..]
                {
                    let _ = stream.set_read_timeout(None);
                    return Ok(stream);
                }
                // Not our neighbour (a stray or a stranger): drop it, keep waiting.
                tracing::warn!(%peer, "tcp ring: refused a connection that did not prove it belongs to this run");
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(format!(
                        "rank {prev_rank} did not connect within {:.1} s",
                        timeout.as_secs_f64()
                    ));
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(format!("accepting rank {prev_rank}: {e}")),
        }
    }
}

/// Hosts whose leader reported no shared memory (a counter).
const HOSTS_WITHOUT_SHM: &str = "tcp/hosts/shm/without";
/// Leaders that reported (a counter).
const HOSTS_REPORTED: &str = "tcp/hosts/shm/reported";
/// How many hosts lack shared memory, written once every leader has reported.
const HOSTS_VERDICT: &str = "tcp/hosts/shm/verdict";
/// How long an incoming ring connection has to send its greeting.
const GREETING_TIMEOUT: Duration = Duration::from_secs(2);

/// 32 random bytes from the operating system.
fn random_bytes() -> Result<[u8; 32], String> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).map_err(|e| format!("no random numbers from the OS: {e}"))?;
    Ok(bytes)
}

/// The ring's secret: drawn by position 0 and published in the store under `scope`, read by
/// the others.
fn ring_secret(
    rank: usize,
    scope: &str,
    store: &mut StoreClient,
    timeout: Duration,
) -> Result<Vec<u8>, String> {
    let key = format!("{scope}/secret");
    if rank == 0 {
        let secret = random_bytes()?.to_vec();
        store
            .set(&key, &secret)
            .map_err(|e| format!("publishing the ring secret: {e}"))?;
        return Ok(secret);
    }
    let mut got = store
        .wait(&[key.as_str()], timeout)
        .map_err(|e| format!("waiting for rank 0's ring secret: {e}"))?;
    Ok(got.remove(0))
}

/// What `from` sends `to` to prove it belongs to the run: SHA-256 of the secret, `to`'s nonce
/// and both ranks (a proof for one link is worthless on another).
fn ring_proof(secret: &[u8], nonce: &[u8], from: usize, to: usize) -> [u8; 32] {
    use sha2::Digest as _;
    let mut hash = sha2::Sha256::new();
    hash.update(b"gptrec ring v1");
    hash.update(secret);
    hash.update(nonce);
    hash.update((from as u64).to_le_bytes());
    hash.update((to as u64).to_le_bytes());
    hash.finalize().into()
}

/// The address other ranks can reach us at: loopback on a single node, otherwise the local
/// address of the route towards the master.
fn local_ip(env: &WorkerEnv) -> std::io::Result<IpAddr> {
    if env.group_world_size <= 1 {
        return Ok(IpAddr::V4(Ipv4Addr::LOCALHOST));
    }
    let socket = UdpSocket::bind("0.0.0.0:0")?;
    socket.connect((env.master_addr.as_str(), env.master_port))?;
    let ip = socket.local_addr()?.ip();
    if ip.is_unspecified() {
        return Err(std::io::Error::other("no route"));
    }
    Ok(ip)
}
