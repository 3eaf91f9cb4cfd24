//! The recommender as a trainable task: the model built from `[model]` (`gpt2rec` in `cached` or
//! `dynamic` text mode, `bpr`) over the data, its loss (`train.loss`: BPR with a negative per
//! pair re-drawn every batch, or the softmax against negatives shared by the step) over a
//! micro-batch of training pairs, and its full-ranking evaluation.
//!
//! It must not drive a training loop, write checkpoints or talk to the launcher: a trainer
//! calls [`RecTask::loss`] and [`RecTask::evaluate`]. All ranks call the collective parts
//! (building in `cached` mode, evaluation) together and in the same order.

use common::config::{Config, LossKind, ModelKind, ScorerKind, TextMode, TextProjInit, UserTower};
use common::memory::PhaseSink;
use runtime::collective::{Collective, OpContext};
use tch::{nn, Device, Kind, Tensor};

use crate::data::{self, Dataset};
use crate::eval::Metrics;
use crate::input::RecData;
use crate::model::gpt2::Tokenizer;
use crate::model::recommender::{
    History, NewUserText, PoolDropout, RecConfig, Recommender, Scorer, Text,
};
use crate::negatives::NegativeSampler;
use crate::sharded_eval::{evaluate_sharded, split_lists, text_chunks_shared, train_and_valid};
use crate::text::{build_gpt2, cached_text_features, token_table};
use crate::{RecError, Split};

/// The recommender as a trainable task: BPR over (user, positive, negative) triples, or the
/// softmax of each positive against the step's shared negatives.
pub struct RecTask {
    model: Recommender,
    /// (user, positive item) of every training interaction; the sampler shards its indices.
    pairs: Vec<(u32, u32)>,
    /// The split (train lists for negatives, held-out lists for evaluation).
    ds: Dataset,
    /// Train ∪ valid per user: what a test ranking excludes.
    train_valid: Vec<Vec<u32>>,
    l2: f64,
    device: Device,
    ks: Vec<usize>,
    batch_users: usize,
    hash: String,
    /// Forward passes under bf16 autocast (`train.bf16`, on CUDA or the CPU).
    bf16: bool,
    /// Time spent assembling micro-batches since [`RecTask::take_data_time`] last asked.
    data_time: std::time::Duration,
    /// The ID rows the last micro-batch looked up: its users, and its positive and negative
    /// items ([`RecTask::rows_used`]).
    last_rows: Option<(Vec<i64>, Vec<i64>)>,
    /// Whether evaluations reuse the first one's user and item tables
    /// ([`RecTask::hold_tables`]).
    held: HeldTables,
    /// `train.loss`: what a micro-batch's loss is.
    objective: Objective,
    /// The optimizer step the coming micro-batches belong to ([`RecTask::begin_step`]).
    step: u64,
    /// `model.history_dropout` and `run.seed`, whose step keys the training pools' dropout.
    history_dropout: (f32, u64),
}

/// What a micro-batch's loss is.
enum Objective {
    /// One negative per positive, drawn from torch's generator (which the trainer reseeds
    /// every step and rank).
    Bpr,
    /// Cross-entropy against the step's shared negatives.
    Softmax(Softmax),
}

/// The softmax's negatives: drawn once a step, shared by its micro-batches.
struct Softmax {
    sampler: NegativeSampler,
    /// `ln` of each warm item's expected count among a step's draws, on the model's device
    /// (`None`: the full softmax, nothing to correct).
    log_expected: Option<Tensor>,
    /// The step whose negatives these are, as ids and as a host tensor.
    drawn: Option<(u64, Vec<i64>, Tensor)>,
}

impl Softmax {
    fn new(config: &Config, ds: &Dataset, device: Device) -> Softmax {
        let t = &config.train;
        let sampler = NegativeSampler::new(
            &ds.train,
            ds.n_warm_items,
            t.negatives,
            t.negative_power,
            config.run.seed,
        );
        let log_expected = sampler
            .log_expected()
            .map(|l| Tensor::from_slice(l).to_device(device));
        Softmax {
            sampler,
            log_expected,
            drawn: None,
        }
    }

    /// Step `step`'s negatives (drawn at its first micro-batch).
    fn for_step(&mut self, step: u64) -> (&[i64], &Tensor) {
        if self.drawn.as_ref().is_none_or(|(s, _, _)| *s != step) {
            let ids = self.sampler.draw(step);
            let tensor = Tensor::from_slice(&ids);
            self.drawn = Some((step, ids, tensor));
        }
        match &self.drawn {
            Some((_, ids, tensor)) => (ids, tensor),
            None => unreachable!("drawn just above"),
        }
    }
}

/// The user and item tables evaluations share while the parameters stay as they are.
enum HeldTables {
    /// Every evaluation computes its own.
    Off,
    /// Held from the next evaluation on.
    Awaited,
    /// The user and item tables the first evaluation since holding computed.
    Held(Tensor, Tensor),
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
        // Before the text features: refused at once, not after GPT-2 has read every text.
        let trained = config.model.kind != ModelKind::Pop;
        if trained && config.model.item_item && ds.n_items as usize > crate::ease::MAX_ITEMS {
            return Err(RecError::Invalid(format!(
                "model.item_item: {} items would make a {0} x {0} matrix; at most {} items (set model.item_item = false)",
                ds.n_items,
                crate::ease::MAX_ITEMS
            )));
        }
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
                let mut gpt2 = build_gpt2(vs, Some("gpt2"), config)?;
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
            n_warm_users: i64::from(ds.n_warm_users),
            n_warm_items: i64::from(ds.n_warm_items),
            dim: config.model.embedding_dim as i64,
            scorer: match config.model.scorer {
                ScorerKind::Dot => Scorer::Dot,
                ScorerKind::Mlp => Scorer::Mlp,
            },
            text_l2: config.model.text_l2,
            zero_text_proj: config.model.text_proj_init == TextProjInit::Zero,
            user_tower: config.model.user_tower,
            item_item: config.model.item_item,
        };
        let mut model = Recommender::new(&vs.root(), rec_config, text);
        if config.model.user_tower != UserTower::Id {
            model.set_history(History::new(&ds.train));
        }
        if config.train.bf16 {
            crate::model::autocast::use_bf16_autocast_on(device);
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
            ds: ds.clone(),
            train_valid,
            l2: config.model.l2,
            device,
            ks: config.eval.topk.clone(),
            batch_users: config.eval.batch_users,
            hash: model_hash(config, data),
            bf16: config.train.bf16,
            data_time: std::time::Duration::ZERO,
            last_rows: None,
            held: HeldTables::Off,
            objective: match config.train.loss {
                LossKind::Bpr => Objective::Bpr,
                LossKind::Softmax => Objective::Softmax(Softmax::new(config, ds, device)),
            },
            step: 0,
            history_dropout: (config.model.history_dropout, config.run.seed),
        })
    }
}

impl RecTask {
    /// GPT-2 blocks recomputed during backward (activation checkpointing), 0 when off.
    pub fn checkpointed_blocks(&self) -> usize {
        self.model.checkpointed_blocks()
    }

    /// The model's ZeRO stage 3 units (GPT-2's blocks in dynamic mode), in forward order.
    pub fn units(&self) -> Vec<String> {
        self.model.units()
    }

    /// See [`Recommender::set_param_gate`].
    pub fn set_param_gate(&mut self, gate: runtime::ddp::ParamGate) {
        self.model.set_param_gate(gate);
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

/// A fingerprint of what the checkpoint's tensors mean and what they were trained on:
/// `MODEL+DATA`, MODEL from the `[model]` section and the data's shape (another data set gives
/// other embedding tables), DATA from the split itself ([`data_digest`]).
fn model_hash(config: &Config, data: &RecData) -> String {
    format!(
        "{}+{}",
        model_part(config, &data.dataset),
        data_digest(data)
    )
}

/// The model part of [`model_hash`] (the whole fingerprint before the data part was added,
/// unchanged, so a checkpoint of an older run still compares on it).
fn model_part(config: &Config, ds: &Dataset) -> String {
    use sha2::Digest;
    // Activation checkpointing changes how gradients are computed, and history dropout what
    // training pools, not the model: a run may change them and resume.
    let model = common::config::ModelConfig {
        activation_checkpointing: false,
        history_dropout: 0.0,
        ..config.model.clone()
    };
    let mut text = format!(
        "{}/{}x{}",
        serde_json::to_string(&model).unwrap_or_default(),
        ds.n_users,
        ds.n_items
    );
    // Cold start reorders the ids: a model trained without it means other rows. (Only then,
    // so the fingerprints of runs without cold start stay what they were.)
    if (ds.n_warm_users, ds.n_warm_items) != (ds.n_users, ds.n_items) {
        text += &format!("/warm {}x{}", ds.n_warm_users, ds.n_warm_items);
    }
    let digest = sha2::Sha256::digest(text.as_bytes());
    digest[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// A digest of the data a model is trained and evaluated on: which users and items the rows
/// are, every split list, and the texts. It covers all the split depends on (run.seed,
/// data.min_rating, data.cold_items, data.cold_users, the data files, the synthetic size and
/// seed) by digesting the result rather than the inputs, so re-fetched identical files match.
fn data_digest(data: &RecData) -> String {
    use sha2::Digest;
    let ds = &data.dataset;
    let mut h = sha2::Sha256::new();
    let mut ints = |values: &[u32]| {
        h.update((values.len() as u64).to_le_bytes());
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        h.update(bytes);
    };
    ints(&[ds.n_users, ds.n_items, ds.n_warm_users, ds.n_warm_items]);
    ints(&ds.user_ids);
    ints(&ds.item_ids);
    for lists in [
        &ds.train,
        &ds.valid,
        &ds.test,
        &ds.cold_items,
        &ds.cold_users,
    ] {
        for list in lists.iter() {
            ints(list);
        }
    }
    for text in data.user_texts.iter().chain(&data.item_texts) {
        h.update((text.len() as u64).to_le_bytes());
        h.update(text.as_bytes());
    }
    let digest = h.finalize();
    digest[..8].iter().map(|b| format!("{b:02x}")).collect()
}

impl RecTask {
    /// The variables that are embedding tables, whose gradient touches only the rows of the
    /// users, items or tokens in a batch: the ID embeddings, and GPT-2's token embeddings (when
    /// dynamic mode trains them). A variable that does not exist or is frozen is ignored.
    pub fn embedding_tables(&self) -> Vec<String> {
        ["user_id.weight", "item_id.weight", "gpt2.wte.weight"]
            .map(String::from)
            .to_vec()
    }

    /// Number of training samples: (user, positive item) pairs; a sampler shards `0..len`.
    pub fn train_len(&self) -> usize {
        self.pairs.len()
    }

    /// The optimizer step the coming micro-batches belong to: the softmax's negatives are a
    /// function of it (and the seed), the same on every rank.
    pub fn begin_step(&mut self, step: u64) {
        self.step = step;
        let (rate, seed) = self.history_dropout;
        if rate > 0.0 {
            let key = PoolDropout::key(seed, step);
            self.model.set_pool_dropout(Some(PoolDropout { rate, key }));
        }
    }

    /// Mean loss (`train.loss`) over the training pairs `indices` (one micro-batch), ready for
    /// backward.
    pub fn loss(&mut self, indices: &[usize]) -> Result<Tensor, tch::TchError> {
        // A previous micro-batch abandoned before its backward leaves nothing behind.
        self.model.discard_pending();
        // Training changes the parameters: tables held for evaluation are stale.
        self.held = HeldTables::Off;
        match self.objective {
            Objective::Bpr => self.bpr_batch(indices),
            Objective::Softmax(_) => self.softmax_batch(indices),
        }
    }

    /// The softmax loss of `indices` against the step's shared negatives.
    fn softmax_batch(&mut self, indices: &[usize]) -> Result<Tensor, tch::TchError> {
        let started = std::time::Instant::now();
        let Objective::Softmax(softmax) = &mut self.objective else {
            unreachable!("called for the softmax objective only")
        };
        let (users, mut items): (Vec<i64>, Vec<i64>) = indices
            .iter()
            .map(|&i| {
                let (u, p) = self.pairs[i];
                (i64::from(u), i64::from(p))
            })
            .unzip();
        let (users_t, pos_t) = (Tensor::from_slice(&users), Tensor::from_slice(&items));
        let (negatives, negatives_t) = softmax.for_step(self.step);
        let negatives_t = negatives_t.shallow_clone();
        items.extend_from_slice(negatives);
        self.last_rows = Some((users, items));
        self.data_time += started.elapsed();
        let (model, l2) = (&self.model, self.l2);
        let log_expected = softmax.log_expected.as_ref();
        Ok(crate::model::autocast::autocast_on(
            self.device,
            self.bf16,
            || model.softmax_loss(&users_t, &pos_t, &negatives_t, log_expected, l2, true),
        ))
    }

    /// The BPR loss of `indices`, each with a negative of its own.
    fn bpr_batch(&mut self, indices: &[usize]) -> Result<Tensor, tch::TchError> {
        let started = std::time::Instant::now();
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
            // Negatives among the warm items only: a cold item must stay unseen.
            let negative =
                data::sample_negative(&self.ds.train[u as usize], self.ds.n_warm_items, &mut state)
                    .unwrap_or(p);
            users.push(i64::from(u));
            pos.push(i64::from(p));
            neg.push(i64::from(negative));
        }
        // On the host: the model copies them in without waiting and reads the texts' lengths
        // from them without asking the device.
        let t = |v: &[i64]| Tensor::from_slice(v);
        let (users_t, pos_t, neg_t) = (t(&users), t(&pos), t(&neg));
        pos.extend_from_slice(&neg);
        self.last_rows = Some((users, pos));
        let (users, pos, neg) = (users_t, pos_t, neg_t);
        self.data_time += started.elapsed();
        Ok(crate::model::autocast::autocast_on(
            self.device,
            self.bf16,
            || self.model.bpr_loss(&users, &pos, &neg, self.l2, true),
        ))
    }

    /// The loss of one micro-batch — users, positives and negatives as dense ids — with dropout
    /// off and no gradient, in the training forward's precision: what a PyTorch peer of the
    /// training step checks its own against (`GPTREC_DUMP_PEER`, `scripts/bench/gpt2_peer.py`).
    pub fn eval_loss(&self, users: &[i64], pos: &[i64], neg: &[i64]) -> Result<f64, tch::TchError> {
        let _guard = tch::no_grad_guard();
        let t = |v: &[i64]| Tensor::from_slice(v).to_device(self.device);
        let (users, pos, neg) = (t(users), t(pos), t(neg));
        crate::model::autocast::autocast_on(self.device, self.bf16, || {
            self.model.bpr_loss(&users, &pos, &neg, self.l2, false)
        })
        .f_double_value(&[])
    }

    /// The rows of the ID table `table` (`user_id.weight` or `item_id.weight`) that the last
    /// micro-batch's loss looked up — the only rows its gradient can touch (the score and the
    /// L2 term both read just those) — so the DDP engine need not scan the table's gradient.
    /// `None` for any other table (GPT-2's token table) or before the first micro-batch.
    pub fn rows_used(&self, table: &str) -> Option<&[i64]> {
        let (users, items) = self.last_rows.as_ref()?;
        match table {
            "user_id.weight" => Some(users),
            "item_id.weight" => Some(items),
            _ => None,
        }
    }

    /// Time spent assembling micro-batches (negatives, index tensors) since the last call.
    pub fn take_data_time(&mut self) -> std::time::Duration {
        std::mem::take(&mut self.data_time)
    }

    /// Completes the backward pass (activation checkpointing recomputes its blocks here).
    pub fn finish_backward(&mut self) -> Result<(), tch::TchError> {
        // The recompute runs under the forward's autocast setting.
        crate::model::autocast::autocast_on(self.device, self.bf16, || self.model.finish_backward())
    }

    /// Representations of every user and every item ([n_users, dim], [n_items, dim]; cold ones
    /// from their text alone; a user row ends with its item scores with the item-item matrix:
    /// see [`Recommender::score_tables`]), for serving.
    pub fn tables(&self) -> (Tensor, Tensor) {
        self.model.tables(self.device)
    }

    /// Scores of user representations [b, dim] (or [b, dim + n]) against item representations
    /// [n, dim] → [b, n].
    pub fn score_tables(&self, users: &Tensor, items: &Tensor) -> Tensor {
        let _guard = tch::no_grad_guard();
        self.model.score_tables(users, items)
    }

    /// The model's scorer.
    pub fn scorer(&self) -> Scorer {
        self.model.config().scorer
    }

    /// Representations [b, dim] (or [b, dim + n_items]) of users described only by `texts` (`data::user_text`), through
    /// the text tower as cold users are; every rank calls it together (cached mode encodes).
    pub fn new_users(
        &self,
        config: &Config,
        data: &RecData,
        texts: &[String],
        comm: &mut dyn Collective,
        ctx: OpContext,
    ) -> Result<Tensor, RecError> {
        let text = match (config.model.kind, config.model.text_mode) {
            (ModelKind::Gpt2rec, TextMode::Cached) => NewUserText::Features(
                crate::text::cached_new_user_features(config, data, texts, self.device, comm, ctx)?,
            ),
            (ModelKind::Gpt2rec, TextMode::Dynamic) => {
                let tok = Tokenizer::new()?;
                NewUserText::Tokens(token_table(&tok, texts, config.model.max_text_tokens, self.device))
            }
            _ => {
                return Err(RecError::Invalid(format!(
                    "model.kind = {:?} has no text tower: only \"gpt2rec\" can place a user known by demographics alone",
                    format!("{:?}", config.model.kind).to_lowercase()
                )))
            }
        };
        self.model
            .new_users(&text)
            .ok_or_else(|| RecError::Invalid("the model has no text tower".into()))
    }

    /// What the best model is tested on: `test`, then the cold-start parts the data has.
    pub fn test_splits(&self) -> Vec<Split> {
        self.ds.test_splits()
    }

    /// A fingerprint of the model's configuration and the data's shape, and (after a `+`) of
    /// the data it trains on.
    pub fn model_hash(&self) -> String {
        self.hash.clone()
    }

    /// While `hold` (until called again with `false`), evaluations reuse the user and item
    /// tables of the first one (in dynamic mode, every text encoded once for all of them): the
    /// caller promises that the parameters do not change meanwhile.
    pub fn hold_tables(&mut self, hold: bool) {
        self.held = if hold {
            HeldTables::Awaited
        } else {
            HeldTables::Off
        };
    }

    /// Full-ranking metrics of the current model on `split`; every rank calls it together.
    pub fn evaluate(
        &mut self,
        split: Split,
        comm: &mut dyn Collective,
        ctx: OpContext,
    ) -> Result<Metrics, RecError> {
        // Every rank encodes a share of the texts (in dynamic mode, GPT-2 over every user and
        // item: most of an evaluation) and gathers the rest.
        let (model, device) = (&self.model, self.device);
        let mut tables =
            || model.tables_with(device, |chunks| text_chunks_shared(chunks, comm, ctx));
        let (users, items) = match &self.held {
            HeldTables::Held(users, items) => (users.shallow_clone(), items.shallow_clone()),
            HeldTables::Awaited => {
                let (users, items) = tables()?;
                self.held = HeldTables::Held(users.shallow_clone(), items.shallow_clone());
                (users, items)
            }
            HeldTables::Off => tables()?,
        };
        let lists = split_lists(&self.ds, &self.train_valid, split);
        let mut score = |batch: &[usize]| -> Result<Tensor, tch::TchError> {
            let _guard = tch::no_grad_guard();
            let ids: Vec<i64> = batch.iter().map(|&u| u as i64).collect();
            let rows = users.f_index_select(0, &Tensor::from_slice(&ids).to_device(self.device))?;
            Ok(model.score_tables(&rows, &items))
        };
        let metrics = evaluate_sharded(&mut score, &lists, &self.ks, self.batch_users, comm, ctx)?;
        Ok(metrics)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::time::Duration;

    use super::*;
    use crate::input::tests::tiny_data;
    use common::env_contract::WorkerEnv;
    use runtime::collective::tcp::TcpCollective;
    use runtime::store::{StoreClient, StoreServer};
    use rusty_fork::rusty_fork_test;

    const CTX: OpContext = OpContext {
        step: 0,
        timeout: Duration::from_secs(20),
    };

    // In its own process: the replay needs torch's global generator to itself (other tests
    // running in parallel threads draw from it and reseed it).
    rusty_fork_test! {
        #[test]
        fn negatives_are_never_train_items_and_change_every_batch() {
            let dir = tempfile::tempdir().unwrap();
            let (_vs, _comm, mut task) = crate::task::tests::bpr_task(dir.path());
            let idx: Vec<usize> = (0..task.train_len()).step_by(7).collect();
            // Recompute the negatives the loss drew by replaying torch's generator.
            for seed in [1i64, 2] {
                tch::manual_seed(seed);
                let mut state =
                    Tensor::randint(i64::MAX, [1], (Kind::Int64, Device::Cpu)).int64_value(&[0]) as u64;
                for &i in &idx {
                    let (u, _) = task.pairs[i];
                    let n = data::sample_negative(&task.ds.train[u as usize], task.ds.n_warm_items, &mut state)
                        .unwrap();
                    assert!(task.ds.train[u as usize].binary_search(&n).is_err());
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

    /// A BPR task on the tiny data in `dir`, with its variables and a world of one.
    pub(super) fn bpr_task(dir: &std::path::Path) -> (nn::VarStore, Box<dyn Collective>, RecTask) {
        let d = tiny_data(&dir.join("d"));
        let mut config = Config::default();
        config.model.kind = ModelKind::Bpr;
        let vs = nn::VarStore::new(Device::Cpu);
        let mut comm = with_single();
        let task = RecTask::new(&config, &d, &vs, Device::Cpu, comm.as_mut(), CTX, &()).unwrap();
        (vs, comm, task)
    }

    /// Held tables serve every evaluation until released, or until training changes the
    /// parameters (a loss is computed).
    #[test]
    fn held_tables_serve_evaluations_until_released_or_trained() {
        let dir = tempfile::tempdir().unwrap();
        let (vs, mut comm, mut task) = bpr_task(dir.path());
        let mut test = |task: &mut RecTask| task.evaluate(Split::Test, comm.as_mut(), CTX).unwrap();
        let before = test(&mut task);
        // The item table negated: every score negated, another ranking.
        let scale = |by: f64| {
            let _guard = tch::no_grad_guard();
            for (name, mut v) in vs.variables() {
                if name.starts_with("item_id") {
                    let _ = v.f_mul_scalar_(by).unwrap();
                }
            }
        };
        task.hold_tables(true);
        assert_eq!(test(&mut task), before);
        scale(-1.0);
        assert_eq!(test(&mut task), before, "the held tables were not used");
        task.hold_tables(false);
        let after = test(&mut task);
        assert_ne!(after, before);
        task.hold_tables(true);
        assert_eq!(test(&mut task), after);
        scale(-1.0);
        let idx: Vec<usize> = (0..4).collect();
        let _ = task.loss(&idx).unwrap();
        assert_eq!(
            test(&mut task),
            before,
            "training did not release the held tables"
        );
    }

    /// Too many items for the item-item matrix: refused before GPT-2 reads any text (no phase
    /// entered), naming the key.
    #[test]
    fn an_item_item_matrix_too_large_is_refused_before_the_texts() {
        struct Entered(std::cell::Cell<bool>);
        impl common::memory::PhaseSink for Entered {
            fn enter(&self, _phase: common::memory::Phase) {
                self.0.set(true);
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let mut d = tiny_data(&dir.path().join("d"));
        d.dataset.n_items = crate::ease::MAX_ITEMS as u32 + 1;
        let mut config = Config::default();
        config.model.item_item = true;
        let vs = nn::VarStore::new(Device::Cpu);
        let mut comm = with_single();
        let entered = Entered(std::cell::Cell::new(false));
        let e = RecTask::new(&config, &d, &vs, Device::Cpu, comm.as_mut(), CTX, &entered)
            .err()
            .expect("refused");
        assert!(e.to_string().contains("model.item_item: 8193 items"), "{e}");
        assert!(!entered.0.get(), "a phase began before the refusal");
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
        // The text projections start at zero (GPT-2 gets gradients from the second step on);
        // give them weights, as one optimizer step would.
        tch::no_grad(|| {
            for (name, var) in &vars {
                if name.contains("text_proj.weight") {
                    let _ = var.shallow_clone().fill_(0.01);
                }
            }
        });
        let before = runtime::host_read::reads();
        let loss = task.loss(&[0, 1, 2, 3]).unwrap();
        // The texts' lengths come from the host: a micro-batch asks the device for nothing.
        assert_eq!(
            runtime::host_read::reads(),
            before,
            "the loss read a value from the device"
        );
        loss.backward();
        let g = vars["gpt2.h.1.mlp.c_fc.weight"].grad();
        assert!(g.defined() && g.abs().sum(Kind::Float).double_value(&[]) > 0.0);
        // Evaluation encodes every text with the current GPT-2.
        let m = task.evaluate(Split::Valid, comm.as_mut(), CTX).unwrap();
        assert!(m.users > 0);
    }
}
