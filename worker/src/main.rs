//! `worker`: one data-parallel training process. Started by `launch` (or torchrun) with the
//! environment contract; everything else comes from its command line. It checks what it was
//! given (contract, config, batch plan, device), brings up the distributed runtime (rendezvous,
//! a collective checked with one all-reduce), loads or generates the data, evaluates the
//! popularity baseline, builds the recommender of `[model]` and trains it (`worker::trainer`);
//! rank 0 prints the summary next to the baseline. It owns no training logic itself.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Parser;
use common::config::{Config, ModelKind};
use common::env_contract::WorkerEnv;
use common::memory::{Phase, PhaseSink as _};
use common::train_plan::TrainPlan;
use recommender::Baseline;
use runtime::collective::{Collective, OpContext, ReduceOp};
use runtime::job_watch::JobWatch;
use tch::{nn, Kind, Tensor};
use tracing::info;
use worker::memory::{self, PhaseTracker, RunFacts};
use worker::run_report;
use worker::trainer::{self, Split, TrainSetup};

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
    worker::run_report::init_logging();
    worker::regroup::install();
    worker::preempt::install();
    // The one out-of-memory tracker of this process: handed down to everything that runs a
    // phase, and held by the panic hook.
    let tracker = PhaseTracker::new();
    // libtorch reports a failed allocation by an error that tch's infallible calls turn into a
    // panic: those are caught below and explained; the default hook stays for real bugs.
    let default_hook = std::panic::take_hook();
    let hook_tracker = tracker.clone();
    std::panic::set_hook(Box::new(move |info| {
        let text = memory::panic_text(info.payload());
        // Reported and exited here, before unwinding closes the connections to the others.
        hook_tracker.exit_if_oom(&text);
        if !memory::is_oom(&text) {
            default_hook(info);
        }
    }));
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        run(&cli, &tracker, alloc_conf_set)
    }));
    let failure = match outcome {
        Ok(Ok(())) => return ExitCode::SUCCESS,
        Ok(Err(e))
            if e.error
                .downcast_ref::<trainer::TrainError>()
                .is_some_and(trainer::TrainError::is_planned_stop) =>
        {
            tracing::info!("{:#}", e.error);
            return ExitCode::from(common::env_contract::EXIT_REGROUP as u8);
        }
        Ok(Err(e)) => e,
        Err(payload) => Failure {
            error: anyhow::anyhow!("{}", memory::panic_text(payload.as_ref())),
            code: 1,
        },
    };
    let text = worker::error_line::chain_text(&failure.error);
    tracker.exit_if_oom(&text);
    // One line, the whole chain of context (each cause once): what was being done and why it
    // failed.
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

/// What the worker knows before it talks to anyone: its place in the job, the config and the
/// batch plan, its device, and (rank 0) the run directory it holds.
struct Start {
    env: WorkerEnv,
    /// The config and its batch plan; replaced once if `batch.micro = "auto"` measures another.
    plan: TrainPlan,
    device: tch::Device,
    memory_limit: Option<u64>,
    run_dir: PathBuf,
    /// Rank 0 holds the run directory until the process ends.
    _run_lock: Option<worker::run_dir::RunLock>,
}

impl Start {
    fn leader(&self) -> bool {
        self.env.rank == 0
    }

    /// What the planning steps (`"auto"` settings) plan with.
    fn probe<'a>(
        &'a self,
        tracker: &'a PhaseTracker,
        shape: &'a common::memory::DataShape,
    ) -> worker::auto_micro::Probe<'a> {
        worker::auto_micro::Probe {
            plan: &self.plan,
            shape,
            device: self.device,
            memory_limit: self.memory_limit,
            env: &self.env,
            tracker,
        }
    }
}

fn run(cli: &Cli, tracker: &PhaseTracker, alloc_conf_set: bool) -> Result<(), Failure> {
    let mut start = start(cli, tracker)?;
    print_banner(cli, &start, alloc_conf_set);
    let (store_server, mut comm, ctx, watch) = connect(&start)?;
    // Rank 0's store serves until this process ends, whichever way it ends: dropped on an error
    // path it would tell every other rank "store gone" before this rank's own error is out.
    std::mem::forget(store_server);
    let mut milestones = run_report::Milestones {
        runtime_rss: memory::rss_bytes(),
        ..Default::default()
    };
    // Data: the same on every rank (the split is seeded), read or generated.
    let config = &start.plan.config;
    let data = recommender::load_data(config, comm.as_mut(), ctx).context("loading the data")?;
    let shape = recommender::data_shape(config, &data)
        .context("measuring the data for the memory estimate")?;
    tracker.update(|f| f.data = Some(shape.clone()));
    if start.leader() {
        log_data(config, &data);
        // Later dry runs estimate with it (a record that cannot be written costs only that).
        if let Err(e) = shape.remember(config) {
            tracing::debug!("keeping the data's shape for later estimates: {e}");
        }
    }
    let (pop_valid, pop_tests) = popularity_baselines(config, &data, comm.as_mut(), ctx)?;
    let ease_tests = ease_baseline(config, &data, comm.as_mut(), ctx, start.leader())?;
    if config.model.kind == ModelKind::Pop {
        if start.leader() {
            run_report::popularity_only(&start.run_dir, config, &pop_valid, &pop_tests)?;
        }
        finish_watch(watch);
        return Ok(());
    }

    milestones.data_rss = memory::rss_bytes();
    let vs = nn::VarStore::new(start.device);
    let mut task = build_model(&start, &data, &vs, comm.as_mut(), ctx, tracker)?;
    milestones.model_rss = memory::rss_bytes();
    milestones.model_peak = tracker.peak_bytes(start.device);
    if start.plan.config.dist.zero.is_auto() {
        plan_zero_stage(&mut start, tracker, &shape, comm.as_mut(), ctx)?;
    }
    if start.plan.config.batch.micro_auto {
        plan_micro_batch(
            &mut start,
            tracker,
            &shape,
            &mut task,
            &vs,
            comm.as_mut(),
            ctx,
        )?;
    }
    let at = memory::placement(start.device, start.env.local_world_size);
    let plan = &start.plan;
    let estimate = common::memory::estimate(&plan.config, &plan.batch, &shape, at);
    if start.leader() {
        log_plan(&start, tracker, &estimate, &vs, &task);
    }
    worker::peer_dump::from_env(plan, &data, &vs, &task, start.env.rank)?;
    let setup = TrainSetup {
        plan,
        run_dir: start.run_dir.clone(),
        memory: tracker.clone(),
        stop_after_epoch: trainer::stop_after_epoch_from_env(),
        baseline: Some(trainer::baseline_record("pop", "valid", &pop_valid)),
    };
    let trained = trainer::train(&mut task, &vs, comm, &setup);
    let mut watch = watch;
    if trained
        .as_ref()
        .is_err_and(trainer::TrainError::is_planned_stop)
    {
        // Every rank stops at this checkpoint (to re-form, or preempted): a planned end.
        finish_watch(watch.take());
    }
    let report = trained.context("training")?;
    if start.leader() {
        run_report::RunSummary {
            plan,
            device: start.device,
            shape: &shape,
            estimate: &estimate,
            milestones,
            report: &report,
            pop_valid: &pop_valid,
            pop_tests: &pop_tests,
            ease_tests: &ease_tests,
            run_dir: &start.run_dir,
            world_size: start.env.world_size,
        }
        .finish()
        .context("writing the run's summary")?;
    }
    finish_watch(watch);
    Ok(())
}

/// The popularity baseline on validation and on every split the model is tested on (test, then
/// any cold-start parts), each evaluated across the ranks.
type Baselines = (
    recommender::eval::Metrics,
    Vec<(Split, recommender::eval::Metrics)>,
);

fn popularity_baselines(
    config: &Config,
    data: &recommender::RecData,
    comm: &mut dyn Collective,
    ctx: OpContext,
) -> Result<Baselines> {
    let (ks, users_at_once) = (&config.eval.topk, config.eval.batch_users);
    let mut on = |split| {
        recommender::evaluate_baseline(
            data,
            Baseline::Popularity,
            split,
            ks,
            users_at_once,
            comm,
            ctx,
        )
        .context("evaluating the popularity baseline")
    };
    let valid = on(Split::Valid)?;
    let mut tests = Vec::new();
    for split in data.dataset.test_splits() {
        tests.push((split, on(split)?));
    }
    Ok((valid, tests))
}

/// The EASE baseline (`eval.ease_reg`, 0: none) fitted on every rank from the same split and
/// evaluated on test across the ranks; nothing, said in one line, above its item limit.
fn ease_baseline(
    config: &Config,
    data: &recommender::RecData,
    comm: &mut dyn Collective,
    ctx: OpContext,
    leader: bool,
) -> Result<Vec<(Split, recommender::eval::Metrics)>> {
    let reg = config.eval.ease_reg;
    let ds = &data.dataset;
    if reg == 0.0 || config.model.kind == ModelKind::Pop {
        return Ok(Vec::new());
    }
    let started = std::time::Instant::now();
    let fitted = recommender::ease::Ease::fit(&ds.train, ds.n_warm_items, ds.n_items, reg)
        .context("fitting the EASE baseline")?;
    let Some(ease) = fitted else {
        if leader {
            info!(
                "EASE baseline skipped: {} warm items, more than its limit of {} (an items x items matrix; eval.ease_reg = 0 leaves it out)",
                ds.n_warm_items,
                recommender::ease::MAX_ITEMS
            );
        }
        return Ok(Vec::new());
    };
    let (ks, users_at_once) = (&config.eval.topk, config.eval.batch_users);
    let test = recommender::evaluate_baseline(
        data,
        Baseline::Ease(&ease),
        Split::Test,
        ks,
        users_at_once,
        comm,
        ctx,
    )
    .context("evaluating the EASE baseline")?;
    if leader {
        info!(
            "EASE baseline (eval.ease_reg = {reg}) fitted on {} items and tested in {:.1} s",
            ds.n_warm_items,
            started.elapsed().as_secs_f64()
        );
    }
    Ok(vec![(Split::Test, test)])
}

/// The recommender built on `vs` (an out-of-memory error in the build is reported as such).
fn build_model(
    start: &Start,
    data: &recommender::RecData,
    vs: &nn::VarStore,
    comm: &mut dyn Collective,
    ctx: OpContext,
    tracker: &PhaseTracker,
) -> Result<recommender::RecTask> {
    tracker.enter(Phase::ModelBuild);
    let built = recommender::RecTask::new(
        &start.plan.config,
        data,
        vs,
        start.device,
        comm,
        ctx,
        tracker,
    );
    tracker.check(built).context("building the model")
}

/// Contract, config, batch plan and device, checked; rank 0 takes the run directory before
/// anything is written or anyone connects.
fn start(cli: &Cli, tracker: &PhaseTracker) -> Result<Start, Failure> {
    let (env, single) = WorkerEnv::from_env_or_single()
        .context("reading the launch environment")
        .map_err(usage)?;
    if single {
        tracing::info!("no launch environment (RANK, WORLD_SIZE, ... unset): one process, world 1");
    }
    let plan = TrainPlan::load(&cli.config, &cli.overrides, u64::from(env.world_size))
        .context("loading the config")
        .map_err(usage)?;
    let config = &plan.config;
    tracker
        .arm_from_env(env.rank)
        .map_err(|e| usage(anyhow::anyhow!(e)))?;
    let memory_limit = memory::simulated_limit(env.rank).map_err(|e| usage(anyhow::anyhow!(e)))?;
    let device = pick_device(&env).map_err(usage)?;
    let run_dir = config.run.output_dir.join(&config.run.name);
    let run_lock = if env.rank == 0 {
        let fingerprint = runtime::store::run_fingerprint(&env.run_id);
        Some(worker::run_dir::lock(&run_dir, &fingerprint).map_err(|e| usage(e.into()))?)
    } else {
        None
    };
    if device.is_cuda() {
        runtime::tf32::set_tf32_matmuls(config.train.tf32);
    }
    if config.train.bf16 && !device.is_cuda() && env.rank == 0 {
        note_cpu_bf16();
    }
    tracker.record(RunFacts {
        plan: plan.clone(),
        device,
        host_ranks: env.local_world_size,
        data: None,
        last_checkpoint: None,
    });
    Ok(Start {
        env,
        plan,
        device,
        memory_limit,
        run_dir,
        _run_lock: run_lock,
    })
}

fn print_banner(cli: &Cli, start: &Start, alloc_conf_set: bool) {
    let env = &start.env;
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
        runtime::store::run_fingerprint(&env.run_id),
        env.restart_count,
        env.max_restarts
    );
    println!(
        "config {} (run {:?}): {}",
        cli.config.display(),
        start.plan.config.run.name,
        start.plan.batch.derivation()
    );
    println!(
        "device {:?}, libtorch threads {}, OMP_NUM_THREADS {}, PYTORCH_CUDA_ALLOC_CONF {}{}",
        start.device,
        tch::get_num_threads(),
        std::env::var("OMP_NUM_THREADS").unwrap_or_else(|_| "unset".into()),
        std::env::var("PYTORCH_CUDA_ALLOC_CONF").unwrap_or_else(|_| "unset".into()),
        if alloc_conf_set {
            " (set by the worker)"
        } else {
            ""
        }
    );
    if start.device.is_cuda() {
        println!(
            "f32 matmuls: {}",
            if runtime::tf32::tf32_matmuls() {
                "TF32 tensor cores (train.tf32 = true)"
            } else {
                "full f32 (train.tf32 = false)"
            }
        );
    }
}

/// What `connect` brings up: rank 0's store (served while it lives), this rank's collective,
/// and the context of set-up operations.
type Runtime = (
    Option<runtime::store::StoreServer>,
    Box<dyn runtime::collective::Collective>,
    OpContext,
    Option<JobWatch>,
);

/// How long rank 0 keeps the store up at the end for the other ranks to finish.
const FINISH_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// Watches for another rank's end (see `runtime::job_watch`): this rank stops at once, in one
/// line naming it, as it would have had to at its next collective (or after a timeout). Not
/// under torchrun's agent store (no wills there) nor alone.
fn watch_the_others(
    env: &WorkerEnv,
    store_addr: &str,
    agent_store: bool,
) -> Result<Option<JobWatch>, Failure> {
    if env.world_size <= 1 || agent_store {
        return Ok(None);
    }
    let line = runtime::job_watch::will_line(env);
    let watch = JobWatch::start(
        store_addr,
        &env.run_id,
        (env.rank, env.world_size),
        &line,
        |seen| {
            eprintln!("{}{seen}", common::env_contract::STOPPED_FOR_PEER);
            // The main thread may be inside a collective: end now, as a death would (the
            // launcher's sweep removes what a dead worker leaves).
            // SAFETY: _exit ends the process; nothing runs after it.
            unsafe { nix::libc::_exit(1) }
        },
    )
    .context("watching for the other ranks' end at the rendezvous store")?;
    Ok(Some(watch))
}

/// This rank ends as planned (done, or re-forming): its watch says so first.
fn finish_watch(watch: Option<JobWatch>) {
    if let Some(watch) = watch {
        if let Err(e) = watch.finish(FINISH_WAIT) {
            tracing::debug!("telling the other ranks this one finished: {e}");
        }
    }
}

/// `dist.require_secret` or `LAUNCH_REQUIRE_SECRET`: a run id anyone can present (torchrun's
/// default `none`, or none at all) is refused before this rank talks to anyone.
fn require_secret(config: &common::config::Config, env: &WorkerEnv) -> anyhow::Result<()> {
    let vars = common::job_shape::process_env();
    let from_env = common::job_shape::require_secret_from_env(&vars)?;
    let public = env.run_id.trim().is_empty() || env.run_id == common::job_shape::PUBLIC_RUN_ID;
    if public && (from_env || config.dist.require_secret) {
        let asked = if from_env {
            "LAUNCH_REQUIRE_SECRET"
        } else {
            "dist.require_secret"
        };
        anyhow::bail!(
            "the run id is {:?}, which anyone can present, and {asked} asks for a secret: give every node the same secret run id (torchrun: --rdzv-id or PET_RDZV_ID, or --standalone on one node; launch: LAUNCH_RUN_ID or --run-id-file)",
            env.run_id
        );
    }
    Ok(())
}

/// The distributed runtime: rendezvous, then the collective, checked with one all-reduce.
fn connect(start: &Start) -> Result<Runtime, Failure> {
    let (env, config, device) = (&start.env, &start.plan.config, start.device);
    let flight_entries =
        runtime::collective::flight::entries_from_env().map_err(|e| usage(e.into()))?;
    require_secret(config, env).map_err(usage)?;
    let (setup_timeout, limit_key) = config.dist.rendezvous_timeout();
    let within = || format!("(within {limit_key} = {} s)", setup_timeout.as_secs());
    if let Some(delay) =
        trainer::slow_start_fault(env.rank as usize).map_err(|e| usage(anyhow::anyhow!(e)))?
    {
        std::thread::sleep(delay);
    }
    let (store_server, mut store) = runtime::store::rendezvous(env, setup_timeout)
        .with_context(|| format!("rendezvous with the other ranks {}", within()))?;
    if env.group_world_size > 1 {
        // Several nodes: each was started on its own; check they run the same job first.
        runtime::agreement::agree(&mut store, env, &job_terms(config, env), setup_timeout)
            .map_err(|e| match e {
                runtime::agreement::AgreementError::Disagree(_) => usage(e.into()),
                _ => e.into(),
            })?;
    }
    // Every rank has joined and runs the same job (a duplicate node refused above must not
    // stop the job): from here on a rank that ends (its collective's set-up failed) stops the
    // others at once, instead of leaving them waiting for it until the set-up's timeout.
    let (store_addr, agent_store) = (store.addr().to_string(), store.is_agent_store());
    let watch = watch_the_others(env, &store_addr, agent_store)?;
    fail_collective_if_asked(env)?;
    let comm = runtime::collective::connect(&config.dist, device, env, store, setup_timeout)
        .with_context(|| format!("connecting the collective {}", within()))?;
    // Every operation from here on is in this rank's flight record (`<run dir>/flight/`).
    let flight_dir = start.run_dir.join(common::flight::DIR);
    let mut comm = runtime::collective::flight::record(comm, &flight_dir, env, flight_entries);
    let mut check = [Tensor::ones([4], (Kind::Float, device)) * f64::from(env.rank + 1)];
    let ctx = OpContext {
        step: 0,
        timeout: setup_timeout.max(recommender::EVAL_TIMEOUT_MIN),
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
    Ok((store_server, comm, ctx, watch))
}

/// `GPTREC_FAULT_COLLECTIVE=RANK`: that rank's collective set-up fails, as an NCCL
/// initialisation can on one rank (a test hook).
fn fail_collective_if_asked(env: &WorkerEnv) -> Result<(), Failure> {
    let asked = std::env::var("GPTREC_FAULT_COLLECTIVE").ok();
    if asked.and_then(|r| r.trim().parse::<u32>().ok()) == Some(env.rank) {
        return Err(anyhow::anyhow!(
            "connecting the collective: set-up failed on this rank (GPTREC_FAULT_COLLECTIVE)"
        )
        .into());
    }
    Ok(())
}

/// What every rank of a multi-node job must agree on: the config (but for per-node paths),
/// the data and weights behind them, this worker's build, and the world size.
fn job_terms(config: &Config, env: &WorkerEnv) -> common::job_terms::Terms {
    let mut terms = common::job_terms::of_config(config);
    if let Ok(exe) = std::env::current_exe() {
        terms.insert(
            "program".into(),
            common::job_terms::program_fingerprint(&exe),
        );
    }
    terms.insert("WORLD_SIZE".into(), env.world_size.to_string());
    terms
}

fn log_data(config: &Config, data: &recommender::RecData) {
    let ds = &data.dataset;
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

/// A planning step's failure with its exit code: a setting that cannot work is a usage error
/// (2), nothing fitting is an out-of-memory (3).
fn auto_failure(e: worker::auto_micro::AutoMicroError) -> Failure {
    use worker::auto_micro::AutoMicroError;
    match e {
        AutoMicroError::Usage(_) => usage(e.into()),
        AutoMicroError::NoFit(_) => Failure {
            error: e.into(),
            code: EXIT_OUT_OF_MEMORY,
        },
        AutoMicroError::Failed(_) => e.into(),
    }
}

/// `dist.zero = "auto"`: the stage the ranks agreed on replaces `"auto"` in the plan's config
/// (before `batch.micro = "auto"`, which plans with it).
fn plan_zero_stage(
    start: &mut Start,
    tracker: &PhaseTracker,
    shape: &common::memory::DataShape,
    comm: &mut dyn runtime::collective::Collective,
    ctx: OpContext,
) -> Result<(), Failure> {
    let probe = start.probe(tracker, shape);
    let stage = worker::auto_zero::auto_zero(&probe, comm, ctx).map_err(auto_failure)?;
    start.plan.config.dist.zero = common::config::ZeroStage::Stage(stage);
    tracker.update(|f| f.plan = start.plan.clone());
    Ok(())
}

/// `batch.micro = "auto"`: the plan the ranks agreed on replaces the configured one everywhere.
fn plan_micro_batch(
    start: &mut Start,
    tracker: &PhaseTracker,
    shape: &common::memory::DataShape,
    task: &mut recommender::RecTask,
    vs: &nn::VarStore,
    comm: &mut dyn runtime::collective::Collective,
    ctx: OpContext,
) -> Result<(), Failure> {
    let probe = start.probe(tracker, shape);
    let batch =
        worker::auto_micro::auto_micro(&probe, task, vs, comm, ctx).map_err(auto_failure)?;
    start.plan = start.plan.with_measured(batch);
    tracker.update(|f| f.plan = start.plan.clone());
    Ok(())
}

/// Rank 0: the memory estimate against the budget, and the model's size.
fn log_plan(
    start: &Start,
    tracker: &PhaseTracker,
    estimate: &common::memory::MemoryEstimate,
    vs: &nn::VarStore,
    task: &recommender::RecTask,
) {
    let (config, device) = (&start.plan.config, start.device);
    let name = tracker.sample(device).1;
    let budget = match memory::budget(device, start.memory_limit, start.env.local_world_size) {
        Some(b) => format!("{}, {}", common::memory::mib_text(b.bytes), b.source),
        None => "unknown: neither NVML nor the CUDA runtime answered".into(),
    };
    info!(
        "memory estimate per worker on {name}: peak {} for {} (budget {budget})",
        common::memory::mib_text(estimate.peak_bytes()),
        start.plan.batch.derivation(),
    );
    let count = |trainable: bool| -> i64 {
        vs.variables()
            .values()
            .filter(|t| t.requires_grad() == trainable)
            .map(Tensor::numel)
            .map(|n| n as i64)
            .sum()
    };
    let m = &config.model;
    // Only what this kind of model uses: bpr has no text and no GPT-2.
    let parts = match m.kind {
        common::config::ModelKind::Gpt2rec => {
            format!(
                "{:?} text, {:?} GPT-2, {:?} scorer",
                m.text_mode, m.preset, m.scorer
            )
        }
        _ => format!("ID embeddings, {:?} scorer", m.scorer),
    };
    info!(
        "model {:?} ({parts}): {} trainable parameters, {} frozen",
        m.kind,
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

/// Says how `train.bf16` runs on this CPU: natively, or emulated (and likely slower).
fn note_cpu_bf16() {
    if recommender::model::autocast::cpu_has_native_bf16() {
        tracing::info!("train.bf16: bf16 autocast on the CPU (which computes bf16 natively)");
    } else {
        tracing::warn!(
            "train.bf16: this CPU has no native bf16 (AVX512-BF16, AMX or Arm BF16); autocast emulates it and is likely slower than f32 (train.bf16 = false)"
        );
    }
}

/// The GPU of this rank when CUDA is usable ([`gpu_index`]), otherwise the CPU.
fn pick_device(env: &WorkerEnv) -> Result<tch::Device> {
    if !tch::Cuda::is_available() {
        return Ok(tch::Device::Cpu);
    }
    let visible = tch::Cuda::device_count().max(0) as u32;
    let index = worker::gpu_index(env.local_rank, visible).map_err(|e| anyhow::anyhow!(e))?;
    Ok(tch::Device::Cuda(index as usize))
}
