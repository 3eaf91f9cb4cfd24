//! The config schema, its defaults, loading with `--set` overrides, and validation.
//!
//! A config is a TOML file with the sections `[run]`, `[data]`, `[model]`, `[train]`, `[batch]`
//! and `[dist]`; every key is optional and falls back to the default documented on its field.
//! Unknown keys are errors. [`Config::load`] reads a file, applies `--set key.path=value`
//! overrides in order, deserialises and runs [`Config::validate`], the one place where field
//! values are checked. Every [`ConfigError`] is a single line naming where the problem is:
//! `file:line:column` for what the file says, `--set ...` for an override.
//!
//! Batch arithmetic that needs the world size lives in [`crate::batch`];
//! [`crate::train_plan::TrainPlan`] ties the two together.

mod error;
mod hf_gpt2;
mod source;
mod validate;
mod zero_stage;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::batch::BatchSpec;

use error::one_line;
pub use error::{ConfigError, Location};
pub use hf_gpt2::{HfGpt2Config, TOKENIZER_VOCAB};
use source::{apply_overrides, classify, locate_semantic, Override, Source};
pub use zero_stage::ZeroStage;

/// A whole config file. Every section is optional (defaults below).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// `[run]`: naming, output location, seed.
    pub run: RunConfig,
    /// `[data]`: where the interactions come from.
    pub data: DataConfig,
    /// `[model]`: which recommender and its size.
    pub model: ModelConfig,
    /// `[train]`: optimisation.
    pub train: TrainConfig,
    /// `[batch]`: any two of global / micro / grad_accum (default: none given, which is an error:
    /// a config must say at least `global` or `micro`).
    pub batch: BatchSpec,
    /// `[dist]`: collectives between workers.
    pub dist: DistConfig,
    /// `[checkpoint]`: when to save, how many to keep, whether to resume.
    pub checkpoint: CheckpointConfig,
    /// `[eval]`: full-ranking evaluation, early stopping and the best model.
    pub eval: EvalConfig,
}

/// `[run]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunConfig {
    /// Run name; the run's files go to `<output_dir>/<name>/`. A plain directory name (no `/`,
    /// `\`, not `.` or `..`). Default: `"default"`.
    pub name: String,
    /// Directory holding all runs (relative paths are relative to the working directory).
    /// Default: `"runs"`.
    pub output_dir: PathBuf,
    /// Seed for model initialisation, synthetic data and sampling (a number, no unit).
    /// Default: `42`.
    pub seed: u64,
}

impl Default for RunConfig {
    fn default() -> Self {
        RunConfig {
            name: "default".to_string(),
            output_dir: PathBuf::from("runs"),
            seed: 42,
        }
    }
}

/// Size of the generated data set used when `data.dir` is not set.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SyntheticSize {
    /// A few hundred users and items: seconds on a CPU (the default).
    #[default]
    Tiny,
    /// Thousands of users and items.
    Small,
    /// About the size of MovieLens-1M.
    Full,
}

/// `[data]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// Directory with a MovieLens data set: MovieLens-1M's `ratings.dat`, `users.dat`,
    /// `movies.dat`, or MovieLens-100k's `u.data`, `u.user`, `u.item` (told apart by the files
    /// present). A name `fetch` knows (`"ml-1m"`, `"ml-100k"`) means its directory in the cache
    /// (`fetch ml-1m` downloads it). Default: unset, meaning synthetic data is generated once into
    /// `<run.output_dir>/data/synthetic-<size>-seed<seed>-v<N>/` and shared by runs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dir: Option<PathBuf>,
    /// Size of the synthetic data set when `dir` is unset. Default: `"tiny"`.
    pub synthetic: SyntheticSize,
    /// Lowest rating (stars, 1..=5) kept as a positive interaction. Default: `3`.
    pub min_rating: u8,
    /// Share of the items (0 <= x <= 0.5) held out of training entirely, cold-start items: no
    /// interaction of theirs is trained on, validated on or drawn as a negative. After
    /// training, the best model ranks them for every (warm) user who interacted with them
    /// (`cold_items` in `metrics.jsonl`). Default: `0` (none).
    #[serde(skip_serializing_if = "is_zero")]
    pub cold_items: f64,
    /// Share of the users (0 <= x <= 0.5) held out of training entirely, cold-start users: the
    /// best model ranks the warm items for each of them from nothing but what it knows without
    /// their interactions (`cold_users` in `metrics.jsonl`). Default: `0` (none).
    #[serde(skip_serializing_if = "is_zero")]
    pub cold_users: f64,
    /// Seed of the train/valid/test split and of the cold-start hold-outs. Default: unset
    /// (`run.seed`). Set it to keep one split while `run.seed` varies the model's
    /// initialisation and sampling, e.g. to average over seeds on one split.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub split_seed: Option<u64>,
}

impl DataConfig {
    /// The seed the split uses: `split_seed`, else `run_seed`.
    pub fn split_seed_or(&self, run_seed: u64) -> u64 {
        self.split_seed.unwrap_or(run_seed)
    }
}

fn is_default<T: Default + PartialEq>(x: &T) -> bool {
    *x == T::default()
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            dir: None,
            synthetic: SyntheticSize::Tiny,
            min_rating: 3,
            cold_items: 0.0,
            cold_users: 0.0,
            split_seed: None,
        }
    }
}

/// Which recommender to train.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    /// GPT-2 text features fused with ID embeddings (the default).
    #[default]
    Gpt2rec,
    /// Matrix factorisation trained with the BPR loss.
    Bpr,
    /// Most-popular baseline (nothing to train).
    Pop,
}

/// Size of the GPT-2 text encoder.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Gpt2Preset {
    /// A small randomly initialised GPT-2 for tests and CPU runs (the default).
    #[default]
    Tiny,
    /// The 124M-parameter `gpt2` architecture (768-d hidden state).
    Gpt2,
}

/// How item and user text reaches the model.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TextMode {
    /// Text encoded once by a frozen GPT-2 and cached (the default).
    #[default]
    Cached,
    /// Text re-encoded in every forward pass, so GPT-2 trains too.
    Dynamic,
}

/// How a user and an item representation become a score.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScorerKind {
    /// Inner product of the two representations (the default).
    #[default]
    Dot,
    /// A two-layer MLP on the concatenated pair (no final sigmoid).
    Mlp,
}

/// How the text projections of `gpt2rec` start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TextProjInit {
    /// All zero: the model starts as plain matrix factorisation (the default).
    #[default]
    Zero,
    /// libtorch's default linear initialisation (uniform, Kaiming-like): text speaks at full
    /// strength from the first step. Kept for the ablation (`scripts/bench/ablation.sh`).
    Random,
}

/// `[model]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// Recommender: `"gpt2rec"`, `"bpr"` or `"pop"`. Default: `"gpt2rec"`.
    pub kind: ModelKind,
    /// GPT-2 size: `"tiny"` or `"gpt2"` (not used when `gpt2_weights` names a model
    /// directory, whose `config.json` gives the size). Default: `"tiny"`.
    pub preset: Gpt2Preset,
    /// Size of the user/item ID embeddings (dimensions, >= 1). Default: `64`.
    pub embedding_dim: usize,
    /// `"cached"` (frozen GPT-2, features computed once) or `"dynamic"`. Default: `"cached"`.
    pub text_mode: TextMode,
    /// Hugging Face GPT-2 weights to load: a model directory (`config.json` +
    /// `model.safetensors`, as `save_pretrained` writes it, e.g. `gpt2`, `distilgpt2`,
    /// `gpt2-medium`; its `config.json` sets the dimensions and `preset` is not used), or a bare
    /// `model.safetensors` of the preset's shape. A name `fetch` knows (`"gpt2"`,
    /// `"distilgpt2"`, `"gpt2-medium"`, ...) means its directory in the cache (`fetch gpt2`
    /// downloads it). Default: unset (random initialisation).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpt2_weights: Option<PathBuf>,
    /// `"dot"` or `"mlp"` (`gpt2rec` and `bpr`). Default: `"dot"`.
    pub scorer: ScorerKind,
    /// Weight of the L2 penalty on the ID embeddings used in a batch (>= 0, per sample).
    /// Default: `1e-4`.
    pub l2: f64,
    /// `gpt2rec`: weight of the L2 penalty on the text part (the projected GPT-2 features) of
    /// the user and item representations in a batch (>= 0, per sample). The projections start
    /// at zero, so the model starts as plain matrix factorisation; this keeps the text part to
    /// what the IDs lack. Default: `1e-2`.
    pub text_l2: f64,
    /// `gpt2rec`: how the text projections start, `"zero"` or `"random"`. Default: `"zero"`.
    #[serde(skip_serializing_if = "is_default")]
    pub text_proj_init: TextProjInit,
    /// Tokens of user/item text fed to GPT-2, longer texts are cut (1..=n_positions).
    /// Default: `64`.
    pub max_text_tokens: usize,
    /// Dynamic mode: keep every GPT-2 weight frozen (only the projections and IDs train).
    /// Default: `false`.
    pub freeze_gpt2: bool,
    /// Dynamic mode: train only the top N GPT-2 blocks and the final layer norm (the rest stays
    /// frozen). Default: unset (all of GPT-2 trains).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trainable_layers: Option<u32>,
    /// Dynamic mode: activation checkpointing of the GPT-2 blocks that train. A training step
    /// keeps only each block's input and recomputes the block during backward: the blocks'
    /// activations shrink to about one block's worth for about a third more compute per
    /// step. Gradients are the same as without it. Default: `false`.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub activation_checkpointing: bool,
    /// What represents a user: `"id"` (the user's own ID row), `"history"` (the pool of the
    /// history rows of the items in the user's training history, their sum over the square
    /// root of their number: a user is what they watched) or `"both"` (the two added). The user's text, with a text
    /// tower, is added in every case. In training a sample's own positive is left out of its
    /// user's pool, so the model cannot learn to recommend what a user has already seen.
    /// Default: `"id"`.
    #[serde(skip_serializing_if = "is_default")]
    pub user_tower: UserTower,
    /// With a history tower, the share of a training sample's history left out of its user's
    /// pool, drawn afresh every step from `run.seed` and the step (the same at any world
    /// size): a user seen through part of what they watched, as Mult-DAE's input dropout.
    /// Evaluation pools the whole history. At least 0, below 1. Default: `0.0`.
    #[serde(skip_serializing_if = "is_default")]
    pub history_dropout: f32,
    /// With a history tower, also an item-item matrix (items x items, zero at the start) whose
    /// rows for a user's training items are pooled as the history rows are, giving each item a
    /// score added to the model's: EASE's form (a user's scores are their history times an
    /// item-item matrix) trained with the model's loss, beside the low-rank pool. Its weight
    /// decay is the optimizer's. Refused with `user_tower = "id"`; a run with more than 8,192
    /// items refuses it at start. Default: `false`.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub item_item: bool,
}

/// What represents a user (`model.user_tower`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UserTower {
    /// The user's own ID embedding (matrix factorisation; the default).
    #[default]
    Id,
    /// The pooled history rows of the items in the user's training history.
    History,
    /// The ID embedding plus the pooled history.
    Both,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            kind: ModelKind::Gpt2rec,
            preset: Gpt2Preset::Tiny,
            embedding_dim: 64,
            text_mode: TextMode::Cached,
            gpt2_weights: None,
            scorer: ScorerKind::Dot,
            l2: 1e-4,
            text_l2: 1e-2,
            text_proj_init: TextProjInit::Zero,
            max_text_tokens: 64,
            freeze_gpt2: false,
            trainable_layers: None,
            activation_checkpointing: false,
            user_tower: UserTower::Id,
            history_dropout: 0.0,
            item_item: false,
        }
    }
}

/// The metrics the evaluator computes (each at every K of `eval.topk`).
pub const METRIC_NAMES: [&str; 5] = ["recall", "ndcg", "mrr", "hit", "precision"];

/// `[eval]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EvalConfig {
    /// Cut-offs K of the full-ranking metrics (each >= 1, distinct). Default: `[10, 20]`.
    pub topk: Vec<usize>,
    /// Evaluate on the validation split every N epochs (>= 1; the last epoch always is).
    /// Default: `1`.
    pub every_n_epochs: u32,
    /// Metric that picks the best model and drives early stopping, `name@K` with a name from
    /// recall, ndcg, mrr, hit, precision and K in `topk`. Default: `"ndcg@10"`.
    pub metric: String,
    /// Stop after this many evaluations without improvement (0 = never stop early).
    /// Default: `3`.
    pub patience: u32,
    /// Users scored at once during evaluation (>= 1). Default: `128`.
    pub batch_users: usize,
    /// Regularisation of the EASE baseline evaluated beside popularity at the start of a run
    /// (>= 0, finite; RecBole's `reg_weight`); `0` leaves the baseline out. Default: `250.0`.
    pub ease_reg: f64,
}

impl Default for EvalConfig {
    fn default() -> Self {
        EvalConfig {
            topk: vec![10, 20],
            every_n_epochs: 1,
            metric: "ndcg@10".to_string(),
            patience: 3,
            batch_users: 128,
            ease_reg: 250.0,
        }
    }
}

/// `[train]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Passes over the training interactions (>= 1). Default: `1`.
    pub epochs: u32,
    /// Peak learning rate of AdamW (per optimizer step, > 0, finite). Default: `1e-3`.
    pub lr: f64,
    /// AdamW decoupled weight decay (>= 0, finite; 0 disables). Default: `0.0`.
    pub weight_decay: f64,
    /// Optimizer steps of linear learning-rate warm-up (0 = none). Default: `0`.
    pub warmup_steps: u64,
    /// Clip gradients to this global L2 norm (> 0, finite). Default: `1.0`.
    pub max_grad_norm: f64,
    /// Learning-rate decay after warm-up: `"cosine"`, `"linear"` or `"constant"`.
    /// Default: `"cosine"`.
    pub lr_schedule: LrScheduleKind,
    /// Learning rate reached at the end of the decay (>= 0, <= lr). Default: `0.0`.
    pub min_lr: f64,
    /// Multiply `lr` by the world size (the "linear scaling rule"). Default: `false`.
    pub scale_lr_with_world: bool,
    /// Run forward passes under bf16 autocast (matmuls in bf16, weights and optimizer state
    /// stay f32): less activation memory and faster steps on CUDA; on the CPU (PyTorch's
    /// `torch.autocast("cpu")`) faster matmuls where the CPU has native bf16 (AVX512-BF16,
    /// AMX), and a warning where it has not. Default: `false`.
    pub bf16: bool,
    /// Let f32 matmuls on CUDA use TF32 tensor cores (10 bits of mantissa in the products,
    /// f32 accumulation; `torch.backends.cuda.matmul.allow_tf32`, as Lightning and the Hugging
    /// Face Trainer offer): several times faster on Ampere and later GPUs. Ignored on the CPU.
    /// Default: `true`.
    pub tf32: bool,
    /// The training objective: `"bpr"` (each positive against one negative of its own, drawn
    /// among the items its user has not rated) or `"softmax"` (cross-entropy of each positive
    /// against `negatives` items shared by the whole step, or against every warm item).
    /// Default: `"bpr"`.
    pub loss: LossKind,
    /// With `loss = "softmax"`: items drawn each optimizer step as the negatives of every
    /// positive in it, the same on every rank (drawn from `run.seed` and the step, so the run
    /// is the same at any world size); a drawn item equal to a sample's positive is left out of
    /// that sample's softmax. `0` ranks each positive against every warm item (the full
    /// softmax; not in dynamic text mode, where it would run GPT-2 over every item each
    /// micro-batch). Default: `0`.
    pub negatives: u32,
    /// With `loss = "softmax"` and `negatives > 0`: an item is drawn with probability
    /// proportional to (its training interactions + 1)^`negative_power` (`0` uniform, `0.75`
    /// as word2vec), and every logit is corrected by minus the log of its expected count
    /// (the logQ correction), so that the sampled loss estimates the full one (>= 0, finite).
    /// Default: `0.0`.
    pub negative_power: f64,
}

/// The training objective (`train.loss`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LossKind {
    /// Bayesian personalised ranking: one sampled negative per positive (the default).
    #[default]
    Bpr,
    /// Cross-entropy over the positive and the step's shared negatives (or every warm item).
    Softmax,
}

/// `dist.offload`: where AdamW's moments live and its update runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OffloadKind {
    /// Beside the parameters, on their device (the default; `"none"`).
    #[default]
    #[serde(rename = "none")]
    NoOffload,
    /// In host memory, the update run there (ZeRO-Offload).
    Optimizer,
}

/// Learning-rate decay after warm-up.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LrScheduleKind {
    /// Half a cosine from `lr` down to `min_lr` at the last step (the default).
    #[default]
    Cosine,
    /// A straight line from `lr` down to `min_lr` at the last step.
    Linear,
    /// `lr` throughout.
    Constant,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            epochs: 1,
            lr: 1e-3,
            weight_decay: 0.0,
            warmup_steps: 0,
            max_grad_norm: 1.0,
            lr_schedule: LrScheduleKind::Cosine,
            min_lr: 0.0,
            scale_lr_with_world: false,
            bf16: false,
            tf32: true,
            loss: LossKind::Bpr,
            negatives: 0,
            negative_power: 0.0,
        }
    }
}

/// Collective backend between workers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// NCCL when the worker's device is CUDA, TCP otherwise (the default).
    #[default]
    Auto,
    /// CPU tensors over a TCP ring.
    Tcp,
    /// CUDA tensors through NCCL.
    Nccl,
}

/// `[dist]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DistConfig {
    /// `"auto"`, `"tcp"` or `"nccl"`. Default: `"auto"`.
    pub backend: Backend,
    /// Time limit for each collective, and for rendezvous unless `rendezvous_timeout_s` is given
    /// (seconds, >= 1). Default: `300`.
    pub timeout_s: u64,
    /// Time limit for rendezvous and the collective's set-up: every rank must have started and
    /// joined within it (seconds, >= 1). Default: unset, `timeout_s`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rendezvous_timeout_s: Option<u64>,
    /// Gradient bucket size for the all-reduce (MiB of f32 gradients, > 0). Default: `25`.
    pub bucket_mb: f64,
    /// Compare a checksum of all parameters across ranks every N optimizer steps and stop if
    /// they differ (0 = never). Default: `0`.
    pub check_params_every: u64,
    /// With the `tcp` backend, all-reduce through shared memory (`/dev/shm`) when every rank
    /// runs on one host, instead of through sockets; falls back to sockets, with a warning, when
    /// shared memory cannot be had. Default: `true`.
    pub shared_memory: bool,
    /// Exchange only the rows of embedding-table gradients that some rank touched in the step
    /// (when at most half the table), instead of the whole table; the result is the same.
    /// Default: `true`.
    pub sparse_embeddings: bool,
    /// With `sparse_embeddings` and shared memory, the ranks of a one-host run keep those
    /// embedding tables (CPU ones), with their AdamW moments, once in shared memory, and each
    /// rank updates its share of the rows: the same numbers, in a fraction of the update's time
    /// and memory. Ignored on GPUs and across hosts. Default: `true`.
    pub shared_tables: bool,
    /// ZeRO stage 1 on one host: with shared memory and every trainable parameter on the CPU,
    /// the ranks keep each parameter and its AdamW moments once in shared memory, write their
    /// gradients into shared memory, and each rank reduces, clips and updates its share of
    /// every parameter's rows (two barriers a step instead of a gradient all-reduce per bucket):
    /// the same numbers, bit for bit. Replaces `shared_tables` where it applies; ignored on GPUs
    /// and across hosts. Default: `true`.
    pub shard_optimizer: bool,
    /// All-reduce each gradient bucket during the backward pass, as soon as autograd has
    /// accumulated every gradient in it (in bucket order, from a communication thread), instead
    /// of after it: the same numbers. Only where buckets are all-reduced (not with
    /// `shard_optimizer` where that applies); a model whose backward finishes later (activation
    /// checkpointing) gets its buckets reduced after that. Default: `false` (measured on a 2-core
    /// CPU machine, it pays only where the all-reduce mostly waits, as on a network, and the
    /// dense gradients are large: see docs/figures.md).
    pub overlap_backward: bool,
    /// ZeRO stage (as DeepSpeed's `zero_stage`): `0` keeps the AdamW moments of every parameter
    /// on every rank; `1` keeps each dense parameter's moments once across the ranks, each rank
    /// its shard of every gradient bucket (gradients reduce-scattered, parameters all-gathered
    /// after the update): the moments take 1/world of their memory, on any backend, GPUs and
    /// several hosts included, and the numbers are DDP's (bit for bit on CPUs). On one CPU host
    /// with shared memory, `shard_optimizer` is the faster form of stage 1 and is used instead.
    /// Row-sparse embedding tables keep their moments whole (on every rank, or once per host
    /// with `shared_tables`). `2` also shards the gradients: each bucket reduce-scattered during
    /// the last backward pass, only this rank's shard kept (with gradient accumulation the
    /// earlier micro-batches keep whole ones, so it then needs more than stage 1).
    /// `"auto"`: the memory plan chooses, before training, among the built stages with the
    /// least traffic (0, 1 and 2 all move DDP's bytes) the one that fits the largest micro
    /// batch on every rank, the lower stage on a tie (`launch --dry-run` prints each stage's
    /// terms and the choice); where none fits, the run stops before training and names the
    /// shortfall per term. `3` also shards the parameters' values: between uses each rank
    /// keeps its shard, and the model's units are gathered around their forward and backward
    /// (1.5x DDP's bytes; `"auto"` takes it only where nothing with less traffic fits).
    /// Checkpoints hold the whole state whatever the stage: any stage and world size resumes
    /// them. Default: `0`.
    pub zero: ZeroStage,
    /// Where AdamW's moments live and its update runs (as DeepSpeed's `offload_optimizer` and
    /// ZeRO-Offload): `"none"` beside the parameters; `"optimizer"` in host memory, each
    /// step copying the values this rank updates (its shard under `zero` 1-3, all of them
    /// otherwise) and their gradients to the host and the values back, the update on the
    /// host's threads (`OMP_NUM_THREADS`): a GPU then keeps no moments, 8 bytes per value
    /// less, for three copies per value a step (row-sparse tables whole). With `zero =
    /// "auto"` stage 1 or 2 is taken before stage 0, where every rank would keep the whole
    /// moments in host memory. The same numbers (bit for bit on CPUs, where it
    /// adds only the copies). Row-sparse tables kept once per host (`shared_tables`,
    /// `shard_optimizer`) keep their moments there. Default: `"none"`.
    pub offload: OffloadKind,
    /// Refuse to run when the run id is no secret (a multi-node run given none, so torchrun's
    /// public `none`, or one derived from the Slurm job), instead of warning that anyone who
    /// reaches the rendezvous can join. `launch` checks it before starting, the worker again
    /// (under torchrun too). Default: `false`.
    pub require_secret: bool,
}

impl DistConfig {
    /// The limit of rendezvous and set-up, with the key that sets it (for messages).
    pub fn rendezvous_timeout(&self) -> (std::time::Duration, &'static str) {
        match self.rendezvous_timeout_s {
            Some(secs) => (
                std::time::Duration::from_secs(secs),
                "dist.rendezvous_timeout_s",
            ),
            None => (
                std::time::Duration::from_secs(self.timeout_s),
                "dist.timeout_s",
            ),
        }
    }
}

impl Default for DistConfig {
    fn default() -> Self {
        DistConfig {
            backend: Backend::Auto,
            timeout_s: 300,
            rendezvous_timeout_s: None,
            bucket_mb: 25.0,
            check_params_every: 0,
            shared_memory: true,
            sparse_embeddings: true,
            shared_tables: true,
            shard_optimizer: true,
            overlap_backward: false,
            zero: ZeroStage::Stage(0),
            offload: OffloadKind::NoOffload,
            require_secret: false,
        }
    }
}

/// `[checkpoint]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointConfig {
    /// Also save every N optimizer steps (0 = only at the end of each epoch). Default: `0`.
    pub every_n_steps: u64,
    /// Checkpoints kept on disk, newest first (>= 1). Default: `3`.
    pub keep: u32,
    /// `"auto"` (continue from `<run dir>/checkpoints/latest` when present), `"never"`, or the
    /// path of a checkpoint directory (`.../step-000123`), of a `checkpoints` directory or of a
    /// run directory (its newest checkpoint). A path in this run's own `checkpoints` continues the run from there. A path in another
    /// run's starts this run from that checkpoint's weights at step 0 (fine-tuning: the model
    /// must be the same, the data, batch and seed may differ), unless this run has a checkpoint
    /// of its own, which it then continues from. Default: `"auto"`.
    pub resume: String,
    /// When `resume` starts this run from another run's checkpoint: also take that run's AdamW
    /// moments (`false`: a fresh optimizer, as fine-tuning usually wants). A run continuing from
    /// its own checkpoint always takes them. Default: `false`.
    pub load_optimizer: bool,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        CheckpointConfig {
            every_n_steps: 0,
            keep: 3,
            resume: "auto".to_string(),
            load_optimizer: false,
        }
    }
}

/// Largest config file read: configs are a few KiB; anything bigger is a mistake.
const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// A config file's text. A FIFO, a device or a directory is refused without blocking on it
/// (`crate::files`), as is a file over 1 MiB.
fn read_config_text(path: &Path) -> std::io::Result<String> {
    use crate::files::InputError;
    use std::io::Read as _;
    let (file, _) = crate::files::open_input(path, MAX_CONFIG_BYTES).map_err(|e| match e {
        InputError::Missing { .. } => std::io::Error::from_raw_os_error(libc::ENOENT),
        InputError::NotAFile {
            what: "a directory",
            ..
        } => std::io::Error::other("it is a directory"),
        InputError::NotAFile { .. } => {
            std::io::Error::other("it is not a regular file (a FIFO, socket or device)")
        }
        InputError::TooLarge { size, max, .. } => {
            std::io::Error::other(format!("it is {size} bytes, more than a config's {max}"))
        }
        InputError::Io { error, .. } => error,
    })?;
    let mut text = String::new();
    file.take(MAX_CONFIG_BYTES + 1).read_to_string(&mut text)?;
    Ok(text)
}

impl Config {
    /// Reads `path`, applies `--set key.path=value` overrides in order, deserialises, validates.
    pub fn load(path: &Path, overrides: &[String]) -> Result<Config, ConfigError> {
        let origin = path.display().to_string();
        let text = read_config_text(path).map_err(|source| ConfigError::Read {
            path: origin.clone(),
            source,
        })?;
        Config::parse(&text, &origin, overrides)
    }

    /// Same as [`Config::load`] from text; `origin` names the file in messages.
    ///
    /// The file alone must be a valid config (so that errors point into it); overrides are
    /// then applied as TOML values (`8`, `1e-3`, `true`, `"x"`, `[1, 2]`), or as plain strings
    /// when the value is not TOML or the key wants a string (`--set run.name=exp1`). Overrides
    /// create missing tables. Keys in overrides are dotted bare keys (no quoting).
    pub fn parse(text: &str, origin: &str, overrides: &[String]) -> Result<Config, ConfigError> {
        let file = Source::parse(text, origin)?;
        let mut overrides = overrides
            .iter()
            .map(|o| Override::parse(o))
            .collect::<Result<Vec<_>, _>>()?;

        // Pass 1: the file alone, so spans point into the user's text.
        let mut from_file: Config = toml::from_str(text)
            .map_err(|e| classify(e, &file, |_, span| file.location(span)).error)?;
        if overrides.is_empty() {
            from_file.resolve_asset_names();
            from_file
                .validate()
                .map_err(|e| locate_semantic(e, &file, &[]))?;
            return Ok(from_file);
        }

        // Pass 2: overrides applied to the file's table; errors blamed on the override that
        // touched the key.
        let config = loop {
            match apply_overrides(&file, &overrides) {
                Ok(config) => break config,
                Err(failure) => {
                    let Some(i) = failure.retry_as_string else {
                        return Err(*failure.error);
                    };
                    let mut trial = overrides.clone();
                    trial[i].use_raw_string();
                    match apply_overrides(&file, &trial) {
                        Ok(config) => break config,
                        Err(second) if second.blamed == Some(i) => return Err(*failure.error),
                        Err(_) => overrides = trial,
                    }
                }
            }
        };
        let mut config = config;
        config.resolve_asset_names();
        config
            .validate()
            .map_err(|e| locate_semantic(e, &file, &overrides))?;
        Ok(config)
    }

    /// `data.dir` and `model.gpt2_weights` written as a name `fetch` knows (`"ml-1m"`,
    /// `"gpt2"`) become that download's directory in the cache (see [`crate::assets`]).
    fn resolve_asset_names(&mut self) {
        use crate::assets::{resolve, AssetKind};
        if let Some(dir) = &mut self.data.dir {
            *dir = resolve(dir, AssetKind::Dataset);
        }
        if let Some(weights) = &mut self.model.gpt2_weights {
            *weights = resolve(weights, AssetKind::Model);
        }
    }

    /// The config as TOML text (for `config.resolved.toml`); `parse(to_toml())` gives it back.
    /// Fails only for values TOML cannot hold (a path that is not UTF-8).
    pub fn to_toml(&self) -> Result<String, ConfigError> {
        let fail = |message: String| ConfigError::Serialize {
            message: one_line(&message),
        };
        let text = toml::to_string(self).map_err(|e| fail(e.to_string()))?;
        // Guarantee the promise: what is written reads back the same.
        let back: Config = toml::from_str(&text).map_err(|e| {
            let line = e
                .span()
                .and_then(|s| text.get(..s.start))
                .map(|before| before.lines().count().max(1))
                .and_then(|n| text.lines().nth(n - 1))
                .unwrap_or("")
                .trim();
            fail(format!("`{line}` does not read back ({})", e.message()))
        })?;
        match toml::to_string(&back) {
            Ok(again) if again == text => Ok(text),
            _ => Err(fail(
                "the written config does not read back the same".to_string(),
            )),
        }
    }
}

/// Splits `"name@K"` into its name and K, checking the name and that K is in `topk`.
pub fn parse_metric(metric: &str, topk: &[usize]) -> Result<(String, usize), String> {
    let bad = || {
        format!(
            "must be name@K with name one of {} and K one of eval.topk {topk:?} (got {metric:?})",
            METRIC_NAMES.join(", ")
        )
    };
    let (name, k) = metric.trim().split_once('@').ok_or_else(bad)?;
    let name = name.trim().to_ascii_lowercase();
    let k: usize = k.trim().parse().map_err(|_| bad())?;
    if !METRIC_NAMES.contains(&name.as_str()) || !topk.contains(&k) {
        return Err(bad());
    }
    Ok((name, k))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const ORIGIN: &str = "configs/x.toml";

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse(text, ORIGIN, &[])
    }

    fn parse_with(text: &str, sets: &[&str]) -> Result<Config, ConfigError> {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        Config::parse(text, ORIGIN, &sets)
    }

    fn err(text: &str) -> String {
        let e = parse(text).expect_err("should fail");
        let s = e.to_string();
        assert!(!s.contains('\n'), "multi-line message: {s:?}");
        s
    }

    fn err_with(text: &str, sets: &[&str]) -> String {
        let e = parse_with(text, sets).expect_err("should fail");
        let s = e.to_string();
        assert!(!s.contains('\n'), "multi-line message: {s:?}");
        s
    }

    const MINIMAL: &str = "[batch]\nglobal = 64\nmicro = 16\n";

    /// Each `(text, message)`: parsing the file `text` fails with `message`.
    fn assert_errors(cases: &[(&str, &str)]) {
        for &(text, message) in cases {
            assert_eq!(err(text), message, "file {text:?}");
        }
    }

    /// Each `(set, message)`: `--set set` on [`MINIMAL`] fails with `message`.
    fn assert_override_errors(cases: &[(&str, &str)]) {
        for &(set, message) in cases {
            assert_eq!(err_with(MINIMAL, &[set]), message, "--set {set}");
        }
    }

    fn valid() -> Config {
        let mut c = Config::default();
        c.batch.global = Some(64);
        c.batch.micro = Some(16);
        c
    }

    #[test]
    fn defaults() {
        let c = Config::default();
        assert_eq!(c.run.name, "default");
        assert_eq!(c.run.output_dir, PathBuf::from("runs"));
        assert_eq!(c.run.seed, 42);
        assert_eq!(c.data.dir, None);
        assert_eq!(c.data.synthetic, SyntheticSize::Tiny);
        assert_eq!(c.data.min_rating, 3);
        assert_eq!(c.model.kind, ModelKind::Gpt2rec);
        assert_eq!(c.model.preset, Gpt2Preset::Tiny);
        assert_eq!(c.model.embedding_dim, 64);
        assert_eq!(c.model.text_mode, TextMode::Cached);
        assert_eq!(c.model.gpt2_weights, None);
        assert_eq!(c.train.epochs, 1);
        assert_eq!(c.train.lr, 1e-3);
        assert_eq!(c.train.weight_decay, 0.0);
        assert_eq!(c.train.warmup_steps, 0);
        assert_eq!(c.train.max_grad_norm, 1.0);
        assert_eq!(c.batch, BatchSpec::default());
        assert_eq!(c.dist.backend, Backend::Auto);
        assert_eq!(c.dist.timeout_s, 300);
        // Only [batch] is needed; everything else falls back to the defaults above.
        assert_eq!(parse(MINIMAL).unwrap(), valid());
    }

    #[test]
    fn empty_batch_is_reported_against_the_file() {
        assert_errors(&[
            ("", "configs/x.toml: [batch] needs two of global, micro, grad_accum (none given)"),
            (
                "[run]\nseed = 1\n\n[batch]\ngrad_accum = 2\n",
                "configs/x.toml:4: [batch] needs two of global, micro, grad_accum (only grad_accum 2 given)",
            ),
        ]);
    }

    #[test]
    fn full_file_parses() {
        let text = r#"
[run]
name = "exp"
output_dir = "/tmp/out"
seed = 7

[data]
dir = "data/ml-1m"
synthetic = "full"
min_rating = 4

[model]
kind = "bpr"
preset = "gpt2"
embedding_dim = 32
text_mode = "dynamic"
gpt2_weights = "w/model.safetensors"

[train]
epochs = 3
lr = 3e-4
weight_decay = 0.01
warmup_steps = 100
max_grad_norm = 0.5

[batch]
global = 48
micro = 8
grad_accum = 3

[dist]
backend = "nccl"
timeout_s = 60
"#;
        let c = parse(text).unwrap();
        assert_eq!(c.run.name, "exp");
        assert_eq!(c.run.output_dir, PathBuf::from("/tmp/out"));
        assert_eq!(c.data.dir, Some(PathBuf::from("data/ml-1m")));
        assert_eq!(c.data.synthetic, SyntheticSize::Full);
        assert_eq!(c.data.min_rating, 4);
        assert_eq!(c.model.kind, ModelKind::Bpr);
        assert_eq!(c.model.preset, Gpt2Preset::Gpt2);
        assert_eq!(c.model.text_mode, TextMode::Dynamic);
        assert_eq!(
            c.model.gpt2_weights,
            Some(PathBuf::from("w/model.safetensors"))
        );
        assert_eq!(c.train.lr, 3e-4);
        assert_eq!(c.train.warmup_steps, 100);
        assert_eq!(c.batch.grad_accum, Some(3));
        assert_eq!(c.dist.backend, Backend::Nccl);
        assert_eq!(c.dist.timeout_s, 60);
        assert_eq!(c.batch.resolve(2).unwrap().grad_accum, 3);
        assert_eq!(c.batch.resolve(1).unwrap_err().key_path(), "batch");
        assert_eq!(c.batch.resolve(1).unwrap_err().suggestions().len(), 3);
    }

    #[test]
    fn unreadable_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.toml");
        let e = Config::load(&path, &[]).unwrap_err();
        assert!(matches!(e, ConfigError::Read { .. }));
        assert_eq!(
            e.to_string(),
            format!(
                "cannot read {}: No such file or directory (os error 2)",
                path.display()
            )
        );
    }

    #[test]
    fn load_reads_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.toml");
        std::fs::write(&path, "[batch]\nmicro = 4\n\n[train]\nlr = -1\n").unwrap();
        let e = Config::load(&path, &[]).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("{}:5: `train.lr` must be > 0 (got -1)", path.display())
        );
        let c = Config::load(&path, &["train.lr=0.5".to_string()]).unwrap();
        assert_eq!(c.train.lr, 0.5);
    }

    #[test]
    fn syntax_error_has_line_and_column() {
        let e = parse("[run]\nname = \"x\"\nseed = = 3\n").unwrap_err();
        assert!(matches!(e, ConfigError::Syntax { .. }));
        let s = e.to_string();
        assert!(s.starts_with("configs/x.toml:3:8: invalid TOML: "), "{s}");
        assert!(!s.contains('\n'));
        // Unterminated string on line 2.
        let s = err("[run]\nname = \"x\n");
        assert!(s.starts_with("configs/x.toml:2:"), "{s}");
        assert!(s.contains("invalid TOML: "), "{s}");
        // Duplicate key.
        let s = err("[batch]\nmicro = 1\nmicro = 2\n");
        assert!(s.starts_with("configs/x.toml:3:1: invalid TOML: "), "{s}");
    }

    #[test]
    fn unknown_key_names_section_and_expected_keys() {
        let text = "[run]\nname = \"x\"\n\n[batch]\nglobal = 64\nmicr = 8\n";
        let e = parse(text).unwrap_err();
        assert_eq!(
            e.to_string(),
            "configs/x.toml:6:1: unknown key `micr` in [batch] (expected one of: global, micro, grad_accum, max_micro)"
        );
        match e {
            ConfigError::UnknownKey {
                key,
                section,
                expected,
                at,
            } => {
                assert_eq!(key, "micr");
                assert_eq!(section, "batch");
                assert_eq!(expected, vec!["global", "micro", "grad_accum", "max_micro"]);
                assert_eq!(
                    at,
                    Location::File {
                        file: ORIGIN.into(),
                        line: Some(6),
                        column: Some(1)
                    }
                );
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn unknown_key_variants() {
        assert_errors(&[
            (
                "[batch]\nmicro = 4\n\n[dist]\n  backnd = \"tcp\"\n",
                "configs/x.toml:5:3: unknown key `backnd` in [dist] (expected one of: backend, timeout_s, rendezvous_timeout_s, bucket_mb, check_params_every, shared_memory, sparse_embeddings, shared_tables, shard_optimizer, overlap_backward, zero, offload, require_secret)",
            ),
            (
                "[batch]\nmicro = 4\n[optim]\nlr = 1\n",
                "configs/x.toml:3:2: unknown key `optim` at the top level (expected one of: run, data, model, train, batch, dist, checkpoint, eval)",
            ),
            (
                "epochs = 3\n[batch]\nmicro = 4\n",
                "configs/x.toml:1:1: unknown key `epochs` at the top level (expected one of: run, data, model, train, batch, dist, checkpoint, eval)",
            ),
            // Dotted keys and inline tables.
            (
                "batch.micr = 4\n",
                "configs/x.toml:1:7: unknown key `micr` in [batch] (expected one of: global, micro, grad_accum, max_micro)",
            ),
            (
                "batch = { micro = 4 }\ntrain = { lrr = 1 }\n",
                "configs/x.toml:2:11: unknown key `lrr` in [train] (expected one of: epochs, lr, weight_decay, warmup_steps, max_grad_norm, lr_schedule, min_lr, scale_lr_with_world, bf16, tf32, loss, negatives, negative_power)",
            ),
        ]);
    }

    #[test]
    fn wrong_type_and_bad_enum() {
        let text = "[batch]\nmicro = 4\n\n[model]\nkind = \"gpt3\"\n";
        assert!(matches!(parse(text), Err(ConfigError::WrongValue { .. })));
        assert_errors(&[
            (
                text,
                "configs/x.toml:5:8: `model.kind`: unknown variant `gpt3`, expected one of `gpt2rec`, `bpr`, `pop`",
            ),
            (
                "[batch]\nmicro = \"8\"\n",
                "configs/x.toml:2:9: `batch.micro`: must be a number of samples or \"auto\" (got \"8\")",
            ),
            (
                "[batch]\nmicro = 4\n[train]\nepochs = -2\n",
                "configs/x.toml:4:10: `train.epochs`: invalid value: integer `-2`, expected u32",
            ),
            (
                "[batch]\nmicro = 4\n[data]\nmin_rating = 300\n",
                "configs/x.toml:4:14: `data.min_rating`: invalid value: integer `300`, expected u8",
            ),
            (
                "batch = 5\n",
                "configs/x.toml:1:9: `batch`: invalid type: integer `5`, expected struct BatchSpec",
            ),
            (
                "[batch]\nmicro = 4\n[model]\npreset = \"large\"\n",
                "configs/x.toml:4:10: `model.preset`: unknown variant `large`, expected `tiny` or `gpt2`",
            ),
        ]);
    }

    #[test]
    fn semantic_errors_point_at_the_key_line() {
        let text = "[batch]\nmicro = 4\n\n[train]\nepochs = 2\nlr = -1\n";
        assert!(matches!(
            parse(text),
            Err(ConfigError::Invalid {
                at: Location::File {
                    line: Some(6),
                    column: None,
                    ..
                },
                ..
            })
        ));
        assert_errors(&[
            (text, "configs/x.toml:6: `train.lr` must be > 0 (got -1)"),
            (
                "[batch]\nglobal = 8\nmicro = 0\n",
                "configs/x.toml:3: `batch.micro` must be >= 1 (got 0)",
            ),
            (
                "[batch]\nmicro = 4\n[data]\nmin_rating = 0\n",
                "configs/x.toml:4: `data.min_rating` must be between 1 and 5 (got 0)",
            ),
            (
                "[batch]\nmicro = 4\n[data]\ncold_items = 0.7\n",
                "configs/x.toml:4: `data.cold_items` must be a share between 0 and 0.5 (got 0.7)",
            ),
            (
                "[batch]\nmicro = 4\n[data]\ncold_users = -0.1\n",
                "configs/x.toml:4: `data.cold_users` must be a share between 0 and 0.5 (got -0.1)",
            ),
            (
                "[batch]\nmicro = 4\n[train]\nlr = inf\n",
                "configs/x.toml:4: `train.lr` must be a finite number > 0 (got inf)",
            ),
            (
                "[batch]\nmicro = 4\n[train]\nweight_decay = -0.1\n",
                "configs/x.toml:4: `train.weight_decay` must be >= 0 and finite (got -0.1)",
            ),
            (
                "[batch]\nmicro = 4\n[train]\nmax_grad_norm = 0.0\n",
                "configs/x.toml:4: `train.max_grad_norm` must be > 0 (got 0)",
            ),
            (
                "[batch]\nmicro = 4\n[train]\nepochs = 0\n",
                "configs/x.toml:4: `train.epochs` must be >= 1 (got 0)",
            ),
            (
                "[batch]\nmicro = 4\n[model]\nembedding_dim = 0\n",
                "configs/x.toml:4: `model.embedding_dim` must be >= 1 (got 0)",
            ),
            (
                "[batch]\nmicro = 4\n[dist]\ntimeout_s = 0\n",
                "configs/x.toml:4: `dist.timeout_s` must be >= 1 (got 0)",
            ),
            (
                "[batch]\nmicro = 4\n[run]\nname = \"a/b\"\n",
                "configs/x.toml:4: `run.name` must be a plain directory name (no `/`, `\\`, surrounding spaces, not `.` or `..`) (got \"a/b\")",
            ),
            (
                "[batch]\nmicro = 4\n[run]\nname = \"\"\n",
                "configs/x.toml:4: `run.name` must not be empty",
            ),
            (
                "[batch]\nmicro = 4\n[data]\ndir = \"\"\n",
                "configs/x.toml:4: `data.dir` must not be empty (leave it out to generate synthetic data)",
            ),
        ]);
    }

    #[test]
    fn item_item_needs_a_history() {
        let err = parse_with(MINIMAL, &["model.item_item=true"])
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "--set model.item_item=true: `model.item_item` pools a user's history: set model.user_tower = \"history\" or \"both\""
        );
        let c = parse_with(
            MINIMAL,
            &["model.user_tower=\"both\"", "model.item_item=true"],
        )
        .unwrap();
        assert!(c.model.item_item);
        assert!(
            !parse_with(MINIMAL, &[]).unwrap().model.item_item,
            "off by default"
        );
    }

    #[test]
    fn history_dropout_needs_a_history_and_a_share_below_one() {
        let err = |sets: &[&str]| parse_with(MINIMAL, sets).unwrap_err().to_string();
        assert_eq!(
            err(&["model.history_dropout=0.2"]),
            "--set model.history_dropout=0.2: `model.history_dropout` does nothing: model.user_tower is \"id\" (no history is pooled); remove it"
        );
        let history = "model.user_tower=\"history\"";
        for bad in ["1.0", "-0.1", "nan"] {
            let set = format!("model.history_dropout={bad}");
            assert!(
                err(&[history, &set]).contains("must be at least 0 and below 1"),
                "{bad}"
            );
        }
        let c = parse_with(MINIMAL, &[history, "model.history_dropout=0.25"]).unwrap();
        assert_eq!(c.model.history_dropout, 0.25);
    }

    #[test]
    fn offload_is_none_or_the_optimizer() {
        let offload = |sets: &[&str]| parse_with(MINIMAL, sets).map(|c| c.dist.offload);
        assert_eq!(offload(&[]).unwrap(), OffloadKind::NoOffload);
        assert_eq!(
            offload(&["dist.offload=\"none\""]).unwrap(),
            OffloadKind::NoOffload
        );
        assert_eq!(
            offload(&["dist.offload=\"optimizer\""]).unwrap(),
            OffloadKind::Optimizer
        );
        let err = |sets: &[&str]| parse_with(MINIMAL, sets).unwrap_err().to_string();
        assert_eq!(
            err(&["dist.offload=\"cpu\""]),
            "--set dist.offload=\"cpu\": `dist.offload`: unknown variant `cpu`, expected `none` or `optimizer`"
        );
    }

    #[test]
    fn zero_is_a_stage_that_is_built_or_auto() {
        let err = |sets: &[&str]| parse_with(MINIMAL, sets).unwrap_err().to_string();
        assert_eq!(
            err(&["dist.zero=4"]),
            "--set dist.zero=4: `dist.zero`: must be 0, 1, 2, 3 or \"auto\" (got 4)"
        );
        assert!(err(&["dist.zero=\"most\""]).contains("(got \"most\")"));
        assert!(err(&["dist.zero=-1"]).contains("(got -1)"));
        let zero = |sets: &[&str]| parse_with(MINIMAL, sets).unwrap().dist.zero;
        assert_eq!(zero(&[]), ZeroStage::Stage(0));
        assert_eq!(zero(&["dist.zero=1"]), ZeroStage::Stage(1));
        assert_eq!(zero(&["dist.zero=2"]), ZeroStage::Stage(2));
        assert_eq!(zero(&["dist.zero=3"]), ZeroStage::Stage(3));
        assert_eq!(zero(&["dist.zero=\"auto\""]), ZeroStage::Auto);
        // In a file, the error names the value's place.
        let e = super::tests::err("[batch]\nmicro = 4\n[dist]\nzero = \"x\"\n");
        assert!(e.starts_with("configs/x.toml:4:8: `dist.zero`"), "{e}");
    }

    #[test]
    fn the_loss_and_its_negatives_are_checked() {
        let err = |sets: &[&str]| parse_with(MINIMAL, sets).unwrap_err().to_string();
        let softmax = "train.loss=\"softmax\"";
        assert_eq!(
            err(&["train.negatives=64"]),
            "--set train.negatives=64: `train.negatives` does nothing: train.loss is \"bpr\" (one negative per positive); remove it"
        );
        assert!(err(&[softmax, "train.negative_power=0.75"]).contains(
            "`train.negative_power` does nothing: train.negatives = 0 ranks against every item"
        ));
        assert!(
            err(&[softmax, "train.negatives=8", "train.negative_power=-1.0"])
                .contains("`train.negative_power` must be >= 0 and finite (got -1)")
        );
        let dynamic = err(&[softmax, "model.text_mode=\"dynamic\""]);
        assert!(dynamic.contains(
            "`train.negatives` = 0 (the full softmax) would run GPT-2 over every item's text"
        ));
        assert!(dynamic.ends_with("(train.negatives = 256, say) or train.loss = \"bpr\""));
        assert!(err(&["train.loss=\"hinge\""]).contains("train.loss"));
        let c = parse_with(
            MINIMAL,
            &[softmax, "train.negatives=256", "train.negative_power=0.75"],
        )
        .unwrap();
        assert_eq!(
            (c.train.loss, c.train.negatives, c.train.negative_power),
            (LossKind::Softmax, 256, 0.75)
        );
        assert!(parse_with(
            MINIMAL,
            &[softmax, "model.text_mode=\"dynamic\"", "train.negatives=16"]
        )
        .is_ok());
    }

    #[test]
    fn eval_and_model_keys_are_checked() {
        let err = |sets: &[&str]| parse_with(MINIMAL, sets).unwrap_err().to_string();
        assert_eq!(
            err(&["eval.metric=\"ndcg@5\""]),
            "--set eval.metric=\"ndcg@5\": `eval.metric` must be name@K with name one of recall, ndcg, mrr, hit, precision and K one of eval.topk [10, 20] (got \"ndcg@5\")"
        );
        assert!(err(&["eval.metric=\"auc@10\""]).contains("`eval.metric` must be name@K"));
        assert!(err(&["eval.topk=[]"]).contains("`eval.topk` must list at least one cut-off"));
        assert!(err(&["eval.topk=[10, 10]"]).contains("lists 10 twice"));
        assert!(err(&["eval.topk=[0]"]).contains("cut-offs must be >= 1"));
        assert!(err(&["eval.every_n_epochs=0"]).contains("`eval.every_n_epochs` must be >= 1"));
        assert!(err(&["eval.ease_reg=-1.0"]).contains("`eval.ease_reg` must be >= 0 and finite"));
        assert!(parse_with(MINIMAL, &["eval.ease_reg=0.0"]).is_ok());
        assert!(err(&["model.l2=-1"]).contains("`model.l2` must be >= 0"));
        assert!(err(&["model.max_text_tokens=200"])
            .contains("`model.max_text_tokens` must be between 1 and 128 (the tiny preset's positions) (got 200)"));
        assert!(parse_with(
            MINIMAL,
            &["model.max_text_tokens=200", "model.preset=\"gpt2\""]
        )
        .is_ok());
        assert!(err(&["model.kind=\"bpr\"", "model.max_text_tokens=2000"])
            .contains("between 1 and 1024 (GPT-2's positions)"));
        let dynamic = "model.text_mode=\"dynamic\"";
        assert!(err(&[dynamic, "model.trainable_layers=3"])
            .contains("`model.trainable_layers` is 3, but the tiny preset has 2 blocks"));
        assert!(err(&["model.trainable_layers=1"])
            .contains("`model.trainable_layers` does nothing: model.text_mode is \"cached\""));
        assert!(err(&["model.kind=\"bpr\"", "model.freeze_gpt2=true"])
            .contains("`model.freeze_gpt2` does nothing: model.kind is not \"gpt2rec\""));
        assert!(parse_with(MINIMAL, &[dynamic, "model.freeze_gpt2=true"]).is_ok());
        assert!(err(&["model.freeze_gpt2=true", "model.trainable_layers=2"])
            .contains("contradicts model.freeze_gpt2"));
        assert!(err(&["model.activation_checkpointing=true"]).contains(
            "`model.activation_checkpointing` has nothing to checkpoint: model.text_mode is \"cached\""
        ));
        assert!(err(&[
            "model.text_mode=\"dynamic\"",
            "model.trainable_layers=0",
            "model.activation_checkpointing=true"
        ])
        .contains("no GPT-2 block trains"));
        assert!(
            err(&["model.kind=\"bpr\"", "model.activation_checkpointing=true"])
                .contains("model.kind is not \"gpt2rec\"")
        );
        let c = parse_with(
            MINIMAL,
            &[
                "model.text_mode=\"dynamic\"",
                "model.trainable_layers=1",
                "model.activation_checkpointing=true",
            ],
        )
        .unwrap();
        assert!(c.model.activation_checkpointing);
        assert!(err(&["model.scorer=\"cosine\""]).contains("unknown variant `cosine`"));
        let c = parse_with(MINIMAL, &["eval.topk=[5, 50]", "eval.metric=\"Recall@50\""]).unwrap();
        assert_eq!(
            parse_metric(&c.eval.metric, &c.eval.topk),
            Ok(("recall".into(), 50))
        );
    }

    #[test]
    fn validate_without_source_has_no_location() {
        let mut c = valid();
        c.train.lr = -1.0;
        let e = c.validate().unwrap_err();
        assert_eq!(e.location(), Some(&Location::Unknown));
        assert_eq!(e.to_string(), "`train.lr` must be > 0 (got -1)");
        c.train.lr = f64::NAN;
        assert_eq!(
            c.validate().unwrap_err().to_string(),
            "`train.lr` must be a finite number > 0 (got NaN)"
        );
        assert!(valid().validate().is_ok());
    }

    #[test]
    fn override_of_each_type() {
        let c = parse_with(
            MINIMAL,
            &[
                "batch.micro=8",
                "train.lr=1e-4",
                "train.weight_decay=0",
                "run.name=exp1",
                "run.output_dir=\"out dir\"",
                "model.kind=bpr",
                "data.dir=/data/ml-1m",
                "dist.backend = tcp",
            ],
        )
        .unwrap();
        assert_eq!(c.batch.micro, Some(8));
        assert_eq!(c.train.lr, 1e-4);
        assert_eq!(c.train.weight_decay, 0.0);
        assert_eq!(c.run.name, "exp1");
        assert_eq!(c.run.output_dir, PathBuf::from("out dir"));
        assert_eq!(c.model.kind, ModelKind::Bpr);
        assert_eq!(c.data.dir, Some(PathBuf::from("/data/ml-1m")));
        assert_eq!(c.dist.backend, Backend::Tcp);
        // A whole table as an inline table, and the last override wins.
        let c = parse_with(
            MINIMAL,
            &["batch={ micro = 2, grad_accum = 4 }", "batch.micro=1"],
        )
        .unwrap();
        assert_eq!(
            c.batch,
            BatchSpec {
                global: None,
                micro: Some(1),
                grad_accum: Some(4),
                ..Default::default()
            }
        );
    }

    #[test]
    fn override_values_that_look_like_other_types_fall_back_to_strings() {
        let c = parse_with(
            MINIMAL,
            &["run.name=2024", "data.dir=123", "run.output_dir=true"],
        )
        .unwrap();
        assert_eq!(c.run.name, "2024");
        assert_eq!(c.data.dir, Some(PathBuf::from("123")));
        assert_eq!(c.run.output_dir, PathBuf::from("true"));
        let c = parse_with(MINIMAL, &["run.name=2024-01-01"]).unwrap();
        assert_eq!(c.run.name, "2024-01-01");
    }

    #[test]
    fn override_creates_missing_section() {
        let c = parse_with(MINIMAL, &["dist.timeout_s=5"]).unwrap();
        assert_eq!(c.dist.timeout_s, 5);
        let c = parse_with("", &["batch.global=32", "batch.micro=4"]).unwrap();
        assert_eq!(c.batch.resolve(2).unwrap().grad_accum, 4);
    }

    #[test]
    fn override_syntax_errors() {
        assert_override_errors(&[
            ("batchmicro", "--set batchmicro: expected key.path=value"),
            (
                "batch..micro=4",
                "--set batch..micro=4: expected key.path=value",
            ),
            ("=4", "--set =4: expected key.path=value"),
            (
                "batch.micro.x=4",
                "--set batch.micro.x=4: `batch.micro` is an integer, not a table",
            ),
        ]);
    }

    #[test]
    fn override_unknown_key() {
        let e = parse_with(MINIMAL, &["train.lr=0.1", "batch.micr=4"]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "--set batch.micr=4: unknown key `micr` in [batch] (expected one of: global, micro, grad_accum, max_micro)"
        );
        assert!(matches!(
            e,
            ConfigError::UnknownKey {
                at: Location::Override { .. },
                ..
            }
        ));
        assert_eq!(
            err_with(MINIMAL, &["optim.lr=4"]),
            "--set optim.lr=4: unknown key `optim` at the top level (expected one of: run, data, model, train, batch, dist, checkpoint, eval)"
        );
    }

    #[test]
    fn override_type_mismatch() {
        assert_override_errors(&[
            (
                "batch.micro=abc",
                "--set batch.micro=abc: `batch.micro`: must be a number of samples or \"auto\" (got \"abc\")",
            ),
            (
                "batch.micro=1.5",
                "--set batch.micro=1.5: `batch.micro`: invalid type: floating point `1.5`, expected a number of samples or \"auto\"",
            ),
            (
                "model.kind=gpt3",
                "--set model.kind=gpt3: `model.kind`: unknown variant `gpt3`, expected one of `gpt2rec`, `bpr`, `pop`",
            ),
            (
                "batch={ micro = \"x\" }",
                "--set batch={ micro = \"x\" }: `batch.micro`: must be a number of samples or \"auto\" (got \"x\")",
            ),
        ]);
    }

    #[test]
    fn override_semantic_errors_are_blamed_on_the_override() {
        assert_override_errors(&[
            (
                "train.lr=-1",
                "--set train.lr=-1: `train.lr` must be > 0 (got -1)",
            ),
            (
                "batch.micro=0",
                "--set batch.micro=0: `batch.micro` must be >= 1 (got 0)",
            ),
        ]);
        // A bad value in the file stays the file's fault when overrides touch other keys.
        let text = "[batch]\nmicro = 4\n[train]\nlr = -1\n";
        assert_eq!(
            err_with(text, &["train.epochs=3"]),
            "configs/x.toml:4: `train.lr` must be > 0 (got -1)"
        );
        // ...and an override can fix it.
        assert_eq!(parse_with(text, &["train.lr=0.1"]).unwrap().train.lr, 0.1);
        // A default that is invalid only because of the file is reported against the file.
        assert_eq!(
            err_with("[run]\nseed = 1\n", &["run.seed=2"]),
            "configs/x.toml: [batch] needs two of global, micro, grad_accum (none given)"
        );
    }

    #[test]
    fn file_errors_come_before_overrides() {
        assert_eq!(
            err_with("[batch]\nmicr = 4\n", &["batch.micro=4"]),
            "configs/x.toml:2:1: unknown key `micr` in [batch] (expected one of: global, micro, grad_accum, max_micro)"
        );
    }

    #[test]
    fn to_toml_round_trips() {
        let mut c = valid();
        c.data.dir = Some(PathBuf::from("data/ml-1m"));
        c.model.gpt2_weights = Some(PathBuf::from("gpt2/model.safetensors"));
        c.train.lr = 3e-4;
        c.train.weight_decay = 0.1;
        c.batch.grad_accum = Some(2);
        c.dist.backend = Backend::Nccl;
        let text = c.to_toml().unwrap();
        assert_eq!(Config::parse(&text, "resolved", &[]).unwrap(), c);

        let text = valid().to_toml().unwrap();
        assert!(!text.contains("\ndir ="), "{text}");
        assert!(!text.contains("gpt2_weights"), "{text}");
        assert!(!text.contains("grad_accum"), "{text}");
        assert_eq!(Config::parse(&text, "resolved", &[]).unwrap(), valid());
    }

    #[test]
    fn to_toml_reports_unrepresentable_values() {
        let mut c = valid();
        // toml reads back what it writes, even integers above 2^63 - 1.
        c.run.seed = u64::MAX;
        assert_eq!(Config::parse(&c.to_toml().unwrap(), "x", &[]).unwrap(), c);
        c.run.output_dir = non_utf8_path();
        let e = c.to_toml().unwrap_err();
        assert!(matches!(e, ConfigError::Serialize { .. }));
        assert!(!e.to_string().contains('\n'));
    }

    #[cfg(unix)]
    fn non_utf8_path() -> PathBuf {
        use std::os::unix::ffi::OsStrExt;
        PathBuf::from(std::ffi::OsStr::from_bytes(b"runs-\xff"))
    }

    #[cfg(not(unix))]
    fn non_utf8_path() -> PathBuf {
        PathBuf::from("runs")
    }

    #[test]
    fn default_toml_file_loads() {
        let path = Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../configs/default.toml"
        ));
        let c = Config::load(path, &[]).unwrap();
        assert_eq!(c.run.name, "default");
        assert_eq!(c.run.output_dir, PathBuf::from("runs"));
        assert_eq!(c.run.seed, 42);
        assert_eq!(c.data.dir, None);
        assert_eq!(c.data.synthetic, SyntheticSize::Small);
        assert_eq!(c.model.kind, ModelKind::Gpt2rec);
        assert_eq!(c.model.preset, Gpt2Preset::Tiny);
        assert_eq!(c.model.text_mode, TextMode::Cached);
        assert_eq!(c.model.embedding_dim, 64);
        assert_eq!(c.train.epochs, 6);
        assert_eq!(c.train.lr, 5e-3);
        assert_eq!(c.eval.topk, vec![10, 20]);
        assert_eq!(c.dist.backend, Backend::Auto);
        assert_eq!(c.dist.timeout_s, 120);
        // global 192 alone: micro = 192 / world on every common process count.
        for world in [1, 2, 3, 4, 6, 8] {
            let plan = c.batch.resolve(world).unwrap();
            assert_eq!((plan.micro * world, plan.grad_accum), (192, 1), "{world}");
        }
        assert_eq!(
            c.batch.resolve(2).unwrap().derivation(),
            "micro 96 x grad_accum 1 x world 2 = global 192"
        );
        let again = Config::parse(&c.to_toml().unwrap(), "resolved", &[]).unwrap();
        assert_eq!(again, c);
    }

    #[test]
    fn position_counts_characters() {
        let text = "# é\n[batch]\nmicro = 4\n[run]\nnam = \"é\"\n";
        assert_eq!(
            err(text),
            "configs/x.toml:5:1: unknown key `nam` in [run] (expected one of: name, output_dir, seed)"
        );
        let text = "[batch]\nmicro = 4\n[run]\nname = \"é\" x\n";
        assert!(err(text).starts_with("configs/x.toml:4:12: invalid TOML"));
    }

    fn path_strategy() -> impl Strategy<Value = PathBuf> {
        "[a-zA-Z0-9_./ -]{1,24}".prop_map(PathBuf::from)
    }

    fn finite_positive() -> impl Strategy<Value = f64> {
        prop_oneof![
            1e-12f64..1e6,
            Just(1e-3),
            Just(f64::MIN_POSITIVE),
            Just(1e300)
        ]
    }

    prop_compose! {
        fn arb_config()(
            name in "[a-zA-Z0-9_-][a-zA-Z0-9_.-]{0,15}",
            output_dir in path_strategy(),
            seed in any::<u64>(),
            dir in prop::option::of(path_strategy()),
            synthetic in prop_oneof![Just(SyntheticSize::Tiny), Just(SyntheticSize::Small), Just(SyntheticSize::Full)],
            min_rating in 1u8..=5,
            kind in prop_oneof![Just(ModelKind::Gpt2rec), Just(ModelKind::Bpr), Just(ModelKind::Pop)],
            preset in prop_oneof![Just(Gpt2Preset::Tiny), Just(Gpt2Preset::Gpt2)],
            embedding_dim in 1usize..=4096,
            text_mode in prop_oneof![Just(TextMode::Cached), Just(TextMode::Dynamic)],
            gpt2_weights in prop::option::of(path_strategy()),
            epochs in 1u32..=1000,
            lr in finite_positive(),
            weight_decay in prop_oneof![Just(0.0f64), 0.0f64..10.0],
            warmup_steps in any::<u64>(),
            max_grad_norm in finite_positive(),
            global in prop::option::of(1u64..=u64::MAX),
            micro in prop::option::of(1u64..=u64::MAX),
            grad_accum in prop::option::of(1u64..=4096),
            backend in prop_oneof![Just(Backend::Auto), Just(Backend::Tcp), Just(Backend::Nccl)],
            timeout_s in 1u64..=u64::MAX,
            rendezvous_timeout_s in prop::option::of(1u64..=u64::MAX),
            (lr_schedule, scale_lr_with_world) in (prop_oneof![Just(LrScheduleKind::Cosine), Just(LrScheduleKind::Linear), Just(LrScheduleKind::Constant)], any::<bool>()),
            (bucket_mb, check_params_every, shared_memory, sparse_embeddings, shared_tables, shard_optimizer, overlap_backward, require_secret, zero, offload) in (finite_positive(), any::<u64>(), any::<bool>(), any::<bool>(), any::<bool>(), any::<bool>(), any::<bool>(), any::<bool>(), prop_oneof![Just(ZeroStage::Stage(0)), Just(ZeroStage::Stage(1)), Just(ZeroStage::Stage(2)), Just(ZeroStage::Stage(3)), Just(ZeroStage::Auto)], prop_oneof![Just(OffloadKind::NoOffload), Just(OffloadKind::Optimizer)]),
            (every_n_steps, keep, resume, load_optimizer) in (any::<u64>(), 1u32..=100, prop_oneof![Just("auto".to_string()), Just("never".to_string()), "[a-z/]{1,12}"], any::<bool>()),
            (scorer, l2, max_text_tokens, trainable_layers) in (prop_oneof![Just(ScorerKind::Dot), Just(ScorerKind::Mlp)], prop_oneof![Just(0.0f64), 0.0f64..1.0], 1usize..=1024, prop::option::of(0u32..=48)),
            (topk, every_n_epochs, patience, batch_users, cold_items, cold_users) in (prop::collection::btree_set(1usize..=1000, 1..4), 1u32..=10, 0u32..=10, 1usize..=4096, prop_oneof![Just(0.0f64), 0.0f64..=0.5], prop_oneof![Just(0.0f64), 0.0f64..=0.5]),
        ) -> Config {
            // A directory (".", "a/..") is a model directory whose config.json validation reads;
            // the round trip is about the text.
            let gpt2_weights = gpt2_weights.filter(|p| !p.is_dir());
            let topk: Vec<usize> = topk.into_iter().collect();
            let metric = format!("recall@{}", topk[0]);
            let micro = if global.is_none() && micro.is_none() { Some(1) } else { micro };
            // Within what validation accepts: the preset's positions and blocks, and block
            // settings only where GPT-2 trains.
            let dims = crate::memory::Gpt2Dims::of(preset);
            let gpt2rec = kind == ModelKind::Gpt2rec;
            let max_text_tokens = if gpt2rec { max_text_tokens.min(dims.n_positions as usize) } else { max_text_tokens };
            let trainable_layers = trainable_layers
                .filter(|_| gpt2rec && text_mode == TextMode::Dynamic)
                .map(|n| n.min(dims.n_layer as u32));
            Config {
                run: RunConfig { name, output_dir, seed },
                data: DataConfig { dir, synthetic, min_rating, cold_items, cold_users, split_seed: None },
                model: ModelConfig { kind, preset, embedding_dim, text_mode, gpt2_weights, scorer, l2, text_l2: 1e-2, text_proj_init: TextProjInit::Zero, max_text_tokens, freeze_gpt2: false, trainable_layers, activation_checkpointing: false, user_tower: UserTower::Id, history_dropout: 0.0, item_item: false },
                train: TrainConfig { epochs, lr, weight_decay, warmup_steps, max_grad_norm, lr_schedule, min_lr: 0.0, scale_lr_with_world, bf16: false, tf32: true, ..Default::default() },
                batch: BatchSpec { global, micro, grad_accum, ..Default::default() },
                dist: DistConfig { backend, timeout_s, rendezvous_timeout_s, bucket_mb, check_params_every, shared_memory, sparse_embeddings, shared_tables, shard_optimizer, overlap_backward, zero, offload, require_secret },
                checkpoint: CheckpointConfig { every_n_steps, keep, resume, load_optimizer },
                eval: EvalConfig { topk, every_n_epochs, metric, patience, batch_users, ease_reg: 250.0 },
            }
        }
    }

    proptest! {
        #[test]
        fn to_toml_parse_round_trips(c in arb_config()) {
            prop_assume!(c.run.name != "." && c.run.name != "..");
            prop_assert!(c.validate().is_ok(), "{:?}", c.validate());
            let text = c.to_toml().unwrap();
            let back = Config::parse(&text, "resolved", &[]);
            prop_assert!(back.is_ok(), "{:?}\n{}", back, text);
            prop_assert_eq!(back.unwrap(), c);
        }

        #[test]
        fn arbitrary_text_never_panics(text in "\\PC{0,200}") {
            let _ = Config::parse(&text, ORIGIN, &[]);
        }

        #[test]
        fn arbitrary_overrides_never_panic(set in "[a-z_.=\\[\\]{}\" 0-9-]{0,40}") {
            let r = Config::parse(MINIMAL, ORIGIN, &[set]);
            if let Err(e) = r {
                prop_assert!(!e.to_string().contains('\n'));
            }
        }
    }
}
