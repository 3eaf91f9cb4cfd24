//! What a run tells its user as it goes (rank 0): a record per step in `metrics.jsonl`, a log
//! line at every tenth of an epoch with the ranks' largest peak memory (or a progress bar in a
//! terminal), and log lines printed above that bar.

use common::config::{Config, OffloadKind};
use common::progress::{Phase, ProgressRecord};
use tracing::{info, warn};

use runtime::ddp::{Ddp, StepStats};

use super::{StepRecord, TrainError, Trainer};

impl Trainer<'_> {
    /// The step's record in `metrics.jsonl` (rank 0) with the largest peak memory of any rank,
    /// and at logged steps a log line (or the progress bar).
    pub(super) fn log_step(
        &mut self,
        epoch: u64,
        lr: f64,
        stats: &StepStats,
        secs: f64,
    ) -> Result<(), TrainError> {
        let step = self.progress.step;
        let log_every = (self.steps_per_epoch / 10).max(1);
        let log_now = step % log_every == 0 || step == self.total_steps;
        // Every rank's peak in MiB (sampled after the step's backward passes) came with the
        // step.
        let peak = stats.probed_max;
        let epoch_end = step % self.steps_per_epoch.max(1) == 0 || step == self.total_steps;
        // Sent at every logged step too, so that `launch`'s bar is never behind the log lines.
        self.report_progress_in(epoch + 1, Phase::Train, epoch_end || log_now);
        let global = self.setup.plan.batch.global;
        let Some(file) = self.metrics.as_mut() else {
            return Ok(());
        };
        file.append(&StepRecord {
            kind: "step".into(),
            epoch: epoch + 1,
            step,
            loss: stats.loss,
            lr,
            grad_norm: stats.grad_norm,
            samples_per_s: global as f64 / secs.max(1e-9),
            peak_mem_mib: peak.map(|(_, mib)| mib),
            peak_mem_rank: peak.map(|(r, _)| r as u64),
        })?;
        let p = &self.progress;
        let elapsed = p.started.elapsed().as_secs_f64();
        let rate = p.samples_per_s(global);
        if let Some(bar) = self.bar.as_mut() {
            bar.set_position(step);
            bar.set_prefix(common::progress::eta_prefix(p.eta_s(self.total_steps)));
            bar.set_message(format!(
                "epoch {}/{} loss {:.4} {rate:.0} samples/s",
                epoch + 1,
                self.epochs,
                stats.loss
            ));
        } else if log_now {
            let eta = p.eta_s(self.total_steps).unwrap_or(0.0);
            let (peak_rank, peak_mib) = peak.unwrap_or_default();
            info!(
                "epoch {}/{} step {step}/{} loss {:.6} lr {lr:.3e} grad_norm {:.4} {rate:.0} samples/s {:.1} ms/step, peak mem {:.0} MiB (rank {peak_rank}) ETA {}",
                epoch + 1,
                self.epochs,
                self.total_steps,
                stats.loss,
                stats.grad_norm,
                elapsed * 1000.0 / p.steps_run as f64,
                peak_mib,
                common::progress::duration_text(eta)
            );
        }
        Ok(())
    }

    /// A log line of rank 0, printed above the progress bar when there is one.
    pub(super) fn say(&self, line: String) {
        if !self.leader() {
            return;
        }
        match &self.bar {
            Some(bar) => bar.suspend(|| info!("{line}")),
            None => info!("{line}"),
        }
    }

    /// This rank's report for `launch`'s live display (when it asked for reports), in the
    /// epoch under way or just done; `force` sends it even right after another.
    pub(super) fn report_progress(&mut self, phase: Phase, force: bool) {
        let epoch = self.progress.epochs_done.clamp(1, self.epochs.max(1));
        self.report_progress_in(epoch, phase, force);
    }

    fn report_progress_in(&mut self, epoch: u64, phase: Phase, force: bool) {
        let Some(sender) = self.reports.as_mut() else {
            return;
        };
        let p = &self.progress;
        let record = ProgressRecord {
            rank: self.ddp.rank() as u32,
            phase,
            epoch,
            epochs: self.epochs,
            step: p.step,
            total_steps: self.total_steps,
            loss: p.last_loss,
            samples_per_s: (p.steps_run > 0).then(|| p.samples_per_s(self.setup.plan.batch.global)),
            eta_s: p.eta_s(self.total_steps),
        };
        if !sender.send(&record, force) {
            self.reports = None;
        }
    }
}

/// A progress bar on rank 0 only when a person watches (see [`common::progress::wanted`]).
pub(super) fn progress_bar_wanted() -> bool {
    common::progress::wanted(std::io::IsTerminal::is_terminal(&std::io::stderr()))
}

pub(super) fn new_bar(total_steps: u64, position: u64) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(total_steps);
    bar.set_style(
        indicatif::ProgressStyle::with_template(common::progress::BAR_TEMPLATE)
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_position(position);
    bar
}

/// What the ranks of one host keep once in shared memory, if anything, the ZeRO stage, and
/// whether the gradient reduction overlaps backward (rank 0 says it), or why not when it was
/// asked to.
pub(super) fn log_sharing(ddp: &Ddp, config: &Config, grad_accum: usize) {
    let (overlap_asked, zero_asked) = (config.dist.overlap_backward, config.dist.zero.stage());
    let (world, shared) = (ddp.world_size(), ddp.shared_tables());
    if ddp.sharded() {
        info!(
            "parameters, AdamW moments and gradients kept in shared memory: each of the {world} ranks reduces, clips and updates its share of every parameter's rows (dist.shard_optimizer)"
        );
    } else if !shared.is_empty() {
        info!(
            "embedding tables {} kept once in shared memory: each of the {world} ranks updates its share of their rows",
            shared.join(", ")
        );
    }
    match ddp.zero_stage() {
        1 => info!(
            "ZeRO stage 1 (dist.zero = 1): each of the {world} ranks keeps the AdamW moments of its shard of every gradient bucket; gradients reduce-scattered, parameters all-gathered"
        ),
        2 => info!(
            "ZeRO stage 2 (dist.zero = 2): each of the {world} ranks keeps the AdamW moments and the reduced gradients of its shard of every gradient bucket only; gradients reduce-scattered, parameters all-gathered"
        ),
        3 => info!(
            "ZeRO stage 3 (dist.zero = 3): each of the {world} ranks keeps the parameters, AdamW moments and reduced gradients of its shard of every gradient bucket only; {}, every parameter for evaluations and checkpoints",
            match ddp.gathered_units() {
                0 => "the model has no units: every parameter gathered for each step".to_string(),
                n => format!("{n} units (GPT-2's blocks) gathered around their forward and backward and reduce-scattered as backward completes each, the other parameters gathered for each step"),
            }
        ),
        _ => {}
    }
    if ddp.offloads() {
        let threads = match tch::get_num_threads() {
            1 => "1 thread".to_string(),
            n => format!("{n} threads"),
        };
        info!(
            "AdamW moments in host memory, each step's update on the host's {threads}: the values this rank updates and their gradients copied there, the values back (dist.offload = \"optimizer\")"
        );
        if ddp.zero_stage() == 0 && world > 1 {
            warn!(
                "dist.offload = \"optimizer\" with dist.zero = 0: each of the {world} ranks keeps the whole AdamW moments in host memory; dist.zero = 1 keeps them once across the ranks, for the same traffic"
            );
        }
    } else if config.dist.offload == OffloadKind::Optimizer {
        warn!(
            "dist.offload = \"optimizer\" does nothing in this run: dist.shard_optimizer (one CPU host, shared memory) keeps the AdamW moments in host memory already"
        );
    }
    if ddp.overlaps_backward() {
        let (how, why) = match ddp.zero_stage() {
            0 => ("all-reduced", "dist.overlap_backward"),
            1 => ("reduce-scattered", "dist.overlap_backward"),
            _ => ("reduce-scattered", "ZeRO stage 2"),
        };
        info!(
            "gradient buckets ({}) {how} during the backward pass as they become ready ({why})",
            ddp.bucket_count()
        );
    }
    if ddp.sharded() && zero_asked >= 2 {
        warn!(
            "dist.zero = {zero_asked} does nothing in this run: dist.shard_optimizer (one CPU host, shared memory) runs instead, which shards the AdamW moments but keeps each rank's gradients whole; set dist.shard_optimizer = false for stage {zero_asked}"
        );
    }
    let stage = ddp.zero_stage();
    if stage == 2 && grad_accum > 1 {
        warn!(
            "ZeRO stage 2 with batch.grad_accum = {grad_accum}: the micro-batches before the last keep whole gradients (DDP's sums need them), so the peak is stage 1's plus the gradient shards; dist.zero = 1 needs less here, or raise batch.micro to need no accumulation"
        );
    } else if stage == 2 && config.model.activation_checkpointing {
        warn!(
            "ZeRO stage 2 with model.activation_checkpointing: the buckets are reduced once the recomputation is done, so the whole gradients exist at once and the peak is stage 1's plus the gradient shards; dist.zero = 1 needs less here"
        );
    } else if stage == 3 && (grad_accum > 1 || config.model.activation_checkpointing) {
        warn!(
            "ZeRO stage 3 with {}: the whole gradients exist at once (DDP's sums need them), so only the parameters' and moments' sharding saves memory here",
            if grad_accum > 1 {
                format!("batch.grad_accum = {grad_accum}")
            } else {
                "model.activation_checkpointing".to_string()
            }
        );
    }
    if let Some(why) = overlap_asked.then(|| ddp.overlap_unavailable()).flatten() {
        warn!("dist.overlap_backward = true does nothing in this run: {why}");
    }
}
