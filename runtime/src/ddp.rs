//! The DDP engine: makes N processes train one model as if they were one. It owns the
//! parameter broadcast at start, gradient accumulation over micro-batches, the bucketed
//! gradient all-reduce (only after the last micro-batch of a window), the row-sparse exchange of
//! embedding-table gradients, global-norm clipping and the optimizer step, plus the optional
//! cross-rank parameter check. It works on any `tch`
//! model and any loss: it must not know about the recommender, the data or files.

use std::time::{Duration, Instant};

use tch::{nn, Tensor};

use crate::clip::{clip_grads, ClipGrad};
use crate::collective::{Collective, CollectiveError, OpContext, ReduceOp};
use crate::optim::{AdamW, OptimError};
use crate::rows;

mod shared_tables;
use shared_tables::SharedTables;

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
    #[error("the optimizer: {0}")]
    Optim(#[from] OptimError),
    #[error("expected {expected} micro-batches per optimizer step, got {got}")]
    Window { expected: usize, got: usize },
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
    /// Inside collectives: moving data and waiting for the other ranks.
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
    /// The sparse tables, when they live in shared memory.
    shared: Option<SharedTables>,
}

impl Ddp {
    /// Takes the trainable variables of `vs` and makes them identical on every rank by
    /// broadcasting rank 0's values.
    pub fn new(
        comm: Box<dyn Collective>,
        vs: &nn::VarStore,
        config: DdpConfig,
    ) -> Result<Ddp, DdpError> {
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
        let dense: Vec<usize> = (0..params.len())
            .filter(|i| !sparse.iter().any(|s| s.index == *i))
            .collect();
        let buckets = make_buckets(&params, &dense, config.bucket_bytes);
        let mut ddp = Ddp {
            comm,
            params,
            variables,
            buckets,
            sparse,
            config,
            probe: None,
            shared: None,
        };
        ddp.broadcast_params(0)?;
        if ddp.config.shared_tables {
            let tables: Vec<usize> = ddp.sparse.iter().map(|t| t.index).collect();
            let ctx = ddp.ctx(0);
            ddp.shared = SharedTables::new(ddp.comm.as_mut(), &ddp.params, &tables, ctx)?;
        }
        Ok(ddp)
    }

    /// Every step from now on samples `probe` and reports the ranks' largest value in
    /// [`StepStats::probed_max`]. Set it on every rank or on none (the summary's layout follows).
    pub fn set_probe(&mut self, probe: StepProbe) {
        self.probe = Some(probe);
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

    /// The trainable parameters, in the engine's (name-sorted) order.
    pub fn params(&self) -> &[Tensor] {
        &self.params
    }

    /// (name, variable) pairs of the whole model, trainable or not, for checkpoints.
    pub fn named_variables(&self) -> Vec<(String, Tensor)> {
        self.variables
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect()
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

    /// Messages number steps from 1, as the logs do: callers pass `step + 1`.
    fn ctx(&self, step: u64) -> OpContext {
        OpContext {
            step,
            timeout: self.config.timeout,
        }
    }

    /// Overwrites every rank's variables (trainable or not) with `root`'s. Tables in shared
    /// memory are every rank's already: they are not sent, and the barrier that ends this call
    /// keeps anyone from reading them before `root` is done with what it wrote.
    pub fn broadcast_params(&mut self, root: usize) -> Result<(), DdpError> {
        let ctx = self.ctx(0);
        let _guard = tch::no_grad_guard();
        let shared = self.shared_tables();
        let mut views: Vec<Tensor> = (self.variables.iter())
            .filter(|(name, _)| !shared.contains(&name.as_str()))
            .map(|(_, t)| t.shallow_clone())
            .collect();
        self.comm.broadcast(&mut views, root, ctx)?;
        if self.shared.is_some() {
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
        // Every parameter takes part in the reduction (the others may have gradients for one
        // this rank's batches did not reach), and a sparse backward adds into a dense gradient.
        self.zero_grads()?;
        let scale = 1.0 / window.len() as f64;
        let mut local_loss = 0.0;
        let mut bad_loss = None;
        for micro in window {
            model.phase(StepPhase::Forward);
            let loss = model.loss(micro)?;
            let value = loss.f_double_value(&[])?;
            if !value.is_finite() {
                bad_loss = Some(value);
                break;
            }
            local_loss += value * scale;
            model.phase(StepPhase::Backward);
            (loss * scale).f_backward()?;
            model.finish_backward()?;
            self.mark_rows_used(model);
        }
        model.phase(StepPhase::Optimizer);
        let mut time = StepTime {
            compute: started.elapsed(),
            ..StepTime::default()
        };
        let ctx = self.ctx(step + 1);
        let _guard = tch::no_grad_guard();
        // Loss, a "bad loss" flag and the rows each sparse table touched travel together first,
        // so that every rank stops together when any rank's loss is not finite (instead of the
        // others waiting for its gradients), and every rank knows the union of touched rows.
        let mut summary = [self.summary(local_loss, bad_loss.is_some())?];
        let reducing = Instant::now();
        time.update = reducing - started - time.compute;
        self.comm.all_reduce(&mut summary, ReduceOp::Sum, ctx)?;
        let global_loss = summary[0].f_double_value(&[0])? / self.world_size() as f64;
        let probed_max = self.probed_max(&summary[0])?;
        if summary[0].f_double_value(&[1])? > 0.0 {
            return Err(DdpError::Loss {
                step: step + 1,
                detail: match bad_loss {
                    Some(value) => format!(
                        "the loss is {value} on rank {}; lower train.lr or check the data",
                        self.rank()
                    ),
                    None => "the loss is not finite on another rank (see its message)".to_string(),
                },
            });
        }
        self.reduce_sparse(&summary[0], ctx)?;
        for bucket in &self.buckets {
            let mut grads: Vec<Tensor> = bucket.iter().map(|&i| self.params[i].grad()).collect();
            self.comm.all_reduce(&mut grads, ReduceOp::Avg, ctx)?;
        }
        time.collective = reducing.elapsed();
        let grad_norm = self.update(optimizer, lr, ctx, &mut time)?;
        let stats = StepStats {
            loss: global_loss,
            grad_norm,
            time,
            probed_max,
        };
        let every = self.config.check_params_every;
        if every > 0 && (step + 1) % every == 0 {
            self.check_params(step)?;
        }
        Ok(stats)
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
            return Err(DdpError::Loss {
                step: ctx.step,
                detail: format!(
                    "the gradient norm is {grad_norm}; lower train.lr or check the data"
                ),
            });
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

    /// `[local loss, bad-loss flag, probe slot of each rank (with a probe), touched-row mask of
    /// each sparse table...]` (f32).
    fn summary(&mut self, local_loss: f64, bad: bool) -> Result<Tensor, DdpError> {
        let head = Tensor::from_slice(&[local_loss as f32, if bad { 1.0 } else { 0.0 }]);
        let mut parts = vec![head];
        if let Some(probe) = self.probe.as_mut() {
            let mut slots = vec![0f32; self.comm.world_size()];
            slots[self.comm.rank()] = probe() as f32;
            parts.push(Tensor::from_slice(&slots));
        }
        for table in &mut self.sparse {
            parts.push(match table.used.take() {
                Some(used) => Tensor::from_slice(&used),
                None => touched_rows(&self.params[table.index].grad())?,
            });
        }
        Ok(Tensor::f_cat(&parts, 0)?)
    }

    /// Averages each sparse table's gradient over the ranks: only the rows some rank touched
    /// (from the reduced `summary`) when they are at most half the table, otherwise all of it.
    /// Remembers the rows exchanged: the only ones not zero afterwards.
    fn reduce_sparse(&mut self, summary: &Tensor, ctx: OpContext) -> Result<(), DdpError> {
        let summary = Vec::<f32>::try_from(summary)?;
        let mut masks = &summary[self.summary_head_len() as usize..];
        // The touched rows of every row-sparse table travel in one all-reduce (one
        // synchronisation of the ranks instead of one per table).
        let mut compact = Vec::new();
        for table in &mut self.sparse {
            let (mask, rest) = masks.split_at(table.rows as usize);
            masks = rest;
            let union: Vec<i64> = (0..table.rows)
                .filter(|&r| mask[r as usize] > 0.0)
                .collect();
            let mut grad = self.params[table.index].grad();
            if union.len() as i64 * 2 > table.rows {
                self.comm
                    .all_reduce(std::slice::from_mut(&mut grad), ReduceOp::Avg, ctx)?;
                continue;
            }
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

    /// Zeroes every gradient before a step (giving dense ones first): a sparse table whose last
    /// exchange was row-sparse only on the rows it exchanged, the only ones not zero (a whole
    /// table is most of a step's memory traffic otherwise).
    fn zero_grads(&mut self) -> Result<(), DdpError> {
        give_dense_grads(&self.params)?;
        let mut done = vec![false; self.params.len()];
        for table in &mut self.sparse {
            table.used = Some(vec![0.0; table.rows as usize]);
            // Taken: until this step's exchange, nothing says which rows are non-zero.
            if let Some(union) = table.union.take() {
                rows::zero(&self.params[table.index].grad(), &union)?;
                done[table.index] = true;
            }
        }
        for (p, done) in self.params.iter_mut().zip(done) {
            if !done {
                p.zero_grad();
            }
        }
        Ok(())
    }

    /// Adds the rows the last micro-batch used to each sparse table's mask (`used` is set to all
    /// zeros when the step's zeroing starts, and dropped for good once the model cannot tell).
    fn mark_rows_used<B>(&mut self, model: &impl MicroBatchLoss<B>) {
        for table in &mut self.sparse {
            let Some(used) = table.used.as_mut() else {
                continue;
            };
            let rows = model.rows_used(&table.name);
            let fits = |r: &i64| (0..table.rows).contains(r);
            match rows {
                Some(rows) if rows.iter().all(fits) => {
                    for &r in rows {
                        used[r as usize] = 1.0;
                    }
                }
                _ => table.used = None,
            }
        }
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

    /// Where the sparse tables' masks start in the summary.
    fn summary_head_len(&self) -> i64 {
        2 + if self.probe.is_some() {
            self.comm.world_size() as i64
        } else {
            0
        }
    }

    /// The largest probe slot of the reduced `summary`, with its rank (the lowest on a tie).
    fn probed_max(&self, summary: &Tensor) -> Result<Option<(usize, f64)>, DdpError> {
        if self.probe.is_none() {
            return Ok(None);
        }
        let world = self.comm.world_size();
        let slots = Vec::<f32>::try_from(summary.f_narrow(0, 2, world as i64)?)?;
        Ok(slots
            .iter()
            .enumerate()
            .fold(None, |best: Option<(usize, f64)>, (r, &v)| match best {
                Some((_, b)) if b >= f64::from(v) => best,
                _ => Some((r, f64::from(v))),
            }))
    }

    /// What the parameter check compares across ranks, by name: each variable's checksum; and
    /// for each table kept once per host, which every rank sees alike by construction, what can
    /// still go wrong: the averaged gradient each rank updated its rows from (the same on every
    /// rank after a correct exchange) and whether the rank's parameter is the host's copy.
    fn agreement_entries(&self) -> Result<Vec<(String, Entry)>, DdpError> {
        let mut entries = Vec::with_capacity(self.variables.len());
        for (name, p) in &self.variables {
            entries.push((name.clone(), Entry::Same(checksum(p)?)));
        }
        if let Some(shared) = &self.shared {
            for table in self.sparse.iter().filter(|t| shared.holds(t.index)) {
                let param = &self.params[table.index];
                let grad = param.grad();
                let sum = if grad.defined() { checksum(&grad)? } else { 0 };
                entries.push((format!("{} (its gradient)", table.name), Entry::Same(sum)));
                let here = shared.is_shared_copy(table.index, param);
                entries.push((table.name.clone(), Entry::SharedCopy(here)));
            }
        }
        Ok(entries)
    }

    /// Fails loudly if any rank's parameters differ from the others' (see
    /// [`Ddp::agreement_entries`] for what is compared), naming what differs and where.
    pub fn check_params(&mut self, step: u64) -> Result<(), DdpError> {
        let entries = self.agreement_entries()?;
        let values: Vec<i64> = entries.iter().map(|(_, e)| e.value()).collect();
        let all = self
            .comm
            .all_gather(&Tensor::from_slice(&values), self.ctx(step))?;
        let ranks: Vec<Vec<i64>> = all
            .iter()
            .map(Vec::<i64>::try_from)
            .collect::<Result<_, _>>()?;
        match disagreement(&entries, &ranks) {
            Some(detail) => Err(DdpError::Diverged { step, detail }),
            None => Ok(()),
        }
    }
}

/// One value the parameter check compares across ranks.
#[derive(Debug, Clone, Copy)]
enum Entry {
    /// Must be the same on every rank.
    Same(i64),
    /// Whether this rank's parameter is the host's one copy of a shared table: must hold on every rank.
    SharedCopy(bool),
}

impl Entry {
    fn value(self) -> i64 {
        match self {
            Entry::Same(v) => v,
            Entry::SharedCopy(here) => i64::from(here),
        }
    }
}

/// What differs between the ranks' `values` (rank order; each in the order of `entries`), in
/// words: at most three entries, then a count. `None` when they agree.
fn disagreement(entries: &[(String, Entry)], values: &[Vec<i64>]) -> Option<String> {
    let mut found = Vec::new();
    for (i, (name, entry)) in entries.iter().enumerate() {
        let of = |r: usize| values[r].get(i).copied();
        let odd: Vec<String> = (0..values.len())
            .filter(|&r| match entry {
                Entry::Same(_) => of(r) != of(0),
                Entry::SharedCopy(_) => of(r) != Some(1),
            })
            .map(|r| r.to_string())
            .collect();
        if odd.is_empty() {
            continue;
        }
        found.push(match entry {
            Entry::Same(_) => format!(
                "`{name}` differs from rank 0's on rank(s) {}",
                odd.join(", ")
            ),
            Entry::SharedCopy(_) => format!(
                "`{name}` is not the host's shared copy on rank(s) {}",
                odd.join(", ")
            ),
        });
    }
    let more = found.len().saturating_sub(3);
    found.truncate(3);
    (!found.is_empty()).then(|| match more {
        0 => found.join("; "),
        n => format!("{} (and {n} more)", found.join("; ")),
    })
}

/// A checksum of a tensor's bits (FNV-1a over its bytes, so any difference shows).
fn checksum(t: &Tensor) -> Result<i64, DdpError> {
    let t = t
        .f_detach()?
        .f_to_device(tch::Device::Cpu)?
        .f_contiguous()?;
    let n = t.numel();
    let mut bytes = vec![0u8; n * t.f_kind()?.elt_size_in_bytes()];
    t.f_copy_data_u8(&mut bytes, n)?;
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    Ok(hash as i64)
}

/// Gives each of `params` that has no gradient yet a dense zero one. An embedding whose
/// backward is sparse (`sparse = true`: a few rows instead of a dense table per micro-batch)
/// then adds into it in place and the gradient stays dense, as the reduction and the optimizer
/// need; left undefined, the first backward would store a sparse gradient instead. Refuses a
/// gradient that is already sparse (it cannot be replaced).
pub fn give_dense_grads(params: &[Tensor]) -> Result<(), tch::TchError> {
    for p in params {
        let grad = p.grad();
        if grad.defined() && grad.is_sparse() {
            return Err(tch::TchError::Torch(format!(
                "a parameter of shape {:?} has a sparse gradient: give it a dense one (runtime::ddp::give_dense_grads) before its first backward",
                p.size()
            )));
        }
        if !grad.defined() && p.requires_grad() {
            tch::with_grad(|| (p.f_sum(tch::Kind::Float)? * 0.0).f_backward())?;
        }
    }
    Ok(())
}

/// 1.0 for each row of the 2-D `grad` that holds a non-zero (or NaN) element, 0.0 for the
/// others (f32). On a contiguous f32 CPU gradient one read pass with no temporaries (tensor
/// ops took five times as long, the largest part of the sparse exchange's cost); tensor ops
/// otherwise.
fn touched_rows(grad: &Tensor) -> Result<Tensor, tch::TchError> {
    let (rows, n) = (grad.size()[0], grad.numel());
    let cpu_f32 = grad.device() == tch::Device::Cpu && grad.kind() == tch::Kind::Float;
    if !cpu_f32 || !grad.is_contiguous() || n == 0 {
        return grad
            .f_ne(0.0)?
            .f_any_dim(1, false)?
            .f_to_kind(tch::Kind::Float);
    }
    // SAFETY: a contiguous f32 CPU buffer of n elements, alive and unchanged for this call
    // (the step runs on the training thread, under no_grad).
    let values = unsafe { std::slice::from_raw_parts(grad.data_ptr() as *const f32, n) };
    let width = n / rows as usize;
    let mask: Vec<f32> = values
        .chunks_exact(width)
        // The bits but the sign's: zero only for ±0.0. A fold without early exit vectorises.
        .map(|row| {
            f32::from(u8::from(
                row.iter().fold(0, |acc, x| acc | x.to_bits() << 1) != 0,
            ))
        })
        .collect();
    Ok(Tensor::from_slice(&mask))
}

/// Groups the parameters `which` (indices into `params`) into buckets of at most
/// `bucket_bytes` of f32 gradient, in reverse order (the order backward produces gradients, as
/// PyTorch's DDP does); a parameter larger than a bucket gets one of its own.
fn make_buckets(params: &[Tensor], which: &[usize], bucket_bytes: usize) -> Vec<Vec<usize>> {
    let mut buckets: Vec<Vec<usize>> = Vec::new();
    let mut current: Vec<usize> = Vec::new();
    let mut bytes = 0usize;
    for &i in which.iter().rev() {
        let size = params[i].numel() * 4;
        if !current.is_empty() && bytes + size > bucket_bytes {
            buckets.push(std::mem::take(&mut current));
            bytes = 0;
        }
        current.push(i);
        bytes += size;
    }
    if !current.is_empty() {
        buckets.push(current);
    }
    buckets
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The runtime trains any `tch` model: a plain MLP regressing `y = x0 - 2 x1` data-parallel
    /// over a real TCP ring of two ranks, with the sharded sampler, gradient accumulation and
    /// AdamW — no recommender anywhere. The loss falls and the ranks end bit-identical.
    #[test]
    fn a_plain_mlp_trains_data_parallel_through_the_runtime_alone() {
        use crate::collective::tcp::test_ring::with_ring_owned;
        use tch::nn::{self, Module};

        struct Mlp {
            net: nn::Sequential,
            x: Tensor,
            y: Tensor,
        }
        impl MicroBatchLoss<Vec<usize>> for Mlp {
            fn loss(&mut self, micro: &Vec<usize>) -> Result<Tensor, tch::TchError> {
                let idx = Tensor::from_slice(&micro.iter().map(|&i| i as i64).collect::<Vec<_>>());
                let (x, y) = (self.x.index_select(0, &idx), self.y.index_select(0, &idx));
                Ok((self.net.forward(&x) - y).square().mean(tch::Kind::Float))
            }
        }

        let results = with_ring_owned(2, |rank, ring| {
            tch::manual_seed(7);
            let x = Tensor::randn([256, 2], (tch::Kind::Float, tch::Device::Cpu));
            let y = (x.select(1, 0) - x.select(1, 1) * 2.0).unsqueeze(1);
            tch::manual_seed(100 + rank as i64); // different on each rank: the broadcast fixes it
            let vs = nn::VarStore::new(tch::Device::Cpu);
            let net = nn::seq()
                .add(nn::linear(vs.root() / "l1", 2, 16, Default::default()))
                .add_fn(|t| t.relu())
                .add(nn::linear(vs.root() / "l2", 16, 1, Default::default()));
            let mut model = Mlp { net, x, y };
            let config = DdpConfig {
                grad_accum: 2,
                bucket_bytes: 256,
                max_grad_norm: 1.0,
                check_params_every: 10,
                timeout: Duration::from_secs(20),
                sparse: Vec::new(),
                shared_tables: true,
            };
            let world = ring.world_size();
            let mut ddp = Ddp::new(Box::new(ring), &vs, config).unwrap();
            let mut adam = AdamW::new(ddp.params(), 0.9, 0.999, 1e-8, 0.0);
            let sampler = crate::sampler::DistributedSampler::new(256, world, rank, 1).unwrap();
            let (mut first, mut last, mut step) = (None, 0.0, 0u64);
            for epoch in 0..30 {
                for window in sampler.batches(epoch, 16, 0, true).chunks(2) {
                    let stats = ddp.step(window, &mut model, &mut adam, 0.02, step).unwrap();
                    step += 1;
                    first.get_or_insert(stats.loss);
                    last = stats.loss;
                }
            }
            let params: Vec<Vec<f32>> = ddp
                .params()
                .iter()
                .map(|t| Vec::<f32>::try_from(t.flatten(0, -1)).unwrap())
                .collect();
            (first.unwrap(), last, params)
        });
        let (first, last, params0) = &results[0];
        assert!(last < &(first / 10.0), "loss {first} -> {last}");
        assert_eq!(params0, &results[1].2, "the ranks' parameters differ");
    }

    /// A tiny matrix-factorisation model (two embedding tables and a bias) over fixed random
    /// (user, item, rating) triples: trains `steps` steps data-parallel over `world` ranks and
    /// returns rank 0's loss curve and final parameters.
    /// Sparse runs keep their tables in shared memory where they can (as by default).
    fn train_embeddings(
        world: u32,
        options: crate::collective::tcp::TcpOptions,
        sparse: bool,
        steps: u64,
    ) -> (Vec<f64>, Vec<Vec<f32>>) {
        train_embeddings_hinted(world, options, sparse, Hint::None, steps, true)
    }

    /// What the test model says of the rows its micro-batches used.
    #[derive(Clone, Copy, PartialEq)]
    enum Hint {
        /// Nothing: the engine scans the gradients.
        None,
        /// The users and items looked up.
        Exact,
        /// Only the first half of the items: a model that under-reports.
        Short,
    }

    fn train_embeddings_hinted(
        world: u32,
        options: crate::collective::tcp::TcpOptions,
        sparse: bool,
        hint: Hint,
        steps: u64,
        shared_tables: bool,
    ) -> (Vec<f64>, Vec<Vec<f32>>) {
        use crate::collective::tcp::test_ring::with_ring_owned_opts;
        struct Mf {
            users: nn::Embedding,
            items: nn::Embedding,
            bias: Tensor,
            data: Tensor,
            hint: Hint,
            used: Vec<(String, Vec<i64>)>,
        }
        impl MicroBatchLoss<Vec<i64>> for Mf {
            fn rows_used(&self, table: &str) -> Option<&[i64]> {
                let (_, rows) = self.used.iter().find(|(name, _)| name == table)?;
                Some(rows)
            }

            fn loss(&mut self, micro: &Vec<i64>) -> Result<Tensor, tch::TchError> {
                use tch::nn::Module;
                let rows = self.data.index_select(0, &Tensor::from_slice(micro));
                let (u, i) = (rows.select(1, 0), rows.select(1, 1));
                let ids = |t: &Tensor| Vec::<i64>::try_from(t).unwrap();
                let (mut users, mut items) = (ids(&u), ids(&i));
                if self.hint == Hint::Short {
                    items.truncate(items.len() / 2);
                }
                self.used = match self.hint {
                    Hint::None => Vec::new(),
                    _ => vec![
                        ("users.weight".into(), std::mem::take(&mut users)),
                        ("items.weight".into(), std::mem::take(&mut items)),
                    ],
                };
                let y = rows.select(1, 2).to_kind(tch::Kind::Float);
                let score = (self.users.forward(&u) * self.items.forward(&i)).sum_dim_intlist(
                    1,
                    false,
                    tch::Kind::Float,
                ) + &self.bias;
                Ok((score - y).square().mean(tch::Kind::Float))
            }
        }
        let results = with_ring_owned_opts(world, options, move |rank, ring| {
            // Deterministic data and weights (the RNG is shared by the rank threads).
            let k = Tensor::arange(400, (tch::Kind::Int64, tch::Device::Cpu));
            let data = Tensor::stack(
                &[
                    (&k * 7).remainder(200),
                    (&k * 13).remainder(300),
                    (&k * 5 + 1).remainder(5),
                ],
                1,
            );
            let vs = nn::VarStore::new(tch::Device::Cpu);
            // `sparse`: the tables' backward is sparse too, added into the dense gradients
            // the engine gives them.
            let emb = nn::EmbeddingConfig {
                sparse,
                ..Default::default()
            };
            let mut model = Mf {
                users: nn::embedding(vs.root() / "users", 200, 8, emb),
                items: nn::embedding(vs.root() / "items", 300, 8, emb),
                bias: vs.root().zeros("bias", &[1]),
                data,
                hint,
                used: Vec::new(),
            };
            tch::no_grad(|| {
                for (t, phase) in [(&mut model.users.ws, 0.3), (&mut model.items.ws, 1.7)] {
                    let n = t.numel() as i64;
                    let init = (Tensor::arange(n, (tch::Kind::Float, tch::Device::Cpu)) + phase)
                        .sin()
                        .view([-1, 8]);
                    t.copy_(&init);
                }
            });
            let config = DdpConfig {
                grad_accum: 2,
                bucket_bytes: 1 << 20,
                max_grad_norm: 1.0,
                check_params_every: 25,
                timeout: Duration::from_secs(20),
                sparse: if sparse {
                    vec!["users.weight".into(), "items.weight".into()]
                } else {
                    Vec::new()
                },
                shared_tables,
            };
            let mut ddp = Ddp::new(Box::new(ring), &vs, config).unwrap();
            let exchanged = if sparse && world > 1 { 2 } else { 0 };
            assert_eq!(ddp.sparse.len(), exchanged);
            let shared = exchanged > 0 && shared_tables && options.shared_memory;
            assert_eq!(ddp.shared_tables().len(), if shared { 2 } else { 0 });
            // The sparse runs also carry a probe (which moves the masks in the summary) and
            // must still train as the dense ones do.
            let top = world as usize - 1;
            let probed = |r: usize| r as f64 * 1.5 + 1.0;
            if sparse {
                ddp.set_probe(Box::new(move || probed(rank)));
            }
            let mut adam = AdamW::new(ddp.params(), 0.9, 0.999, 1e-8, 0.01);
            let sampler =
                crate::sampler::DistributedSampler::new(400, world as usize, rank, 9).unwrap();
            let mut losses = Vec::new();
            'train: for epoch in 0.. {
                for window in sampler.batches(epoch, 4, 0, true).chunks_exact(2) {
                    let window: Vec<Vec<i64>> = window
                        .iter()
                        .map(|m| m.iter().map(|&i| i as i64).collect())
                        .collect();
                    let step = losses.len() as u64;
                    let stats = match ddp.step(&window, &mut model, &mut adam, 0.05, step) {
                        Ok(stats) => stats,
                        // Rows left out are not exchanged: the ranks drift apart, and the
                        // parameter check must say so.
                        Err(DdpError::Diverged { detail, .. }) if hint == Hint::Short => {
                            assert!(detail.contains("`items.weight"), "{detail}");
                            break 'train;
                        }
                        Err(e) => panic!("step {step}: {e}"),
                    };
                    losses.push(stats.loss);
                    assert_eq!(stats.probed_max, sparse.then(|| (top, probed(top))));
                    if losses.len() as u64 == steps {
                        break 'train;
                    }
                }
            }
            let params = ddp
                .params()
                .iter()
                .map(|t| Vec::<f32>::try_from(t.flatten(0, -1)).unwrap())
                .collect();
            (losses, params)
        });
        results.into_iter().next().unwrap()
    }

    /// Row-sparse exchange of the embedding gradients (and their sparse backward) gives the
    /// dense all-reduce's numbers: bit for bit through shared memory (each element is summed in
    /// rank order either way), and
    /// within float tolerance through the socket ring of three ranks (whose summation order
    /// depends on where an element lies in the buffer).
    #[test]
    fn sparse_embedding_gradients_train_exactly_as_dense_ones() {
        use crate::collective::tcp::TcpOptions;
        let shm = TcpOptions::default();
        let (dense_loss, dense_params) = train_embeddings(2, shm, false, 50);
        let (sparse_loss, sparse_params) = train_embeddings(2, shm, true, 50);
        assert_eq!(dense_loss.len(), 50);
        assert!(dense_loss[49] < dense_loss[0], "{dense_loss:?}");
        assert_eq!(sparse_loss, dense_loss);
        assert_eq!(sparse_params, dense_params);
        // Tables kept by each rank (not shared) train alike too.
        let private = train_embeddings_hinted(2, shm, true, Hint::None, 50, false);
        assert_eq!(private, (dense_loss.clone(), dense_params.clone()));
        // The rows the model says it used replace the scan of the gradients: the same bits
        // when it says them all.
        let hinted = |hint, shared| train_embeddings_hinted(2, shm, true, hint, 50, shared);
        assert_eq!(
            hinted(Hint::Exact, true),
            (dense_loss.clone(), dense_params)
        );
        // A model that leaves rows out makes private tables drift apart (so the hint is what
        // is used), which the parameter check (every 25 steps) catches.
        let (short_loss, _) = hinted(Hint::Short, false);
        assert_eq!(short_loss.len(), 24, "stopped at the first check");
        // Kept once per host, the table is the same for every rank however wrong: the check
        // compares the averaged gradient each rank updated its rows from instead.
        let (short_loss, _) = hinted(Hint::Short, true);
        assert_eq!(
            short_loss.len(),
            24,
            "a shared table stopped at the first check too"
        );
        // Three ranks split the tables' rows unevenly (200 and 300 rows): still the same bits.
        let (dense3, dense3_params) = train_embeddings(3, shm, false, 30);
        assert_eq!(train_embeddings(3, shm, true, 30), (dense3, dense3_params));
        // Alone: only the backward is sparse.
        assert_eq!(
            train_embeddings(1, shm, true, 50),
            train_embeddings(1, shm, false, 50)
        );

        let sockets = TcpOptions {
            shared_memory: false,
        };
        let (dense_loss, _) = train_embeddings(3, sockets, false, 50);
        let (sparse_loss, _) = train_embeddings(3, sockets, true, 50);
        for (step, (d, s)) in dense_loss.iter().zip(&sparse_loss).enumerate() {
            assert!(
                (d - s).abs() <= 1e-5 * d.abs().max(1.0),
                "step {step}: {d} vs {s}"
            );
        }
    }

    /// A rank whose parameter no longer is the host's copy of a shared table (it would train
    /// its own, unseen) fails the check at once, even while the values still agree.
    #[test]
    fn the_check_sees_a_rank_off_the_shared_table() {
        use crate::collective::tcp::test_ring::with_ring_owned_opts;
        let options = crate::collective::tcp::TcpOptions::default();
        let results = with_ring_owned_opts(2, options, |rank, ring| {
            let vs = nn::VarStore::new(tch::Device::Cpu);
            let table = vs.root().randn_standard("items", &[6, 4]);
            let config = DdpConfig {
                grad_accum: 1,
                bucket_bytes: 1 << 20,
                max_grad_norm: 1.0,
                check_params_every: 0,
                timeout: Duration::from_secs(20),
                sparse: vec!["items".into()],
                shared_tables: true,
            };
            let mut ddp = Ddp::new(Box::new(ring), &vs, config).unwrap();
            assert_eq!(ddp.shared_tables(), vec!["items"]);
            ddp.check_params(1).unwrap();
            if rank == 1 {
                let private = tch::no_grad(|| table.copy());
                ddp.params[0].shallow_clone().set_data(&private);
            }
            ddp.check_params(2).map_err(|e| e.to_string())
        });
        for result in results {
            let message = result.unwrap_err();
            assert!(
                message.contains("at step 2: `items` is not the host's shared copy on rank(s) 1;"),
                "{message}"
            );
        }
    }

    #[test]
    fn disagreement_names_what_differs_and_where() {
        let entries: Vec<(String, Entry)> = ["a", "b", "c", "d"]
            .iter()
            .map(|n| (n.to_string(), Entry::Same(0)))
            .chain([("t".to_string(), Entry::SharedCopy(true))])
            .collect();
        let same = vec![vec![1, 2, 3, 4, 1]; 3];
        assert_eq!(disagreement(&entries, &same), None);
        let mut odd = same.clone();
        odd[2][1] = 9;
        assert_eq!(
            disagreement(&entries, &odd).unwrap(),
            "`b` differs from rank 0's on rank(s) 2"
        );
        let all_off = vec![vec![1, 2, 3, 4, 0]; 2];
        assert_eq!(
            disagreement(&entries, &all_off).unwrap(),
            "`t` is not the host's shared copy on rank(s) 0, 1"
        );
        let many = vec![vec![0; 5], vec![5, 5, 5, 5, 1]];
        assert_eq!(
            disagreement(&entries, &many).unwrap(),
            "`a` differs from rank 0's on rank(s) 1; `b` differs from rank 0's on rank(s) 1; `c` differs from rank 0's on rank(s) 1 (and 2 more)"
        );
    }

    /// The one-pass mask and the tensor-op one (for a transposed, non-contiguous view) agree:
    /// a row counts when any element is non-zero, NaN included (so a NaN is exchanged and seen
    /// by clipping), and -0.0 does not.
    #[test]
    fn touched_rows_marks_rows_with_any_non_zero() {
        let grad = Tensor::zeros([5, 3], (tch::Kind::Float, tch::Device::Cpu));
        let _ = grad.get(1).get(2).fill_(-2.5);
        let _ = grad.get(3).get(0).fill_(f64::NAN);
        let _ = grad.get(4).get(1).fill_(-0.0);
        let want = vec![0.0, 1.0, 0.0, 1.0, 0.0];
        let got = |t: &Tensor| Vec::<f32>::try_from(touched_rows(t).unwrap()).unwrap();
        assert_eq!(got(&grad), want);
        let transposed = grad.tr().contiguous().tr();
        assert!(!transposed.is_contiguous());
        assert_eq!(got(&transposed), want);
    }

    #[test]
    fn buckets_respect_the_size_and_cover_every_parameter_once() {
        let params: Vec<Tensor> = [10, 300, 5, 5, 1000, 1]
            .iter()
            .map(|&n| Tensor::zeros([n], (tch::Kind::Float, tch::Device::Cpu)))
            .collect();
        let buckets = make_buckets(&params, &[0, 1, 2, 3, 4, 5], 1024);
        let mut seen: Vec<usize> = buckets.iter().flatten().copied().collect();
        seen.sort();
        assert_eq!(seen, vec![0, 1, 2, 3, 4, 5]);
        for b in &buckets {
            let bytes: usize = b.iter().map(|&i| params[i].numel() * 4).sum();
            assert!(bytes <= 1024 || b.len() == 1, "{b:?} holds {bytes} bytes");
        }
        // Reverse order: the last parameter is in the first bucket.
        assert_eq!(buckets[0][0], 5);
        assert_eq!(buckets.len(), 5);
    }
}
