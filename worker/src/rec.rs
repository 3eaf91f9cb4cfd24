//! The recommender as a training task: the data it trains on (ML-1M files or generated ones),
//! the model built from `[model]` (`gpt2rec` in `cached` or `dynamic` text mode, `bpr`), its
//! loss over a micro-batch of training pairs with negatives re-drawn every batch, and the
//! full-ranking evaluation with users split across ranks. The popularity baseline goes through
//! the same evaluation.
//!
//! It must not drive the training loop, write checkpoints or talk to the launcher: the trainer
//! (`train`) calls it through [`Task`]. All ranks call the collective parts (caching text
//! features, evaluation) together and in the same order.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::config::{Config, Gpt2Preset, ModelKind, ScorerKind, TextMode};
use common::memory::{DataShape, Phase, PhaseSink};
use tch::{nn, Device, Kind, Tensor};
use tracing::info;

use crate::data::{self, DataError, Dataset, RawData};
use crate::eval::{add_user, EvalError, MetricSums, Metrics};
use crate::model::gpt2::{self, Gpt2, Gpt2Error, Tokenizer};
use crate::model::recommender::{
    popularity_scores, RecConfig, Recommender, Scorer, Text, TextFeatures, TokenTable,
};
use crate::trainer::{Split, Task, TrainError};
use dist::collective::{Collective, CollectiveError, OpContext};

#[derive(Debug, thiserror::Error)]
pub enum RecError {
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    #[error(transparent)]
    Eval(#[from] EvalError),
    #[error(transparent)]
    Gpt2(#[from] Gpt2Error),
    #[error(transparent)]
    Torch(#[from] tch::TchError),
    #[error("{0}")]
    Invalid(String),
}

impl From<RecError> for TrainError {
    fn from(e: RecError) -> TrainError {
        match e {
            RecError::Collective(c) => TrainError::Collective(c),
            RecError::Torch(t) => TrainError::Torch(t),
            other => TrainError::Plan(other.to_string()),
        }
    }
}

/// The interactions and the metadata text of every (dense) user and item.
pub struct RecData {
    pub dataset: Dataset,
    pub user_texts: Vec<String>,
    pub item_texts: Vec<String>,
    /// Where the files came from, for logs.
    pub source: PathBuf,
}

impl RecData {
    /// Implicit feedback, split and texts from parsed ML-1M files.
    pub fn from_raw(raw: &RawData, min_rating: u8, seed: u64, source: PathBuf) -> RecData {
        let dataset = data::build_dataset(raw, min_rating, seed);
        let users: HashMap<u32, &data::User> = raw.users.iter().map(|u| (u.id, u)).collect();
        let movies: HashMap<u32, &data::Movie> = raw.movies.iter().map(|m| (m.id, m)).collect();
        // Every rated user and movie exists (the reader checks), so the lookups succeed.
        let user_texts = dataset
            .user_ids
            .iter()
            .map(|id| {
                users
                    .get(id)
                    .map_or_else(String::new, |u| data::user_text(u))
            })
            .collect();
        let item_texts = dataset
            .item_ids
            .iter()
            .map(|id| {
                movies
                    .get(id)
                    .map_or_else(String::new, |m| data::item_text(m))
            })
            .collect();
        RecData {
            dataset,
            user_texts,
            item_texts,
            source,
        }
    }

    /// Number of training interactions.
    pub fn train_interactions(&self) -> usize {
        self.dataset.train.iter().map(Vec::len).sum()
    }
}

/// Reads `data.dir`, or — when it is unset — synthetic data generated once into
/// `<output_dir>/data/synthetic-<size>-seed<seed>-v<generator version>/` (rank 0 first; a rank that still does not
/// see it after the barrier, e.g. on another machine, writes its own identical copy).
pub fn load_data(
    config: &Config,
    comm: &mut dyn Collective,
    ctx: OpContext,
) -> Result<RecData, RecError> {
    let dir = match &config.data.dir {
        Some(dir) => dir.clone(),
        None => {
            let size = format!("{:?}", config.data.synthetic).to_lowercase();
            let dir = config.run.output_dir.join("data").join(format!(
                "synthetic-{size}-seed{}-v{}",
                config.run.seed,
                data::GENERATOR_VERSION
            ));
            if comm.rank() == 0 {
                generate_once(&dir, config)?;
            }
            comm.barrier(ctx)?;
            generate_once(&dir, config)?;
            dir
        }
    };
    let raw = data::read_ml1m(&dir)?;
    Ok(RecData::from_raw(
        &raw,
        config.data.min_rating,
        config.run.seed,
        dir,
    ))
}

/// Generates the synthetic files into `dir` unless it exists: into a temporary sibling, then
/// renamed, so `dir` is either absent or complete.
fn generate_once(dir: &Path, config: &Config) -> Result<(), RecError> {
    if dir.join("ratings.dat").is_file() {
        return Ok(());
    }
    let parent = dir.parent().unwrap_or(Path::new("."));
    let io = |path: &Path, e: std::io::Error| RecError::Invalid(format!("{}: {e}", path.display()));
    std::fs::create_dir_all(parent).map_err(|e| io(parent, e))?;
    let tmp = parent.join(format!(
        ".{}.tmp-{}",
        dir.file_name().and_then(|n| n.to_str()).unwrap_or("data"),
        std::process::id()
    ));
    data::generate_ml1m(&tmp, config.data.synthetic, config.run.seed)?;
    match std::fs::rename(&tmp, dir) {
        Ok(()) => {
            info!("generated synthetic data into {}", dir.display());
            Ok(())
        }
        // Someone else finished first: theirs is identical.
        Err(_) if dir.join("ratings.dat").is_file() => {
            let _ = std::fs::remove_dir_all(&tmp);
            Ok(())
        }
        Err(e) => Err(io(dir, e)),
    }
}

/// GPT-2's config for a preset.
pub fn gpt2_config(preset: Gpt2Preset) -> gpt2::Config {
    match preset {
        Gpt2Preset::Tiny => gpt2::Config::tiny(),
        Gpt2Preset::Gpt2 => gpt2::Config::gpt2(),
    }
}

/// Builds GPT-2 under `path` and loads `model.gpt2_weights` into it when set. `vs` must be the
/// store `path` belongs to (weights are loaded through a temporary store when `path` is not its
/// root).
fn build_gpt2(
    vs: &nn::VarStore,
    prefix: Option<&str>,
    config: &Config,
    device: Device,
) -> Result<Gpt2, RecError> {
    let gcfg = gpt2_config(config.model.preset);
    if config.model.max_text_tokens as i64 > gcfg.n_positions {
        return Err(RecError::Invalid(format!(
            "model.max_text_tokens = {} exceeds the {:?} preset's {} positions",
            config.model.max_text_tokens, config.model.preset, gcfg.n_positions
        )));
    }
    let root = vs.root();
    let path = match prefix {
        Some(p) => &root / p,
        None => root,
    };
    let model = Gpt2::new(&path, &gcfg);
    if let Some(weights) = &config.model.gpt2_weights {
        let mut tmp = nn::VarStore::new(device);
        let _ = Gpt2::new(&tmp.root(), &gcfg);
        let report = gpt2::load_hf_safetensors(&mut tmp, weights).map_err(|e| {
            RecError::Invalid(format!("model.gpt2_weights = {}: {e}", weights.display()))
        })?;
        let ours: HashMap<String, Tensor> = vs.variables().into_iter().collect();
        tch::no_grad(|| -> Result<(), RecError> {
            for (name, value) in tmp.variables() {
                let key = match prefix {
                    Some(p) => format!("{p}.{name}"),
                    None => name.clone(),
                };
                let Some(var) = ours.get(&key) else {
                    return Err(RecError::Invalid(format!(
                        "GPT-2 variable {key} is missing"
                    )));
                };
                var.shallow_clone().f_copy_(&value)?;
            }
            Ok(())
        })?;
        info!(
            "loaded {} GPT-2 tensors from {}",
            report.loaded,
            weights.display()
        );
    }
    Ok(model)
}

/// Token tables of `texts` on `device`, each cut to `max_len` tokens.
fn token_table(tok: &Tokenizer, texts: &[String], max_len: usize, device: Device) -> TokenTable {
    let (ids, mask) = tok.encode_batch(texts, max_len);
    TokenTable {
        ids: ids.to_device(device),
        mask: mask.to_device(device),
    }
}

/// Rows of text GPT-2 encodes at once while caching features.
const CACHE_ROWS: usize = 64;

/// `cached` mode: every user's and item's text encoded once by a frozen GPT-2, the rows split
/// evenly across ranks and gathered, then standardised per feature (GPT-2's hidden states have
/// a few dimensions hundreds of times larger than the rest, which would swamp the projection)
/// and scaled to rows of norm about 1.
pub fn cached_text_features(
    config: &Config,
    data: &RecData,
    device: Device,
    comm: &mut dyn Collective,
    ctx: OpContext,
    phases: &dyn PhaseSink,
) -> Result<TextFeatures, RecError> {
    phases.enter(Phase::TextCaching);
    // The same weights on every rank by construction: drawn from the CPU generator with one
    // seed (or read from the file), then moved to the device. Drawn on each rank's GPU they
    // would agree only if every GPU's generator gave the same numbers, and nothing broadcasts
    // this encoder (it is not part of the trained model).
    tch::manual_seed(config.run.seed as i64);
    let mut vs = nn::VarStore::new(Device::Cpu);
    let gpt2 = build_gpt2(&vs, None, config, Device::Cpu)?;
    vs.set_device(device);
    let tok = Tokenizer::new()?;
    let mut encode = |texts: &[String]| -> Result<Tensor, RecError> {
        let (rank, world) = (comm.rank(), comm.world_size());
        let per_rank = texts.len().div_ceil(world).max(1);
        let start = (rank * per_rank).min(texts.len());
        let end = (start + per_rank).min(texts.len());
        let width = gpt2.config().n_embd;
        let mut parts = Vec::new();
        let _guard = tch::no_grad_guard();
        for chunk in texts[start..end].chunks(CACHE_ROWS) {
            let table = token_table(&tok, chunk, config.model.max_text_tokens, device);
            let hidden = gpt2.forward(&table.ids, &table.mask, false);
            parts.push(Gpt2::mean_pool(&hidden, &table.mask));
        }
        // Pad to the same number of rows everywhere (all_gather needs equal shapes).
        let mine = end - start;
        if mine < per_rank {
            parts.push(Tensor::zeros(
                [(per_rank - mine) as i64, width],
                (Kind::Float, device),
            ));
        }
        let mine = Tensor::cat(&parts, 0);
        let all = comm.all_gather(&mine, ctx)?;
        let all: Vec<Tensor> = all.iter().map(|t| t.to_device(device)).collect();
        let full = Tensor::cat(&all, 0).narrow(0, 0, texts.len() as i64);
        let mean = full.mean_dim([0i64].as_slice(), true, Kind::Float);
        let std = full.std_dim([0i64].as_slice(), false, true);
        // Unit-variance columns, then rows of norm ~1: projected, they start at the scale of
        // the ID embeddings instead of swamping them.
        Ok((full - mean) / (std + 1e-6) / (width as f64).sqrt())
    };
    let users = encode(&data.user_texts)?;
    let items = encode(&data.item_texts)?;
    phases.enter(Phase::ModelBuild);
    Ok(TextFeatures { users, items })
}

/// The data's shape for the memory estimate: counts from the data, and (when the model reads
/// text) the longest user and item text in tokens after `model.max_text_tokens`.
pub fn data_shape(config: &Config, data: &RecData) -> Result<DataShape, RecError> {
    let ds = &data.dataset;
    let mut shape = DataShape::assumed(config);
    shape.users = u64::from(ds.n_users);
    shape.items = u64::from(ds.n_items);
    shape.interactions = [&ds.train, &ds.valid, &ds.test]
        .iter()
        .map(|lists| lists.iter().map(Vec::len).sum::<usize>() as u64)
        .sum();
    shape.source = format!("measured on {}", data.source.display());
    if config.model.kind == ModelKind::Gpt2rec {
        let tok = Tokenizer::new()?;
        let cap = config.model.max_text_tokens;
        let longest = |texts: &[String]| -> u64 {
            texts
                .iter()
                .map(|t| tok.encode(t).len().min(cap))
                .max()
                .unwrap_or(1) as u64
        };
        shape.user_tokens = longest(&data.user_texts);
        shape.item_tokens = longest(&data.item_texts);
    }
    Ok(shape)
}

/// The recommender as a [`Task`]: BPR over (user, positive, negative) triples.
pub struct RecTask {
    model: Recommender,
    /// (user, positive item) of every training interaction; the sampler shards its indices.
    pairs: Vec<(u32, u32)>,
    train: Vec<Vec<u32>>,
    valid: Vec<Vec<u32>>,
    test: Vec<Vec<u32>>,
    /// Train ∪ valid per user: what a test ranking excludes.
    train_valid: Vec<Vec<u32>>,
    n_items: u32,
    l2: f64,
    device: Device,
    ks: Vec<usize>,
    batch_users: usize,
    hash: String,
    /// Forward passes under bf16 autocast (`train.bf16` on CUDA).
    bf16: bool,
}

impl RecTask {
    /// Builds the model of `config.model` (`gpt2rec` or `bpr`) in `vs`. Every rank calls it
    /// (cached mode encodes texts collectively, telling `phases` while it does).
    pub fn new(
        config: &Config,
        data: &RecData,
        vs: &nn::VarStore,
        device: Device,
        comm: &mut dyn Collective,
        ctx: OpContext,
        phases: &dyn PhaseSink,
    ) -> Result<RecTask, RecError> {
        let ds = &data.dataset;
        let text = match (config.model.kind, config.model.text_mode) {
            (ModelKind::Pop, _) => {
                return Err(RecError::Invalid(
                    "model.kind = \"pop\" has nothing to train".into(),
                ))
            }
            (ModelKind::Bpr, _) => Text::None,
            (ModelKind::Gpt2rec, TextMode::Cached) => Text::Cached(cached_text_features(
                config, data, device, comm, ctx, phases,
            )?),
            (ModelKind::Gpt2rec, TextMode::Dynamic) => {
                tch::manual_seed(config.run.seed as i64);
                let mut gpt2 = build_gpt2(vs, Some("gpt2"), config, device)?;
                freeze_gpt2_layers(vs, config, gpt2.config().n_layer);
                gpt2.set_activation_checkpointing(config.model.activation_checkpointing);
                let tok = Tokenizer::new()?;
                Text::Dynamic {
                    users: token_table(
                        &tok,
                        &data.user_texts,
                        config.model.max_text_tokens,
                        device,
                    ),
                    items: token_table(
                        &tok,
                        &data.item_texts,
                        config.model.max_text_tokens,
                        device,
                    ),
                    gpt2: Box::new(gpt2),
                }
            }
        };
        tch::manual_seed(config.run.seed as i64 + 1);
        let rec_config = RecConfig {
            n_users: i64::from(ds.n_users),
            n_items: i64::from(ds.n_items),
            dim: config.model.embedding_dim as i64,
            scorer: match config.model.scorer {
                ScorerKind::Dot => Scorer::Dot,
                ScorerKind::Mlp => Scorer::Mlp,
            },
        };
        let model = Recommender::new(&vs.root(), rec_config, text);
        if config.train.bf16 && device.is_cuda() {
            crate::model::autocast::use_bf16_autocast();
        }
        let pairs = ds
            .train
            .iter()
            .enumerate()
            .flat_map(|(u, items)| items.iter().map(move |&i| (u as u32, i)))
            .collect();
        let train_valid = train_and_valid(ds);
        Ok(RecTask {
            model,
            pairs,
            train: ds.train.clone(),
            valid: ds.valid.clone(),
            test: ds.test.clone(),
            train_valid,
            n_items: ds.n_items,
            l2: config.model.l2,
            device,
            ks: config.eval.topk.clone(),
            batch_users: config.eval.batch_users,
            hash: model_hash(config, ds),
            bf16: config.train.bf16 && device.is_cuda(),
        })
    }
}

impl RecTask {
    /// GPT-2 blocks recomputed during backward (activation checkpointing), 0 when off.
    pub fn checkpointed_blocks(&self) -> usize {
        self.model.checkpointed_blocks()
    }
}

/// Dynamic mode: `freeze_gpt2` freezes every GPT-2 variable; `trainable_layers = N` leaves only
/// the top N blocks and the final layer norm trainable.
fn freeze_gpt2_layers(vs: &nn::VarStore, config: &Config, n_layer: i64) {
    let keep = |name: &str| -> bool {
        if config.model.freeze_gpt2 {
            return false;
        }
        let Some(n) = config.model.trainable_layers else {
            return true;
        };
        if name.starts_with("gpt2.ln_f.") {
            return n > 0;
        }
        name.strip_prefix("gpt2.h.")
            .and_then(|rest| rest.split('.').next())
            .and_then(|i| i.parse::<i64>().ok())
            .is_some_and(|i| i >= n_layer - i64::from(n))
    };
    for (name, var) in vs.variables() {
        if name.starts_with("gpt2.") && !keep(&name) {
            let _ = var.set_requires_grad(false);
        }
    }
}

/// A fingerprint of what the checkpoint's tensors mean: the `[model]` section and the data's
/// shape (another data set gives other embedding tables).
fn model_hash(config: &Config, ds: &Dataset) -> String {
    use sha2::Digest;
    // Activation checkpointing changes how gradients are computed, not the model: a run may
    // turn it on and resume.
    let model = common::config::ModelConfig {
        activation_checkpointing: false,
        ..config.model.clone()
    };
    let text = format!(
        "{}/{}x{}",
        serde_json::to_string(&model).unwrap_or_default(),
        ds.n_users,
        ds.n_items
    );
    let digest = sha2::Sha256::digest(text.as_bytes());
    digest[..8].iter().map(|b| format!("{b:02x}")).collect()
}

impl Task for RecTask {
    fn train_len(&self) -> usize {
        self.pairs.len()
    }

    fn loss(&mut self, indices: &[usize]) -> Result<Tensor, tch::TchError> {
        // A previous micro-batch abandoned before its backward leaves nothing behind.
        self.model.discard_pending();
        // Negatives come from torch's generator, which the trainer reseeds every step: the
        // same numbers after a resume, different ones every batch.
        let mut state = Tensor::f_randint(i64::MAX, [1], (Kind::Int64, Device::Cpu))?
            .f_int64_value(&[0])? as u64;
        let n = indices.len();
        let (mut users, mut pos, mut neg) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        for &i in indices {
            let (u, p) = self.pairs[i];
            // A user who has every item in train has no negative: reuse the positive (the
            // pair then adds a constant to the loss and no gradient through the score).
            let negative = data::sample_negative(&self.train[u as usize], self.n_items, &mut state)
                .unwrap_or(p);
            users.push(i64::from(u));
            pos.push(i64::from(p));
            neg.push(i64::from(negative));
        }
        let t = |v: &[i64]| Tensor::from_slice(v).to_device(self.device);
        let (users, pos, neg) = (t(&users), t(&pos), t(&neg));
        Ok(crate::model::autocast::autocast(self.bf16, || {
            self.model.bpr_loss(&users, &pos, &neg, self.l2, true)
        }))
    }

    fn finish_backward(&mut self) -> Result<(), tch::TchError> {
        // The recompute runs under the forward's autocast setting.
        crate::model::autocast::autocast(self.bf16, || self.model.finish_backward())
    }

    fn model_hash(&self) -> String {
        self.hash.clone()
    }

    fn evaluate(
        &mut self,
        split: Split,
        comm: &mut dyn Collective,
        ctx: OpContext,
    ) -> Result<Option<Metrics>, TrainError> {
        let (users, items) = self.model.tables(self.device);
        let (exclude, positives) = match split {
            Split::Valid => (&self.train, &self.valid),
            Split::Test => (&self.train_valid, &self.test),
        };
        let model = &self.model;
        let mut score = |batch: &[usize]| -> Result<Tensor, tch::TchError> {
            let _guard = tch::no_grad_guard();
            let ids: Vec<i64> = batch.iter().map(|&u| u as i64).collect();
            let rows = users.f_index_select(0, &Tensor::from_slice(&ids).to_device(self.device))?;
            Ok(model.score_tables(&rows, &items))
        };
        let metrics = evaluate_sharded(
            &mut score,
            exclude,
            positives,
            &self.ks,
            self.batch_users,
            comm,
            ctx,
        )?;
        Ok(Some(metrics))
    }
}

/// The popularity baseline's metrics on `split`, through the same sharded evaluation.
pub fn evaluate_popularity(
    data: &RecData,
    split: Split,
    ks: &[usize],
    batch_users: usize,
    comm: &mut dyn Collective,
    ctx: OpContext,
) -> Result<Metrics, RecError> {
    let ds = &data.dataset;
    let counts = Tensor::from_slice(&popularity_scores(&ds.train, ds.n_items as usize));
    let mut score = |batch: &[usize]| -> Result<Tensor, tch::TchError> {
        Ok(counts.unsqueeze(0).expand([batch.len() as i64, -1], false))
    };
    let train_valid: Vec<Vec<u32>>;
    let (exclude, positives) = match split {
        Split::Valid => (&ds.train, &ds.valid),
        Split::Test => {
            train_valid = train_and_valid(ds);
            (&train_valid, &ds.test)
        }
    };
    evaluate_sharded(&mut score, exclude, positives, ks, batch_users, comm, ctx)
}

/// Train ∪ valid per user, sorted: what a test ranking excludes.
fn train_and_valid(ds: &Dataset) -> Vec<Vec<u32>> {
    ds.train
        .iter()
        .zip(&ds.valid)
        .map(|(t, v)| {
            let mut both: Vec<u32> = t.iter().chain(v).copied().collect();
            both.sort_unstable();
            both
        })
        .collect()
}

/// Full-ranking metrics with users split across ranks: this rank scores the users `u` with
/// `u % world == rank` (and at least one positive), `batch_users` at a time (`score_batch` gives
/// `[b, n_items]`); the per-rank sums travel as f64 and are added in rank order, so every rank
/// returns the same metrics, equal to a single-process evaluation up to summation order.
pub fn evaluate_sharded(
    score_batch: &mut dyn FnMut(&[usize]) -> Result<Tensor, tch::TchError>,
    exclude: &[Vec<u32>],
    positives: &[Vec<u32>],
    ks: &[usize],
    batch_users: usize,
    comm: &mut dyn Collective,
    ctx: OpContext,
) -> Result<Metrics, RecError> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let users: Vec<usize> = (0..positives.len())
        .filter(|&u| u % world == rank && !positives[u].is_empty())
        .collect();
    let mut sums = MetricSums::new(ks);
    for chunk in users.chunks(batch_users.max(1)) {
        let scores = score_batch(chunk)?
            .f_to_device(Device::Cpu)?
            .f_to_kind(Kind::Float)?
            .f_contiguous()?;
        let n = scores.size().get(1).copied().unwrap_or(0) as usize;
        let flat = Vec::<f32>::try_from(scores.f_view([-1])?)?;
        for (row, &u) in chunk.iter().enumerate() {
            let mut s = flat[row * n..(row + 1) * n].to_vec();
            let ex = exclude.get(u).map_or(&[][..], Vec::as_slice);
            add_user(&mut sums, &mut s, ex, &positives[u]);
        }
    }
    let mine = Tensor::from_slice(&sums.to_vec());
    let gathered = comm.all_gather(&mine, ctx)?;
    let mut total = MetricSums::new(ks);
    for part in gathered {
        let v = Vec::<f64>::try_from(part.f_to_device(Device::Cpu)?)?;
        total.merge(&MetricSums::from_vec(ks, &v)?)?;
    }
    Ok(total.means())
}

/// Evaluation can take longer than a training collective: scoring every user.
pub const EVAL_TIMEOUT_MIN: Duration = Duration::from_secs(600);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eval::evaluate_all;
    use common::env_contract::WorkerEnv;
    use dist::collective::tcp::{test_ring::with_ring, TcpCollective};
    use dist::store::{StoreClient, StoreServer};
    use rusty_fork::rusty_fork_test;

    const CTX: OpContext = OpContext {
        step: 0,
        timeout: Duration::from_secs(20),
    };

    /// A deterministic, tie-free score table.
    fn score_of(u: usize, i: usize) -> f32 {
        (((u * 7919 + i * 104_729) % 1009) as f32) / 1009.0 + i as f32 * 1e-7
    }

    #[test]
    fn sharded_evaluation_equals_a_single_process_one() {
        let n_users = 53;
        let n_items = 40;
        let mut state = 7u64;
        let mut lists = |max: u64| -> Vec<Vec<u32>> {
            (0..n_users)
                .map(|_| {
                    let k = dist::rng::splitmix64(&mut state) % max;
                    let mut v: Vec<u32> = (0..k)
                        .map(|_| (dist::rng::splitmix64(&mut state) % n_items as u64) as u32)
                        .collect();
                    v.sort_unstable();
                    v.dedup();
                    v
                })
                .collect()
        };
        let exclude = lists(8);
        let positives = lists(5);
        let ks = vec![1, 5, 10];
        let users: Vec<usize> = (0..n_users).collect();
        let direct = evaluate_all(
            |u| (0..n_items).map(|i| score_of(u, i)).collect(),
            &users,
            &exclude,
            &positives,
            &ks,
        )
        .means();
        assert!(direct.users > 10);
        for world in [1u32, 2, 3] {
            let (ex, pos, k) = (exclude.clone(), positives.clone(), ks.clone());
            let results = with_ring(world, move |_, comm| {
                let mut score = |batch: &[usize]| -> Result<Tensor, tch::TchError> {
                    let rows: Vec<f32> = batch
                        .iter()
                        .flat_map(|&u| (0..n_items).map(move |i| score_of(u, i)))
                        .collect();
                    Ok(Tensor::from_slice(&rows).view([batch.len() as i64, n_items as i64]))
                };
                evaluate_sharded(&mut score, &ex, &pos, &k, 4, comm, CTX).unwrap()
            });
            for m in results {
                assert_eq!(m.users, direct.users, "world {world}");
                for name in ["recall@5", "ndcg@10", "mrr@1", "hit@5", "precision@10"] {
                    let (a, b) = (m.get(name).unwrap(), direct.get(name).unwrap());
                    assert!((a - b).abs() < 1e-12, "world {world} {name}: {a} vs {b}");
                }
            }
        }
    }

    fn tiny_data(dir: &Path) -> RecData {
        data::generate_ml1m(dir, common::config::SyntheticSize::Tiny, 3).unwrap();
        let raw = data::read_ml1m(dir).unwrap();
        RecData::from_raw(&raw, 3, 3, dir.to_path_buf())
    }

    #[test]
    fn texts_follow_the_dense_ids() {
        let dir = tempfile::tempdir().unwrap();
        let d = tiny_data(&dir.path().join("d"));
        assert_eq!(d.user_texts.len(), d.dataset.n_users as usize);
        assert_eq!(d.item_texts.len(), d.dataset.n_items as usize);
        assert!(d.item_texts.iter().all(|t| t.starts_with("Movie: ")));
        assert!(d.user_texts.iter().all(|t| t.starts_with("User: ")));
    }

    // In its own process: the replay needs torch's global generator to itself (other tests
    // running in parallel threads draw from it and reseed it).
    rusty_fork_test! {
        #[test]
        fn negatives_are_never_train_items_and_change_every_batch() {
            let dir = tempfile::tempdir().unwrap();
            let d = tiny_data(&dir.path().join("d"));
            let mut config = Config::default();
            config.model.kind = ModelKind::Bpr;
            let vs = nn::VarStore::new(Device::Cpu);
            let mut comm = with_single();
            let mut task = RecTask::new(&config, &d, &vs, Device::Cpu, comm.as_mut(), CTX, &()).unwrap();
            let idx: Vec<usize> = (0..task.train_len()).step_by(7).collect();
            // Recompute the negatives the loss drew by replaying torch's generator.
            for seed in [1i64, 2] {
                tch::manual_seed(seed);
                let mut state =
                    Tensor::randint(i64::MAX, [1], (Kind::Int64, Device::Cpu)).int64_value(&[0]) as u64;
                for &i in &idx {
                    let (u, _) = task.pairs[i];
                    let n = data::sample_negative(&task.train[u as usize], task.n_items, &mut state)
                        .unwrap();
                    assert!(task.train[u as usize].binary_search(&n).is_err());
                }
                tch::manual_seed(seed);
                let loss = task.loss(&idx).unwrap().double_value(&[]);
                assert!(loss.is_finite() && loss > 0.0);
            }
        }
    }

    fn with_single() -> Box<dyn Collective> {
        let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), "one").unwrap();
        let addr = server.local_addr();
        let store = StoreClient::connect(&addr.to_string(), "one", Duration::from_secs(5)).unwrap();
        let env = WorkerEnv::single_node(0, 1, "127.0.0.1", addr.port(), "one");
        let comm = TcpCollective::connect(&env, store, Duration::from_secs(5)).unwrap();
        std::mem::forget(server);
        Box::new(comm)
    }

    #[test]
    fn trainable_layers_freeze_the_lower_blocks() {
        let dir = tempfile::tempdir().unwrap();
        let d = tiny_data(&dir.path().join("d"));
        let mut config = Config::default();
        config.model.text_mode = TextMode::Dynamic;
        config.model.trainable_layers = Some(1);
        config.model.max_text_tokens = 16;
        let vs = nn::VarStore::new(Device::Cpu);
        let mut comm = with_single();
        let mut task =
            RecTask::new(&config, &d, &vs, Device::Cpu, comm.as_mut(), CTX, &()).unwrap();
        let vars: HashMap<String, Tensor> = vs.variables().into_iter().collect();
        assert!(!vars["gpt2.h.0.attn.c_attn.weight"].requires_grad());
        assert!(!vars["gpt2.wte.weight"].requires_grad());
        assert!(vars["gpt2.h.1.attn.c_attn.weight"].requires_grad());
        assert!(vars["gpt2.ln_f.weight"].requires_grad());
        let loss = task.loss(&[0, 1, 2, 3]).unwrap();
        loss.backward();
        let g = vars["gpt2.h.1.mlp.c_fc.weight"].grad();
        assert!(g.defined() && g.abs().sum(Kind::Float).double_value(&[]) > 0.0);
        // Evaluation encodes every text with the current GPT-2.
        let m = task
            .evaluate(Split::Valid, comm.as_mut(), CTX)
            .unwrap()
            .unwrap();
        assert!(m.users > 0);
    }
}
