//! `ddp-fixture`: a test fixture, not a user-facing tool. It drives the real DDP engine, sampler,
//! optimizer, checkpoints and collectives with a small MLP regression task instead of the
//! recommender, so the end-to-end tests can check the engine's promises (equivalence across
//! world sizes, bit-identical ranks, exact resume, timeouts) in seconds on a CPU.
//! Run it like the worker: `launch --worker target/release/ddp-fixture CONFIG`.
//!
//! Extra behaviour for tests: writes `<run dir>/params-rank<R>.safetensors` at the end;
//! `GPTREC_STOP_AFTER_EPOCH=N` stops after epoch N (an interrupted run);
//! `GPTREC_FIXTURE_STOP_RANK=R` makes rank R stop itself with SIGSTOP before step 3 (a hung peer);
//! `GPTREC_FIXTURE_EXIT_AT_CALL=N` makes every rank exit with code 3 at its N-th micro-batch (a
//! crash between checkpoints); `GPTREC_FIXTURE_DROPOUT=P` adds dropout, so that the run uses
//! random numbers.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Parser;
use common::env_contract::WorkerEnv;
use common::train_plan::TrainPlan;
use tch::{nn, nn::Module, Device, Kind, Tensor};
use worker::trainer::{self as train, Task, TrainSetup};

/// DDP engine test fixture (an MLP on synthetic regression data).
#[derive(Debug, Parser)]
#[command(name = "ddp-fixture")]
struct Cli {
    #[arg(long = "set", value_name = "KEY.PATH=VALUE")]
    overrides: Vec<String>,
    #[arg(value_name = "CONFIG")]
    config: PathBuf,
}

/// Samples of the synthetic data set.
const SAMPLES: i64 = 480;
const INPUTS: i64 = 8;
const HIDDEN: i64 = 32;

struct Regression {
    model: nn::Sequential,
    x: Tensor,
    y: Tensor,
    stop_rank: Option<usize>,
    rank: usize,
    calls: usize,
    exit_at_call: Option<usize>,
    model_hash: String,
}

impl Task for Regression {
    fn train_len(&self) -> usize {
        SAMPLES as usize
    }

    fn loss(&mut self, indices: &[usize]) -> Result<Tensor, tch::TchError> {
        self.calls += 1;
        if self.exit_at_call == Some(self.calls) {
            eprintln!("ddp-fixture: simulated crash at micro-batch {}", self.calls);
            std::process::exit(3);
        }
        if self.stop_rank == Some(self.rank) && self.calls == 3 {
            // A hung peer: alive, holding its sockets, answering nothing.
            let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGSTOP);
        }
        let idx: Vec<i64> = indices.iter().map(|&i| i as i64).collect();
        let idx = Tensor::from_slice(&idx);
        let x = self.x.f_index_select(0, &idx)?;
        let y = self.y.f_index_select(0, &idx)?;
        self.model.forward(&x).f_mse_loss(&y, tch::Reduction::Mean)
    }

    fn model_hash(&self) -> String {
        self.model_hash.clone()
    }
}

fn env_number<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

fn main() -> ExitCode {
    worker::run_report::init_logging();
    worker::preempt::install();
    worker::run_report::exit_code("ddp-fixture", run())
}

fn run() -> Result<()> {
    let cli = Cli::parse();
    let env = WorkerEnv::from_env().context("reading the launch environment")?;
    let plan = TrainPlan::load(&cli.config, &cli.overrides, u64::from(env.world_size))
        .context("loading the config")?;
    let config = &plan.config;
    tch::set_num_threads(1);
    let (setup_timeout, limit_key) = config.dist.rendezvous_timeout();
    let within = || format!("(within {limit_key} = {} s)", setup_timeout.as_secs());
    let (_server, store) = runtime::store::rendezvous(&env, setup_timeout)
        .with_context(|| format!("rendezvous with the other ranks {}", within()))?;
    let comm = runtime::collective::connect(&config.dist, Device::Cpu, &env, store, setup_timeout)
        .with_context(|| format!("connecting the collective {}", within()))?;

    // The same seed everywhere: same data on every rank; a different init would be overwritten
    // by rank 0's anyway.
    tch::manual_seed(config.run.seed as i64);
    let x = Tensor::randn([SAMPLES, INPUTS], (Kind::Float, Device::Cpu));
    let w = Tensor::randn([INPUTS, 1], (Kind::Float, Device::Cpu));
    let y = x.matmul(&w).sin();
    // Each rank initialises differently on purpose: only rank 0's values may survive.
    tch::manual_seed(config.run.seed as i64 + 1000 * i64::from(env.rank));
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let model = nn::seq()
        .add(nn::linear(
            &root / "fc1",
            INPUTS,
            HIDDEN,
            Default::default(),
        ))
        .add_fn(|x| x.tanh())
        .add(nn::linear(&root / "fc2", HIDDEN, 1, Default::default()));
    let mut task = Regression {
        model,
        x,
        y,
        stop_rank: env_number("GPTREC_FIXTURE_STOP_RANK"),
        rank: env.rank as usize,
        calls: 0,
        exit_at_call: env_number("GPTREC_FIXTURE_EXIT_AT_CALL"),
        // The architecture plus the [model] section: a checkpoint of another model is refused.
        model_hash: {
            use sha2::Digest;
            let text = format!(
                "mlp-{INPUTS}-{HIDDEN}-1/{}",
                serde_json::to_string(&config.model).unwrap_or_default()
            );
            let digest = sha2::Sha256::digest(text.as_bytes());
            digest[..8].iter().map(|b| format!("{b:02x}")).collect()
        },
    };
    let run_dir = config.run.output_dir.join(&config.run.name);
    let setup = TrainSetup {
        plan: &plan,
        run_dir: run_dir.clone(),
        memory: Default::default(),
        stop_after_epoch: train::stop_after_epoch_from_env(),
        baseline: None,
    };
    let report = train::train(&mut task, &vs, comm, &setup).context("training")?;
    let params: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    let path = run_dir.join(format!("params-rank{}.safetensors", env.rank));
    Tensor::write_safetensors(&params, &path)
        .with_context(|| format!("writing {}", path.display()))?;
    println!(
        "rank {} done: {} steps, {} epochs, last loss {:?}",
        env.rank, report.steps, report.epochs_done, report.last_loss
    );
    Ok(())
}
