//! The memory estimate of one worker, from the config, the batch plan and the data's shape alone
//! (no libtorch, no device): what `launch --dry-run` prints, what the OOM message and
//! `batch.micro = "auto"` reason with, and what the smaller-micro-batch suggestions come from.
//!
//! Each term is kept separate ([`MemoryTerm`]) so a user sees where the memory goes and the
//! estimate can be checked term by term against a measured run. Terms belong to a phase: the
//! persistent ones (runtime, data, parameters, ...) add up, and on top of them the largest of
//! the transient phases counts (caching the text features happens before training and is freed;
//! an evaluation happens between steps).
//!
//! This module does arithmetic only: it measures nothing, touches no device and never panics.
//! The constants that are not sizes of tensors (the runtime's own memory, the allocator's
//! reserve, how many activation copies autograd keeps) say where they come from.

use std::fmt::Write as _;

mod measured;
mod phase;
pub mod stages;
mod terms;

pub use phase::{Fault, Phase, PhaseSink, SIMULATED_OOM};

use crate::batch::BatchPlan;
use crate::config::{
    Config, Gpt2Preset, LossKind, ModelKind, OffloadKind, ScorerKind, SyntheticSize, TextMode,
    UserTower,
};

const MIB: f64 = 1024.0 * 1024.0;
/// The name of NCCL's buffers in the estimate.
pub const NCCL_TERM: &str = "NCCL buffers";
const F32: u64 = 4;

/// Where a worker runs, as far as its memory goes: the kind of device its tensors live on, and
/// how many of the job's ranks share its host. Ranks that are the whole job on one CPU host keep
/// row-sparse tables once in shared memory (`dist.shared_tables`): each counts its share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    pub device: DeviceKind,
    /// Ranks of the job on this worker's host (>= 1).
    pub host_ranks: u64,
}

impl Placement {
    pub fn new(device: DeviceKind, host_ranks: u64) -> Placement {
        Placement {
            device,
            host_ranks: host_ranks.max(1),
        }
    }
}

/// A worker alone on its host.
impl From<DeviceKind> for Placement {
    fn from(device: DeviceKind) -> Placement {
        Placement::new(device, 1)
    }
}

/// Where the worker's tensors live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// Host memory; compared with available RAM, measured as peak RSS.
    Cpu,
    /// A CUDA GPU; compared with the device's memory, measured with NVML.
    Cuda,
}

/// Sizes of GPT-2 (Hugging Face names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gpt2Dims {
    /// Blocks (`n_layer`).
    pub n_layer: u64,
    /// Attention heads (`n_head`).
    pub n_head: u64,
    /// Width (`n_embd`).
    pub n_embd: u64,
    /// Learned positions (`n_positions`).
    pub n_positions: u64,
    /// Vocabulary (`vocab_size`).
    pub vocab_size: u64,
}

impl Gpt2Dims {
    /// The dimensions of a preset: the one table, which the worker's `model::gpt2::Config`
    /// presets are built from.
    pub fn of(preset: Gpt2Preset) -> Gpt2Dims {
        match preset {
            Gpt2Preset::Tiny => Gpt2Dims {
                n_layer: 2,
                n_head: 2,
                n_embd: 64,
                n_positions: 128,
                vocab_size: 50257,
            },
            Gpt2Preset::Gpt2 => Gpt2Dims {
                n_layer: 12,
                n_head: 12,
                n_embd: 768,
                n_positions: 1024,
                vocab_size: 50257,
            },
        }
    }

    /// Parameters of one block: ln_1, c_attn, c_proj, ln_2, c_fc, c_proj = 12d² + 13d.
    pub fn block_params(&self) -> u64 {
        let d = self.n_embd;
        12 * d * d + 13 * d
    }

    /// All parameters: wte + wpe + blocks + ln_f (124,439,808 for `gpt2`).
    pub fn params(&self) -> u64 {
        let d = self.n_embd;
        self.vocab_size * d + self.n_positions * d + self.n_layer * self.block_params() + 2 * d
    }
}

/// The data's shape as far as memory goes.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DataShape {
    pub users: u64,
    pub items: u64,
    /// Training + validation + test interactions.
    pub interactions: u64,
    /// Tokens of the longest user text (after `max_text_tokens`): dynamic batches are cut to it.
    pub user_tokens: u64,
    /// Tokens of the longest item text (after `max_text_tokens`).
    pub item_tokens: u64,
    /// Where the numbers come from, for the table ("ML-1M, published counts", "measured").
    pub source: String,
}

/// Longest user text in tokens ("User: female, aged 25-34, works as programmer."): measured on
/// the ML-1M metadata with GPT-2's tokenizer.
const USER_TEXT_TOKENS: u64 = 16;
/// Longest item text in tokens (title, year and genres): measured on the ML-1M metadata.
const ITEM_TEXT_TOKENS: u64 = 40;

impl DataShape {
    /// The shape the config implies before any data is read: the generator's sizes for
    /// synthetic data, MovieLens-1M's published counts (REFERENCE.md) for `data.dir`.
    pub fn assumed(config: &Config) -> DataShape {
        let cap = config.model.max_text_tokens as u64;
        let (users, items, interactions, source) = match &config.data.dir {
            Some(_) => (
                6040,
                3629,
                836_478,
                "assumed: MovieLens-1M's counts at ratings >= 3 until a run measures the data"
                    .to_string(),
            ),
            None => {
                let spec = config.data.synthetic.spec();
                let users = spec.users as u64;
                // About 84% of ML-1M's ratings are >= 3; the generator follows its rating mix.
                let all = spec.users as f64 * spec.mean_ratings;
                (
                    users,
                    spec.movies as u64,
                    (all * 0.84) as u64,
                    format!(
                        "assumed: the generator's synthetic {:?} data until a run measures it",
                        config.data.synthetic
                    )
                    .to_lowercase(),
                )
            }
        };
        DataShape {
            users,
            items,
            interactions,
            user_tokens: USER_TEXT_TOKENS.min(cap),
            item_tokens: ITEM_TEXT_TOKENS.min(cap),
            source,
        }
    }
}

impl SyntheticSize {
    /// Users, movies and mean ratings per user of the generated data set.
    pub fn spec(self) -> SyntheticSpec {
        match self {
            SyntheticSize::Tiny => SyntheticSpec {
                users: 200,
                movies: 150,
                mean_ratings: 30.0,
            },
            SyntheticSize::Small => SyntheticSpec {
                users: 1000,
                movies: 800,
                mean_ratings: 60.0,
            },
            SyntheticSize::Full => SyntheticSpec {
                users: 6040,
                movies: 3883,
                mean_ratings: 165.6,
            },
        }
    }
}

/// Size of a synthetic data set (the generator's parameters).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SyntheticSpec {
    pub users: usize,
    pub movies: usize,
    /// Mean ratings per user (>= 20 each).
    pub mean_ratings: f64,
}

/// When a term's memory is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Held {
    /// From start-up to the end (parameters, optimizer state, ...).
    Always,
    /// Only while training steps run (gradients of activations, activations).
    Training,
    /// Only while the model is built (the frozen encoder that caches text features,
    /// initialisation copies), before training; freed afterwards.
    Build,
    /// Only while rank 0 writes a checkpoint (snapshots and serialised bytes).
    Checkpoint,
    /// Only while an evaluation runs.
    Eval,
}

/// One line of the estimate.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryTerm {
    /// Short name: `parameters`, `gradients`, `optimizer (AdamW)`, ...
    pub name: &'static str,
    pub bytes: u64,
    pub held: Held,
    /// How it was computed, e.g. `3 x 64 x 40 tokens x 64 wide x 2 layers x 26 copies x 4 B`.
    pub detail: String,
}

/// The estimate for one worker.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryEstimate {
    pub device: DeviceKind,
    pub plan: BatchPlan,
    pub terms: Vec<MemoryTerm>,
}

impl MemoryEstimate {
    /// The expected peak. On a GPU: the persistent terms plus the largest transient phase
    /// (the caching allocator reuses what a finished phase freed). On the CPU: the persistent
    /// terms plus all transient phases, because freed memory mostly stays in the process (the C
    /// allocator keeps it; measured with `scripts/bench/memory.sh`, where "the largest phase"
    /// underestimated peak RSS by up to 35%).
    pub fn peak_bytes(&self) -> u64 {
        let phases = [Held::Training, Held::Build, Held::Checkpoint, Held::Eval]
            .map(|held| self.held_bytes(held));
        let transient = match self.device {
            DeviceKind::Cuda => phases.into_iter().max().unwrap_or(0),
            DeviceKind::Cpu => phases.into_iter().sum(),
        };
        self.held_bytes(Held::Always) + transient
    }

    /// Bytes of all terms held while `held`.
    pub fn held_bytes(&self, held: Held) -> u64 {
        self.bytes_of(|t| t.held == held)
    }

    /// Bytes of the term named `name` (0 when absent).
    pub fn term(&self, name: &str) -> u64 {
        self.bytes_of(|t| t.name == name)
    }

    /// Bytes of the terms that `pick` picks.
    fn bytes_of(&self, pick: impl Fn(&MemoryTerm) -> bool) -> u64 {
        self.terms.iter().filter(|t| pick(t)).map(|t| t.bytes).sum()
    }

    /// The estimate as an aligned table, one term per line, then the peak.
    pub fn table(&self, indent: &str) -> String {
        let mut out = String::new();
        for t in &self.terms {
            let when = match t.held {
                Held::Always => "",
                Held::Training => " (training)",
                Held::Build => " (model build, freed)",
                Held::Checkpoint => " (checkpoint, freed)",
                Held::Eval => " (evaluation)",
            };
            let _ = writeln!(
                out,
                "{indent}{:<24} {:>10}  {}{when}",
                t.name,
                mib_text(t.bytes),
                t.detail
            );
        }
        let _ = writeln!(
            out,
            "{indent}{:<24} {:>10}  persistent terms + {}",
            "estimated peak",
            mib_text(self.peak_bytes()),
            match self.device {
                DeviceKind::Cuda => "the largest phase",
                DeviceKind::Cpu => "every phase (freed memory stays in the process)",
            }
        );
        out
    }
}

/// `123.4 MiB`, or `1.23 GiB` from 10 GiB up.
pub fn mib_text(bytes: u64) -> String {
    let mib = bytes as f64 / MIB;
    if mib >= 10.0 * 1024.0 {
        format!("{:.2} GiB", mib / 1024.0)
    } else {
        format!("{mib:.1} MiB")
    }
}

/// Resident memory of a worker process on the CPU before it builds anything: libtorch's code
/// and thread pools, the collective. Measured on this project's CI machine (RSS of the
/// `worker` after its collective check, 349 MiB, `scripts/bench/memory.sh`).
pub const CPU_RUNTIME_BYTES: u64 = 349 << 20;
/// GPT-2's BPE tables in tiktoken-rs (host memory). Measured: 9 MiB.
pub const TOKENIZER_BYTES: u64 = 9 << 20;
/// CUDA context, libtorch's kernels, cuBLAS's workspace and a one-rank NCCL communicator on the
/// device. Measured on an H100 80GB (CUDA 13.0, PyTorch 2.11.0, NCCL 2.28.9;
/// `scripts/gpu/check.sh`, 2026-11-27; the same on an H200): workers whose tensors take a few
/// MiB peaked at 1,214 MiB (ID embeddings alone) to 1,322 MiB (the default config, whose GPT-2
/// kernels load too) by NVML. Other GPUs and CUDA versions differ by a few hundred MiB.
pub const CUDA_CONTEXT_BYTES: u64 = 1_300 << 20;
/// The caching allocator keeps freed blocks and rounds sizes up; what it holds beyond the live
/// tensors, as a fraction of them (a planning margin, not a measurement).
pub const CUDA_ALLOCATOR_RESERVE: f64 = 0.15;
/// NCCL's own device buffers, allocated outside the caching allocator when a communicator first
/// connects: per channel and connection, one FIFO per protocol (Simple `NCCL_BUFFSIZE` 4 MiB,
/// LL128 4.69 MiB, LL 0.5 MiB: 9.19 MiB, NCCL's defaults), for a ring and a tree connection on
/// each of 16 channels (NVLink-class boxes use 16-32; PCIe fewer), plus NVLS's ~288 MiB on
/// NVSwitch boxes. From NCCL's defaults and its maintainers' figures, not measured here.
pub const NCCL_CHANNELS: u64 = 16;
pub const NCCL_CONNECTION_BYTES: u64 = (4 << 20) + 4_915_200 + (512 << 10);
pub const NCCL_NVLS_BYTES: u64 = 288 << 20;
/// Host bytes per interaction held by the worker: the parsed ratings, the split lists (and
/// the task's copies), the training pairs. Measured with `scripts/bench/memory.sh` (48 MiB for
/// the 953,537 interactions of the full-size synthetic set).
const HOST_BYTES_PER_INTERACTION: u64 = 50;
/// f32 values autograd keeps per token and per unit of width in one GPT-2 block during training
/// (this model's block in f32: the layer-norm inputs and outputs, q/k/v and their contiguous
/// copies, the attention output, the MLP's 4d input and GELU output, dropout outputs and masks
/// and the residual sums;
const BLOCK_ACTIVATION_COPIES: u64 = 26;
/// The same on CUDA, measured on an H100 (`scripts/gpu/check.sh`, 2026-11-27): GPT-2 small, 12
/// blocks training, micro 192, 10,736 MiB of device memory. Less the context, the allocator's
/// 15%, the weights, gradients, AdamW and its temporaries, that leaves about 6.3 GiB, or about 14
/// copies per block: fewer than the CPU's 26, likely because the caching allocator reuses freed
/// blocks where the CPU's allocator holds them. 16 keeps a margin.
const CUDA_BLOCK_ACTIVATION_COPIES: u64 = 16;
/// The same under bf16 autocast on CUDA, in bf16 values (layer norms, softmax and the residual
/// stream stay f32): about 19 by the same arithmetic on the run with `train.bf16 = true`
/// (8,776 MiB, which also holds autocast's bf16 copies of the weights).
const CUDA_BF16_BLOCK_ACTIVATION_COPIES: u64 = 22;
/// f32 values per token and unit of width that activation checkpointing holds besides the
/// block inputs while it recomputes: the gradients at a block's output and at its input.
const CHECKPOINT_BOUNDARY_COPIES: u64 = 2;
/// f32 copies per token and unit of width each checkpointed block costs while a step runs: its
/// saved input, plus what the allocator holds back from the recompute-and-backward of the
/// blocks before it (measured: `scripts/bench/checkpointing.sh` on `gpt2`, 27 to 33 MiB per
/// sample of micro batch; 5 copies per block, one block's working set and the embeddings give
/// 27; with 1 copy the estimate was 13).
const CHECKPOINT_COPIES_PER_BLOCK: u64 = 5;
/// The same on CUDA: the saved input alone. With activation checkpointing the run above measured
/// 3,944 MiB, which leaves 0.4 to 0.7 GiB (as the allocator's 15% is or is not held) for every
/// block's input, one block's recompute and the embeddings together: less than this estimate's
/// 12 + 2 + 16 + 5 copies, which errs on the safe side.
const CUDA_CHECKPOINT_COPIES_PER_BLOCK: u64 = 1;
/// The same per attention score (per head, per query and key): scores, softmax output, dropout
/// output and mask; on the CPU only (see `terms::gpt2_activations`). The CUDA constants above
/// were measured with attention by hand, which kept these too: with the fused attention they
/// err on the safe side until measured again.
const ATTENTION_SCORE_COPIES: u64 = 4;
/// f32 values per token and unit of width outside the blocks (embedding sum and dropout,
/// final layer norm, mean pooling).
const EMBEDDING_COPIES: u64 = 5;
/// f32 copies per row and embedding dimension of the ID part (embedding lookups, projections,
/// sums, products, the L2 squares) and the MLP scorer's hidden layer.
const ID_ROW_COPIES: u64 = 8;

/// The estimate of one worker's memory for `config` run with `plan` on `device`.
pub fn estimate(
    config: &Config,
    plan: &BatchPlan,
    data: &DataShape,
    at: impl Into<Placement>,
) -> MemoryEstimate {
    let at: Placement = at.into();
    let device = at.device;
    let m = &config.model;
    // Validation has read a model directory's config.json already; a directory gone since
    // then fails in the worker, which says so.
    let gpt2 = m.gpt2_dims().unwrap_or_else(|_| Gpt2Dims::of(m.preset));
    let cuda = device == DeviceKind::Cuda;
    let x = terms::Inputs {
        config,
        plan,
        data,
        device,
        cuda,
        bf16: config.train.bf16,
        text: (m.kind == ModelKind::Gpt2rec).then_some(m.text_mode),
        gpt2,
        d: gpt2.n_embd,
        dim: m.embedding_dim as u64,
        host_ranks: at.host_ranks,
    };
    use terms::*;
    let mut terms = runtime_terms(&x);
    if m.kind != ModelKind::Pop {
        let sizes = model_sizes(&x);
        terms.extend(parameter_terms(&x, &sizes));
        terms.extend(text_terms(&x));
        terms.extend(activation_terms(&x, &sizes));
        terms.push(evaluation_term(&x));
        if cuda {
            terms.push(allocator_reserve(&terms));
        }
    }
    MemoryEstimate {
        device,
        plan: *plan,
        terms,
    }
}

/// Rows of text the worker encodes at once while caching features (worker `rec::CACHE_ROWS`).
const CACHE_ROWS: u64 = 64;
/// f32 copies per token and unit of width held while a frozen GPT-2 encodes without gradients:
/// about 13 live at once (the residual stream, a layer norm, the attention's 3d projections,
/// the MLP's 4d hidden state before and after GELU), plus what the allocator keeps of freed
/// ones. Measured: preset `gpt2`, cached, 64 rows x 24 tokens: the RSS peak was 113 MiB above
/// the start-up, data and weights (about 24 copies; `scripts/bench/memory.sh`).
const ENCODE_COPIES: u64 = 26;
/// Rows of text encoded at once while building evaluation tables (worker `ENCODE_ROWS`).
const ENCODE_ROWS: u64 = 128;

/// The fraction of a device's (or the RAM's) memory an estimate may use before `launch` warns
/// and `micro = "auto"` steps down: 10% stays free for what the estimate does not see.
pub const SAFETY_MARGIN: f64 = 0.10;

/// `GPTREC_MEMORY_LIMIT_MB`'s value, `N` or `N@rank`: pretend a device (or a CPU worker's share
/// of RAM) has N MiB, on every rank or only on `rank`. Returns (bytes, rank).
pub fn parse_memory_limit(text: &str) -> Result<(u64, Option<u32>), String> {
    let bad = || {
        format!("GPTREC_MEMORY_LIMIT_MB={text}: expected MiB, optionally @rank (e.g. 900 or 900@1)")
    };
    let (mb, rank) = match text.trim().split_once('@') {
        Some((mb, r)) => (mb, Some(r.trim().parse::<u32>().map_err(|_| bad())?)),
        None => (text.trim(), None),
    };
    let mb: u64 = mb.trim().parse().map_err(|_| bad())?;
    if mb == 0 || mb > (1 << 40) {
        return Err(bad());
    }
    Ok((mb << 20, rank))
}

/// What `budget` bytes allow: the usable part after the safety margin.
pub fn usable(budget: u64) -> u64 {
    (budget as f64 * (1.0 - SAFETY_MARGIN)) as u64
}

/// Plans that keep `plan.global` with a smaller micro batch, largest first (each satisfies the
/// invariant). The first `n` of them are "the nearest".
pub fn smaller_micro_plans(plan: &BatchPlan) -> Vec<BatchPlan> {
    BatchPlan::plans_keeping_global(plan.global, plan.world_size)
        .into_iter()
        .filter(|p| p.micro < plan.micro)
        .collect()
}

/// The largest plan keeping `plan.global` (micro <= `plan.micro`) whose estimate fits in
/// `usable(budget)`, or `None` when not even micro 1 fits.
pub fn largest_fitting_plan(
    config: &Config,
    plan: &BatchPlan,
    data: &DataShape,
    at: impl Into<Placement>,
    budget: u64,
) -> Option<BatchPlan> {
    let at: Placement = at.into();
    std::iter::once(*plan)
        .chain(smaller_micro_plans(plan))
        .find(|p| estimate(config, p, data, at).peak_bytes() <= usable(budget))
}

/// `micro 32 -> 16, grad_accum 2 -> 4 keeps global 192`.
pub fn change_text(from: &BatchPlan, to: &BatchPlan) -> String {
    format!(
        "micro {} -> {}, grad_accum {} -> {} keeps global {}",
        from.micro, to.micro, from.grad_accum, to.grad_accum, to.global
    )
}

/// Other ways to need less memory than `config` does, each with the estimate it would give:
/// cached instead of dynamic text, frozen GPT-2 layers, bf16 on CUDA, activation
/// checkpointing, ZeRO stage 1 where it shards something.
pub fn other_levers(
    config: &Config,
    plan: &BatchPlan,
    data: &DataShape,
    at: impl Into<Placement>,
) -> Vec<String> {
    let at: Placement = at.into();
    let mut out = Vec::new();
    let m = &config.model;
    let now = estimate(config, plan, data, at).peak_bytes();
    // Only levers that lower the estimate are named.
    let mut try_lever = |text: &str, change: &dyn Fn(&mut Config)| {
        let mut c = config.clone();
        change(&mut c);
        let e = estimate(&c, plan, data, at).peak_bytes();
        if e < now {
            out.push(format!("{text} (estimate {})", mib_text(e)));
        }
    };
    if m.kind == ModelKind::Gpt2rec && m.text_mode == TextMode::Dynamic {
        // Block settings mean nothing in cached mode (validation refuses them): say to drop them.
        let dropped: Vec<&str> = [
            ("model.trainable_layers", m.trainable_layers.is_some()),
            ("model.freeze_gpt2", m.freeze_gpt2),
            ("model.activation_checkpointing", m.activation_checkpointing),
        ]
        .into_iter()
        .filter_map(|(key, set)| set.then_some(key))
        .collect();
        let cached = match dropped.as_slice() {
            [] => "model.text_mode = \"cached\"".to_string(),
            keys => format!("model.text_mode = \"cached\" without {}", keys.join(", ")),
        };
        try_lever(&cached, &|c| {
            c.model.text_mode = TextMode::Cached;
            c.model.trainable_layers = None;
            c.model.freeze_gpt2 = false;
            c.model.activation_checkpointing = false;
        });
        if !m.freeze_gpt2 && m.trainable_layers.is_none_or(|n| n > 1) {
            try_lever("model.trainable_layers = 1", &|c| {
                c.model.trainable_layers = Some(1)
            });
        }
        if !m.freeze_gpt2 {
            try_lever("model.freeze_gpt2 = true", &|c| {
                c.model.freeze_gpt2 = true;
                c.model.trainable_layers = None;
                c.model.activation_checkpointing = false;
            });
        }
        if at.device == DeviceKind::Cuda && !config.train.bf16 {
            try_lever("train.bf16 = true", &|c| c.train.bf16 = true);
        }
        if !m.freeze_gpt2 && m.trainable_layers != Some(0) && !m.activation_checkpointing {
            try_lever("model.activation_checkpointing = true", &|c| {
                c.model.activation_checkpointing = true
            });
        }
    }
    if config.dist.zero == crate::config::ZeroStage::Stage(0) {
        try_lever("dist.zero = 1", &|c| c.dist.zero = 1.into());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(global: u64, micro: u64, grad_accum: u64, world_size: u64) -> BatchPlan {
        BatchPlan::new(global, micro, grad_accum, world_size)
    }

    fn shape(users: u64, items: u64) -> DataShape {
        DataShape {
            users,
            items,
            interactions: 1000,
            user_tokens: 16,
            item_tokens: 40,
            source: "test".into(),
        }
    }

    #[test]
    fn gpt2_parameter_counts_match_the_published_ones() {
        // Hugging Face's `gpt2`: 124,439,808 parameters.
        assert_eq!(Gpt2Dims::of(Gpt2Preset::Gpt2).params(), 124_439_808);
        // tiny: 50257 x 64 + 128 x 64 + 2 x (12 x 64² + 13 x 64) + 2 x 64.
        assert_eq!(
            Gpt2Dims::of(Gpt2Preset::Tiny).params(),
            50257 * 64 + 128 * 64 + 2 * (12 * 4096 + 13 * 64) + 128
        );
    }

    #[test]
    fn bpr_terms_by_hand() {
        let mut c = Config::default();
        c.model.kind = ModelKind::Bpr;
        c.model.embedding_dim = 64;
        let e = estimate(
            &c,
            &plan(256, 64, 2, 2),
            &shape(6040, 3629),
            DeviceKind::Cpu,
        );
        let params = (6040 + 3629) * 64;
        assert_eq!(e.term("parameters"), params * 4);
        assert_eq!(e.term("gradients"), params * 4);
        assert_eq!(e.term("optimizer (AdamW)"), params * 8);
        // All gradients fit in one 25 MiB bucket: two copies of them.
        assert_eq!(e.term("all-reduce buffers"), 2 * params * 4);
        assert_eq!(e.term("activations (IDs)"), 3 * 64 * 64 * 8 * 4);
        assert_eq!(e.term("runtime (libtorch)"), CPU_RUNTIME_BYTES);
        assert_eq!(e.term("data (host)"), 1000 * HOST_BYTES_PER_INTERACTION);
        assert_eq!(e.term("tokenizer (host)"), 0, "BPR reads no text");
        // AdamW's temporaries: 3 x the user table; rank 0's checkpoint: 2 moments + 2 moments.
        assert_eq!(e.term("optimizer temporaries"), 3 * 6040 * 64 * 4);
        assert_eq!(e.term("checkpoint (rank 0)"), 4 * params * 4);
        assert_eq!(e.term("cached text features"), 0);
        assert_eq!(
            e.term("evaluation"),
            (6040 + 3629) * 64 * 4 + 3 * 128 * 3629 * 4
        );
        // One process: no all-reduce.
        let e1 = estimate(
            &c,
            &plan(256, 64, 4, 1),
            &shape(6040, 3629),
            DeviceKind::Cpu,
        );
        assert_eq!(e1.term("all-reduce buffers"), 0);
    }

    /// The softmax's negatives and logits, and the history tower's table, are counted.
    #[test]
    fn softmax_and_history_terms_by_hand() {
        let mut c = Config::default();
        c.model.kind = ModelKind::Bpr;
        c.model.embedding_dim = 64;
        c.train.loss = LossKind::Softmax;
        c.model.user_tower = UserTower::Both;
        let at =
            |c: &Config| estimate(c, &plan(256, 64, 2, 2), &shape(6040, 3629), DeviceKind::Cpu);
        let e = at(&c);
        // The full softmax: every item a negative.
        assert_eq!(
            e.term("activations (softmax)"),
            (3629 * 64 * 8 + 64 * 3629 * 6) * 4
        );
        assert_eq!(e.term("parameters"), (6040 + 2 * 3629) * 64 * 4);
        c.train.negatives = 256;
        assert_eq!(
            at(&c).term("activations (softmax)"),
            (256 * 64 * 8 + 64 * 256 * 6) * 4
        );
        c.model.item_item = true;
        assert_eq!(
            at(&c).term("parameters"),
            ((6040 + 2 * 3629) * 64 + 3629 * 3629) * 4,
            "the item-item matrix"
        );
        assert_eq!(
            at(&c).term("activations (softmax)"),
            (256 * 64 * 8 + 64 * 256 * 6 + 64 * 3629 * 5) * 4,
            "and its scores"
        );
        c.model.item_item = false;
        c.train.loss = LossKind::Bpr;
        c.train.negatives = 0;
        c.model.user_tower = UserTower::Id;
        assert_eq!(at(&c).term("activations (softmax)"), 0);
        assert_eq!(at(&c).term("parameters"), (6040 + 3629) * 64 * 4);
    }

    /// Ranks that are the whole job on one CPU host keep the ID tables and their moments once
    /// (`dist.shared_tables`): each counts its share, so the host's ranks together count them
    /// once. Ranks on several hosts, or with the sharing off, each count a whole copy.
    #[test]
    fn shared_tables_count_once_per_host() {
        let mut c = Config::default();
        c.dist.shard_optimizer = false;
        c.model.kind = ModelKind::Bpr;
        c.model.embedding_dim = 64;
        let (data, two) = (shape(6040, 3629), plan(256, 64, 2, 2));
        let tables = (6040 + 3629) * 64 * 4;
        let shared = estimate(&c, &two, &data, Placement::new(DeviceKind::Cpu, 2));
        assert_eq!(shared.term("parameters"), 0, "BPR is its two tables");
        assert_eq!(shared.term("optimizer (AdamW)"), 0);
        assert_eq!(shared.term("shared tables"), 3 * tables / 2);
        assert_eq!(shared.term("gradients"), tables, "every rank has its own");
        let private = estimate(&c, &two, &data, Placement::new(DeviceKind::Cpu, 1));
        assert_eq!(private.term("shared tables"), 0);
        assert_eq!(
            private.term("parameters") + private.term("optimizer (AdamW)"),
            3 * tables
        );
        assert_eq!(
            private.peak_bytes() - shared.peak_bytes(),
            3 * tables / 2,
            "each of the two ranks saves half of one copy"
        );
        c.dist.shared_tables = false;
        assert_eq!(
            estimate(&c, &two, &data, Placement::new(DeviceKind::Cpu, 2)),
            private
        );
        c.dist.shared_tables = true;
        let gpu = estimate(&c, &two, &data, Placement::new(DeviceKind::Cuda, 2));
        assert_eq!(gpu.term("shared tables"), 0, "GPUs keep their own");
        // GPT-2's token table is shared too when every GPT-2 weight trains.
        c.model.kind = ModelKind::Gpt2rec;
        c.model.text_mode = TextMode::Dynamic;
        let g = estimate(&c, &two, &data, Placement::new(DeviceKind::Cpu, 2));
        let wte = Gpt2Dims::of(c.model.preset).vocab_size * Gpt2Dims::of(c.model.preset).n_embd;
        assert_eq!(g.term("shared tables"), 3 * (tables + wte * 4) / 2);
    }

    /// ZeRO stage 1 (`dist.zero = 1`): each rank counts its share of the dense values'
    /// moments, on GPUs and across hosts too; the row-sparse tables' moments stay whole; the
    /// one-host shared-memory form, where it applies, is counted as before.
    #[test]
    fn zero_stage_1_counts_a_share_of_the_dense_moments() {
        let mut c = Config::default();
        c.model.kind = ModelKind::Bpr;
        c.model.embedding_dim = 64;
        c.dist.sparse_embeddings = false;
        let (data, four) = (shape(6040, 3629), plan(256, 64, 1, 4));
        let tables = (6040 + 3629) * 64;
        let gpu = Placement::new(DeviceKind::Cuda, 4);
        let ddp = estimate(&c, &four, &data, gpu);
        assert_eq!(ddp.term("optimizer (AdamW)"), 2 * tables * 4);
        c.dist.zero = 1.into();
        let zero = estimate(&c, &four, &data, gpu);
        assert_eq!(zero.term("optimizer (AdamW)"), 2 * tables.div_ceil(4) * 4);
        assert_eq!(
            zero.term("gradients"),
            ddp.term("gradients"),
            "stage 1 keeps them"
        );
        c.dist.sparse_embeddings = true;
        let sparse = estimate(&c, &four, &data, gpu);
        assert_eq!(
            sparse.term("optimizer (AdamW)"),
            2 * tables * 4,
            "row-sparse: whole"
        );
        let one_host = estimate(&c, &four, &data, Placement::new(DeviceKind::Cpu, 4));
        assert_eq!(
            one_host.term("optimizer (AdamW)"),
            0,
            "shard_optimizer's form"
        );
        // Without it, the tables once per host (shared_tables) and the dense rest sharded.
        c.dist.shard_optimizer = false;
        c.model.kind = ModelKind::Gpt2rec;
        let cpu = Placement::new(DeviceKind::Cpu, 4);
        let zero = estimate(&c, &four, &data, cpu);
        c.dist.zero = 0.into();
        let ddp = estimate(&c, &four, &data, cpu);
        assert!(zero.term("shared tables") > 0);
        assert_eq!(zero.term("shared tables"), ddp.term("shared tables"));
        let dense = ddp.term("optimizer (AdamW)") / 8;
        assert!(dense > 0);
        assert_eq!(zero.term("optimizer (AdamW)"), 2 * dense.div_ceil(4) * 4);
    }

    /// Offloaded (`dist.offload = "optimizer"`), a GPU keeps no moments and no update
    /// temporaries, at every stage; a CPU rank counts them as before (host memory is where
    /// they were), and the one-host shared-memory form is unchanged.
    #[test]
    fn an_offloaded_optimizer_leaves_the_gpu_and_stays_on_a_cpu() {
        let mut c = Config::default();
        c.model.kind = ModelKind::Bpr;
        c.model.embedding_dim = 64;
        c.dist.sparse_embeddings = false;
        let (data, four) = (shape(6040, 3629), plan(256, 64, 1, 4));
        let gpu = Placement::new(DeviceKind::Cuda, 4);
        for stage in [0u8, 1, 2, 3] {
            c.dist.zero = stage.into();
            c.dist.offload = OffloadKind::NoOffload;
            let kept = estimate(&c, &four, &data, gpu);
            c.dist.offload = OffloadKind::Optimizer;
            let off = estimate(&c, &four, &data, gpu);
            let moments = kept.term("optimizer (AdamW)");
            assert!(moments > 0, "stage {stage}");
            assert_eq!(off.term("optimizer (AdamW)"), 0, "stage {stage}");
            assert_eq!(off.term("optimizer temporaries"), 0, "stage {stage}");
            assert_eq!(off.term("gradients"), kept.term("gradients"));
            let temporaries = kept.term("optimizer temporaries");
            assert!(
                off.peak_bytes() + moments <= kept.peak_bytes(),
                "stage {stage}"
            );
            assert!(off.peak_bytes() + moments + temporaries >= kept.peak_bytes());
            let line = off.table("");
            assert!(line.contains("in host memory (dist.offload)"), "{line}");
        }
        c.dist.zero = 1.into();
        let cpu = Placement::new(DeviceKind::Cpu, 4);
        c.dist.shard_optimizer = false;
        let off = estimate(&c, &four, &data, cpu);
        c.dist.offload = OffloadKind::NoOffload;
        let kept = estimate(&c, &four, &data, cpu);
        assert_eq!(off.peak_bytes(), kept.peak_bytes());
        assert!(off.term("optimizer (AdamW)") > 0);
        c.dist.shard_optimizer = true;
        let shared = estimate(&c, &four, &data, cpu);
        c.dist.offload = OffloadKind::Optimizer;
        assert_eq!(estimate(&c, &four, &data, cpu), shared);
    }

    /// Sharded (`dist.shard_optimizer`, the default), every trainable value and its moments
    /// count once per host, the GPT-2 recommender's projections too; each rank's gradients
    /// still count whole.
    #[test]
    fn sharded_parameters_count_once_per_host() {
        let mut c = Config::default();
        assert!(c.dist.shard_optimizer);
        c.model.embedding_dim = 64;
        let (data, two) = (shape(6040, 3629), plan(256, 64, 2, 2));
        let sharded = estimate(&c, &two, &data, Placement::new(DeviceKind::Cpu, 2));
        assert_eq!(sharded.term("shared tables"), 0);
        let shared = sharded.term("shared parameters");
        assert_eq!(
            sharded.term("optimizer (AdamW)"),
            0,
            "every moment is shared"
        );
        c.dist.shard_optimizer = false;
        let tables = estimate(&c, &two, &data, Placement::new(DeviceKind::Cpu, 2));
        assert!(shared > tables.term("shared tables"), "the projections too");
        assert_eq!(sharded.term("gradients"), tables.term("gradients"));
        assert!(sharded.peak_bytes() < tables.peak_bytes());
        c.dist.shard_optimizer = true;
        let alone = estimate(
            &c,
            &plan(256, 64, 4, 1),
            &data,
            Placement::new(DeviceKind::Cpu, 1),
        );
        assert_eq!(
            alone.term("shared parameters"),
            0,
            "one rank shares nothing"
        );
    }

    #[test]
    fn gpt2_cached_terms_by_hand() {
        let mut c = Config::default();
        c.model.preset = Gpt2Preset::Gpt2;
        let e = estimate(
            &c,
            &plan(2048, 512, 1, 4),
            &shape(6040, 3629),
            DeviceKind::Cuda,
        );
        // The recommender trains IDs and the two projections 768 -> 64; GPT-2 is not in it.
        let trainable = (6040 + 3629) * 64 + 2 * (768 * 64 + 64);
        assert_eq!(e.term("parameters"), trainable * 4);
        assert_eq!(e.term("optimizer (AdamW)"), trainable * 8);
        assert_eq!(e.term("cached text features"), (6040 + 3629) * 768 * 4);
        assert_eq!(e.term("CUDA context"), CUDA_CONTEXT_BYTES);
        assert_eq!(e.term("data (host)"), 0, "host data is not on the device");
        // Caching needs the whole frozen GPT-2 for a while.
        assert!(e.term("text encoder (caching)") > 124_439_808 * 4);
        // NCCL's buffers, outside the caching allocator: 16 x 2 x 9.19 MiB + 288 MiB.
        assert_eq!(e.term(NCCL_TERM), 16 * 2 * 9_633_792 + (288 << 20));
        // The reserve is 15% of every tensor term of the caching allocator.
        let tensors: u64 = e
            .terms
            .iter()
            .filter(|t| !["CUDA context", "allocator reserve", NCCL_TERM].contains(&t.name))
            .map(|t| t.bytes)
            .sum();
        assert_eq!(
            e.term("allocator reserve"),
            (tensors as f64 * CUDA_ALLOCATOR_RESERVE) as u64
        );
    }

    #[test]
    fn nccl_buffers_only_where_nccl_runs() {
        let mut c = Config::default();
        let data = shape(6040, 3629);
        let nccl = |c: &Config, world: u64, device: DeviceKind| {
            estimate(c, &plan(64, 64 / world, 1, world), &data, device).term(NCCL_TERM)
        };
        assert!(nccl(&c, 2, DeviceKind::Cuda) > 500 << 20);
        assert_eq!(
            nccl(&c, 1, DeviceKind::Cuda),
            0,
            "one rank: no communicator"
        );
        assert_eq!(nccl(&c, 2, DeviceKind::Cpu), 0, "the CPU runs the TCP ring");
        c.dist.backend = crate::config::Backend::Tcp;
        assert_eq!(nccl(&c, 2, DeviceKind::Cuda), 0, "tcp asked for by name");
    }

    #[test]
    fn gpt2_dynamic_activations_scale_with_micro_tokens_width_and_blocks() {
        let mut c = Config::default();
        c.model.preset = Gpt2Preset::Gpt2;
        c.model.text_mode = TextMode::Dynamic;
        let data = shape(6040, 3629);
        let act = |c: &Config, micro| {
            estimate(
                c,
                &plan(192, micro, 192 / micro, 1),
                &data,
                DeviceKind::Cuda,
            )
            .term("activations (GPT-2)")
        };
        // micro 16: 16 x 16 user tokens + 32 x 40 item tokens = 1536 token rows.
        let tokens = 16 * 16 + 2 * 16 * 40;
        let scores = 16 * 16 * 16 + 2 * 16 * 40 * 40;
        // The fused attention keeps no scores on CUDA.
        let block = tokens * 768 * CUDA_BLOCK_ACTIVATION_COPIES * 4;
        assert_eq!(
            act(&c, 16),
            12 * block + tokens * 768 * EMBEDDING_COPIES * 4
        );
        // Linear in the micro batch.
        assert_eq!(act(&c, 32), 2 * act(&c, 16));
        // The CPU keeps more copies per block (its allocator holds freed blocks back).
        let on_cpu = estimate(&c, &plan(192, 16, 12, 1), &data, DeviceKind::Cpu);
        assert_eq!(
            on_cpu.term("activations (GPT-2)"),
            12 * (tokens * 768 * BLOCK_ACTIVATION_COPIES * 4 + scores * 12 * 4 * 4)
                + tokens * 768 * EMBEDDING_COPIES * 4
        );
        // Only the trained blocks keep activations.
        c.model.trainable_layers = Some(3);
        assert_eq!(act(&c, 16), 3 * block + tokens * 768 * EMBEDDING_COPIES * 4);
        let e = estimate(&c, &plan(192, 16, 12, 1), &data, DeviceKind::Cuda);
        let g = Gpt2Dims::of(Gpt2Preset::Gpt2);
        let ids = (6040 + 3629) * 64 + 2 * (768 * 64 + 64);
        assert_eq!(
            e.term("gradients"),
            (ids + 3 * g.block_params() + 2 * 768) * 4
        );
        assert_eq!(e.term("parameters"), (ids + g.params()) * 4);
        // Frozen: one block's working set, no gradients for GPT-2.
        c.model.trainable_layers = None;
        c.model.freeze_gpt2 = true;
        assert_eq!(act(&c, 16), block);
        // bf16: its own copies, in 2 bytes each.
        c.model.freeze_gpt2 = false;
        c.train.bf16 = true;
        let bf = block - tokens * 768 * CUDA_BLOCK_ACTIVATION_COPIES * 4
            + tokens * 768 * CUDA_BF16_BLOCK_ACTIVATION_COPIES * 2;
        assert_eq!(act(&c, 16), 12 * bf + tokens * 768 * EMBEDDING_COPIES * 4);
        assert!(
            estimate(&c, &plan(192, 16, 12, 1), &data, DeviceKind::Cuda).term("bf16 weight copies")
                > 0
        );
        // On the CPU autocast keeps the same copies; the activations keep the f32 count (an
        // upper bound there: not measured in bf16).
        let cpu = |c: &Config| estimate(c, &plan(192, 16, 12, 1), &data, DeviceKind::Cpu);
        let cpu_bf16 = cpu(&c);
        assert_eq!(cpu_bf16.term("bf16 weight copies"), g.params() * 2);
        c.train.bf16 = false;
        assert_eq!(
            cpu_bf16.term("activations (GPT-2)"),
            cpu(&c).term("activations (GPT-2)")
        );
        c.model.activation_checkpointing = true;
        // Checkpointing on CUDA: each trained block's input, two gradients, one block's copies.
        assert_eq!(
            act(&c, 16),
            (12 + 2) * tokens * 768 * 4 + block + tokens * 768 * EMBEDDING_COPIES * 4
        );
        assert_eq!(act(&c, 32), 2 * act(&c, 16));
        c.model.trainable_layers = Some(3);
        assert_eq!(
            act(&c, 16),
            (3 + 2) * tokens * 768 * 4 + block + tokens * 768 * EMBEDDING_COPIES * 4
        );
        // Never more than without it: with 1 trained block it saves nothing by the estimate.
        c.model.trainable_layers = Some(1);
        assert_eq!(act(&c, 16), block + tokens * 768 * EMBEDDING_COPIES * 4);
    }

    #[test]
    fn peak_is_persistent_plus_the_largest_phase() {
        let c = Config::default();
        let on = |device| estimate(&c, &plan(256, 64, 2, 2), &DataShape::assumed(&c), device);
        let e = on(DeviceKind::Cpu);
        let sum = |p| e.held_bytes(p);
        let phases = [Held::Training, Held::Build, Held::Checkpoint, Held::Eval];
        // CPU: every phase adds up.
        let expected = sum(Held::Always) + phases.into_iter().map(sum).sum::<u64>();
        assert_eq!(e.peak_bytes(), expected);
        // GPU: only the largest phase counts.
        let g = on(DeviceKind::Cuda);
        let gsum = |p| g.held_bytes(p);
        let largest = phases.into_iter().map(gsum).max().unwrap();
        assert_eq!(g.peak_bytes(), gsum(Held::Always) + largest);
        let table = e.table("  ");
        assert!(table.contains("estimated peak"), "{table}");
        assert!(table.contains("parameters"), "{table}");
    }

    #[test]
    fn memory_limits_parse() {
        assert_eq!(parse_memory_limit("900").unwrap(), (900 << 20, None));
        assert_eq!(parse_memory_limit(" 512@1 ").unwrap(), (512 << 20, Some(1)));
        for bad in ["", "x", "0", "12@", "12@x", "-5"] {
            assert!(parse_memory_limit(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn suggestions_keep_the_global_batch() {
        let p = plan(192, 32, 2, 3);
        let smaller = smaller_micro_plans(&p);
        assert_eq!(
            smaller.iter().map(|p| p.micro).collect::<Vec<_>>(),
            vec![16, 8, 4, 2, 1]
        );
        for s in &smaller {
            assert!(s.is_consistent(), "{s:?}");
            assert_eq!(s.global, 192);
            assert_eq!(s.world_size, 3);
        }
        assert_eq!(
            change_text(&p, &smaller[0]),
            "micro 32 -> 16, grad_accum 2 -> 4 keeps global 192"
        );
        // Every plan any search returns satisfies the invariant, for many shapes.
        for global in 1..=300u64 {
            for world in 1..=8u64 {
                for p in BatchPlan::plans_keeping_global(global, world) {
                    for s in smaller_micro_plans(&p) {
                        assert!(s.is_consistent() && s.global == global && s.micro < p.micro);
                    }
                }
            }
        }
    }

    #[test]
    fn the_largest_fitting_plan_is_found_and_fits() {
        let mut c = Config::default();
        c.model.text_mode = TextMode::Dynamic;
        let data = DataShape::assumed(&c);
        let top = plan(256, 128, 1, 2);
        let need = |m| estimate(&c, &plan(256, m, 128 / m, 2), &data, DeviceKind::Cpu).peak_bytes();
        // A budget between micro 32's and micro 64's needs picks 32.
        let budget = ((need(32) + need(64)) as f64 / 2.0 / (1.0 - SAFETY_MARGIN)) as u64;
        let got = largest_fitting_plan(&c, &top, &data, DeviceKind::Cpu, budget).unwrap();
        assert_eq!((got.micro, got.grad_accum), (32, 4));
        assert!(largest_fitting_plan(&c, &top, &data, DeviceKind::Cpu, 1).is_none());
        let levers = other_levers(&c, &top, &data, DeviceKind::Cpu);
        assert!(
            levers[0].starts_with("model.text_mode = \"cached\""),
            "{levers:?}"
        );
        assert!(levers
            .iter()
            .any(|l| l.starts_with("model.trainable_layers = 1")));
        c.model.preset = Gpt2Preset::Gpt2;
        let levers = other_levers(&c, &top, &data, DeviceKind::Cpu);
        assert!(
            levers
                .iter()
                .any(|l| l.starts_with("model.activation_checkpointing = true")),
            "{levers:?}"
        );
        c.model.activation_checkpointing = true;
        assert!(!other_levers(&c, &top, &data, DeviceKind::Cpu)
            .iter()
            .any(|l| l.starts_with("model.activation_checkpointing")));
    }
}
