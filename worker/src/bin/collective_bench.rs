//! `collective-bench`: all-reduce (or broadcast, all-gather, barrier: `--op`) latency and
//! bandwidth of the `tcp` backend, through shared memory (default on one host) or its socket
//! ring, for `scripts/bench/allreduce.sh`.
//! Run under `launch --num-processes N`; rank 0 prints one line per size:
//! `shm <size>: median <ms> ms (<us> us), <GiB/s> GiB/s (algorithm bandwidth)` (or `tcp ...`),
//! and the single-thread memcpy bandwidth of this machine (the ceiling for any intra-host scheme).
//!
//! With `--shared-buffer` the data lies in the shared-memory arena (`shm-arena` lines): it is
//! reduced where it lies, as DDP's gradient buckets are once flattened into it.
//!
//! With `--op broadcast` (from rank 0) or `--op all-gather` (SIZE is each rank's part; the
//! bandwidth counts the gathered bytes) lines start `shm broadcast`, `tcp all-gather`, ...;
//! `--op barrier` times barriers (SIZE ignored). `--op sharded-reduce` times what a sharded
//! training step (`dist.shard_optimizer`) does instead of an all-reduce: every rank's gradient
//! lies in shared memory, each rank averages its share of the rows over all of them where they
//! lie, and a barrier ends it (`shm-sharded` lines; SIZE is the gradient, as for all-reduce).
//!
//! Usage: collective-bench [--op OP] [--sockets | --shared-buffer] [SIZE ...]   (SIZE: MiB, or KiB with a
//! K suffix; default: 64K 1 16 64 256)

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use common::env_contract::WorkerEnv;
use runtime::collective::tcp::{TcpCollective, TcpOptions};
use runtime::collective::{Collective, OpContext, ReduceOp};
use tch::{Kind, Tensor};

/// A size argument: `64K` (KiB) or `16` (MiB), in bytes.
fn parse_size(arg: &str) -> Result<usize, String> {
    let (digits, unit) = match arg.strip_suffix(['K', 'k']) {
        Some(kib) => (kib, 1usize << 10),
        None => (arg, 1usize << 20),
    };
    match digits.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n * unit),
        _ => Err(format!(
            "expected a whole number of MiB, or of KiB with K (e.g. 64K), got {arg:?}"
        )),
    }
}

fn label(bytes: usize) -> String {
    if bytes < 1 << 20 {
        format!("{} KiB", bytes >> 10)
    } else {
        format!("{} MiB", bytes >> 20)
    }
}

/// All-reduce latency and bandwidth of the `tcp` backend; run under `launch --num-processes N`.
#[derive(Debug, clap::Parser)]
#[command(name = "collective-bench", version)]
struct Cli {
    /// Through the socket ring instead of shared memory.
    #[arg(long, conflicts_with = "shared_buffer")]
    sockets: bool,
    /// With the data in the shared-memory arena (reduced where it lies).
    #[arg(long = "shared-buffer")]
    shared_buffer: bool,
    /// All-gather in place: each rank's part is already its slot of the output (as FSDP gathers
    /// its parameters with `all_gather_into_tensor`), so its own part is not copied.
    #[arg(long = "in-place")]
    in_place: bool,
    /// The operation timed.
    #[arg(long, value_enum, default_value = "all-reduce")]
    op: Op,
    /// Sizes: MiB, or KiB with a K suffix (default: 64K 1 16 64 256).
    #[arg(value_name = "SIZE", value_parser = parse_size)]
    sizes: Vec<usize>,
}

/// What is timed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Op {
    AllReduce,
    Broadcast,
    AllGather,
    Barrier,
    ShardedReduce,
}

fn main() -> Result<()> {
    let cli = <Cli as clap::Parser>::parse();
    anyhow::ensure!(
        !cli.in_place || cli.op == Op::AllGather,
        "--in-place applies to --op all-gather only"
    );
    let (sockets, shared) = (cli.sockets, cli.shared_buffer);
    let sizes = if cli.sizes.is_empty() {
        vec![64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20]
    } else {
        cli.sizes
    };
    let env = WorkerEnv::from_env().context("reading the launch environment")?;
    let timeout = Duration::from_secs(120);
    let (_server, store) = runtime::store::rendezvous(&env, timeout)?;
    let options = TcpOptions {
        shared_memory: !sockets,
    };
    let mut comm = TcpCollective::connect_with(&env, store, timeout, options)?;
    let path = match (comm.uses_shared_memory(), shared) {
        (true, true) => "shm-arena",
        (true, false) => "shm",
        (false, _) => "tcp",
    };
    let name = match cli.op {
        Op::AllReduce => path.to_string(),
        Op::Broadcast => format!("{path} broadcast"),
        Op::AllGather if cli.in_place => format!("{path} all-gather in place"),
        Op::AllGather => format!("{path} all-gather"),
        Op::Barrier => format!("{path} barrier"),
        Op::ShardedReduce => "shm-sharded".to_string(),
    };
    let ctx = OpContext { step: 0, timeout };
    let leader = env.rank == 0;
    if leader {
        print_memcpy_bandwidth();
    }
    for bytes in sizes {
        let iters = match bytes >> 20 {
            256.. => 5,
            64.. => 10,
            1.. => 20,
            _ => 200,
        };
        let mut times = match cli.op {
            Op::AllReduce if shared && comm.uses_shared_memory() => {
                time_shared(&mut comm, bytes / 4, iters, ctx)?
            }
            Op::AllReduce => time_private(&mut comm, bytes / 4, iters, ctx)?,
            Op::Broadcast => time_broadcast(&mut comm, bytes / 4, iters, ctx)?,
            Op::AllGather => time_all_gather(&mut comm, bytes / 4, iters, cli.in_place, ctx)?,
            Op::Barrier => time_barrier(&mut comm, 1000, ctx)?,
            Op::ShardedReduce => time_sharded(&mut comm, bytes / 4, iters, ctx)?,
        };
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        // The bytes each rank ends with: all of them for an all-gather.
        let moved = match cli.op {
            Op::AllGather => bytes * env.world_size as usize,
            _ => bytes,
        };
        if cli.op == Op::Barrier {
            if leader {
                println!(
                    "{name}: median {:.1} us ({} ranks, 1000 runs)",
                    median * 1e6,
                    env.world_size
                );
            }
            break; // the sizes mean nothing to a barrier
        }
        if leader {
            println!(
                "{name} {}: median {:.3} ms ({:.0} us), {:.2} GiB/s (algorithm bandwidth, {} ranks, {iters} runs)",
                label(bytes),
                median * 1e3,
                median * 1e6,
                moved as f64 / (1u64 << 30) as f64 / median,
                env.world_size
            );
        }
    }
    Ok(())
}

/// The single-thread `memcpy` bandwidth of this machine (the ceiling for any intra-host
/// scheme), on stdout.
fn print_memcpy_bandwidth() {
    let bytes = 64usize << 20;
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        dst.copy_from_slice(&src);
        best = best.min(t.elapsed().as_secs_f64());
    }
    std::hint::black_box(&dst);
    println!(
        "memcpy 64 MiB (one thread): {:.1} ms, {:.2} GiB/s",
        best * 1e3,
        bytes as f64 / best / (1u64 << 30) as f64
    );
}

/// Times `iters` all-reduces of `n` ones in a private tensor (after two warm-up runs) and checks
/// the result.
fn time_private(
    comm: &mut TcpCollective,
    n: usize,
    iters: usize,
    ctx: OpContext,
) -> Result<Vec<f64>> {
    let mut t = [Tensor::ones([n as i64], (Kind::Float, tch::Device::Cpu))];
    let mut times = Vec::with_capacity(iters);
    for i in 0..iters + 2 {
        let _ = t[0].fill_(1.0);
        comm.barrier(ctx)?;
        let start = Instant::now();
        comm.all_reduce(&mut t, ReduceOp::Sum, ctx)?;
        if i >= 2 {
            times.push(start.elapsed().as_secs_f64());
        }
    }
    let ends = [t[0].double_value(&[0]), t[0].double_value(&[n as i64 - 1])];
    check_sum(comm, ends)?;
    Ok(times)
}

/// As [`time_private`], with the data in the shared-memory arena.
fn time_shared(
    comm: &mut TcpCollective,
    n: usize,
    iters: usize,
    ctx: OpContext,
) -> Result<Vec<f64>> {
    let mut times = Vec::with_capacity(iters);
    for i in 0..iters + 2 {
        comm.shared_buffer(n, ctx)?
            .context("no shared-memory arena could be had")?
            .fill(1.0);
        comm.barrier(ctx)?;
        let start = Instant::now();
        comm.all_reduce_shared(n, ReduceOp::Sum, ctx)?;
        if i >= 2 {
            times.push(start.elapsed().as_secs_f64());
        }
    }
    let buf = comm.shared_buffer(n, ctx)?.context("the arena went away")?;
    let ends = [buf[0] as f64, buf[n - 1] as f64];
    check_sum(comm, ends)?;
    Ok(times)
}

/// Times `iters` broadcasts from rank 0 of `n` floats (rank 0's are its rank + 1) and checks
/// what arrived.
fn time_broadcast(
    comm: &mut TcpCollective,
    n: usize,
    iters: usize,
    ctx: OpContext,
) -> Result<Vec<f64>> {
    let mine = comm.rank() as f64 + 1.0;
    let mut t = [Tensor::full(
        [n as i64],
        mine,
        (Kind::Float, tch::Device::Cpu),
    )];
    let mut times = Vec::with_capacity(iters);
    for i in 0..iters + 2 {
        let _ = t[0].fill_(mine);
        comm.barrier(ctx)?;
        let start = Instant::now();
        comm.broadcast(&mut t, 0, ctx)?;
        if i >= 2 {
            times.push(start.elapsed().as_secs_f64());
        }
    }
    let got = [t[0].double_value(&[0]), t[0].double_value(&[n as i64 - 1])];
    anyhow::ensure!(got == [1.0, 1.0], "wrong broadcast result {got:?}");
    Ok(times)
}

/// Times `iters` all-gathers of `n` floats per rank (each rank's hold its rank) into outputs
/// kept from run to run, and checks them; `in_place`: each rank's part is its own output slot.
fn time_all_gather(
    comm: &mut TcpCollective,
    n: usize,
    iters: usize,
    in_place: bool,
    ctx: OpContext,
) -> Result<Vec<f64>> {
    let mine = comm.rank() as f64;
    let t = Tensor::full([n as i64], mine, (Kind::Float, tch::Device::Cpu));
    let mut times = Vec::with_capacity(iters);
    // Into outputs kept from run to run, as `torch.distributed.all_gather(out, t)` is used.
    let mut parts: Vec<Tensor> = (0..comm.world_size()).map(|_| t.zeros_like()).collect();
    let t = if in_place {
        parts[comm.rank()].copy_(&t);
        parts[comm.rank()].shallow_clone()
    } else {
        t
    };
    for i in 0..iters + 2 {
        comm.barrier(ctx)?;
        let start = Instant::now();
        comm.all_gather_into(&t, &mut parts, ctx)?;
        if i >= 2 {
            times.push(start.elapsed().as_secs_f64());
        }
    }
    for (r, part) in parts.iter().enumerate() {
        let got = part.double_value(&[n as i64 - 1]);
        anyhow::ensure!(got == r as f64, "wrong all-gather part {r}: {got}");
    }
    Ok(times)
}

/// Times `iters` sharded reductions of `n` floats per rank (every rank's are its rank + 1, in
/// memory shared by all): each rank averages its share of the floats over every rank's where
/// they lie, then a barrier; checks the means.
fn time_sharded(
    comm: &mut TcpCollective,
    n: usize,
    iters: usize,
    ctx: OpContext,
) -> Result<Vec<f64>> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let memory = comm
        .host_shared(n * world, ctx)?
        .context("no shared memory between the ranks")?;
    let block = |r: usize| {
        // SAFETY: `n * world` floats of shared memory, mapped until the process exits.
        unsafe { memory.as_ptr().add(r * n) }
    };
    let sources: Vec<*const f32> = (0..world).map(|r| block(r) as *const f32).collect();
    let (lo, hi) = (n * rank / world, n * (rank + 1) / world);
    let mut times = Vec::with_capacity(iters);
    for i in 0..iters + 2 {
        // SAFETY: our own block, which no other rank writes.
        unsafe { std::slice::from_raw_parts_mut(block(rank), n) }.fill(rank as f32 + 1.0);
        comm.barrier(ctx)?;
        let start = Instant::now();
        // SAFETY: rows lo..hi of our block are ours alone to write; every block is complete
        // (the barrier above) and valid for n floats.
        unsafe { runtime::ddp::mean_into(&sources, block(rank), lo, hi, world as f32) };
        comm.barrier(ctx)?;
        if i >= 2 {
            times.push(start.elapsed().as_secs_f64());
        }
    }
    let want = (1..=world).sum::<usize>() as f32 / world as f32;
    // SAFETY: as above; every rank finished its share (the last barrier).
    let ours = unsafe { std::slice::from_raw_parts(block(rank), n) };
    anyhow::ensure!(
        ours[lo..hi].iter().all(|x| *x == want),
        "wrong sharded mean, expected {want}"
    );
    Ok(times)
}

/// Times `iters` barriers, one after another.
fn time_barrier(comm: &mut TcpCollective, iters: usize, ctx: OpContext) -> Result<Vec<f64>> {
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters {
        let start = Instant::now();
        comm.barrier(ctx)?;
        times.push(start.elapsed().as_secs_f64());
    }
    Ok(times)
}

/// Every run sums ones: each element must hold the world size.
fn check_sum(comm: &TcpCollective, ends: [f64; 2]) -> Result<()> {
    let expect = comm.world_size() as f64;
    let got = ends[0].min(ends[1]);
    anyhow::ensure!(
        got == expect,
        "wrong all-reduce result {got}, expected {expect}"
    );
    Ok(())
}
