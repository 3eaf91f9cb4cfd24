//! The memory section of a plan: the estimate of one worker next to what each local rank's
//! device has (NVML's figures for GPUs, RAM shared by the workers on a CPU-only node), the
//! warnings with the plan change that keeps the global batch, `micro = "auto"`'s choice by the
//! estimate, and the refusal when other processes hold a GPU's memory.
//!
//! Must not: measure anything on a device (the workers do) or start anything.

use super::*;
use common::config::{OffloadKind, ZeroStage};

impl Plan {
    /// The memory estimate of one worker next to what each local rank's device has (NVML's
    /// figures for GPUs; available RAM shared by the workers on a CPU-only node): the table and
    /// one warning per local rank whose estimate leaves less than the safety margin, with the
    /// plan change that keeps the global batch. `None` when no config is run.
    pub fn memory_check(&self) -> Option<MemoryCheck> {
        let wc = self.config.as_ref()?;
        let gpus: &[Gpu] = self.gpus.as_deref().unwrap_or(&[]);
        let kind = if gpus.is_empty() {
            DeviceKind::Cpu
        } else {
            DeviceKind::Cuda
        };
        let budgets = self.local_budgets(kind, gpus);
        let mut lines = Vec::new();
        let mut est = Estimating {
            config: wc.config.clone(),
            data: DataShape::best_known(&wc.config),
            at: Placement::new(kind, self.nproc as u64),
        };
        if wc.batch.world_size > 1 {
            let (stage, stage_lines) = est.zero_stages(&wc.batch, &budgets);
            if let Some(stage) = stage {
                est.config.dist.zero = ZeroStage::Stage(stage);
            }
            lines.extend(stage_lines);
        }
        let mut plan = wc.batch;
        if wc.config.batch.micro_auto {
            let (chosen, line) = est.auto_micro(&wc.batch, &budgets);
            plan = chosen.unwrap_or(plan);
            lines.push(line);
        }
        let estimate = estimate(&est.config, &plan, &est.data, est.at);
        let peak = estimate.peak_bytes();
        lines.push(format!(
            "estimate per worker ({}, {}; {}):",
            match kind {
                DeviceKind::Cuda => "GPU",
                DeviceKind::Cpu => "CPU",
            },
            plan.derivation(),
            est.data.source
        ));
        lines.extend(estimate.table("  ").lines().map(str::to_string));
        let (mut warnings, mut refusals) = (Vec::new(), Vec::new());
        for (local_rank, (device, budget)) in budgets.iter().enumerate() {
            let Some((free, total)) = *budget else {
                lines.push(format!("local rank {local_rank}: {device}: memory unknown"));
                continue;
            };
            let what = match kind {
                DeviceKind::Cuda => format!("{} free of {}", mib_text(free), mib_text(total)),
                DeviceKind::Cpu => format!(
                    "{} of available RAM per worker ({} in all)",
                    mib_text(free),
                    mib_text(total)
                ),
            };
            let fits = peak <= usable(free);
            lines.push(format!(
                "local rank {local_rank}: {device}: {what}; estimate {} = {:.0}% {}",
                mib_text(peak),
                peak as f64 / free.max(1) as f64 * 100.0,
                if fits {
                    "fits"
                } else {
                    "does NOT fit with the 10% margin"
                }
            ));
            if !fits {
                let rank = format!("local rank {local_rank} ({device})");
                warnings.push(est.does_not_fit(&rank, &plan, peak, free));
                refusals.extend(self.held_by_others(local_rank, peak, free));
            }
        }
        let refusal = (!refusals.is_empty()).then(|| {
            format!(
                "{}; stop them, choose other GPUs (--gpu-ids), or --force to start anyway",
                refusals.join("; ")
            )
        });
        Some(MemoryCheck {
            lines,
            warnings,
            refusal,
        })
    }

    /// What each local rank may use and where the figure comes from: the simulated limit
    /// `GPTREC_MEMORY_LIMIT_MB` the workers read too (tests, and "what if this GPU were
    /// smaller"), else its device's (free, total) bytes.
    fn local_budgets(&self, kind: DeviceKind, gpus: &[Gpu]) -> Vec<(String, Option<(u64, u64)>)> {
        let ram = common::host_memory::host_memory();
        let limit = std::env::var("GPTREC_MEMORY_LIMIT_MB")
            .ok()
            .and_then(|t| common::memory::parse_memory_limit(&t).ok());
        (0..self.nproc)
            .map(|local_rank| {
                let rank = self.first_rank + local_rank;
                match limit {
                    Some((bytes, only)) if only.is_none_or(|r| r == rank) => (
                        "simulated limit GPTREC_MEMORY_LIMIT_MB".to_string(),
                        Some((bytes, bytes)),
                    ),
                    _ => self.device_budget(kind, gpus, ram.as_ref(), local_rank),
                }
            })
            .collect()
    }

    /// A local rank's device name and (free, total) bytes: NVML's figures for its GPU, or its
    /// share of the node's available RAM (under the cgroup's memory limit, when there is one:
    /// then the limit is the total and the name says which cgroup).
    fn device_budget(
        &self,
        kind: DeviceKind,
        gpus: &[Gpu],
        ram: Option<&common::host_memory::HostMemory>,
        local_rank: u32,
    ) -> (String, Option<(u64, u64)>) {
        match kind {
            DeviceKind::Cuda => match gpus.get(local_rank as usize) {
                Some(g) => (
                    format!("cuda:{} ({})", g.cuda_index, g.name),
                    // 0: a MIG instance NVML could not measure.
                    (g.total_bytes > 0).then_some((g.free_bytes, g.total_bytes)),
                ),
                None => (format!("cuda:{local_rank} (missing)"), None),
            },
            DeviceKind::Cpu => (
                match ram.and_then(|m| m.cgroup.as_deref()) {
                    Some(cgroup) => format!("cpu in cgroup {cgroup}"),
                    None => "cpu".to_string(),
                },
                ram.map(|m| (m.available / u64::from(self.nproc.max(1)), m.total)),
            ),
        }
    }
}

impl Plan {
    /// `local rank 0's GPU 0 has 1.2 GiB free, less than the estimate 1994.2 MiB: other
    /// processes hold it: pid ... (...)`, when other processes hold memory on its GPU.
    fn held_by_others(&self, local_rank: usize, peak: u64, free: u64) -> Option<String> {
        let gpu = self.gpus.as_ref()?.get(local_rank)?;
        if gpu.holders.is_empty() {
            return None;
        }
        let holders: Vec<String> = gpu.holders.iter().map(|h| h.to_string()).collect();
        Some(format!(
            "local rank {local_rank}'s GPU {} has {} free, less than the estimate {} with the 10% margin: other processes hold it: {}",
            gpu.nvml_index,
            mib_text(free),
            mib_text(peak),
            holders.join(", ")
        ))
    }

    /// Under each local rank of the dry run: the processes holding memory on its GPU.
    pub(super) fn holders_line(&self, local_rank: u32) -> Option<String> {
        let gpu = self.gpus.as_ref()?.get(local_rank as usize)?;
        let holders: Vec<String> = gpu.holders.iter().map(|h| h.to_string()).collect();
        (!holders.is_empty()).then(|| format!("    held by: {}", holders.join(", ")))
    }
}

/// The memory section of a plan: table lines and warnings (each one line), and why the job
/// must not start: GPUs whose free memory, taken by other processes, does not hold the estimate.
#[derive(Debug, Clone)]
pub struct MemoryCheck {
    pub refusal: Option<String>,
    pub lines: Vec<String>,
    pub warnings: Vec<String>,
}

/// The estimate's inputs for the dry run's checks.
struct Estimating {
    /// The config, with `dist.zero = "auto"` resolved once [`Estimating::zero_stages`] chose.
    config: Config,
    data: DataShape,
    at: Placement,
}

impl Estimating {
    /// Each built ZeRO stage against the tightest local rank (the terms that differ, the peak,
    /// whether it fits), shown with `dist.zero = "auto"` or when the configured stage does not
    /// fit, and with `"auto"` the stage it picks from every local rank's budget (`None`: keep
    /// the configured one, or no stage fits or the memory is unknown, which the workers then
    /// find too).
    fn zero_stages(
        &self,
        configured: &BatchPlan,
        budgets: &[(String, Option<(u64, u64)>)],
    ) -> (Option<u8>, Vec<String>) {
        use common::memory::stages;
        let auto = self.config.dist.zero.is_auto();
        let free: Vec<u64> = budgets.iter().filter_map(|(_, b)| b.map(|b| b.0)).collect();
        let Some(&tightest) = free.iter().min() else {
            let line = "ZeRO stages: memory unknown; dist.zero \"auto\" is chosen by each worker on its own device";
            return (
                None,
                if auto {
                    vec![line.to_string()]
                } else {
                    Vec::new()
                },
            );
        };
        let candidates: Vec<BatchPlan> = if self.config.batch.micro_auto {
            std::iter::once(*configured)
                .chain(common::memory::smaller_micro_plans(configured))
                .collect()
        } else {
            vec![*configured]
        };
        let fits_in =
            |budget| stages::stage_fits(&self.config, &candidates, &self.data, self.at, budget);
        let mut lines = vec![format!(
            "ZeRO stages (dist.zero = {}; per worker, against the tightest local rank's {}):",
            self.config.dist.zero,
            mib_text(tightest)
        )];
        let tight = fits_in(tightest);
        lines.extend(
            stages::stage_lines(&tight, tightest)
                .into_iter()
                .map(|l| format!("  {l}")),
        );
        if !auto {
            // A configured stage: the section only where it may help, when that stage does
            // not fit.
            let configured_fits = tight
                .iter()
                .any(|f| f.stage == self.config.dist.zero.stage() && f.fits);
            return (None, if configured_fits { Vec::new() } else { lines });
        }
        // Local ranks with the same budget answer alike: each budget is asked once.
        let mut budgets_once = free.clone();
        budgets_once.sort_unstable();
        budgets_once.dedup();
        let per_rank: Vec<Vec<(u8, u64)>> = budgets_once
            .iter()
            .map(|&b| fits_in(b).iter().map(|f| (f.stage, f.micro())).collect())
            .collect();
        let offloaded =
            self.config.dist.offload == OffloadKind::Optimizer && configured.world_size > 1;
        let (chosen, line) = match stages::choose(&stages::agree(&per_rank), offloaded) {
            Some(s) => (Some(s), format!(
                "dist.zero \"auto\": by the estimate, stage {s} (the least traffic, then the largest micro batch, then the lower stage; each worker checks its own budget at start)"
            )),
            None if !self.config.batch.micro_auto => {
                let least = stages::least_memory(&tight).map(|f| f.stage);
                (least, format!(
                    "dist.zero \"auto\": by the estimate no stage fits micro {}; stage {} needs the least: {}",
                    configured.micro,
                    least.unwrap_or(0),
                    stages::shortfall(&tight, tightest)
                ))
            }
            None => (None, format!(
                "dist.zero \"auto\": by the estimate no stage fits: {}; the workers will stop with the reason",
                stages::shortfall(&tight, tightest)
            )),
        };
        lines.push(line);
        (chosen, lines)
    }

    /// What `micro = "auto"` would choose from the estimate (the smallest over the ranks), and
    /// the line saying so.
    fn auto_micro(
        &self,
        configured: &BatchPlan,
        budgets: &[(String, Option<(u64, u64)>)],
    ) -> (Option<BatchPlan>, String) {
        let chosen = budgets
            .iter()
            .filter_map(|(_, b)| b.map(|(free, _)| free))
            .filter_map(|free| {
                largest_fitting_plan(&self.config, configured, &self.data, self.at, free)
            })
            .min_by_key(|p| p.micro);
        let line = match chosen {
            Some(p) => format!(
                "micro \"auto\": by the estimate, {} (each worker checks on its own device at start)",
                p.derivation()
            ),
            None => "micro \"auto\": by the estimate no micro batch fits; the workers will stop with the reason"
                .to_string(),
        };
        (chosen, line)
    }

    /// The warning for `rank`, whose `free` bytes do not hold `peak` with the margin: the
    /// largest micro batch that fits and keeps the global batch, and other levers.
    fn does_not_fit(&self, rank: &str, plan: &BatchPlan, peak: u64, free: u64) -> String {
        let (config, data, at) = (&self.config, &self.data, self.at);
        let mut w = format!(
            "{rank}: the estimate {} leaves less than {:.0}% of {} free",
            mib_text(peak),
            SAFETY_MARGIN * 100.0,
            mib_text(free)
        );
        match largest_fitting_plan(config, plan, data, at, free) {
            Some(p) => w.push_str(&format!(
                "; set batch.micro = {} ({}, estimate {})",
                p.micro,
                change_text(plan, &p),
                mib_text(estimate(config, &p, data, at).peak_bytes())
            )),
            None => w.push_str(&format!(
                "; no micro batch keeping global {} fits",
                plan.global
            )),
        }
        let levers = other_levers(config, plan, data, at);
        if !levers.is_empty() {
            w.push_str(&format!("; or {}", levers.join("; ")));
        }
        w
    }
}
