//! `worker`: one data-parallel training process. Started by `launch` (or torchrun) with the
//! environment contract; everything else comes from its command line. For now it reads and checks
//! what it was given — contract, config, batch plan, device — reports it, and brings up the
//! distributed runtime (rendezvous, collective) with a checked all-reduce; the recommender's
//! training comes next.

use std::path::PathBuf;
use std::process::ExitCode;

use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Parser;
use common::config::Config;
use common::env_contract::WorkerEnv;
use tch::{Kind, Tensor};
use worker::collective::{OpContext, ReduceOp};

/// One data-parallel worker of a `launch` job.
#[derive(Debug, Parser)]
#[command(name = "worker", version, about)]
struct Cli {
    /// Override a config value, e.g. `--set batch.micro=8` (repeatable).
    #[arg(long = "set", value_name = "KEY.PATH=VALUE")]
    overrides: Vec<String>,
    /// Training config (TOML).
    #[arg(value_name = "CONFIG")]
    config: PathBuf,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(&cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line, the whole chain of context: what was being done and why it failed.
            eprintln!("worker: error: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn run(cli: &Cli) -> Result<()> {
    let env = WorkerEnv::from_env().context("reading the launch environment")?;
    let config = Config::load(&cli.config, &cli.overrides).context("loading the config")?;
    let batch = config
        .batch
        .resolve(u64::from(env.world_size))
        .with_context(|| format!("{}: checking the batch plan", cli.config.display()))?;
    let device = pick_device(&env)?;
    println!(
        "worker rank {}/{} (local {}/{}, node {}/{}), pid {}, rendezvous {}:{} run id {}, restart {}/{}",
        env.rank,
        env.world_size,
        env.local_rank,
        env.local_world_size,
        env.group_rank,
        env.group_world_size,
        std::process::id(),
        env.master_addr,
        env.master_port,
        env.run_id,
        env.restart_count,
        env.max_restarts
    );
    println!(
        "config {} (run {:?}): {}",
        cli.config.display(),
        config.run.name,
        batch.derivation()
    );
    println!(
        "device {device:?}, libtorch threads {}, OMP_NUM_THREADS {}",
        tch::get_num_threads(),
        std::env::var("OMP_NUM_THREADS").unwrap_or_else(|_| "unset".into())
    );

    // The distributed runtime: rendezvous, then the collective, checked with one all-reduce.
    let timeout = Duration::from_secs(config.dist.timeout_s);
    let setup_timeout = timeout.max(worker::collective::SETUP_TIMEOUT_MIN);
    let (_store_server, store) = worker::store::rendezvous(&env, setup_timeout)
        .context("rendezvous with the other ranks")?;
    let mut comm =
        worker::collective::connect(config.dist.backend, device, &env, store, setup_timeout)
            .context("connecting the collective")?;
    let mut check = [Tensor::ones([4], (Kind::Float, device)) * f64::from(env.rank + 1)];
    let ctx = OpContext { step: 0, timeout };
    comm.all_reduce(&mut check, ReduceOp::Sum, ctx)
        .context("checking the collective")?;
    let expect = f64::from(env.world_size * (env.world_size + 1) / 2);
    let got = check[0].f_double_value(&[0])?;
    if got != expect {
        bail!(
            "the {} all-reduce gave {got}, expected {expect}",
            comm.name()
        );
    }
    comm.barrier(ctx).context("final barrier")?;
    println!(
        "collective {} ready: all-reduce over {} rank(s) checked",
        comm.name(),
        env.world_size
    );
    Ok(())
}

/// `cuda:LOCAL_RANK` when CUDA is usable, otherwise the CPU.
fn pick_device(env: &WorkerEnv) -> Result<tch::Device> {
    if !tch::Cuda::is_available() {
        return Ok(tch::Device::Cpu);
    }
    let count = tch::Cuda::device_count();
    let index = env.local_rank as i64;
    if index >= count {
        bail!(
            "LOCAL_RANK {index} has no GPU: only {count} visible (CUDA_VISIBLE_DEVICES={}); start at most {count} processes per node",
            std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "unset".into())
        );
    }
    Ok(tch::Device::Cuda(index as usize))
}
