//! ZeRO stages in the memory plan: each built stage's estimate against a budget, the choice
//! `dist.zero = "auto"` makes from the ranks' answers, the dry run's lines per stage, and the
//! shortfall per term when no stage fits.
//!
//! Arithmetic only, like the rest of the module: the launcher and the workers ask the same
//! questions here with their own budgets, and agree through their own channels.

use std::fmt::Write as _;

use super::{estimate, mib_text, usable, DataShape, MemoryEstimate, Placement, SAFETY_MARGIN};
use crate::batch::BatchPlan;
use crate::config::{Config, ZeroStage};

/// How one stage fares in a budget.
#[derive(Debug, Clone, PartialEq)]
pub struct StageFit {
    pub stage: u8,
    /// The plan it would run: the first candidate that fits, else the last (smallest) one.
    pub plan: BatchPlan,
    pub estimate: MemoryEstimate,
    pub fits: bool,
}

impl StageFit {
    /// The micro batch that fits, 0 when none does: what a rank tells the others.
    pub fn micro(&self) -> u64 {
        if self.fits {
            self.plan.micro
        } else {
            0
        }
    }
}

/// `config` with its ZeRO stage set to `stage`.
pub fn with_stage(config: &Config, stage: u8) -> Config {
    let mut c = config.clone();
    c.dist.zero = ZeroStage::Stage(stage);
    c
}

/// Every built stage against `budget` (bytes, before the safety margin): the first of
/// `candidates` (largest micro first: the configured plan alone, or with `micro = "auto"` every
/// plan it may choose) whose estimate fits.
pub fn stage_fits(
    config: &Config,
    candidates: &[BatchPlan],
    data: &DataShape,
    at: Placement,
    budget: u64,
) -> Vec<StageFit> {
    ZeroStage::BUILT
        .iter()
        .filter_map(|&stage| {
            let c = with_stage(config, stage);
            let mut last = None;
            for plan in candidates {
                let e = estimate(&c, plan, data, at);
                if e.peak_bytes() <= usable(budget) {
                    return Some(fit(stage, *plan, e, true));
                }
                last = Some((*plan, e));
            }
            last.map(|(plan, e)| fit(stage, plan, e, false))
        })
        .collect()
}

fn fit(stage: u8, plan: BatchPlan, estimate: MemoryEstimate, fits: bool) -> StageFit {
    StageFit {
        stage,
        plan,
        estimate,
        fits,
    }
}

/// The bytes a step moves per rank, in halves of DDP's all-reduce: stages 0-2 move DDP's
/// bytes (a reduce-scatter and an all-gather are an all-reduce's two halves), stage 3 half as
/// much again (the parameters are gathered twice), as DeepSpeed's and FSDP's papers count.
fn traffic(stage: u8) -> u32 {
    if stage >= 3 {
        3
    } else {
        2
    }
}

/// `dist.zero = "auto"`'s rule, on the micro batch every rank can run at each stage (the
/// smallest over the ranks, 0 where a rank fits none): among the stages that fit, those with
/// the least traffic; of them the one with the largest micro batch; the lower stage on a tie.
/// With the optimizer offloaded over several ranks (`offloaded`), stage 0 only where no
/// sharded stage with its traffic fits: there every rank would keep the whole moments in host
/// memory, where stage 1 keeps them once across the ranks. `None` when no stage fits.
pub fn choose(agreed: &[(u8, u64)], offloaded: bool) -> Option<u8> {
    let sharded_fits =
        (agreed.iter()).any(|&(s, micro)| s > 0 && micro > 0 && traffic(s) == traffic(0));
    let skip_0 = offloaded && sharded_fits;
    let fitting = (agreed.iter()).filter(|&&(s, micro)| micro > 0 && !(skip_0 && s == 0));
    let least = fitting.clone().map(|&(s, _)| traffic(s)).min()?;
    fitting
        .filter(|&&(s, _)| traffic(s) == least)
        .max_by_key(|&&(s, micro)| (micro, std::cmp::Reverse(s)))
        .map(|&(s, _)| s)
}

/// The per-stage micro batches of several ranks' [`StageFit::micro`] lists, agreed: the
/// smallest per stage.
pub fn agree(per_rank: &[Vec<(u8, u64)>]) -> Vec<(u8, u64)> {
    ZeroStage::BUILT
        .iter()
        .map(|&s| {
            let micro = per_rank
                .iter()
                .map(|mine| mine.iter().find(|(t, _)| *t == s).map_or(0, |(_, m)| *m))
                .min()
                .unwrap_or(0);
            (s, micro)
        })
        .collect()
}

/// The dry run's lines, one per stage: the terms that differ between the stages (each per
/// rank), the peak and the plan, and whether it fits `budget`.
pub fn stage_lines(fits: &[StageFit], budget: u64) -> Vec<String> {
    let differ = |name: &str| {
        let first = fits.first().map_or(0, |f| f.estimate.term(name));
        fits.iter().any(|f| f.estimate.term(name) != first)
    };
    // Every stage's terms, in order of first appearance (stage 3 has terms of its own).
    let mut names: Vec<&'static str> = Vec::new();
    for t in fits.iter().flat_map(|f| &f.estimate.terms) {
        if !names.contains(&t.name) {
            names.push(t.name);
        }
    }
    let varying: Vec<&str> = names.into_iter().filter(|n| differ(n)).collect();
    fits.iter()
        .map(|f| {
            let mut line = format!("stage {}:", f.stage);
            let has = |name: &str| f.estimate.terms.iter().any(|t| t.name == name);
            for name in varying.iter().filter(|n| has(n)) {
                let _ = write!(line, " {name} {},", mib_text(f.estimate.term(name)));
            }
            let peak = f.estimate.peak_bytes();
            let _ = write!(
                line,
                " peak {} at micro {}: {}",
                mib_text(peak),
                f.plan.micro,
                if f.fits {
                    "fits".to_string()
                } else {
                    format!("short by {}", mib_text(peak.saturating_sub(usable(budget))))
                }
            );
            if varying.is_empty() && fits.len() > 1 {
                line.push_str(" (every stage the same here: nothing is sharded)");
            }
            line
        })
        .collect()
}

/// The stage that needs the least memory (the lower one on a tie): with a fixed micro batch
/// that no stage fits, `"auto"` runs it, and the dry run's warning names the smaller plans.
pub fn least_memory(fits: &[StageFit]) -> Option<&StageFit> {
    fits.iter()
        .min_by_key(|f| (f.estimate.peak_bytes(), f.stage))
}

/// Why nothing fits, per term: the stage that needs the least, its plan and peak against the
/// usable part of `budget`, and its terms largest first.
pub fn shortfall(fits: &[StageFit], budget: u64) -> String {
    let Some(least) = least_memory(fits) else {
        return "no stage to estimate".into();
    };
    let e = &least.estimate;
    let peak = e.peak_bytes();
    let mut terms: Vec<_> = e.terms.iter().filter(|t| t.bytes > 0).collect();
    terms.sort_by_key(|t| std::cmp::Reverse(t.bytes));
    let by_term: Vec<String> = terms
        .iter()
        .map(|t| format!("{} {}", t.name, mib_text(t.bytes)))
        .collect();
    format!(
        "stage {} at {} needs {}, {} over the {} usable ({} less the {:.0}% margin); by term: {}",
        least.stage,
        least.plan.derivation(),
        mib_text(peak),
        mib_text(peak.saturating_sub(usable(budget))),
        mib_text(usable(budget)),
        mib_text(budget),
        SAFETY_MARGIN * 100.0,
        by_term.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelKind;
    use crate::memory::{DataShape, DeviceKind};

    fn plan(global: u64, micro: u64, accum: u64, world: u64) -> BatchPlan {
        BatchPlan {
            global,
            micro,
            grad_accum: accum,
            world_size: world,
        }
    }

    fn config() -> Config {
        let mut c = Config::default();
        c.model.kind = ModelKind::Bpr;
        c.model.embedding_dim = 256;
        c.dist.sparse_embeddings = false;
        c
    }

    fn data() -> DataShape {
        DataShape::assumed(&Config::default())
    }

    #[test]
    fn the_rule_prefers_least_traffic_then_the_largest_micro_then_the_lower_stage() {
        assert_eq!(choose(&[(0, 64), (1, 64)], false), Some(0));
        assert_eq!(choose(&[(0, 32), (1, 64)], false), Some(1));
        assert_eq!(choose(&[(0, 0), (1, 1)], false), Some(1));
        assert_eq!(choose(&[(0, 0), (1, 0)], false), None);
        // Stage 3 moves more: it is chosen only where nothing else fits.
        assert_eq!(choose(&[(0, 0), (1, 8), (3, 64)], false), Some(1));
        assert_eq!(choose(&[(0, 0), (1, 0), (3, 1)], false), Some(3));
        // Offloaded, stage 1 or 2 before stage 0 (each rank would keep the whole moments on
        // the host), not stage 3 (more traffic).
        assert_eq!(choose(&[(0, 64), (1, 64), (2, 64)], true), Some(1));
        assert_eq!(choose(&[(0, 64), (1, 0), (3, 8)], true), Some(0));
        assert_eq!(choose(&[(0, 64), (1, 0), (2, 8)], true), Some(2));
    }

    #[test]
    fn ranks_agree_on_the_smallest_micro_per_stage() {
        let a = vec![(0, 64), (1, 64)];
        let b = vec![(0, 0), (1, 32)];
        assert_eq!(agree(&[a, b]), vec![(0, 0), (1, 32), (2, 0), (3, 0)]);
        assert_eq!(agree(&[]), vec![(0, 0), (1, 0), (2, 0), (3, 0)]);
    }

    #[test]
    fn a_budget_between_the_stages_fits_only_stage_1_and_the_lines_say_why() {
        let c = config();
        let p = plan(256, 64, 1, 4);
        let at = Placement::new(DeviceKind::Cuda, 4);
        let need = |stage| estimate(&with_stage(&c, stage), &p, &data(), at).peak_bytes();
        let (zero, one, two, three) = (need(0), need(1), need(2), need(3));
        assert!(one < zero, "stage 1 shards the moments: {one} vs {zero}");
        // This model's gradients fit in fewer than two buckets: stage 2 holds them whole
        // during backward, and its shards on top.
        assert!(two > one, "stage 2 on a small model: {two} vs {one}");
        // Stage 3 without units gathers every parameter for each step: no less again.
        assert!(
            three > one,
            "stage 3 on a model without units: {three} vs {one}"
        );
        let budget = ((one + one.max(zero.min(two))) as f64 / 2.0 / (1.0 - SAFETY_MARGIN)) as u64;
        let fits = stage_fits(&c, &[p], &data(), at, budget);
        let micro: Vec<(u8, u64)> = fits.iter().map(|f| (f.stage, f.micro())).collect();
        assert_eq!(micro, vec![(0, 0), (1, 64), (2, 0), (3, 0)]);
        assert_eq!(choose(&micro, false), Some(1));
        let lines = stage_lines(&fits, budget);
        assert!(lines[0].starts_with("stage 0: parameters "), "{lines:?}");
        assert!(lines[3].contains("gathered parameters "), "{lines:?}");
        assert!(lines[0].contains("optimizer (AdamW) "), "{lines:?}");
        assert!(lines[0].contains("short by"), "{lines:?}");
        assert!(lines[1].ends_with("at micro 64: fits"), "{lines:?}");
        assert!(lines[2].contains("short by"), "{lines:?}");
        assert!(lines[3].contains("short by"), "{lines:?}");
    }

    #[test]
    fn stage_2_keeps_a_shard_of_a_large_models_gradients_and_whole_ones_while_accumulating() {
        let mut c = config();
        c.model.embedding_dim = 131_072; // 175 MiB of gradients, the largest table 100 MiB
        let at = Placement::new(DeviceKind::Cuda, 4);
        let term = |stage, accum| {
            let p = plan(256, 64 / accum, accum, 4);
            estimate(&with_stage(&c, stage), &p, &data(), at).term("gradients")
        };
        let (whole, sharded) = (term(1, 1), term(2, 1));
        assert!(whole > 150 << 20, "{whole}");
        // A quarter of them, and whole during backward the largest table (a bucket of its
        // own) and one bucket (dist.bucket_mb 25).
        let largest = 4 * data().users.max(data().items) * 131_072;
        assert!(largest > 50 << 20, "{largest}");
        assert_eq!(sharded, whole.div_ceil(4) + largest + 25 * 1024 * 1024);
        assert!(sharded < whole, "{sharded} vs {whole}");
        assert_eq!(term(2, 2), whole + whole.div_ceil(4));
        assert_eq!(term(0, 1), whole);
    }

    #[test]
    fn with_micro_auto_each_stage_gets_its_largest_micro_and_nothing_fitting_names_the_terms() {
        let c = config();
        let top = plan(256, 64, 1, 4);
        let candidates: Vec<BatchPlan> = std::iter::once(top)
            .chain(crate::memory::smaller_micro_plans(&top))
            .collect();
        let at = Placement::new(DeviceKind::Cuda, 4);
        let small = candidates[candidates.len() - 1];
        let need = |stage| estimate(&with_stage(&c, stage), &small, &data(), at).peak_bytes();
        // Enough for stage 1 at the smallest micro only.
        let budget = ((need(1) + need(0)) as f64 / 2.0 / (1.0 - SAFETY_MARGIN)) as u64;
        let fits = stage_fits(&c, &candidates, &data(), at, budget);
        assert!(!fits[0].fits && fits[0].plan == small);
        assert!(fits[1].fits && fits[1].plan.micro >= 1);
        let tiny = need(1) / 4;
        let none = stage_fits(&c, &candidates, &data(), at, tiny);
        assert!(none.iter().all(|f| !f.fits));
        let why = shortfall(&none, tiny);
        assert!(
            why.starts_with(&format!("stage 1 at {} needs ", small.derivation())),
            "{why}"
        );
        assert!(why.contains("by term: "), "{why}");
        assert!(why.contains("optimizer (AdamW) "), "{why}");
    }

    #[test]
    fn one_rank_alone_has_nothing_to_shard() {
        let c = config();
        let p = plan(64, 64, 1, 1);
        let at = Placement::new(DeviceKind::Cpu, 1);
        let fits = stage_fits(&c, &[p], &data(), at, u64::MAX / 2);
        let lines = stage_lines(&fits, u64::MAX / 2);
        assert!(lines[1].ends_with("(every stage the same here: nothing is sharded)"));
        let micro: Vec<(u8, u64)> = fits.iter().map(|f| (f.stage, f.micro())).collect();
        assert_eq!(choose(&micro, false), Some(0));
    }

    /// Stage 3 on dynamic GPT-2 (124M, every weight trains, dense tables) at world 4: the
    /// parameters term is the values not sharded and a quarter of the others; during a step
    /// the values outside the blocks are whole and three blocks; for evaluations all of them;
    /// and on a GPU its peak is below stage 2's, whose parameters are whole throughout.
    #[test]
    fn stage_3_counts_the_shards_the_values_outside_the_blocks_and_three_blocks() {
        let mut c = Config::default();
        c.model.text_mode = crate::config::TextMode::Dynamic;
        c.model.preset = crate::config::Gpt2Preset::Gpt2;
        c.dist.sparse_embeddings = false;
        let p = plan(64, 4, 4, 4);
        let at = Placement::new(DeviceKind::Cuda, 4);
        let e = |stage| estimate(&with_stage(&c, stage), &p, &data(), at);
        let (two, three) = (e(2), e(3));
        let params = two.term("parameters");
        let gpt2 = crate::memory::Gpt2Dims::of(crate::config::Gpt2Preset::Gpt2);
        let block = gpt2.block_params() * 4;
        let blocks = 12 * block;
        assert!(
            blocks > params / 2,
            "the blocks are most of the model: {blocks} of {params}"
        );
        let values = params / 4;
        assert_eq!(three.term("parameters"), values.div_ceil(4) * 4);
        assert_eq!(
            three.term("gathered parameters"),
            params - blocks + 3 * block
        );
        assert_eq!(three.term("gathered parameters (evaluation)"), params);
        assert!(
            three.peak_bytes() < two.peak_bytes(),
            "{} vs {}",
            three.peak_bytes(),
            two.peak_bytes()
        );
    }
}
