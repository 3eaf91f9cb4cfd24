//! `worker`: one data-parallel training process. Started by `launch` (or torchrun) with the
//! environment contract; everything else comes from its command line. It checks what it was
//! given (contract, config, batch plan, device), brings up the distributed runtime (rendezvous,
//! a collective checked with one all-reduce), loads or generates the data, evaluates the
//! popularity baseline, builds the recommender of `[model]` and trains it (`worker::train`);
//! rank 0 prints the summary next to the baseline. It owns no training logic itself.

use std::path::PathBuf;
use std::process::ExitCode;

use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Parser;
use common::config::{Config, ModelKind};
use common::env_contract::WorkerEnv;
use tch::{nn, Kind, Tensor};
use tracing::info;
use worker::collective::{OpContext, ReduceOp};
use worker::rec;
use worker::train::{self, Split, TrainSetup};

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
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .without_time()
        .with_target(false)
        .init();
    match run(&cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line, the whole chain of context: what was being done and why it failed.
            eprintln!("worker: error: {:#}", e.error);
            ExitCode::from(e.code)
        }
    }
}

/// An error and the exit code it maps to: 2 for what the user gave us (environment, config,
/// batch plan), 1 for a failure while running.
struct Failure {
    error: anyhow::Error,
    code: u8,
}

fn usage(error: anyhow::Error) -> Failure {
    Failure { error, code: 2 }
}

impl<E: Into<anyhow::Error>> From<E> for Failure {
    fn from(e: E) -> Failure {
        Failure {
            error: e.into(),
            code: 1,
        }
    }
}

fn run(cli: &Cli) -> Result<(), Failure> {
    let env = WorkerEnv::from_env()
        .context("reading the launch environment")
        .map_err(usage)?;
    let config = Config::load(&cli.config, &cli.overrides)
        .context("loading the config")
        .map_err(usage)?;
    let batch = config
        .batch
        .resolve(u64::from(env.world_size))
        .with_context(|| format!("{}: checking the batch plan", cli.config.display()))
        .map_err(usage)?;
    let device = pick_device(&env).map_err(usage)?;
    let leader = env.rank == 0;
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
    let ctx = OpContext {
        step: 0,
        timeout: setup_timeout.max(rec::EVAL_TIMEOUT_MIN),
    };
    comm.all_reduce(&mut check, ReduceOp::Sum, ctx)
        .context("checking the collective")?;
    let expect = f64::from(env.world_size * (env.world_size + 1) / 2);
    let got = check[0].f_double_value(&[0])?;
    if got != expect {
        return Err(anyhow::anyhow!(
            "the {} all-reduce gave {got}, expected {expect}",
            comm.name()
        )
        .into());
    }
    println!(
        "collective {} ready: all-reduce over {} rank(s) checked",
        comm.name(),
        env.world_size
    );

    // Data: the same on every rank (the split is seeded), read or generated.
    let data = rec::load_data(&config, comm.as_mut(), ctx).context("loading the data")?;
    let ds = &data.dataset;
    if leader {
        info!(
            "data {}: {} users, {} items, {} train / {} valid / {} test interactions (ratings >= {})",
            data.source.display(),
            ds.n_users,
            ds.n_items,
            data.train_interactions(),
            ds.valid.iter().map(Vec::len).sum::<usize>(),
            ds.test.iter().map(Vec::len).sum::<usize>(),
            config.data.min_rating
        );
    }
    let run_dir = config.run.output_dir.join(&config.run.name);
    let ks = &config.eval.topk;
    let users_at_once = config.eval.batch_users;
    let pop_valid =
        rec::evaluate_popularity(&data, Split::Valid, ks, users_at_once, comm.as_mut(), ctx)
            .context("evaluating the popularity baseline")?;
    let pop_test =
        rec::evaluate_popularity(&data, Split::Test, ks, users_at_once, comm.as_mut(), ctx)
            .context("evaluating the popularity baseline")?;

    if config.model.kind == ModelKind::Pop {
        if leader {
            std::fs::create_dir_all(&run_dir)
                .with_context(|| format!("creating {}", run_dir.display()))?;
            let path = run_dir.join("config.resolved.toml");
            std::fs::write(&path, config.to_toml()?)
                .with_context(|| format!("writing {}", path.display()))?;
            let path = run_dir.join("metrics.jsonl");
            let lines = format!(
                "{}\n{}\n",
                train::eval_record("valid", 0, 0, &pop_valid, 0.0),
                train::eval_record("test", 0, 0, &pop_test, 0.0)
            );
            std::fs::write(&path, lines).with_context(|| format!("writing {}", path.display()))?;
            println!("summary: model pop (nothing to train)");
            println!("  valid     {}", pop_valid.summary_line());
            println!("  test      {}", pop_test.summary_line());
        }
        return Ok(());
    }

    let vs = nn::VarStore::new(device);
    let mut task = rec::RecTask::new(&config, &data, &vs, device, comm.as_mut(), ctx)
        .context("building the model")?;
    if leader {
        let count = |trainable: bool| -> i64 {
            vs.variables()
                .values()
                .filter(|t| t.requires_grad() == trainable)
                .map(Tensor::numel)
                .map(|n| n as i64)
                .sum()
        };
        info!(
            "model {:?} ({:?} text, {:?} GPT-2, {:?} scorer): {} trainable parameters, {} frozen",
            config.model.kind,
            config.model.text_mode,
            config.model.preset,
            config.model.scorer,
            count(true),
            count(false)
        );
    }
    let setup = TrainSetup {
        config: &config,
        batch,
        run_dir: run_dir.clone(),
        stop_after_epoch: train::stop_after_epoch_from_env(),
    };
    let report = train::train(&mut task, &vs, comm, &setup).context("training")?;
    if leader {
        let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
        let peak: Vec<String> = report
            .peak_rss
            .iter()
            .map(|&b| format!("{:.0}", mib(b)))
            .collect();
        let summary = serde_json::json!({
            "kind": "summary",
            "steps": report.steps,
            "epochs": report.epochs_done,
            "stopped_early": report.stopped_early,
            "last_loss": report.last_loss,
            "samples_per_s": report.samples_per_s,
            "seconds_per_epoch": report.seconds_per_epoch,
            "peak_rss_mib": report.peak_rss.iter().map(|&b| mib(b)).collect::<Vec<f64>>(),
            "world_size": env.world_size,
        });
        let path = run_dir.join("metrics.jsonl");
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(&path)
        {
            use std::io::Write as _;
            let _ = writeln!(f, "{summary}");
        }
        println!(
            "summary: {} steps, {} epoch(s){}, last loss {}, {:.0} samples/s, {} s/epoch, peak RSS per rank [{}] MiB",
            report.steps,
            report.epochs_done,
            if report.stopped_early { " (stopped early)" } else { "" },
            report.last_loss.map_or("-".into(), |l| format!("{l:.4}")),
            report.samples_per_s,
            report.seconds_per_epoch.map_or("-".into(), |s| format!("{s:.1}")),
            peak.join(", ")
        );
        if let Some(best) = &report.best {
            println!(
                "  best valid {} {:.4} at epoch {} (step {}); model in {}",
                best.metric,
                best.value,
                best.epoch,
                best.step,
                run_dir.join("best").display()
            );
            println!("  valid     {}", best.valid.summary_line());
        }
        if let Some(test) = &report.test {
            println!("  test      {}", test.summary_line());
        }
        println!("  pop valid {}", pop_valid.summary_line());
        println!("  pop test  {}", pop_test.summary_line());
        if let Some(test) = &report.test {
            let metric = config.eval.metric.trim().to_ascii_lowercase();
            if let (Some(ours), Some(pop)) = (test.get(&metric), pop_test.get(&metric)) {
                println!(
                    "  test {metric}: {ours:.4} vs popularity {pop:.4} ({:+.1}%)",
                    if pop > 0.0 {
                        (ours / pop - 1.0) * 100.0
                    } else {
                        0.0
                    }
                );
            }
        }
    }
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
