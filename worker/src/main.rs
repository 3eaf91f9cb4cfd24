//! `worker`: one data-parallel training process. Started by `launch` (or torchrun) with the
//! environment contract; everything else comes from its command line. It checks what it was
//! given (contract, config, batch plan, device), brings up the distributed runtime (rendezvous,
//! a collective checked with one all-reduce), loads or generates the data, evaluates the
//! popularity baseline, builds the recommender of `[model]` and trains it (`worker::trainer`);
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
use worker::memory::{self, Phase, ProbeOutcome};
use worker::rec;
use worker::trainer::{self as train, Split, TrainSetup};

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

/// Exit code of a worker that ran out of memory (its message says what to change).
const EXIT_OUT_OF_MEMORY: u8 = worker::memory::EXIT_OUT_OF_MEMORY as u8;

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Before anything starts CUDA or a thread: the allocator reads this once, at its start.
    let alloc_conf_set = set_alloc_conf_default();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .without_time()
        .with_target(false)
        .init();
    // libtorch reports a failed allocation by an error that tch's infallible calls turn into a
    // panic: those are caught below and explained; the default hook stays for real bugs.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let text = memory::panic_text(info.payload());
        // Reported and exited here, before unwinding closes the connections to the others.
        worker::memory::exit_if_oom(&text);
        if !worker::memory::is_oom(&text) {
            default_hook(info);
        }
    }));
    let outcome =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(&cli, alloc_conf_set)));
    let failure = match outcome {
        Ok(Ok(())) => return ExitCode::SUCCESS,
        Ok(Err(e)) => e,
        Err(payload) => Failure {
            error: anyhow::anyhow!("{}", memory::panic_text(payload.as_ref())),
            code: 1,
        },
    };
    let text = format!("{:#}", failure.error);
    worker::memory::exit_if_oom(&text);
    // One line, the whole chain of context: what was being done and why it failed.
    eprintln!("worker: error: {text}");
    ExitCode::from(failure.code)
}

/// Sets `PYTORCH_CUDA_ALLOC_CONF` to the default `launch` gives its workers when the user set
/// neither name (a worker started by torchrun gets it too); whether it did.
fn set_alloc_conf_default() -> bool {
    match common::env_contract::alloc_conf_default(|n| std::env::var_os(n).is_some()) {
        Some((name, value)) => {
            std::env::set_var(name, value);
            true
        }
        None => false,
    }
}

/// An error and the exit code it maps to: 2 for what the user gave us (environment, config,
/// batch plan), 1 for a failure while running (3 for running out of memory, decided in
/// `main`).
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

fn run(cli: &Cli, alloc_conf_set: bool) -> Result<(), Failure> {
    let env = WorkerEnv::from_env()
        .context("reading the launch environment")
        .map_err(usage)?;
    let mut config = Config::load(&cli.config, &cli.overrides)
        .context("loading the config")
        .map_err(usage)?;
    memory::init(env.rank).map_err(|e| usage(anyhow::anyhow!(e)))?;
    let memory_limit = memory::simulated_limit(env.rank).map_err(|e| usage(anyhow::anyhow!(e)))?;
    let mut batch = config
        .batch
        .resolve(u64::from(env.world_size))
        .with_context(|| format!("{}: checking the batch plan", cli.config.display()))
        .map_err(usage)?;
    let device = pick_device(&env).map_err(usage)?;
    let leader = env.rank == 0;
    // One run per run directory: rank 0 (the only writer) holds it until the process ends,
    // taken before anything is written or anyone connects.
    let run_dir = config.run.output_dir.join(&config.run.name);
    let _run_lock = if leader {
        Some(
            worker::run_dir::lock(&run_dir, &worker::store::run_fingerprint(&env.run_id))
                .map_err(|e| usage(e.into()))?,
        )
    } else {
        None
    };
    if config.train.bf16 && !device.is_cuda() && leader {
        tracing::warn!("train.bf16 applies to CUDA only; this run is on the CPU and stays in f32");
    }
    memory::record(memory::RunFacts {
        config: config.clone(),
        plan: batch,
        device,
        data: None,
        last_checkpoint: None,
    });
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
        // The run id admits connections to the store: logs get its fingerprint only.
        worker::store::run_fingerprint(&env.run_id),
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
        "device {device:?}, libtorch threads {}, OMP_NUM_THREADS {}, PYTORCH_CUDA_ALLOC_CONF {}{}",
        tch::get_num_threads(),
        std::env::var("OMP_NUM_THREADS").unwrap_or_else(|_| "unset".into()),
        std::env::var("PYTORCH_CUDA_ALLOC_CONF").unwrap_or_else(|_| "unset".into()),
        if alloc_conf_set {
            " (set by the worker)"
        } else {
            ""
        }
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

    let runtime_rss = memory::rss_bytes();
    // Data: the same on every rank (the split is seeded), read or generated.
    let data = rec::load_data(&config, comm.as_mut(), ctx).context("loading the data")?;
    let shape =
        rec::data_shape(&config, &data).context("measuring the data for the memory estimate")?;
    memory::update(|f| f.data = Some(shape.clone()));
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
            // The results of an earlier run here are not this one's: moved aside, not lost.
            if let Some((to, moved)) = worker::run_dir::set_aside(&run_dir, 0, None)? {
                info!(
                    "moved {} of an earlier run to {}",
                    moved.join(", "),
                    to.display()
                );
            }
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

    let data_rss = memory::rss_bytes();
    memory::enter(Phase::ModelBuild);
    let vs = nn::VarStore::new(device);
    let mut task = memory::check(rec::RecTask::new(
        &config,
        &data,
        &vs,
        device,
        comm.as_mut(),
        ctx,
    ))
    .context("building the model")?;
    let model_rss = memory::rss_bytes();
    let model_peak = memory::peak_bytes(device);
    if config.batch.micro_auto {
        batch = auto_micro(
            &config,
            &shape,
            &mut task,
            &vs,
            device,
            memory_limit,
            &env,
            comm.as_mut(),
            ctx,
        )?;
        config.batch = common::batch::BatchSpec {
            global: Some(batch.global),
            micro: Some(batch.micro),
            grad_accum: Some(batch.grad_accum),
            ..Default::default()
        };
        memory::update(|f| {
            f.plan = batch;
            f.config = config.clone();
        });
    }
    let estimate = common::memory::estimate(&config, &batch, &shape, memory::device_kind(device));
    if leader {
        let name = memory::usage(device).1;
        let budget = match memory::budget(device, memory_limit, env.local_world_size) {
            Some(b) => format!("{}, {}", common::memory::mib_text(b.bytes), b.source),
            None => "unknown: neither NVML nor the CUDA runtime answered".into(),
        };
        info!(
            "memory estimate per worker on {name}: peak {} for {} (budget {budget})",
            common::memory::mib_text(estimate.peak_bytes()),
            batch.derivation(),
        );
    }
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
        if config.model.activation_checkpointing {
            info!(
                "activation checkpointing: {} GPT-2 block(s) keep only their inputs and are recomputed during backward",
                task.checkpointed_blocks()
            );
        }
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
        // The estimate next to what rank 0 measured, term by term where a measurement exists.
        let measured = serde_json::json!({
            "runtime_rss_mib": mib(runtime_rss),
            "after_data_rss_mib": mib(data_rss),
            "after_model_rss_mib": mib(model_rss),
            "after_model_peak_mib": mib(model_peak),
            "peak_rss_mib": report.peak_rss.iter().map(|&b| mib(b)).collect::<Vec<f64>>(),
            "peak_device_mib": report.peak_device.as_ref().map(|v| v.iter().map(|&b| mib(b)).collect::<Vec<f64>>()),
        });
        let terms: Vec<serde_json::Value> = estimate
            .terms
            .iter()
            .map(|t| serde_json::json!({"name": t.name, "mib": mib(t.bytes), "phase": format!("{:?}", t.phase).to_lowercase(), "detail": t.detail}))
            .collect();
        let record = serde_json::json!({
            "device": format!("{device:?}"),
            "plan": {"global": batch.global, "micro": batch.micro, "grad_accum": batch.grad_accum, "world": batch.world_size},
            "data": {"users": shape.users, "items": shape.items, "interactions": shape.interactions, "user_tokens": shape.user_tokens, "item_tokens": shape.item_tokens},
            "estimate": {"peak_mib": mib(estimate.peak_bytes()), "terms": terms},
            "measured": measured,
        });
        let path = run_dir.join("memory.json");
        if let Err(e) = std::fs::write(&path, format!("{record:#}\n")) {
            tracing::warn!("could not write {}: {e}", path.display());
        }
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
            "peak_device_mib": report.peak_device.as_ref().map(|v| v.iter().map(|&b| mib(b)).collect::<Vec<f64>>()),
            "estimated_peak_mib": mib(estimate.peak_bytes()),
            "world_size": env.world_size,
        });
        worker::run_dir::MetricsLog::open(&run_dir.join("metrics.jsonl"))
            .and_then(|mut log| log.append(&summary))
            .context("writing the summary record")?;
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
        let measured_peak = match &report.peak_device {
            Some(dev) => dev.iter().copied().max().unwrap_or(0),
            None => report.peak_rss.iter().copied().max().unwrap_or(0),
        };
        println!(
            "  memory: estimated peak {} per worker, measured {} ({}; memory.json has each term)",
            common::memory::mib_text(estimate.peak_bytes()),
            common::memory::mib_text(measured_peak),
            if report.peak_device.is_some() {
                "device memory, NVML"
            } else {
                "peak RSS"
            }
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

/// `batch.micro = "auto"`: every rank finds the largest micro batch (among those that keep
/// `batch.global` exactly, up to `batch.max_micro`) whose estimate fits its memory with the
/// safety margin — and, on a GPU, that really runs a forward and backward pass with the
/// optimizer's state allocated — then the ranks agree on the smallest, and `grad_accum` follows.
#[allow(clippy::too_many_arguments)]
fn auto_micro(
    config: &Config,
    shape: &common::memory::DataShape,
    task: &mut rec::RecTask,
    vs: &nn::VarStore,
    device: tch::Device,
    memory_limit: Option<u64>,
    env: &WorkerEnv,
    comm: &mut dyn worker::collective::Collective,
    ctx: OpContext,
) -> Result<common::batch::BatchPlan, Failure> {
    use common::memory::{estimate, mib_text, usable};
    let candidates = config
        .batch
        .auto_candidates(u64::from(env.world_size))
        .context("batch.micro = \"auto\"")
        .map_err(usage)?;
    let kind = memory::device_kind(device);
    let name = memory::usage(device).1;
    let Some(memory::Budget {
        bytes: budget,
        source,
    }) = memory::budget(device, memory_limit, env.local_world_size)
    else {
        return Err(usage(anyhow::anyhow!(
            "batch.micro = \"auto\": cannot tell how much memory {name} has (neither NVML nor the CUDA runtime answered); set batch.micro to a number, or GPTREC_MEMORY_LIMIT_MB=N to plan with N MiB"
        )));
    };
    let mut mine = None;
    let mut tried = Vec::new();
    for plan in &candidates {
        let need = estimate(config, plan, shape, kind).peak_bytes();
        if need > usable(budget) {
            tried.push(format!("micro {} needs {}", plan.micro, mib_text(need)));
            continue;
        }
        if device.is_cuda() {
            match probe_step(task, vs, plan.micro as usize, device) {
                ProbeOutcome::Fits(used) => info!(
                    "batch.micro = \"auto\": rank {} ran micro {} using {} of {name}",
                    env.rank,
                    plan.micro,
                    mib_text(used)
                ),
                ProbeOutcome::OutOfMemory(why) => {
                    tried.push(format!("micro {} ran out of memory ({why})", plan.micro));
                    continue;
                }
                ProbeOutcome::Failed(why) => {
                    return Err(anyhow::anyhow!(
                        "batch.micro = \"auto\": the probe step with micro {} failed, and not for lack of memory: {why}",
                        plan.micro
                    )
                    .into())
                }
            }
        }
        mine = Some(*plan);
        break;
    }
    let my_micro = mine.map_or(0, |p| p.micro);
    let all = train::gather_u64(comm, my_micro, ctx).context("agreeing on the micro batch")?;
    let chosen = all.iter().copied().min().unwrap_or(0);
    let Some(plan) = candidates.iter().find(|p| p.micro == chosen).copied() else {
        let short: Vec<String> = all
            .iter()
            .enumerate()
            .filter(|(_, &m)| m == 0)
            .map(|(r, _)| r.to_string())
            .collect();
        let levers =
            common::memory::other_levers(config, &candidates[candidates.len() - 1], shape, kind);
        return Err(Failure {
            error: anyhow::anyhow!(
                "batch.micro = \"auto\": no micro batch that keeps global {} fits on rank(s) {} ({name}, budget {} with a {:.0}% margin){}{}; lower batch.global{}",
                config.batch.global.unwrap_or(0),
                short.join(", "),
                mib_text(budget),
                common::memory::SAFETY_MARGIN * 100.0,
                if short.contains(&env.rank.to_string()) { ": " } else { "" },
                if short.contains(&env.rank.to_string()) { tried.join(", ") } else { String::new() },
                if levers.is_empty() { String::new() } else { format!(" or try {}", levers.join("; ")) }
            ),
            code: EXIT_OUT_OF_MEMORY,
        });
    };
    if env.rank == 0 {
        info!(
            "batch.micro = \"auto\": largest micro per rank {all:?} (budget {} per worker, {source}); using {}",
            mib_text(budget),
            plan.derivation()
        );
    }
    Ok(plan)
}

/// One forward and backward pass of `micro` training samples with AdamW's two moments
/// allocated, without changing any weight: the device memory this process then uses, or how
/// it failed (only a real out-of-memory lets the caller try a smaller micro batch).
fn probe_step(
    task: &mut rec::RecTask,
    vs: &nn::VarStore,
    micro: usize,
    device: tch::Device,
) -> ProbeOutcome<u64> {
    use worker::trainer::Task as _;
    memory::enter(Phase::AutoProbe);
    let n = task.train_len().max(1);
    let indices: Vec<usize> = (0..micro).map(|i| i % n).collect();
    let params = vs.trainable_variables();
    memory::set_probing(true);
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let loss = task.loss(&indices)?;
        loss.f_backward()?;
        task.finish_backward()?;
        let moments: Vec<Tensor> = params
            .iter()
            .flat_map(|p| [p.zeros_like(), p.zeros_like()])
            .collect();
        if let tch::Device::Cuda(i) = device {
            tch::Cuda::synchronize(i as i64);
        }
        let used = memory::usage(device).0.used;
        drop(moments);
        Ok::<u64, tch::TchError>(used)
    }));
    memory::set_probing(false);
    for p in &params {
        let mut p = p.shallow_clone();
        p.zero_grad();
    }
    memory::classify_probe(outcome)
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
