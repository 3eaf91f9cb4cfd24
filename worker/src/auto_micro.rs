//! `batch.micro = "auto"`: before training, each rank finds the largest micro batch that keeps
//! `batch.global` exactly and fits its memory — by the estimate, and on a GPU by one real
//! forward and backward pass — and the ranks agree on the smallest. Only a real out-of-memory
//! moves the probe on to a smaller plan; any other failure is reported as itself.

use common::batch::BatchPlan;
use common::env_contract::WorkerEnv;
use common::memory::{DataShape, Phase, PhaseSink as _};
use common::train_plan::TrainPlan;
use tch::{nn, Tensor};
use tracing::info;

use crate::memory::{self, PhaseTracker, ProbeOutcome};
use crate::trainer::gather_u64;
use recommender::RecTask;
use runtime::collective::{Collective, OpContext};

/// Why no plan came out; each maps to the worker's exit code.
#[derive(Debug, thiserror::Error)]
pub enum AutoMicroError {
    /// A setting that cannot work (exit code 2).
    #[error("{0}")]
    Usage(String),
    /// No plan fits on some rank (exit code 3, as an out-of-memory).
    #[error("{0}")]
    NoFit(String),
    /// The probe or the agreement failed for another reason (exit code 1).
    #[error("{0}")]
    Failed(String),
}

/// NCCL allocates its buffers lazily, outside libtorch's allocator, when collectives of a size
/// first run; the set-up's check reduced 4 floats. One all-reduce of a bucket's size before the
/// memory is measured makes the probe plan with what training will hold (on GPUs, with
/// others to talk to).
fn warm_up_nccl(
    comm: &mut dyn Collective,
    bucket_mb: f64,
    device: tch::Device,
    ctx: OpContext,
) -> Result<(), AutoMicroError> {
    if !device.is_cuda() || comm.world_size() < 2 {
        return Ok(());
    }
    let floats = ((bucket_mb * f64::from(1u32 << 20)) / 4.0).max(1.0) as i64;
    let mut bucket = [Tensor::zeros([floats], (tch::Kind::Float, device))];
    comm.all_reduce(&mut bucket, runtime::collective::ReduceOp::Sum, ctx)
        .map_err(|e| {
            AutoMicroError::Failed(format!(
                "a bucket-sized all-reduce before the memory probe: {e}"
            ))
        })
}

/// What the probe plans for and runs on.
#[derive(Clone, Copy)]
pub struct Probe<'a> {
    /// The configured plan (`micro = "auto"`).
    pub plan: &'a TrainPlan,
    pub shape: &'a DataShape,
    pub device: tch::Device,
    /// `GPTREC_MEMORY_LIMIT_MB`, when set for this rank.
    pub memory_limit: Option<u64>,
    pub env: &'a WorkerEnv,
    pub tracker: &'a PhaseTracker,
}

impl Probe<'_> {
    /// This rank's memory budget, or why `key = "auto"` cannot plan without one (set it to
    /// `instead`).
    pub fn budget(&self, key: &str, instead: &str) -> Result<memory::Budget, AutoMicroError> {
        memory::budget(self.device, self.memory_limit, self.env.local_world_size).ok_or_else(|| {
            AutoMicroError::Usage(format!(
                "{key} = \"auto\": cannot tell how much memory {} has (neither NVML nor the CUDA runtime answered); set {key} to {instead}, or GPTREC_MEMORY_LIMIT_MB=N to plan with N MiB",
                self.tracker.sample(self.device).1
            ))
        })
    }
}

/// `batch.micro = "auto"`: every rank finds the largest micro batch (among those that keep
/// `batch.global` exactly, up to `batch.max_micro`) whose estimate fits its memory with the
/// safety margin — and, on a GPU, that really runs a forward and backward pass with the
/// optimizer's state allocated — then the ranks agree on the smallest, and `grad_accum` follows.
pub fn auto_micro(
    probe: &Probe<'_>,
    task: &mut RecTask,
    vs: &nn::VarStore,
    comm: &mut dyn Collective,
    ctx: OpContext,
) -> Result<BatchPlan, AutoMicroError> {
    use common::memory::{estimate, mib_text, usable};
    let Probe {
        plan: TrainPlan { config, .. },
        shape,
        device,
        env,
        tracker,
        ..
    } = *probe;
    let candidates = config
        .batch
        .auto_candidates(u64::from(env.world_size))
        .map_err(|e| AutoMicroError::Usage(format!("batch.micro = \"auto\": {e}")))?;
    warm_up_nccl(comm, config.dist.bucket_mb, device, ctx)?;
    let at = memory::placement(device, env.local_world_size);
    let name = tracker.sample(device).1;
    let memory::Budget {
        bytes: budget,
        source,
    } = probe.budget("batch.micro", "a number")?;
    let mut mine = None;
    let mut tried = Vec::new();
    for plan in &candidates {
        let need = estimate(config, plan, shape, at).peak_bytes();
        if need > usable(budget) {
            tried.push(format!("micro {} needs {}", plan.micro, mib_text(need)));
            continue;
        }
        if device.is_cuda() {
            match probe_step(task, vs, plan.micro as usize, device, tracker) {
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
                    return Err(AutoMicroError::Failed(format!(
                        "batch.micro = \"auto\": the probe step with micro {} failed, and not for lack of memory: {why}",
                        plan.micro
                    )))
                }
            }
        }
        mine = Some(*plan);
        break;
    }
    let my_micro = mine.map_or(0, |p| p.micro);
    let all = gather_u64(comm, my_micro, ctx)
        .map_err(|e| AutoMicroError::Failed(format!("agreeing on the micro batch: {e}")))?;
    let chosen = all.iter().copied().min().unwrap_or(0);
    let Some(plan) = candidates.iter().find(|p| p.micro == chosen).copied() else {
        let short: Vec<String> = all
            .iter()
            .enumerate()
            .filter(|(_, &m)| m == 0)
            .map(|(r, _)| r.to_string())
            .collect();
        let levers =
            common::memory::other_levers(config, &candidates[candidates.len() - 1], shape, at);
        return Err(AutoMicroError::NoFit(format!(
                "batch.micro = \"auto\": no micro batch that keeps global {} fits on rank(s) {} ({name}, budget {} with a {:.0}% margin){}{}; lower batch.global{}",
                config.batch.global.unwrap_or(0),
                short.join(", "),
                mib_text(budget),
                common::memory::SAFETY_MARGIN * 100.0,
                if short.contains(&env.rank.to_string()) { ": " } else { "" },
                if short.contains(&env.rank.to_string()) { tried.join(", ") } else { String::new() },
                if levers.is_empty() { String::new() } else { format!(" or try {}", levers.join("; ")) }
        )));
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
    task: &mut RecTask,
    vs: &nn::VarStore,
    micro: usize,
    device: tch::Device,
    tracker: &PhaseTracker,
) -> ProbeOutcome<u64> {
    tracker.enter(Phase::AutoProbe);
    let n = task.train_len().max(1);
    let indices: Vec<usize> = (0..micro).map(|i| i % n).collect();
    let params = vs.trainable_variables();
    let outcome = tracker.probing(|| {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // As in training: dense gradients that the embeddings' sparse backward adds into.
            runtime::ddp::give_dense_grads(&params)?;
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
            let used = tracker.sample(device).0.used;
            drop(moments);
            Ok::<u64, tch::TchError>(used)
        }))
    });
    for p in &params {
        let mut p = p.shallow_clone();
        p.zero_grad();
    }
    memory::classify_probe(outcome)
}
