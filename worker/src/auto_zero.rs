//! `dist.zero = "auto"`: before training (and before `batch.micro = "auto"` probes), each rank
//! asks the memory plan which built ZeRO stages fit its budget and with what micro batch; the
//! ranks agree on the smallest micro per stage and take the stage
//! [`common::memory::stages::choose`] picks, the same rule the dry run shows.
//!
//! By the estimate only: `micro = "auto"` then probes the chosen stage on a GPU as it does
//! without ZeRO. Must not: build the engine or touch the model (the trainer does, with the
//! chosen stage).

use common::config::OffloadKind;
use common::memory::stages::{self, StageFit};
use common::memory::{mib_text, usable};
use common::train_plan::TrainPlan;
use runtime::collective::{Collective, OpContext};
use tracing::info;

use crate::auto_micro::{AutoMicroError, Probe};
use crate::memory;
use crate::trainer::gather_u64;

/// The stage every rank runs. `micro = "auto"` with no stage fitting at micro 1 on some rank
/// is [`AutoMicroError::NoFit`], naming the shortfall per term; with a fixed micro batch that
/// no stage fits, the stage that needs the least (training may still fit: the estimate errs
/// on the safe side).
pub fn auto_zero(
    probe: &Probe<'_>,
    comm: &mut dyn Collective,
    ctx: OpContext,
) -> Result<u8, AutoMicroError> {
    let Probe {
        plan: TrainPlan { config, batch, .. },
        shape,
        device,
        env,
        ..
    } = *probe;
    let candidates = if config.batch.micro_auto {
        config
            .batch
            .auto_candidates(u64::from(env.world_size))
            .map_err(|e| AutoMicroError::Usage(format!("batch.micro = \"auto\": {e}")))?
    } else {
        vec![*batch]
    };
    let memory::Budget {
        bytes: budget,
        source,
    } = probe.budget("dist.zero", "a stage")?;
    let at = memory::placement(device, env.local_world_size);
    let fits = stages::stage_fits(config, &candidates, shape, at, budget);
    let mut per_stage = Vec::new();
    for fit in &fits {
        let all = gather_u64(comm, fit.micro(), ctx)
            .map_err(|e| AutoMicroError::Failed(format!("agreeing on the ZeRO stage: {e}")))?;
        per_stage.push((fit.stage, all));
    }
    let ranks = env.world_size as usize;
    let per_rank: Vec<Vec<(u8, u64)>> = (0..ranks)
        .map(|r| per_stage.iter().map(|(s, all)| (*s, all[r])).collect())
        .collect();
    let agreed = stages::agree(&per_rank);
    let said = |stage: u8, why: &str| {
        if env.rank == 0 {
            info!(
                "dist.zero = \"auto\": stage {stage} ({why}; largest micro per stage over the ranks {agreed:?}; budget {} per worker, {source})",
                mib_text(budget)
            );
        }
        stage
    };
    let offloaded = config.dist.offload == OffloadKind::Optimizer && ranks > 1;
    if let Some(stage) = stages::choose(&agreed, offloaded) {
        return Ok(said(
            stage,
            "the least traffic, then the largest micro batch, then the lower stage",
        ));
    }
    if !config.batch.micro_auto {
        // Every rank's estimate is the same arithmetic on the same inputs but its own host's
        // rank count: agree on the most sharded of their answers.
        let least = stages::least_memory(&fits).map_or(0, |f| f.stage);
        let all = gather_u64(comm, u64::from(least), ctx)
            .map_err(|e| AutoMicroError::Failed(format!("agreeing on the ZeRO stage: {e}")))?;
        let stage = all.into_iter().max().unwrap_or(0) as u8;
        return Ok(said(
            stage,
            &format!(
                "no stage fits micro {} by the estimate; this one needs the least",
                batch.micro
            ),
        ));
    }
    Err(no_fit(probe, &per_rank, &fits, budget))
}

/// Which ranks fit no stage at any micro batch, and this rank's shortfall per term if it is
/// one of them.
fn no_fit(
    probe: &Probe<'_>,
    per_rank: &[Vec<(u8, u64)>],
    fits: &[StageFit],
    budget: u64,
) -> AutoMicroError {
    let (rank, device) = (probe.env.rank, probe.device);
    let name = probe.tracker.sample(device).1;
    let at = memory::placement(device, probe.env.local_world_size);
    let short: Vec<String> = per_rank
        .iter()
        .enumerate()
        .filter(|(_, stages)| stages.iter().all(|(_, micro)| *micro == 0))
        .map(|(r, _)| r.to_string())
        .collect();
    let mine = if short.contains(&rank.to_string()) {
        format!("; here: {}", stages::shortfall(fits, budget))
    } else {
        String::new()
    };
    let levers = match stages::least_memory(fits) {
        Some(f) => {
            let c = stages::with_stage(&probe.plan.config, f.stage);
            common::memory::other_levers(&c, &f.plan, probe.shape, at)
        }
        None => Vec::new(),
    };
    AutoMicroError::NoFit(format!(
        "dist.zero = \"auto\": no ZeRO stage fits even the smallest micro batch on rank(s) {} ({name}, {} usable){mine}; {}",
        short.join(", "),
        mib_text(usable(budget)),
        if levers.is_empty() {
            "run on devices with more memory, or on more of them".to_string()
        } else {
            format!("try {}", levers.join("; "))
        }
    ))
}
