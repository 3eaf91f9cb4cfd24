//! `collective-bench`: all-reduce bandwidth of the `tcp` backend, for `scripts/bench/allreduce.sh`.
//! Run under `launch --num-processes N`; rank 0 prints one line per size:
//! `tcp <MiB> MiB: median <ms> ms, <GiB/s> GiB/s (algorithm bandwidth)`, and the single-thread
//! memcpy bandwidth of this machine (the ceiling for any intra-host scheme).
//!
//! Usage: collective-bench [SIZE_MIB ...]   (default: 1 16 64 256)

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use common::env_contract::WorkerEnv;
use dist::collective::tcp::TcpCollective;
use dist::collective::{Collective, OpContext, ReduceOp};
use tch::{Kind, Tensor};

fn main() -> Result<()> {
    let sizes: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().context("sizes are whole MiB"))
        .collect::<Result<_>>()?;
    let sizes = if sizes.is_empty() {
        vec![1, 16, 64, 256]
    } else {
        sizes
    };
    let env = WorkerEnv::from_env().context("reading the launch environment")?;
    let timeout = Duration::from_secs(120);
    let (_server, store) = dist::store::rendezvous(&env, timeout)?;
    let mut comm = TcpCollective::connect(&env, store, timeout)?;
    let ctx = OpContext { step: 0, timeout };
    let leader = env.rank == 0;
    if leader {
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
    for mib in sizes {
        let n = (mib << 20) / 4;
        let mut t = [Tensor::ones([n as i64], (Kind::Float, tch::Device::Cpu))];
        let iters = if mib >= 256 {
            5
        } else if mib >= 64 {
            10
        } else {
            20
        };
        let mut times = Vec::with_capacity(iters);
        for i in 0..iters + 2 {
            comm.barrier(ctx)?;
            let start = Instant::now();
            comm.all_reduce(&mut t, ReduceOp::Sum, ctx)?;
            if i >= 2 {
                times.push(start.elapsed().as_secs_f64());
            }
        }
        // Values stay exact (powers of the world size): check the result is right.
        let expect = (env.world_size as f64).powi(iters as i32 + 2);
        let got = t[0].double_value(&[0]);
        anyhow::ensure!(
            got == expect,
            "wrong all-reduce result {got}, expected {expect}"
        );
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        if leader {
            println!(
                "tcp {mib} MiB: median {:.1} ms, {:.2} GiB/s (algorithm bandwidth, {} ranks, {iters} runs)",
                median * 1e3,
                (mib as f64 / 1024.0) / median,
                env.world_size
            );
        }
    }
    Ok(())
}
