//! The DDP engine: makes N processes train one model as if they were one. It owns the
//! parameter broadcast at start, gradient accumulation over micro-batches, the bucketed
//! gradient all-reduce (after the last micro-batch of a window, or during its backward pass
//! with `overlap`), the row-sparse exchange of embedding-table gradients, global-norm clipping
//! and the optimizer step, plus the optional cross-rank parameter check. It works on any `tch`
//! model and any loss: it must not know about the recommender, the data or files.

use std::time::{Duration, Instant};

use tch::{nn, Tensor};

use crate::clip::{clip_grads, ClipGrad};
use crate::collective::{Collective, CollectiveError, OpContext, ReduceOp};
use crate::host_read;
use crate::optim::{AdamW, OptimError};
use crate::rows;

mod buckets;
mod gate;
mod grads;
mod host_shards;
mod overlap;
mod param_check;
mod param_storage;
mod sharded_step;
mod shared_tables;
mod summary;
mod window;
mod zero;
mod zero_step;
use buckets::{make_buckets, unit_buckets};
use gate::Gate;
pub use gate::ParamGate;
pub use grads::give_dense_grads;
pub use host_shards::mean_into;
use host_shards::HostShards;
use overlap::Overlap;
pub use overlap::OverlapError;
use shared_tables::SharedTables;
use summary::touched_rows;
use window::{micro_batches, WindowLoss};
use zero::ZeroLayout;

/// Engine settings (from `[train]`, `[batch]` and `[dist]`).
#[derive(Debug, Clone)]
pub struct DdpConfig {
    /// Micro-batches per optimizer step.
    pub grad_accum: usize,
    /// Gradient bytes (f32) per all-reduce call.
    pub bucket_bytes: usize,
    /// Clip the global gradient norm to this (`f64::INFINITY` disables).
    pub max_grad_norm: f64,
    /// Compare a parameter checksum across ranks every N optimizer steps (0: never).
    pub check_params_every: u64,
    /// Time limit of each collective.
    pub timeout: Duration,
    /// Names of 2-D parameters (embedding tables) whose gradient touches few rows per step:
    /// only the rows some rank touched are all-reduced, when they are at most half the table.
    /// The result is the dense all-reduce's (zero rows sum to zero). Empty: all dense.
    pub sparse: Vec<String>,
    /// Keep those tables (CPU f32 ones), with their AdamW moments, once in memory shared by the
    /// ranks when all run on one host, each rank updating its share of the rows: the same
    /// numbers, a fraction of the update's time and memory. Ignored where memory cannot be
    /// shared.
    pub shared_tables: bool,
    /// ZeRO stage 1 on one host: where all ranks share memory and every trainable parameter is
    /// an f32 CPU tensor, keep each parameter and its AdamW moments once in shared memory,
    /// produce each rank's gradients into shared memory, and let each rank reduce, clip and
    /// update its share of every parameter's rows (see `host_shards`): the unsharded step's
    /// numbers, with no gradient all-reduce. Replaces `shared_tables` where it applies.
    pub shard_optimizer: bool,
    /// Overlap the dense buckets' reduction with the window's last backward pass: a
    /// communication thread averages each bucket (all-reduced, or under ZeRO reduce-scattered),
    /// in bucket order, as soon as autograd has accumulated every gradient in it (gradient
    /// hooks, see `overlap`); the same operations, earlier, so the same numbers. Ignored by the
    /// shared-memory sharded engine and by a rank alone; ZeRO stage 2 turns it on by itself.
    pub overlap_backward: bool,
    /// ZeRO stage: 0 keeps everything on every rank; 1 keeps AdamW's moments of the dense
    /// parameters once across the ranks, each rank its shard (see `zero`), on any backend and
    /// across hosts: the same numbers; 2 also their gradients (each bucket reduce-scattered
    /// during the last backward pass, as with `overlap_backward`, and only the shard kept).
    /// Where `shard_optimizer` applies (one CPU host, shared memory) that faster form of stage
    /// 1 is used instead. 3 also shards the parameters' values: between uses each rank keeps
    /// its shard only, and the model gathers each unit of [`DdpConfig::units`] around its
    /// forward and backward through [`Ddp::param_gate`] (see `gate`). Ignored by a rank alone.
    pub zero: u8,
    /// The model's units, in its forward order: name prefixes, each unit holding the trainable
    /// dense parameters whose names start with it (the first prefix that matches). At every
    /// stage each unit is one bucket (the others are bucketed by size), so that every stage
    /// reduces the same buckets and gives the same bits. Under ZeRO stage 3 the model enters
    /// and leaves each by this name, and the parameters in none are gathered for each whole
    /// window. Empty: buckets by size only (stage 3 then gathers everything for each window).
    pub units: Vec<String>,
    /// ZeRO-Offload's optimizer half: AdamW's moments in host memory and the update run there
    /// (see [`crate::optim::AdamW::on_host`]), for this rank's shard under ZeRO, every dense
    /// parameter otherwise: a GPU keeps no moments. The same numbers.
    pub offload: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum DdpError {
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    #[error("step {step}: {detail}")]
    Loss { step: u64, detail: String },
    #[error("parameters differ across ranks at step {step}: {detail}; the ranks are no longer training the same model")]
    Diverged { step: u64, detail: String },
    #[error(transparent)]
    Torch(#[from] tch::TchError),
    #[error(transparent)]
    Overlap(#[from] OverlapError),
    #[error("the optimizer: {0}")]
    Optim(#[from] OptimError),
    #[error("expected {expected} micro-batches per optimizer step, got {got}")]
    Window { expected: usize, got: usize },
    #[error(
        "ZeRO stage {0} does not exist (stage 1 shards AdamW's moments, stage 2 also the gradients, stage 3 also the parameters)"
    )]
    ZeroStage(u8),
    #[error("internal error: {0}")]
    Internal(String),
}

/// What the engine runs on each micro-batch: the forward pass that gives its loss, and the end
/// of its backward pass for a model that leaves part of it to itself (activation checkpointing
/// recomputes what the forward did not keep, after the engine's `loss.backward()`).
pub trait MicroBatchLoss<B> {
    /// Mean loss over `micro`, ready for backward.
    fn loss(&mut self, micro: &B) -> Result<Tensor, tch::TchError>;
    /// Called as the step enters each of its phases, so that the caller can tell where it was
    /// when something failed (the engine itself keeps no such state). Default: nothing.
    fn phase(&mut self, _phase: StepPhase) {}
    /// Called after each `loss.backward()`; gradients accumulate as backward's do. Default:
    /// nothing left to do.
    fn finish_backward(&mut self) -> Result<(), tch::TchError> {
        Ok(())
    }
    /// Whether `loss.backward()` alone gives the micro-batch's gradients their final values
    /// (`finish_backward` adds to none of them). With [`DdpConfig::overlap_backward`] a bucket's
    /// all-reduce may start during the last backward pass only when this holds, and otherwise
    /// once `finish_backward` has returned. Default: true, as `finish_backward` does nothing by
    /// default; a model that runs backward passes of its own there must say false (the engine
    /// stops with an error when it sees a gradient grow after its bucket could start). Under
    /// ZeRO stage 2 a wrong `true` is worse than an error: the communication thread drops a
    /// bucket's gradients while autograd may still accumulate into them (undefined behaviour).
    fn backward_is_whole(&self) -> bool {
        true
    }
    /// The rows of the 2-D parameter `table` (a name from [`DdpConfig::sparse`]) that the last
    /// micro-batch's loss looked up: a superset of the rows its backward can have made non-zero
    /// (a missing row's gradient would not be exchanged). Asked after each micro-batch's
    /// backward. Default `None`: the engine finds them by reading the whole gradient.
    fn rows_used(&self, _table: &str) -> Option<&[i64]> {
        None
    }
}

/// The parts of one optimizer step, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepPhase {
    /// A micro-batch's forward pass.
    Forward,
    /// Its backward pass (and what the model recomputes in it).
    Backward,
    /// The all-reduce of the gradients, clipping and the optimizer update.
    Optimizer,
}

/// What one optimizer step reports.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepStats {
    /// Mean loss over the whole global batch (all micro-batches of all ranks).
    pub loss: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Where this rank's time went.
    pub time: StepTime,
    /// The largest number the ranks' [`StepProbe`]s gave this step, and the rank that gave it
    /// (`None` without a probe).
    pub probed_max: Option<(usize, f64)>,
    /// Some rank's stop flag ([`Ddp::set_stop_flag`]) was up when this step began its
    /// summary: every rank learns it at the same step, so they can stop there together.
    pub stop_requested: bool,
}

/// Samples one number on each rank after the step's backward passes (its peak memory, say).
/// The numbers travel in the step's summary all-reduce, one slot per rank, so every rank learns
/// the largest without a collective of its own. Values are sent as f32.
pub type StepProbe = Box<dyn FnMut() -> f64>;

/// One rank's wall time in the parts of a step: what tells a slow rank (long compute, the
/// others' collective wait long) from a slow link (everyone's collective time long).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTime {
    /// Forward and backward passes of the micro-batches (with the batches' assembly).
    pub compute: Duration,
    /// Inside collectives: moving data and waiting for the other ranks. With
    /// [`DdpConfig::overlap_backward`], of the buckets' all-reduce only what was left after
    /// backward (their time during backward counts as compute).
    pub collective: Duration,
    /// Touched-row masks, clipping and the optimizer update.
    pub update: Duration,
}

impl std::ops::AddAssign for StepTime {
    fn add_assign(&mut self, other: StepTime) {
        self.compute += other.compute;
        self.collective += other.collective;
        self.update += other.update;
    }
}

/// An embedding table whose gradient is exchanged row-sparse.
struct SparseTable {
    /// Index into the engine's `params`, and the variable's name.
    index: usize,
    name: String,
    rows: i64,
    /// This step's rows in use, as the model reported them (1.0 each), or `None` once it could
    /// not tell for some micro-batch.
    used: Option<Vec<f32>>,
    /// After a row-sparse exchange: the rows exchanged (ascending), the only non-zero ones.
    union: Option<Vec<i64>>,
}

/// One rank's side of data-parallel training.
pub struct Ddp {
    comm: Box<dyn Collective>,
    /// Trainable parameters in a fixed order (sorted by name: the same on every rank).
    params: Vec<Tensor>,
    /// Every variable of the model (trainable or not: frozen weights, buffers), sorted by name:
    /// what is broadcast at start and saved in checkpoints.
    variables: Vec<(String, Tensor)>,
    /// Indices into `params`, one group per all-reduce call (the sparse ones excepted).
    buckets: Vec<Vec<usize>>,
    /// The row-sparse tables.
    sparse: Vec<SparseTable>,
    config: DdpConfig,
    probe: Option<StepProbe>,
    /// Raised (by a signal handler, say) to have every rank told at the next step.
    stop_flag: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
    /// The sparse tables, when they live in shared memory.
    shared: Option<SharedTables>,
    /// Every trainable parameter, when they live in shared memory ([`DdpConfig::shard_optimizer`]).
    shards: Option<HostShards>,
    /// The names of `params`.
    param_names: Vec<String>,
    /// Per sparse table (in `sparse`'s order), the rows its gradient touched that the model did
    /// not report, when the last parameter check's step looked (sharded steps only).
    left_out: Vec<u64>,
    /// The gradient hooks and their state, with [`DdpConfig::overlap_backward`] where it applies.
    overlap: Option<Overlap>,
    /// Where each rank's shard lies, with ZeRO ([`DdpConfig::zero`]) where it applies.
    zero: Option<std::sync::Arc<ZeroLayout>>,
    /// ZeRO stage 3's parameter gate, where it applies.
    gate: Option<Gate>,
    /// Stage 3: the last window's units were reduce-scattered during its backward pass.
    reduced_in_backward: bool,
}

impl Ddp {
    /// Takes the trainable variables of `vs` and makes them identical on every rank by
    /// broadcasting rank 0's values.
    pub fn new(
        comm: Box<dyn Collective>,
        vs: &nn::VarStore,
        config: DdpConfig,
    ) -> Result<Ddp, DdpError> {
        if config.zero > 3 {
            return Err(DdpError::ZeroStage(config.zero));
        }
        let mut variables: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        variables.sort_by(|a, b| a.0.cmp(&b.0));
        let trainable: Vec<&(String, Tensor)> = variables
            .iter()
            .filter(|(_, t)| t.requires_grad())
            .collect();
        // Alone, there is nothing to exchange: no masks to compute either.
        let alone = comm.world_size() == 1;
        let sparse: Vec<SparseTable> = trainable
            .iter()
            .enumerate()
            .filter(|(_, (name, t))| !alone && config.sparse.contains(name) && t.dim() == 2)
            .map(|(index, (name, t))| SparseTable {
                index,
                name: name.clone(),
                rows: t.size()[0],
                used: None,
                union: None,
            })
            .collect();
        let params: Vec<Tensor> = trainable.iter().map(|(_, t)| t.shallow_clone()).collect();
        let param_names: Vec<String> = trainable.iter().map(|(name, _)| name.clone()).collect();
        let dense: Vec<usize> = (0..params.len())
            .filter(|i| !sparse.iter().any(|s| s.index == *i))
            .collect();
        // With units the buckets follow them at every stage: the ring's sums depend on where
        // an element lies in its bucket, so every stage must reduce the same buckets.
        let (buckets, unit_names) = match config.units.is_empty() {
            true => {
                let buckets = make_buckets(&params, &dense, config.bucket_bytes);
                let names = vec![None; buckets.len()];
                (buckets, names)
            }
            false => unit_buckets(&param_names, &dense, &params, &config),
        };
        let mut ddp = Ddp {
            comm,
            params,
            variables,
            buckets,
            sparse,
            config,
            probe: None,
            stop_flag: None,
            shared: None,
            shards: None,
            param_names,
            left_out: Vec::new(),
            overlap: None,
            zero: None,
            gate: None,
            reduced_in_backward: false,
        };
        ddp.broadcast_params(0)?;
        if ddp.config.shard_optimizer {
            let ctx = ddp.ctx(0);
            give_dense_grads(&ddp.params)?;
            ddp.shards = HostShards::new(ddp.comm.as_mut(), &ddp.params, ctx)?;
        }
        if ddp.config.shared_tables && ddp.shards.is_none() {
            let tables: Vec<usize> = ddp.sparse.iter().map(|t| t.index).collect();
            let ctx = ddp.ctx(0);
            ddp.shared = SharedTables::new(ddp.comm.as_mut(), &ddp.params, &tables, ctx)?;
        }
        if ddp.config.zero >= 1 && !alone && ddp.shards.is_none() {
            ddp.set_up_zero(unit_names)?;
        }
        // Stage 2 reduces each bucket as backward goes: its point is that the whole gradients
        // never exist at once. Stage 3's gate does so itself, with the gatherings in between.
        let stage_2 = ddp.zero_stage() == 2;
        let overlap = ddp.config.overlap_backward && ddp.gate.is_none();
        if (overlap || stage_2) && ddp.overlap_unavailable().is_none() {
            ddp.overlap = Some(Overlap::new(&ddp.params, &ddp.param_names, &ddp.buckets)?);
        }
        Ok(ddp)
    }

    /// ZeRO's layout over the buckets (`unit_names`: each one's unit, for stage 3's gate).
    fn set_up_zero(&mut self, unit_names: Vec<Option<String>>) -> Result<(), DdpError> {
        let (params, stage) = (&self.params, self.config.zero);
        let layout = ZeroLayout::new(self.comm.as_ref(), params, &self.buckets, stage)?;
        let layout = std::sync::Arc::new(layout);
        if layout.stage() == 3 {
            let declared = self.config.units.clone();
            let names = &self.param_names;
            let gate = Gate::new(layout.clone(), params, names, unit_names, declared)?;
            self.gate = Some(gate);
        }
        self.zero = Some(layout);
        self.give_dense_grads()
    }

    /// Whether AdamW's moments live in host memory and its update runs there
    /// ([`DdpConfig::offload`]): not where the shared-memory sharded step keeps them anyway.
    pub fn offloads(&self) -> bool {
        self.config.offload && self.shards.is_none()
    }

    /// Every step from now on samples `probe` and reports the ranks' largest value in
    /// [`StepStats::probed_max`]. Set it on every rank or on none (the summary's layout follows).
    pub fn set_probe(&mut self, probe: StepProbe) {
        self.probe = Some(probe);
    }

    /// From now on each step's summary carries `flag` (raised by a signal handler, say), and
    /// [`StepStats::stop_requested`] says whether it was up on any rank: an agreement at no
    /// extra collective, so that every rank stops after the same step.
    pub fn set_stop_flag(&mut self, flag: std::sync::Arc<std::sync::atomic::AtomicBool>) {
        self.stop_flag = Some(flag);
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    /// The collective, for the trainer's own exchanges (barriers, metrics, checkpoints).
    pub fn comm(&mut self) -> &mut dyn Collective {
        self.comm.as_mut()
    }

    /// The trainable parameters, in the engine's (name-sorted) order. Under ZeRO stage 3 their
    /// values are there only after [`Ddp::gather_params`] (until the next step).
    pub fn params(&self) -> &[Tensor] {
        &self.params
    }

    /// (name, variable) pairs of the whole model, trainable or not, for checkpoints (under ZeRO
    /// stage 3 after [`Ddp::gather_params`]).
    pub fn named_variables(&self) -> Vec<(String, Tensor)> {
        self.variables
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect()
    }

    /// Whether every trainable parameter lives once in shared memory, each rank reducing and
    /// updating its share of the rows ([`DdpConfig::shard_optimizer`]).
    pub fn sharded(&self) -> bool {
        self.shards.is_some()
    }

    /// The names of the trainable variables that live once in shared memory: every one in a
    /// sharded engine, the row-sparse tables with [`DdpConfig::shared_tables`].
    pub fn kept_once(&self) -> Vec<&str> {
        if self.shards.is_some() {
            return self.param_names.iter().map(String::as_str).collect();
        }
        self.shared_tables()
    }

    /// The names of the tables that live once in shared memory ([`DdpConfig::shared_tables`]).
    pub fn shared_tables(&self) -> Vec<&str> {
        let Some(shared) = &self.shared else {
            return Vec::new();
        };
        (self.sparse.iter())
            .filter(|t| shared.holds(t.index))
            .map(|t| t.name.as_str())
            .collect()
    }

    /// Number of all-reduce calls per optimizer step.
    pub fn bucket_count(&self) -> usize {
        self.buckets.len()
    }

    /// Why no bucket all-reduce could overlap the backward pass here, if none could: the rule
    /// behind [`DdpConfig::overlap_backward`]'s "where it applies" (`None`: it can).
    pub fn overlap_unavailable(&self) -> Option<String> {
        Some(if self.world_size() == 1 {
            "one process has no all-reduce to overlap".to_string()
        } else if self.shards.is_some() {
            "the shared-memory optimizer (dist.shard_optimizer) reduces each share after backward; set dist.shard_optimizer = false and dist.zero = 0 to overlap an all-reduce instead".to_string()
        } else if self.bucket_count() == 0 {
            "the model has no dense gradients to all-reduce".to_string()
        } else if self.gate.is_some() {
            "ZeRO stage 3 reduce-scatters each unit during the backward pass itself".to_string()
        } else {
            return None;
        })
    }

    /// How many units ZeRO stage 3 gathers one at a time (0 where it does not apply).
    pub fn gathered_units(&self) -> usize {
        self.gate.as_ref().map_or(0, |g| g.gate.units())
    }

    /// Whether the buckets' all-reduce overlaps the backward pass
    /// ([`DdpConfig::overlap_backward`], where it applies).
    pub fn overlaps_backward(&self) -> bool {
        self.overlap.is_some()
    }

    /// How many buckets the last step started before its backward pass had ended (0 without
    /// overlap): how much overlap there was.
    pub fn buckets_during_backward(&self) -> usize {
        self.overlap.as_ref().map_or(0, |o| o.early)
    }

    /// Messages number steps from 1, as the logs do: callers pass `step + 1`.
    fn ctx(&self, step: u64) -> OpContext {
        OpContext {
            step,
            timeout: self.config.timeout,
        }
    }

    /// Overwrites every rank's variables (trainable or not) with `root`'s. Variables in shared
    /// memory are every rank's already: they are not sent, and the barrier that ends this call
    /// keeps anyone from reading them before `root` is done with what it wrote.
    pub fn broadcast_params(&mut self, root: usize) -> Result<(), DdpError> {
        let ctx = self.ctx(0);
        let _guard = tch::no_grad_guard();
        self.gather_params()?;
        let shared = self.kept_once();
        let mut views: Vec<Tensor> = (self.variables.iter())
            .filter(|(name, _)| !shared.contains(&name.as_str()))
            .map(|(_, t)| t.shallow_clone())
            .collect();
        self.comm.broadcast(&mut views, root, ctx)?;
        if self.shared.is_some() || self.shards.is_some() {
            self.comm.barrier(ctx)?;
        }
        Ok(())
    }

    /// One optimizer step: forward + backward of each micro-batch of `window` (loss divided by
    /// the accumulation count, gradients accumulating locally), then — only then — gradients
    /// averaged over ranks bucket by bucket, clipped, and the optimizer step taken with `lr`.
    pub fn step<B>(
        &mut self,
        window: &[B],
        model: &mut impl MicroBatchLoss<B>,
        optimizer: &mut AdamW,
        lr: f64,
        step: u64,
    ) -> Result<StepStats, DdpError> {
        if window.len() != self.config.grad_accum {
            return Err(DdpError::Window {
                expected: self.config.grad_accum,
                got: window.len(),
            });
        }
        let started = Instant::now();
        let ctx = self.ctx(step + 1);
        // Every parameter takes part in the reduction (the others may have gradients for one
        // this rank's batches did not reach), and a sparse backward adds into a dense gradient.
        self.zero_grads()?;
        let (losses, waited) = self.run_window(window, model, ctx)?;
        let bad_loss = losses.local.shallow_clone();
        model.phase(StepPhase::Optimizer);
        let mut time = StepTime {
            compute: started.elapsed().saturating_sub(waited),
            collective: waited,
            ..StepTime::default()
        };
        let _guard = tch::no_grad_guard();
        // Loss, a "bad loss" flag and the rows each sparse table touched travel together first
        // (after the overlapped buckets, which every rank reduces whatever its loss), so that
        // every rank stops together when any rank's loss is not finite (instead of the others
        // waiting for its gradients), and every rank knows the union of touched rows.
        let mut summary = [self.summary(&losses)?];
        let reducing = Instant::now();
        time.update = (reducing - started).saturating_sub(time.compute + waited);
        // Alone, the sum is the summary itself.
        if self.world_size() > 1 {
            self.comm.all_reduce(&mut summary, ReduceOp::Sum, ctx)?;
        }
        // The step's one wait for the device before the update: the loss, the flags and the
        // masks, read together.
        let summary = host_read::f32s(&summary[0])?;
        let global_loss = f64::from(summary[0]) / self.world_size() as f64;
        let probed_max = self.probed_max(&summary);
        let stop_requested = summary[2] > 0.0;
        if summary[1] > 0.0 {
            let mine = host_read::scalar(&bad_loss)?;
            return Err(DdpError::Loss {
                step: step + 1,
                detail: if mine.is_finite() {
                    "the loss is not finite on another rank (see its message)".to_string()
                } else {
                    format!(
                        "the loss is {mine} on rank {}; lower train.lr or check the data",
                        self.rank()
                    )
                },
            });
        }
        let grad_norm = if self.shards.is_some() {
            time.collective += reducing.elapsed();
            let check_due = self.check_due(step);
            self.sharded_update(&summary, check_due, optimizer, lr, ctx, &mut time)?
        } else if self.zero.is_some() {
            time.collective += reducing.elapsed();
            self.zero_update(&summary, optimizer, lr, ctx, &mut time)?
        } else {
            self.reduce_sparse(&summary, ctx)?;
            if self.overlap.is_none() {
                self.reduce_buckets(ctx)?;
            }
            time.collective += reducing.elapsed();
            self.update(optimizer, lr, ctx, &mut time)?
        };
        let stats = StepStats {
            loss: global_loss,
            grad_norm,
            time,
            probed_max,
            stop_requested,
        };
        if self.check_due(step) {
            self.check_params(step)?;
        }
        Ok(stats)
    }

    /// Under ZeRO stage 3, every parameter's values gathered on every rank and kept until the
    /// next step (for an evaluation, a checkpoint, reading them): every rank must call it at the
    /// same point. Nothing to do otherwise.
    pub fn gather_params(&mut self) -> Result<(), DdpError> {
        let ctx = self.ctx(0);
        match &self.gate {
            Some(gate) => {
                let _guard = tch::no_grad_guard();
                gate.gate.gather_all(self.comm.as_mut(), ctx)
            }
            None => Ok(()),
        }
    }

    /// ZeRO stage 3's gate, for the model to gather each of its units around their use
    /// (`None` where stage 3 does not apply: the parameters always hold their values).
    pub fn param_gate(&self) -> Option<ParamGate> {
        self.gate.as_ref().map(|g| g.gate.clone())
    }

    /// Runs the micro-batches of `window`; with overlap, beside the communication thread that
    /// reduces the buckets meanwhile (all-reduced, or reduce-scattered under ZeRO). Returns the losses and the time spent waiting for that
    /// thread after the last backward pass.
    fn run_window<B>(
        &mut self,
        window: &[B],
        model: &mut impl MicroBatchLoss<B>,
        ctx: OpContext,
    ) -> Result<(WindowLoss, Duration), DdpError> {
        let sparse = &mut self.sparse;
        if let Some(gate) = &self.gate {
            let gate = &gate.gate;
            let lent = gate.lend(self.comm.as_mut(), ctx)?;
            let computed = micro_batches(window, model, sparse, |whole| gate.arm(whole));
            let closed = gate.close(computed.is_ok());
            drop(lent);
            // A hook's error is the cause of a backward pass that stopped.
            self.reduced_in_backward = closed?;
            return Ok((computed?, Duration::ZERO));
        }
        let Some(overlap) = self.overlap.as_mut() else {
            return Ok((
                micro_batches(window, model, sparse, |_| {})?,
                Duration::ZERO,
            ));
        };
        let params = &self.params;
        let buckets = (self.buckets.iter())
            .map(|b| b.iter().map(|&i| params[i].shallow_clone()).collect())
            .collect();
        // Under ZeRO the buckets are reduce-scattered, as its update would after backward.
        let scatter = |comm: &mut dyn Collective, b, members: &[Tensor], ctx| match &self.zero {
            Some(zero) => zero.reduce_bucket(comm, b, members, ctx),
            None => overlap::all_reduce_bucket(comm, b, members, ctx),
        };
        overlap.around(self.comm.as_mut(), buckets, ctx, &scatter, |arm| {
            micro_batches(window, model, sparse, |whole| arm.arm(whole))
        })
    }

    /// Averages the dense gradients over the ranks, bucket by bucket in order.
    fn reduce_buckets(&mut self, ctx: OpContext) -> Result<(), DdpError> {
        if self.world_size() == 1 {
            return Ok(()); // the average of one is itself: no flattening, no collective
        }
        for bucket in &self.buckets {
            let mut grads: Vec<Tensor> = bucket.iter().map(|&i| self.params[i].grad()).collect();
            self.comm.all_reduce(&mut grads, ReduceOp::Avg, ctx)?;
        }
        Ok(())
    }

    /// Whether the parameter check runs after optimizer step `step` (counted from 0).
    fn check_due(&self, step: u64) -> bool {
        let every = self.config.check_params_every;
        every > 0 && (step + 1) % every == 0
    }

    /// Clips the averaged gradients and takes the optimizer step (on shared tables this rank's
    /// rows, then a barrier); returns the norm before clipping. Adds to `time`.
    fn update(
        &mut self,
        optimizer: &mut AdamW,
        lr: f64,
        ctx: OpContext,
        time: &mut StepTime,
    ) -> Result<f64, DdpError> {
        let updating = Instant::now();
        let grad_norm = clip_grads(&self.clip_list(), self.config.max_grad_norm)?;
        if !grad_norm.is_finite() {
            // The same on every rank (the gradients were averaged): all stop together.
            return Err(not_finite_norm(ctx.step, grad_norm));
        }
        if let Some(shared) = &self.shared {
            shared.attach(optimizer)?;
        }
        optimizer.step(&self.params, lr);
        time.update += updating.elapsed();
        if self.shared.is_some() {
            // Every rank wrote its rows of the shared tables: nobody reads them before.
            let waiting = Instant::now();
            self.comm.barrier(ctx)?;
            time.collective += waiting.elapsed();
        }
        Ok(grad_norm)
    }

    /// Averages each sparse table's gradient over the ranks: only the rows some rank touched
    /// (from the reduced `summary`) when they are at most half the table, otherwise all of it.
    /// Remembers the rows exchanged: the only ones not zero afterwards.
    fn reduce_sparse(&mut self, summary: &[f32], ctx: OpContext) -> Result<(), DdpError> {
        let unions = self.unions(summary);
        // The touched rows of every row-sparse table travel in one all-reduce (one
        // synchronisation of the ranks instead of one per table).
        let mut compact = Vec::new();
        for (table, union) in self.sparse.iter_mut().zip(unions) {
            let mut grad = self.params[table.index].grad();
            let Some(union) = union else {
                self.comm
                    .all_reduce(std::slice::from_mut(&mut grad), ReduceOp::Avg, ctx)?;
                continue;
            };
            compact.push(rows::gather(&grad, &union)?);
            table.union = Some(union);
        }
        if compact.is_empty() {
            return Ok(());
        }
        self.comm.all_reduce(&mut compact, ReduceOp::Avg, ctx)?;
        let exchanged = self
            .sparse
            .iter()
            .filter_map(|t| Some((t, t.union.as_ref()?)));
        for ((table, union), values) in exchanged.zip(&compact) {
            // Rows outside the union are zero on every rank already: their average is too.
            rows::scatter(&self.params[table.index].grad(), union, values)?;
        }
        Ok(())
    }

    /// What clipping reads: each defined gradient, a sparse table's by its exchanged rows.
    fn clip_list(&self) -> Vec<ClipGrad<'_>> {
        let rows = |i: usize| {
            self.sparse
                .iter()
                .find(|t| t.index == i)
                .and_then(|t| t.union.as_deref())
        };
        self.params
            .iter()
            .enumerate()
            .map(|(i, p)| (p.grad(), rows(i)))
            .filter(|(grad, _)| grad.defined())
            .map(|(grad, rows)| ClipGrad { grad, rows })
            .collect()
    }
}

/// The error of a step whose averaged gradients have a norm that is not finite: the same on
/// every rank, so all stop together.
fn not_finite_norm(step: u64, grad_norm: f64) -> DdpError {
    DdpError::Loss {
        step,
        detail: format!("the gradient norm is {grad_norm}; lower train.lr or check the data"),
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod zero3_tests;
