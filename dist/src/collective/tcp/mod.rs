//! The `tcp` backend: CPU tensors over persistent TCP connections arranged in a ring (each rank
//! sends to `rank + 1` and receives from `rank - 1`). All-reduce is the bandwidth-optimal ring:
//! reduce-scatter then all-gather, `2 (W-1)/W` of the buffer on the wire per rank, with a sender
//! thread so that sending, receiving and reducing overlap. Addresses are exchanged through the
//! rendezvous store, which also serves to find out who is silent when an operation times out.
//! A ring connection must prove it belongs to the run: rank 0 draws a secret and publishes it in
//! the store (which only admits the run's own ranks), every rank publishes a nonce with its
//! address, and the greeting carries SHA-256(secret, nonce, ranks); anything else is dropped.
//! It must not be used for CUDA tensors in production (they are copied through the host).

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::time::{Duration, Instant};

use common::env_contract::WorkerEnv;
use tch::{Device, Kind, Tensor};

use link::{exchange, read_exact_until, write_all_until};

use super::shm::{ShmFailure, ShmGroup};
use super::{flatten_f32, unflatten_into, Collective, CollectiveError, OpContext, ReduceOp};
use crate::store::StoreClient;

/// Accepts the previous rank's connection: the first that greets with its rank and `proof`
/// (others are dropped), by `deadline`.
fn accept_prev(
    listener: &TcpListener,
    prev: usize,
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
                        "rank {prev} did not connect within {:.1} s",
                        timeout.as_secs_f64()
                    ));
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(format!("accepting rank {prev}: {e}")),
        }
    }
}

/// How long an incoming ring connection has to send its greeting.
const GREETING_TIMEOUT: Duration = Duration::from_secs(2);

/// 32 random bytes from the operating system.
fn random_bytes() -> Result<[u8; 32], String> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).map_err(|e| format!("no random numbers from the OS: {e}"))?;
    Ok(bytes)
}

/// The run's ring secret: drawn by rank 0 and published in the store, read by the others.
fn ring_secret(rank: usize, store: &mut StoreClient, timeout: Duration) -> Result<Vec<u8>, String> {
    if rank == 0 {
        let secret = random_bytes()?.to_vec();
        store
            .set("tcp/secret", &secret)
            .map_err(|e| format!("publishing the ring secret: {e}"))?;
        return Ok(secret);
    }
    let mut got = store
        .wait(&["tcp/secret"], timeout)
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

/// Bytes received and reduced at a time.
const PIECE_BYTES: usize = 1 << 20;
const HEADER_MAGIC: u32 = 0x5249_4e47; // "RING"

/// How the `tcp` backend may move data besides its socket ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpOptions {
    /// All-reduce through shared memory when every rank runs on this host (`[dist]
    /// shared_memory`). Default: true.
    pub shared_memory: bool,
}

impl Default for TcpOptions {
    fn default() -> Self {
        TcpOptions {
            shared_memory: true,
        }
    }
}

/// The ring communicator of one rank.
pub struct TcpCollective {
    rank: usize,
    world: usize,
    /// Connection to `rank + 1` (we write), and from `rank - 1` (we read). None when world is 1.
    links: Option<(TcpStream, TcpStream)>,
    /// Every rank's segment, when all ranks share this host and shared memory could be had:
    /// all-reduces (and barriers) go through it instead of the ring.
    shm: Option<ShmGroup>,
    store: StoreClient,
    /// Operations issued so far; identical on every rank when they call the same operations.
    seq: u64,
    scratch: Vec<f32>,
}

/// Why a transfer failed, before it is turned into a [`CollectiveError`].
enum LinkFailure {
    Timeout,
    Send(std::io::Error),
    Recv(std::io::Error),
}

/// What to do with received bytes.
enum Sink<'a> {
    Copy(&'a mut [u8]),
    Add(&'a mut [f32]),
}

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
    /// accept the previous one; then, when every rank runs on this host and `options` allow,
    /// the shared-memory group. `store` becomes this communicator's own client.
    pub fn connect_with(
        env: &WorkerEnv,
        store: StoreClient,
        timeout: Duration,
        options: TcpOptions,
    ) -> Result<TcpCollective, CollectiveError> {
        let mut comm = Self::connect_ring(env, store, timeout)?;
        if options.shared_memory && comm.world > 1 && env.group_world_size <= 1 {
            let ranks: Vec<usize> = (0..comm.world).collect();
            comm.shm = ShmGroup::connect(&mut comm.store, comm.rank, &ranks, timeout).map_err(
                |detail| CollectiveError::Setup {
                    backend: "tcp",
                    detail: format!("setting up shared memory: {detail}"),
                },
            )?;
        }
        Ok(comm)
    }

    /// Whether all-reduces go through shared memory (rather than the socket ring).
    pub fn uses_shared_memory(&self) -> bool {
        self.shm.is_some()
    }

    fn connect_ring(
        env: &WorkerEnv,
        mut store: StoreClient,
        timeout: Duration,
    ) -> Result<TcpCollective, CollectiveError> {
        let rank = env.rank as usize;
        let world = env.world_size as usize;
        let setup = |detail: String| CollectiveError::Setup {
            backend: "tcp",
            detail,
        };
        if world == 1 {
            return Ok(TcpCollective {
                rank,
                world,
                links: None,
                shm: None,
                store,
                seq: 0,
                scratch: Vec::new(),
            });
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
        let secret = ring_secret(rank, &mut store, timeout).map_err(&setup)?;
        let nonce = random_bytes().map_err(&setup)?;
        store
            .set(&format!("tcp/nonce/{rank}"), &nonce)
            .map_err(|e| setup(format!("publishing our nonce: {e}")))?;
        store
            .set(&format!("tcp/addr/{rank}"), addr.to_string().as_bytes())
            .map_err(|e| setup(format!("publishing our address: {e}")))?;
        let next = (rank + 1) % world;
        let prev = (rank + world - 1) % world;
        let next_key = format!("tcp/addr/{next}");
        let next_nonce = format!("tcp/nonce/{next}");
        let published = store
            .wait(&[next_key.as_str(), next_nonce.as_str()], timeout)
            .map_err(|e| setup(format!("waiting for rank {next}'s address: {e}")))?;
        let next_addr = String::from_utf8_lossy(&published[0]).into_owned();
        let proof = ring_proof(&secret, &published[1], rank, next);

        let next_sock: SocketAddr = next_addr.parse().map_err(|e| {
            setup(format!(
                "rank {next} published a bad address {next_addr:?}: {e}"
            ))
        })?;
        let mut to_next = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match TcpStream::connect_timeout(&next_sock, left.max(Duration::from_millis(10))) {
                Ok(stream) => break stream,
                Err(e) if Instant::now() >= deadline => {
                    return Err(setup(format!(
                        "cannot connect to rank {next} at {next_addr}: {e}"
                    )))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        let mut greeting = (rank as u64).to_le_bytes().to_vec();
        greeting.extend_from_slice(&proof);
        to_next
            .write_all(&greeting)
            .map_err(|e| setup(format!("greeting rank {next}: {e}")))?;

        let proof = ring_proof(&secret, &nonce, prev, rank);
        let from_prev = accept_prev(&listener, prev, &proof, deadline, timeout).map_err(setup)?;
        for stream in [&to_next, &from_prev] {
            stream
                .set_nodelay(true)
                .map_err(|e| setup(format!("socket option: {e}")))?;
        }
        Ok(TcpCollective {
            rank,
            world,
            links: Some((to_next, from_prev)),
            shm: None,
            store,
            seq: 0,
            scratch: vec![0.0; PIECE_BYTES / 4],
        })
    }

    fn next(&self) -> usize {
        (self.rank + 1) % self.world
    }

    fn prev(&self) -> usize {
        (self.rank + self.world - 1) % self.world
    }

    /// Checks that the previous rank is running the same operation on the same amount of data.
    fn handshake(
        &mut self,
        op: &'static str,
        code: u8,
        len: u64,
        ctx: OpContext,
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        self.seq += 1;
        let mut header = [0u8; 24];
        header[..4].copy_from_slice(&HEADER_MAGIC.to_le_bytes());
        header[4] = code;
        header[8..16].copy_from_slice(&self.seq.to_le_bytes());
        header[16..24].copy_from_slice(&len.to_le_bytes());
        let mut theirs = [0u8; 24];
        self.transfer(&header, Sink::Copy(&mut theirs), op, ctx, deadline)?;
        if theirs != header {
            let their_seq = u64::from_le_bytes(theirs[8..16].try_into().unwrap_or_default());
            let their_len = u64::from_le_bytes(theirs[16..24].try_into().unwrap_or_default());
            return Err(CollectiveError::Mismatch {
                op,
                step: ctx.step,
                detail: format!(
                    "rank {} is at operation #{their_seq} ({}, {their_len} elements) while rank {} is at #{} ({op}, {len} elements)",
                    self.prev(),
                    op_name(theirs[4]),
                    self.rank,
                    self.seq
                ),
            });
        }
        Ok(())
    }

    /// Sends `send` to the next rank while receiving as many bytes as the sink holds from the
    /// previous one.
    fn transfer(
        &mut self,
        send: &[u8],
        sink: Sink<'_>,
        op: &'static str,
        ctx: OpContext,
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        let Some((to_next, from_prev)) = self.links.as_mut() else {
            return Ok(());
        };
        match exchange(to_next, from_prev, send, sink, &mut self.scratch, deadline) {
            Ok(()) => Ok(()),
            Err(LinkFailure::Timeout) => Err(self.timeout_error(op, ctx)),
            Err(LinkFailure::Send(source)) => Err(CollectiveError::Peer {
                op,
                step: ctx.step,
                peer: self.next(),
                source,
            }),
            Err(LinkFailure::Recv(source)) => Err(CollectiveError::Peer {
                op,
                step: ctx.step,
                peer: self.prev(),
                source,
            }),
        }
    }

    fn timeout_error(&mut self, op: &'static str, ctx: OpContext) -> CollectiveError {
        let upstream = self.prev();
        let who = super::silent_ranks(&mut self.store, self.seq, self.rank, self.world, upstream);
        CollectiveError::Timeout {
            op,
            step: ctx.step,
            after: ctx.timeout.as_secs_f64(),
            who,
        }
    }

    /// Ring all-reduce (sum) of `buf` in place.
    fn ring_all_reduce(
        &mut self,
        buf: &mut [f32],
        ctx: OpContext,
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        let (w, r, n) = (self.world, self.rank, buf.len());
        let bounds = |i: usize| (i * n / w, (i + 1) * n / w);
        // Reduce-scatter: after W-1 steps chunk (r+1) % W holds the full sum.
        for s in 0..w - 1 {
            let send = bounds((r + w - s) % w);
            let recv = bounds((r + 2 * w - s - 1) % w);
            let (send_bytes, sink) = split_send_recv(buf, send, recv);
            self.transfer(send_bytes, Sink::Add(sink), "all_reduce", ctx, deadline)?;
        }
        // All-gather: pass the finished chunks around.
        for s in 0..w - 1 {
            let send = bounds((r + 1 + w - s) % w);
            let recv = bounds((r + w - s) % w);
            let (send_bytes, sink) = split_send_recv(buf, send, recv);
            self.transfer(
                send_bytes,
                Sink::Copy(as_bytes_mut(sink)),
                "all_reduce",
                ctx,
                deadline,
            )?;
        }
        Ok(())
    }

    /// All-reduce (sum) of `buf` in place through the shared-memory group.
    fn shm_all_reduce(
        &mut self,
        buf: &mut [f32],
        ctx: OpContext,
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        self.seq += 1;
        let Some(shm) = self.shm.as_mut() else {
            return Ok(());
        };
        match shm.all_reduce(buf, self.seq, deadline) {
            Ok(()) => Ok(()),
            Err(ShmFailure::Timeout) => Err(self.timeout_error("all_reduce", ctx)),
            Err(ShmFailure::Exited { rank, pid }) => Err(CollectiveError::Peer {
                op: "all_reduce",
                step: ctx.step,
                peer: rank,
                source: std::io::Error::other(format!(
                    "its process {pid} exited (shared memory)"
                )),
            }),
            Err(ShmFailure::Mismatch {
                rank,
                their_seq,
                their_len,
            }) => Err(CollectiveError::Mismatch {
                op: "all_reduce",
                step: ctx.step,
                detail: format!(
                    "rank {rank} is at operation #{their_seq} ({their_len} elements) while rank {} is at #{} (all_reduce, {} elements)",
                    self.rank,
                    self.seq,
                    buf.len()
                ),
            }),
        }
    }

    /// Ring all-gather of equal-sized byte chunks: chunk `rank` is ours on entry, all are
    /// filled on return.
    fn ring_all_gather(
        &mut self,
        buf: &mut [u8],
        chunk: usize,
        ctx: OpContext,
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        let (w, r) = (self.world, self.rank);
        for s in 0..w - 1 {
            let send_i = (r + w - s) % w;
            let recv_i = (r + 2 * w - s - 1) % w;
            let (send, recv) = split_pair(
                buf,
                (send_i * chunk, (send_i + 1) * chunk),
                (recv_i * chunk, (recv_i + 1) * chunk),
            );
            self.transfer(send, Sink::Copy(recv), "all_gather", ctx, deadline)?;
        }
        Ok(())
    }
}

impl Collective for TcpCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn name(&self) -> &'static str {
        if self.shm.is_some() {
            "tcp (shared memory)"
        } else {
            "tcp"
        }
    }

    fn all_reduce(
        &mut self,
        tensors: &mut [Tensor],
        op: ReduceOp,
        ctx: OpContext,
    ) -> Result<(), CollectiveError> {
        if self.world == 1 || tensors.is_empty() {
            return Ok(());
        }
        let deadline = Instant::now() + ctx.timeout;
        // One contiguous f32 CPU tensor is reduced where it lies; anything else goes through
        // a flat bucket.
        let direct = tensors.len() == 1
            && tensors[0].device() == Device::Cpu
            && tensors[0].kind() == Kind::Float
            && tensors[0].is_contiguous();
        let flat = if direct {
            tensors[0].shallow_clone()
        } else {
            flatten_f32(tensors, Device::Cpu)?
        };
        let n = flat.numel();
        if n == 0 {
            return Ok(()); // the same on every rank: nothing to exchange
        }
        // SAFETY: `flat` is a contiguous f32 CPU tensor of `n` elements that nothing else
        // touches while we hold this slice.
        let buf = unsafe { std::slice::from_raw_parts_mut(flat.data_ptr() as *mut f32, n) };
        if self.shm.is_some() {
            self.shm_all_reduce(buf, ctx, deadline)?;
        } else {
            self.handshake("all_reduce", 1, n as u64, ctx, deadline)?;
            self.ring_all_reduce(buf, ctx, deadline)?;
        }
        if op == ReduceOp::Avg {
            let w = self.world as f32;
            buf.iter_mut().for_each(|x| *x /= w);
        }
        if !direct {
            unflatten_into(&flat, tensors)?;
        }
        Ok(())
    }

    fn broadcast(
        &mut self,
        tensors: &mut [Tensor],
        root: usize,
        ctx: OpContext,
    ) -> Result<(), CollectiveError> {
        if root >= self.world {
            return Err(CollectiveError::Unsupported {
                op: "broadcast",
                detail: format!("root {root} is not a rank of a world of {}", self.world),
            });
        }
        if self.world == 1 || tensors.is_empty() {
            return Ok(());
        }
        let deadline = Instant::now() + ctx.timeout;
        let mut bytes = Vec::new();
        let mut sizes = Vec::with_capacity(tensors.len());
        for t in tensors.iter() {
            let start = bytes.len();
            let n = tensor_bytes(t)?;
            bytes.resize(start + n.len(), 0);
            bytes[start..].copy_from_slice(&n);
            sizes.push(n.len());
        }
        self.handshake("broadcast", 2, bytes.len() as u64, ctx, deadline)?;
        let forward = self.next() != root;
        let receive = self.rank != root;
        let Some((to_next, from_prev)) = self.links.as_mut() else {
            return Ok(());
        };
        let mut result = Ok(());
        for piece in bytes.chunks_mut(PIECE_BYTES) {
            if receive {
                if let Err(e) = read_exact_until(from_prev, piece, deadline) {
                    result = Err(e.map_recv());
                    break;
                }
            }
            if forward {
                if let Err(e) = write_all_until(to_next, piece, deadline) {
                    result = Err(e);
                    break;
                }
            }
        }
        match result {
            Ok(()) => {}
            Err(LinkFailure::Timeout) => return Err(self.timeout_error("broadcast", ctx)),
            Err(LinkFailure::Send(source)) => {
                return Err(CollectiveError::Peer {
                    op: "broadcast",
                    step: ctx.step,
                    peer: self.next(),
                    source,
                })
            }
            Err(LinkFailure::Recv(source)) => {
                return Err(CollectiveError::Peer {
                    op: "broadcast",
                    step: ctx.step,
                    peer: self.prev(),
                    source,
                })
            }
        }
        if receive {
            let mut offset = 0;
            for (t, len) in tensors.iter_mut().zip(sizes) {
                let src =
                    Tensor::f_from_data_size(&bytes[offset..offset + len], &t.size(), t.kind())?;
                t.f_copy_(&src)?;
                offset += len;
            }
        }
        Ok(())
    }

    fn all_gather(
        &mut self,
        tensor: &Tensor,
        ctx: OpContext,
    ) -> Result<Vec<Tensor>, CollectiveError> {
        if self.world == 1 {
            let mut copy = tensor.f_zeros_like()?.f_to_device(Device::Cpu)?;
            copy.f_copy_(tensor)?;
            return Ok(vec![copy]);
        }
        let deadline = Instant::now() + ctx.timeout;
        let mine = tensor_bytes(tensor)?;
        let chunk = mine.len();
        self.handshake("all_gather", 3, chunk as u64, ctx, deadline)?;
        let mut buf = vec![0u8; chunk * self.world];
        buf[self.rank * chunk..(self.rank + 1) * chunk].copy_from_slice(&mine);
        self.ring_all_gather(&mut buf, chunk, ctx, deadline)?;
        (0..self.world)
            .map(|i| {
                Ok(Tensor::f_from_data_size(
                    &buf[i * chunk..(i + 1) * chunk],
                    &tensor.size(),
                    tensor.kind(),
                )?)
            })
            .collect()
    }

    fn barrier(&mut self, ctx: OpContext) -> Result<(), CollectiveError> {
        let mut token = [Tensor::from_slice(&[1.0f32])];
        self.all_reduce(&mut token, ReduceOp::Sum, ctx)
    }
}

impl LinkFailure {
    /// A read that failed is the receiving side's problem.
    fn map_recv(self) -> LinkFailure {
        match self {
            LinkFailure::Send(e) => LinkFailure::Recv(e),
            other => other,
        }
    }
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

/// The bytes of a tensor's values (contiguous, on the CPU).
fn tensor_bytes(t: &Tensor) -> Result<Vec<u8>, tch::TchError> {
    let t = t.f_detach()?.f_to_device(Device::Cpu)?.f_contiguous()?;
    let n = t.numel();
    let mut bytes = vec![0u8; n * t.f_kind()?.elt_size_in_bytes()];
    t.f_copy_data_u8(&mut bytes, n)?;
    Ok(bytes)
}

fn op_name(code: u8) -> &'static str {
    match code {
        1 => "all_reduce",
        2 => "broadcast",
        3 => "all_gather",
        _ => "an unknown operation",
    }
}

fn as_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and any byte pattern is a valid u8.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

fn as_bytes_mut(v: &mut [f32]) -> &mut [u8] {
    // SAFETY: as above; every byte pattern written is a valid f32 bit pattern.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, std::mem::size_of_val(v)) }
}

/// Disjoint views of chunk `send` (to send, as bytes) and chunk `recv` (to fill) of `buf`.
fn split_send_recv(
    buf: &mut [f32],
    send: (usize, usize),
    recv: (usize, usize),
) -> (&[u8], &mut [f32]) {
    let (send, recv) = split_pair(buf, send, recv);
    (as_bytes(send), recv)
}

/// Disjoint views of the half-open ranges `send` and `recv` (which do not overlap; either may
/// be empty, as happens when the buffer is shorter than the world size).
fn split_pair<T>(buf: &mut [T], send: (usize, usize), recv: (usize, usize)) -> (&[T], &mut [T]) {
    if send.0 == send.1 {
        return (&[], &mut buf[recv.0..recv.1]);
    }
    if recv.0 == recv.1 {
        return (&buf[send.0..send.1], &mut []);
    }
    if send.0 < recv.0 {
        let (lo, hi) = buf.split_at_mut(recv.0);
        (&lo[send.0..send.1], &mut hi[..recv.1 - recv.0])
    } else {
        let (lo, hi) = buf.split_at_mut(send.0);
        (&hi[..send.1 - send.0], &mut lo[recv.0..recv.1])
    }
}

mod link;

#[cfg(any(test, feature = "test-support"))]
pub mod test_ring;

#[cfg(test)]
mod tests;
