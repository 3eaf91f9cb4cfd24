//! `worker`: one data-parallel training process. Started by `launch` (or torchrun) with the
//! environment contract; everything else comes from its command line. For now it reads and checks
//! what it was given — contract, config, batch plan, device — and reports it; the training comes
//! with the distributed runtime.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::Parser;
use common::config::Config;
use common::env_contract::WorkerEnv;

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
