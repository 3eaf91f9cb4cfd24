//! The text side of the recommender: GPT-2 built for a preset (with Hugging Face weights loaded
//! when `model.gpt2_weights` is set), texts tokenised into tables, and `cached` mode's features
//! — every text encoded once by a frozen GPT-2, the work split across ranks.

use std::path::PathBuf;

use common::config::{Config, Gpt2Preset, TOKENIZER_VOCAB};
use common::memory::{Phase, PhaseSink};
use runtime::collective::{Collective, OpContext};
use tch::{nn, Device, Kind, Tensor};
use tracing::info;

use crate::input::RecData;
use crate::model::gpt2::{self, Gpt2, HfDir, Tokenizer};
use crate::model::recommender::{TextFeatures, TokenTable};
use crate::RecError;

/// GPT-2's config for a preset.
pub fn gpt2_config(preset: Gpt2Preset) -> gpt2::Config {
    match preset {
        Gpt2Preset::Tiny => gpt2::Config::tiny(),
        Gpt2Preset::Gpt2 => gpt2::Config::gpt2(),
    }
}

/// The GPT-2 `config` asks for and the weights to load into it: a Hugging Face directory's
/// `config.json` and `model.safetensors`, a bare safetensors file of the preset's shape, or
/// none (random initialisation). The weights' header is checked against the shapes here,
/// before anything is built.
pub fn gpt2_source(config: &Config) -> Result<(gpt2::Config, Option<PathBuf>), RecError> {
    let invalid = |e: &dyn std::fmt::Display| RecError::Invalid(format!("model.gpt2_weights: {e}"));
    let m = &config.model;
    let (gcfg, weights) = match m.gpt2_dir() {
        Some(dir) => {
            let hf = HfDir::open(dir).map_err(|e| invalid(&e))?;
            (hf.config, Some(hf.weights))
        }
        None => {
            let gcfg = gpt2_config(m.preset);
            if let Some(weights) = &m.gpt2_weights {
                // The header against the preset's shapes, before the model is built.
                gpt2::check_weights(weights, &gcfg).map_err(|e| {
                    RecError::Invalid(format!("model.gpt2_weights = {}: {e}", weights.display()))
                })?;
            }
            (gcfg, m.gpt2_weights.clone())
        }
    };
    if gcfg.vocab_size < TOKENIZER_VOCAB as i64 {
        return Err(invalid(&format!(
            "vocab_size {} is smaller than the {TOKENIZER_VOCAB} tokens of GPT-2's tokenizer",
            gcfg.vocab_size
        )));
    }
    if m.max_text_tokens as i64 > gcfg.n_positions {
        return Err(RecError::Invalid(format!(
            "model.max_text_tokens = {} exceeds {}'s {} positions",
            m.max_text_tokens,
            m.gpt2_name(),
            gcfg.n_positions
        )));
    }
    Ok((gcfg, weights))
}

/// Builds GPT-2 in `vs` under `prefix` (at its root when `None`) and loads
/// `model.gpt2_weights` into it when set.
pub(crate) fn build_gpt2(
    vs: &nn::VarStore,
    prefix: Option<&str>,
    config: &Config,
) -> Result<Gpt2, RecError> {
    let (gcfg, weights) = gpt2_source(config)?;
    let root = vs.root();
    let path = match prefix {
        Some(p) => &root / p,
        None => root,
    };
    let model = Gpt2::new(&path, &gcfg);
    if let Some(weights) = &weights {
        let report = gpt2::load_hf_safetensors(vs, prefix, weights).map_err(|e| {
            RecError::Invalid(format!("model.gpt2_weights = {}: {e}", weights.display()))
        })?;
        info!(
            "loaded {} GPT-2 tensors from {} ({} blocks, width {}, {} heads, {} positions)",
            report.loaded,
            weights.display(),
            gcfg.n_layer,
            gcfg.n_embd,
            gcfg.n_head,
            gcfg.n_positions
        );
    }
    Ok(model)
}

/// Token tables of `texts` on `device`, each cut to `max_len` tokens.
pub(crate) fn token_table(
    tok: &Tokenizer,
    texts: &[String],
    max_len: usize,
    device: Device,
) -> TokenTable {
    let (ids, mask) = tok.encode_batch(texts, max_len);
    TokenTable::new(&ids, &mask, device)
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
    let encoder = FrozenEncoder::new(config, device)?;
    let users = encoder.encode(&data.user_texts, comm, ctx)?;
    let items = encoder.encode(&data.item_texts, comm, ctx)?;
    phases.enter(Phase::ModelBuild);
    Ok(TextFeatures {
        users: standardize(&users, users.size()[0]),
        items: standardize(&items, items.size()[0]),
    })
}

/// `cached` mode's features of users described only by `texts` (new users): encoded by the same
/// frozen GPT-2 and standardised with the statistics of the data's users, exactly as their rows
/// were (a new user with a known user's text gets that user's row).
pub fn cached_new_user_features(
    config: &Config,
    data: &RecData,
    texts: &[String],
    device: Device,
    comm: &mut dyn Collective,
    ctx: OpContext,
) -> Result<Tensor, RecError> {
    let encoder = FrozenEncoder::new(config, device)?;
    let all: Vec<String> = data.user_texts.iter().chain(texts).cloned().collect();
    let known = data.user_texts.len() as i64;
    let rows = standardize(&encoder.encode(&all, comm, ctx)?, known);
    Ok(rows.narrow(0, known, texts.len() as i64))
}

/// `(x - mean) / std` per feature over the first `n` rows, then divided by sqrt(width): rows of
/// norm about 1, so that projected they start at the scale of the ID embeddings instead of
/// swamping them.
fn standardize(full: &Tensor, n: i64) -> Tensor {
    let width = full.size().last().copied().unwrap_or(1);
    let stats = full.narrow(0, 0, n);
    let mean = stats.mean_dim([0i64].as_slice(), true, Kind::Float);
    let std = stats.std_dim([0i64].as_slice(), false, true);
    (full - mean) / (std + 1e-6) / (width as f64).sqrt()
}

/// The frozen GPT-2 of `cached` mode and its tokenizer.
struct FrozenEncoder {
    gpt2: Gpt2,
    tok: Tokenizer,
    max_tokens: usize,
    device: Device,
    _vs: nn::VarStore,
}

impl FrozenEncoder {
    /// The same weights on every rank by construction: drawn from the CPU generator with one
    /// seed (or read from the file), then moved to the device. Drawn on each rank's GPU they
    /// would agree only if every GPU's generator gave the same numbers, and nothing broadcasts
    /// this encoder (it is not part of the trained model).
    fn new(config: &Config, device: Device) -> Result<FrozenEncoder, RecError> {
        tch::manual_seed(config.run.seed as i64);
        let mut vs = nn::VarStore::new(Device::Cpu);
        let gpt2 = build_gpt2(&vs, None, config)?;
        vs.set_device(device);
        Ok(FrozenEncoder {
            gpt2,
            tok: Tokenizer::new()?,
            max_tokens: config.model.max_text_tokens,
            device,
            _vs: vs,
        })
    }

    /// Mean-pooled last hidden states of `texts` [n, width]: each rank encodes an even share
    /// of the rows, and all are gathered.
    fn encode(
        &self,
        texts: &[String],
        comm: &mut dyn Collective,
        ctx: OpContext,
    ) -> Result<Tensor, RecError> {
        let (rank, world) = (comm.rank(), comm.world_size());
        let per_rank = texts.len().div_ceil(world).max(1);
        let start = (rank * per_rank).min(texts.len());
        let end = (start + per_rank).min(texts.len());
        let width = self.gpt2.config().n_embd;
        let mut parts = Vec::new();
        let _guard = tch::no_grad_guard();
        for chunk in texts[start..end].chunks(CACHE_ROWS) {
            let table = token_table(&self.tok, chunk, self.max_tokens, self.device);
            let hidden = self.gpt2.forward(&table.ids, &table.mask, false);
            parts.push(Gpt2::mean_pool(&hidden, &table.mask));
        }
        // Pad to the same number of rows everywhere (all_gather needs equal shapes).
        let mine = end - start;
        if mine < per_rank {
            parts.push(Tensor::zeros(
                [(per_rank - mine) as i64, width],
                (Kind::Float, self.device),
            ));
        }
        let mine = Tensor::cat(&parts, 0);
        let all = comm.all_gather(&mine, ctx)?;
        let all: Vec<Tensor> = all.iter().map(|t| t.to_device(self.device)).collect();
        Ok(Tensor::cat(&all, 0).narrow(0, 0, texts.len() as i64))
    }
}
