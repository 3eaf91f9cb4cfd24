//! The recommender head: user and item ID embeddings, optionally fused with text features (the
//! mean-pooled GPT-2 states of each user's and item's metadata text, mapped to the embedding
//! size), and a scorer (`dot` or `mlp`, no final sigmoid: it would squeeze BPR's score
//! differences into [-1, 1] and slow learning). A user may also (or instead) be the pool of
//! the history rows of the items in their training history (`model.user_tower`). Also the
//! losses (BPR; the softmax against shared negatives) with L2 on the embeddings used in the
//! batch, and the popularity baseline's scores.
//!
//! The fusion starts as plain matrix factorisation and lets text add only what IDs lack: the
//! text projections start at zero, and the text part of every representation in a batch pays
//! its own L2 (`text_l2`). Added at full strength from the first step (as a default-initialised
//! projection does), the text part of users (a few demographic words shared by many) learns
//! faster than each user's ID and costs warm-item quality (see the ablation in docs/figures.md). A cold
//! user, whom no ID embedding describes, starts from the average warm user, so their text
//! adjusts the average taste rather than replacing it. It does not read data, encode text or train:
//! text features arrive as tensors; the DDP engine trains the variables.

use tch::{nn, nn::Module, Kind, Tensor};

pub use crate::model::history::{History, PoolDropout};
pub use common::config::UserTower;

use crate::model::gpt2::Gpt2;
use tokens::encode_rows;
pub use tokens::TokenTable;

/// How a user and an item representation become a score.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scorer {
    /// Inner product (matrix factorisation).
    Dot,
    /// A two-layer MLP on the concatenated pair.
    Mlp,
}

/// Sizes of the recommender.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RecConfig {
    pub n_users: i64,
    pub n_items: i64,
    /// Users and items training sees (the first ids); the rest are cold start, whose ID
    /// embeddings never train and count as zero (their text alone speaks for them).
    pub n_warm_users: i64,
    pub n_warm_items: i64,
    /// ID embedding size (RecBole's `embedding_size`; 64 in REFERENCE.md's table).
    pub dim: i64,
    pub scorer: Scorer,
    /// L2 weight on the text part of the representations in a batch (per sample).
    pub text_l2: f64,
    /// Whether the text projections start at zero (else libtorch's default initialisation).
    pub zero_text_proj: bool,
    /// What represents a user: the ID row, the pooled history, or both.
    pub user_tower: UserTower,
    /// With a history tower, also the item-item matrix (`model.item_item`): the pooled rows of
    /// an items x items matrix add a score per item.
    pub item_item: bool,
}

/// Text features of every user and item (rows in dense-id order), e.g. `[n_users, 768]`.
pub struct TextFeatures {
    pub users: Tensor,
    pub items: Tensor,
}

/// Where the text part of a representation comes from.
pub enum Text {
    /// ID embeddings only (BPR-MF).
    None,
    /// Fixed features computed once by a frozen GPT-2 (`cached` mode).
    Cached(TextFeatures),
    /// GPT-2 runs in the forward pass on the batch's texts (`dynamic` mode); its variables are
    /// the caller's (under the recommender's `VarStore`), trainable or frozen as it decided.
    Dynamic {
        gpt2: Box<Gpt2>,
        users: TokenTable,
        items: TokenTable,
    },
}

/// The text of users training never saw, as the model's text mode reads it.
pub enum NewUserText {
    /// `cached` mode: their feature rows (standardised as the data's users' were).
    Features(Tensor),
    /// `dynamic` mode: their tokens.
    Tokens(TokenTable),
}

/// Rows of texts GPT-2 encodes at once when building a whole table.
const ENCODE_ROWS: i64 = 128;

/// The text parts of one side of a whole table, [`ENCODE_ROWS`] rows a chunk: what
/// [`Recommender::tables_with`] asks its caller to compute, here or shared out over ranks.
pub struct TextChunks<'a> {
    /// Rows of each chunk, in order (all [`ENCODE_ROWS`] but maybe the last).
    pub rows: Vec<i64>,
    /// Width of a row: the embedding size.
    pub dim: i64,
    /// Where the chunks are computed.
    pub device: tch::Device,
    encode: &'a dyn Fn(usize) -> Option<Tensor>,
}

impl<'a> TextChunks<'a> {
    /// Chunks of `rows` rows each, `dim` wide, on `device`, chunk `c` from `encode(c)`.
    pub(crate) fn new(
        rows: Vec<i64>,
        dim: i64,
        device: tch::Device,
        encode: &'a dyn Fn(usize) -> Option<Tensor>,
    ) -> TextChunks<'a> {
        TextChunks {
            rows,
            dim,
            device,
            encode,
        }
    }

    /// Chunk `c`'s text parts [rows[c], dim] (no gradient; `None` would mean no text tower,
    /// which [`Recommender::tables_with`] never asks of).
    pub fn encode(&self, c: usize) -> Option<Tensor> {
        (self.encode)(c)
    }

    /// Every chunk's, here (`None`: see [`TextChunks::encode`]).
    pub fn all_here(&self) -> Option<Vec<Tensor>> {
        (0..self.rows.len()).map(|c| self.encode(c)).collect()
    }
}

/// User/item ID embeddings (+ projected text features) and a scorer.
pub struct Recommender {
    config: RecConfig,
    user_id: nn::Embedding,
    item_id: nn::Embedding,
    text: Text,
    /// Text width → `dim` maps (user side, item side), when text is used.
    proj: Option<(nn::Linear, nn::Linear)>,
    mlp: Option<(nn::Linear, nn::Linear)>,
    /// Each item's history row (`model.user_tower` `"history"` or `"both"`), pooled into the
    /// representation of the users who have it in their history.
    history_item: Option<nn::Embedding>,
    /// The item-item matrix (`model.item_item`), pooled as the history rows into item scores.
    item_item: Option<nn::Embedding>,
    history: History,
    /// Training pools' dropout for the current step (`model.history_dropout`).
    pool_dropout: Option<PoolDropout>,
}

/// A training batch's representations, and their (ID, text) parts for the penalties.
struct Batch {
    users: Tensor,
    items: Tensor,
    /// The users' item-item scores [b, n_items] (`model.item_item`).
    item_scores: Option<Tensor>,
    user_parts: (Tensor, Option<Tensor>),
    item_parts: (Tensor, Option<Tensor>),
}

#[derive(Clone, Copy)]
enum Side {
    User,
    Item,
}

impl Recommender {
    /// Variables under `p`: `user_id.weight`, `item_id.weight`, and when text is given
    /// `user_text_proj.*`, `item_text_proj.*`; `mlp.0.*`, `mlp.1.*` for the MLP scorer.
    /// The ID tables' backward is sparse: give them dense gradients to add into before the
    /// first one (`runtime::ddp::give_dense_grads`; the DDP engine does).
    pub fn new(p: &nn::Path, config: RecConfig, text: Text) -> Recommender {
        // Xavier-normal, as RecBole's BPR: std sqrt(2 / (rows + dim)), about 0.035 for
        // ML-100k's items at dim 64. A fixed 0.1 cost BPR 8% of test NDCG@10 on ML-100k
        // against RecBole on the identical split (scripts/bench/vs_recbole.sh).
        let table = |name: &str, rows: i64| {
            let emb = nn::EmbeddingConfig {
                ws_init: nn::Init::Randn {
                    mean: 0.0,
                    stdev: (2.0 / (rows + config.dim).max(1) as f64).sqrt(),
                },
                // Each micro-batch's backward is its few rows, added into the table's dense
                // gradient (which the DDP engine gives it first), instead of a dense zero table
                // filled per micro-batch: a fifth of a training step on the full-size tables.
                sparse: true,
                ..Default::default()
            };
            nn::embedding(p / name, rows, config.dim, emb)
        };
        let user_id = table("user_id", config.n_users);
        let item_id = table("item_id", config.n_items);
        let width = match &text {
            Text::None => None,
            Text::Cached(t) => Some((
                t.users.size().last().copied().unwrap_or(1),
                t.items.size().last().copied().unwrap_or(1),
            )),
            Text::Dynamic { gpt2, .. } => Some((gpt2.config().n_embd, gpt2.config().n_embd)),
        };
        // Zero: the model starts as plain MF, and text grows only where it pays.
        let zero = if config.zero_text_proj {
            nn::LinearConfig {
                ws_init: nn::Init::Const(0.0),
                bs_init: Some(nn::Init::Const(0.0)),
                bias: true,
            }
        } else {
            Default::default()
        };
        let proj = width.map(|(wu, wi)| {
            (
                nn::linear(p / "user_text_proj", wu, config.dim, zero),
                nn::linear(p / "item_text_proj", wi, config.dim, zero),
            )
        });
        let text = match text {
            Text::Cached(t) => Text::Cached(TextFeatures {
                users: t.users.detach(),
                items: t.items.detach(),
            }),
            other => other,
        };
        let mlp = (config.scorer == Scorer::Mlp).then(|| {
            (
                nn::linear(
                    p / "mlp" / "0",
                    2 * config.dim,
                    config.dim,
                    Default::default(),
                ),
                nn::linear(p / "mlp" / "1", config.dim, 1, Default::default()),
            )
        });
        // Dense (its gradient is every pooled row of a batch: most of the table).
        let history_item = (config.user_tower != UserTower::Id).then(|| {
            let init = nn::EmbeddingConfig {
                ws_init: nn::Init::Randn {
                    mean: 0.0,
                    stdev: (2.0 / (config.n_items + config.dim).max(1) as f64).sqrt(),
                },
                ..Default::default()
            };
            nn::embedding(p / "history_item", config.n_items, config.dim, init)
        });
        // Zero: the model starts as without it. Dense, as the history rows.
        let item_item = (config.item_item && config.user_tower != UserTower::Id).then(|| {
            let init = nn::EmbeddingConfig {
                ws_init: nn::Init::Const(0.0),
                ..Default::default()
            };
            nn::embedding(p / "item_item", config.n_items, config.n_items, init)
        });
        Recommender {
            config,
            user_id,
            item_id,
            text,
            proj,
            mlp,
            history_item,
            item_item,
            history: History::default(),
            pool_dropout: None,
        }
    }

    /// The users' training histories, which the history tower pools (none until given).
    pub fn set_history(&mut self, history: History) {
        self.history = history;
    }

    /// The history dropout of the coming training pools (`None`: every item pooled).
    pub fn set_pool_dropout(&mut self, dropout: Option<PoolDropout>) {
        self.pool_dropout = dropout;
    }

    pub fn config(&self) -> RecConfig {
        self.config
    }

    /// Completes the backward pass of GPT-2's checkpointed blocks (dynamic mode with activation
    /// checkpointing) after `loss.backward()`; nothing to do otherwise.
    pub fn finish_backward(&self) -> Result<(), tch::TchError> {
        match &self.text {
            Text::Dynamic { gpt2, .. } => gpt2.finish_backward(),
            _ => Ok(()),
        }
    }

    /// The variable-name prefixes of the units ZeRO stage 3 gathers one at a time, in forward
    /// order: GPT-2's blocks in dynamic mode; none otherwise (everything is then gathered for
    /// each whole window).
    pub fn units(&self) -> Vec<String> {
        match &self.text {
            Text::Dynamic { gpt2, .. } => gpt2.units().to_vec(),
            _ => Vec::new(),
        }
    }

    /// Hands ZeRO stage 3's gate to the parts that gather their units (GPT-2's blocks).
    pub fn set_param_gate(&mut self, gate: runtime::ddp::ParamGate) {
        if let Text::Dynamic { gpt2, .. } = &mut self.text {
            gpt2.set_param_gate(gate);
        }
    }

    /// GPT-2 blocks each training forward checkpoints (0 without checkpointing or GPT-2).
    pub fn checkpointed_blocks(&self) -> usize {
        match &self.text {
            Text::Dynamic { gpt2, .. } => gpt2.checkpointed_blocks(),
            _ => 0,
        }
    }

    /// Forgets checkpointed passes whose backward never ran.
    pub fn discard_pending(&self) {
        if let Text::Dynamic { gpt2, .. } = &self.text {
            gpt2.discard_pending();
        }
    }

    /// Text features (before projection) of rows `ids` of one side, or `None` without text.
    /// In dynamic mode GPT-2 runs on those rows' tokens, cut to their longest real text. `ids`
    /// on the host or the model's device.
    fn text_rows(&self, side: Side, ids: &Tensor, train: bool) -> Option<Tensor> {
        match &self.text {
            Text::None => None,
            Text::Cached(f) => {
                let table = match side {
                    Side::User => &f.users,
                    Side::Item => &f.items,
                };
                Some(table.index_select(0, &ids.to_device(table.device())))
            }
            Text::Dynamic { gpt2, users, items } => {
                let table = match side {
                    Side::User => users,
                    Side::Item => items,
                };
                Some(encode_rows(gpt2.as_ref(), table, ids, train))
            }
        }
    }

    /// The two parts of the representations [b, dim] of rows `ids` ([b] i64, on the host or
    /// the model's device), on the model's device: the ID embedding and, with a text tower, the
    /// projected text. A cold item's ID part is zero; a cold user's is the mean of the warm
    /// users' embeddings (the average taste).
    fn parts(&self, side: Side, ids: &Tensor, train: bool) -> (Tensor, Option<Tensor>) {
        self.parts_leaving_out(side, ids, None, train)
    }

    /// [`Recommender::parts`], a user's ID part with the history tower's pool added to (or in
    /// place of) the ID row, `leave_out[k]` left out of row `k`'s pool.
    fn parts_leaving_out(
        &self,
        side: Side,
        ids: &Tensor,
        leave_out: Option<&Tensor>,
        train: bool,
    ) -> (Tensor, Option<Tensor>) {
        let on_device = runtime::host_read::to_device(ids, self.user_id.ws.device());
        let id_part = self.id_part(side, &on_device, train);
        let id_part = match side {
            Side::User => self.with_pool(id_part, ids, leave_out),
            Side::Item => id_part,
        };
        (id_part, self.text_part(side, ids, train))
    }

    /// A user ID part with the pooled history of the users `ids` added.
    fn with_pool(&self, id_part: Tensor, ids: &Tensor, leave_out: Option<&Tensor>) -> Tensor {
        match self.history_pool(ids, leave_out) {
            Some(pool) => id_part + pool,
            None => id_part,
        }
    }

    /// The ID embeddings [b, dim] of rows `ids`, cold rows as [`Recommender::parts`] says.
    fn id_part(&self, side: Side, ids: &Tensor, train: bool) -> Tensor {
        let (table, n, warm) = match side {
            Side::User => (&self.user_id, self.config.n_users, self.config.n_warm_users),
            Side::Item => (&self.item_id, self.config.n_items, self.config.n_warm_items),
        };
        let id_emb = table.forward(ids);
        if matches!(side, Side::User) && self.config.user_tower == UserTower::History {
            return id_emb.zeros_like(); // the pool alone speaks for a user
        }
        // Training sees warm ids only; an embedding training never touched is noise.
        if warm < n && !train {
            let is_warm = ids.lt(warm).unsqueeze(-1);
            let stand_in = match side {
                Side::User if warm > 0 => {
                    table
                        .ws
                        .narrow(0, 0, warm)
                        .mean_dim([0i64].as_slice(), true, Kind::Float)
                }
                _ => Tensor::zeros([1, self.config.dim], (id_emb.kind(), id_emb.device())),
            };
            id_emb.where_self(&is_warm, &stand_in.expand_as(&id_emb))
        } else {
            id_emb
        }
    }

    /// The projected text parts [b, dim] of rows `ids`, or `None` without a text tower.
    fn text_part(&self, side: Side, ids: &Tensor, train: bool) -> Option<Tensor> {
        match (self.text_rows(side, ids, train), &self.proj) {
            (Some(rows), Some((up, ip))) => Some(match side {
                Side::User => up.forward(&rows),
                Side::Item => ip.forward(&rows),
            }),
            _ => None,
        }
    }

    /// Representations [b, dim] of rows `ids` (host or device): ID part + text part.
    fn repr(&self, side: Side, ids: &Tensor, train: bool) -> Tensor {
        match self.parts(side, ids, train) {
            (id_emb, Some(text)) => id_emb + text,
            (id_emb, None) => id_emb,
        }
    }

    fn score_pairs(&self, u: &Tensor, i: &Tensor) -> Tensor {
        match &self.mlp {
            None => (u * i).sum_dim_intlist(-1, false, Kind::Float),
            Some((l0, l1)) => l1
                .forward(&l0.forward(&Tensor::cat(&[u, i], -1)).relu())
                .squeeze_dim(-1),
        }
    }

    /// Scores of (user, item) pairs: [b] for `users` [b] and `items` [b] (inference: no dropout).
    pub fn score(&self, users: &Tensor, items: &Tensor) -> Tensor {
        let scores = self.score_pairs(
            &self.repr(Side::User, users, false),
            &self.repr(Side::Item, items, false),
        );
        match self.item_scores(users, None) {
            Some(s) => scores + pick(&s, &items.to_device(s.device())),
            None => scores,
        }
    }

    /// Representations of every user and every item ([n_users, dim], [n_items, dim]) without
    /// gradients, for evaluation: in dynamic mode GPT-2 encodes every text once here. The ID
    /// parts are looked up in one go (the cold rows' stand-in computed once); the text parts go
    /// [`ENCODE_ROWS`] rows at a time. The values are those of [`Recommender::repr`], bit for bit.
    pub fn tables(&self, device: tch::Device) -> (Tensor, Tensor) {
        let here = |chunks: &TextChunks<'_>| {
            Ok::<_, std::convert::Infallible>(chunks.all_here().unwrap_or_default())
        };
        match self.tables_with(device, here) {
            Ok(tables) => tables,
            Err(never) => match never {},
        }
    }

    /// [`Recommender::tables`] with each side's text parts computed by `text` (called only with
    /// a text tower), which gets the side's chunks and returns every chunk's text parts in
    /// order: all of them here, or each rank encoding a share and gathering the others' (a
    /// chunk encoded anywhere holds the same bits, so the tables do too).
    pub fn tables_with<E>(
        &self,
        device: tch::Device,
        mut text: impl FnMut(&TextChunks<'_>) -> Result<Vec<Tensor>, E>,
    ) -> Result<(Tensor, Tensor), E> {
        let _guard = tch::no_grad_guard();
        let users = self.table(Side::User, self.config.n_users, device, &mut text)?;
        let all = Tensor::arange(self.config.n_users, (Kind::Int64, tch::Device::Cpu));
        let users = match self.item_scores(&all, None) {
            Some(s) => Tensor::cat(&[users, s.to_device(device)], 1),
            None => users,
        };
        Ok((
            users,
            self.table(Side::Item, self.config.n_items, device, &mut text)?,
        ))
    }

    /// The representations of rows `0..n` of one side (see [`Recommender::tables_with`]).
    fn table<E>(
        &self,
        side: Side,
        n: i64,
        device: tch::Device,
        text: &mut impl FnMut(&TextChunks<'_>) -> Result<Vec<Tensor>, E>,
    ) -> Result<Tensor, E> {
        let ids = Tensor::arange(n, (Kind::Int64, device));
        // Ids from the host too: the pools and the texts' lengths are known there.
        let host_ids = Tensor::arange(n, (Kind::Int64, tch::Device::Cpu));
        let id_part = match side {
            Side::User => self.with_pool(self.id_part(side, &ids, false), &host_ids, None),
            Side::Item => self.id_part(side, &ids, false),
        };
        if self.proj.is_none() || matches!(self.text, Text::None) {
            return Ok(id_part); // no text tower
        }
        // Every chunk but maybe the last is ENCODE_ROWS long.
        let rows: Vec<i64> = (0..n)
            .step_by(ENCODE_ROWS as usize)
            .map(|start| ENCODE_ROWS.min(n - start))
            .collect();
        let encode = |c: usize| {
            let start = c as i64 * ENCODE_ROWS;
            self.text_part(side, &host_ids.narrow(0, start, rows[c]), false)
        };
        let chunks = TextChunks::new(rows.clone(), self.config.dim, device, &encode);
        let parts = text(&chunks)?;
        Ok(if parts.is_empty() {
            id_part
        } else {
            id_part + Tensor::cat(&parts, 0)
        })
    }

    /// Representations [b, dim] of users training never saw, from their text alone (the
    /// average warm user's ID part, as a cold user's); `None` without a text tower or with text
    /// of the other mode.
    pub fn new_users(&self, text: &NewUserText) -> Option<Tensor> {
        let _guard = tch::no_grad_guard();
        let (user_proj, _) = self.proj.as_ref()?;
        let rows = match (&self.text, text) {
            (Text::Cached(_), NewUserText::Features(f)) => f.shallow_clone(),
            (Text::Dynamic { gpt2, .. }, NewUserText::Tokens(t)) => {
                let n = t.ids.size()[0];
                let ids = Tensor::arange(n, (Kind::Int64, tch::Device::Cpu));
                encode_rows(gpt2.as_ref(), t, &ids, false)
            }
            _ => return None,
        };
        // The average warm user's ID row and pool, as a cold user's.
        let warm = self.config.n_warm_users;
        let mut average = Tensor::zeros([1, self.config.dim], (Kind::Float, rows.device()));
        if warm > 0 && self.config.user_tower != UserTower::History {
            let rows_mean = self.user_id.ws.narrow(0, 0, warm);
            average += rows_mean
                .mean_dim([0i64].as_slice(), true, Kind::Float)
                .to_device(rows.device());
        }
        if let (Some(table), true) = (&self.history_item, warm > 0) {
            average += self.average_pool(table).to_device(rows.device());
        }
        let users = user_proj.forward(&rows) + average;
        // With the item-item matrix, a table row (see `score_tables`): the average user's scores.
        Some(match self.average_item_scores() {
            Some(s) => {
                let s = s
                    .to_device(users.device())
                    .expand([users.size()[0], -1], false);
                Tensor::cat(&[users, s], 1)
            }
            None => users,
        })
    }

    /// Scores of user representations `u` [b, dim] against item representations `items`
    /// [n, dim] → [b, n]. With the item-item matrix a user table's rows ([`Recommender::tables`])
    /// are [b, dim + n_items], their item-item scores after the representation, and `items`
    /// must then be every item's.
    pub fn score_tables(&self, u: &Tensor, items: &Tensor) -> Tensor {
        let d = items.size()[1];
        if u.size()[1] > d {
            let extra = u.narrow(1, d, u.size()[1] - d);
            return self.score_tables(&u.narrow(1, 0, d), items) + extra;
        }
        match &self.mlp {
            None => u.matmul(&items.transpose(0, 1)),
            Some(_) => {
                let (b, n, d) = (u.size()[0], items.size()[0], self.config.dim);
                let uu = u.unsqueeze(1).expand([b, n, d], false);
                let ii = items.unsqueeze(0).expand([b, n, d], false);
                self.score_pairs(&uu, &ii)
            }
        }
    }

    /// Scores of `users` [b] against every item: [b, n_items] (for full-ranking evaluation).
    pub fn score_all_items(&self, users: &Tensor) -> Tensor {
        let u = self.repr(Side::User, users, false);
        let all = Tensor::arange(self.config.n_items, (Kind::Int64, u.device()));
        let i = self.repr(Side::Item, &all, false);
        let scores = self.score_tables(&u, &i);
        match self.item_scores(users, None) {
            Some(s) => scores + s,
            None => scores,
        }
    }

    /// BPR loss as REFERENCE.md gives it, `-log(1e-10 + sigmoid(pos - neg)).mean()`, plus
    /// `l2` times the squared norms of the ID embeddings used in the batch, plus the config's
    /// `text_l2` times those of their text parts, each averaged over the batch.
    /// `train` turns GPT-2's dropout on (dynamic mode). The ids may be on the host (training
    /// gives them so: copied in without a wait, the texts' lengths read there) or on the
    /// model's device.
    pub fn bpr_loss(
        &self,
        users: &Tensor,
        pos: &Tensor,
        neg: &Tensor,
        l2: f64,
        train: bool,
    ) -> Tensor {
        let b = pos.size()[0];
        let batch = self.batch(users, pos, &Tensor::cat(&[pos, neg], 0), train);
        let (u, items) = (&batch.users, &batch.items);
        let (p, n) = (items.narrow(0, 0, b), items.narrow(0, b, b));
        let diff = self.score_pairs(u, &p) - self.score_pairs(u, &n);
        let diff = match &batch.item_scores {
            Some(s) => diff + pick(s, pos) - pick(s, neg),
            None => diff,
        };
        let bpr = -(diff.sigmoid() + 1e-10).log().mean(Kind::Float);
        let texts = (&batch.user_parts.1, &batch.item_parts.1);
        self.penalised(
            bpr,
            (&batch.user_parts.0, &batch.item_parts.0),
            texts,
            l2,
            b,
        )
    }

    /// Softmax cross-entropy of each positive against `negatives` [n] (item ids shared by the
    /// batch; every warm item for the full softmax): `-log softmax([s(u, p), s(u, n_1), ...])[0]`
    /// averaged over the batch, a negative equal to the sample's positive left out of its
    /// softmax. With `log_expected` (per warm item, `ln` of its expected count among the draws,
    /// on the model's device) every logit, the positive's too, is lowered by it: the logQ
    /// correction of sampled softmax. L2 as [`Recommender::bpr_loss`], on the users and the
    /// positives (the shared negatives are not a sample's own rows). The logits go to f32
    /// before the softmax, whatever the autocast.
    pub fn softmax_loss(
        &self,
        users: &Tensor,
        pos: &Tensor,
        negatives: &Tensor,
        log_expected: Option<&Tensor>,
        l2: f64,
        train: bool,
    ) -> Tensor {
        if let Some(n) = every_item(pos, negatives, log_expected) {
            return self.full_softmax_loss(users, pos, n, l2, train);
        }
        let b = pos.size()[0];
        let batch = self.batch(users, pos, &Tensor::cat(&[pos, negatives], 0), train);
        let (u, items) = (&batch.users, &batch.items);
        let n = items.size()[0] - b;
        let (p, negs) = (items.narrow(0, 0, b), items.narrow(0, b, n));
        let positive = self.score_pairs(u, &p).to_kind(Kind::Float);
        let others = self.score_tables(u, &negs).to_kind(Kind::Float);
        let device = positive.device();
        let (pos_d, neg_d) = (
            runtime::host_read::to_device(pos, device),
            runtime::host_read::to_device(negatives, device),
        );
        let (positive, others) = match &batch.item_scores {
            Some(s) => (
                positive + pick(s, &pos_d),
                others + s.index_select(1, &neg_d),
            ),
            None => (positive, others),
        };
        let (positive, others) = match log_expected {
            Some(log_q) => (
                positive - log_q.index_select(0, &pos_d),
                others - log_q.index_select(0, &neg_d).unsqueeze(0),
            ),
            None => (positive, others),
        };
        let hits = neg_d.unsqueeze(0).eq_tensor(&pos_d.unsqueeze(1));
        let others = others.masked_fill(&hits, f64::NEG_INFINITY);
        let logits = Tensor::cat(&[positive.unsqueeze(1), others], 1);
        let ce = -logits
            .log_softmax(1, Kind::Float)
            .select(1, 0)
            .mean(Kind::Float);
        let (u_id, u_text) = &batch.user_parts;
        let (i_id, i_text) = &batch.item_parts;
        let p_text = i_text.as_ref().map(|t| t.narrow(0, 0, b));
        self.penalised(ce, (u_id, &i_id.narrow(0, 0, b)), (u_text, &p_text), l2, b)
    }

    /// [`Recommender::softmax_loss`] against every item `0..n` (no correction): the logits are
    /// the users' scores of every item at once, each item's representation computed once for
    /// the batch (its positives' columns included) instead of once as a positive and again as
    /// a negative. The same loss, in fewer passes over the [b, n] logits.
    fn full_softmax_loss(
        &self,
        users: &Tensor,
        pos: &Tensor,
        n: i64,
        l2: f64,
        train: bool,
    ) -> Tensor {
        let b = pos.size()[0];
        let all = Tensor::arange(n, (Kind::Int64, tch::Device::Cpu));
        let batch = self.batch(users, pos, &all, train);
        let logits = self
            .score_tables(&batch.users, &batch.items)
            .to_kind(Kind::Float);
        let logits = match &batch.item_scores {
            Some(s) => logits + s.narrow(1, 0, n),
            None => logits,
        };
        let pos_d = runtime::host_read::to_device(pos, logits.device());
        let ce = -pick(&logits.log_softmax(1, Kind::Float), &pos_d).mean(Kind::Float);
        let (u_id, u_text) = &batch.user_parts;
        let (i_id, i_text) = &batch.item_parts;
        let p_text = i_text.as_ref().map(|t| t.index_select(0, &pos_d));
        let p_id = i_id.index_select(0, &pos_d);
        self.penalised(ce, (u_id, &p_id), (u_text, &p_text), l2, b)
    }

    /// The representations of a training batch's `users` and `items` (ids on the host or the
    /// device) with their parts, `positives[k]` left out of user `k`'s pools. The items go
    /// through GPT-2 together: one forward pass.
    fn batch(&self, users: &Tensor, positives: &Tensor, items: &Tensor, train: bool) -> Batch {
        // A sample's own positive is not in its user's pool: else the pool learns to point
        // at what the user has already seen.
        let user_parts = self.parts_leaving_out(Side::User, users, Some(positives), train);
        let item_parts = self.parts(Side::Item, items, train);
        let item_scores = self.item_scores(users, Some(positives));
        let (users, items) = match (&user_parts, &item_parts) {
            ((u_id, Some(ut)), (i_id, Some(it))) => (u_id + ut, i_id + it),
            ((u_id, _), (i_id, _)) => (u_id.shallow_clone(), i_id.shallow_clone()),
        };
        Batch {
            users,
            items,
            item_scores,
            user_parts,
            item_parts,
        }
    }

    /// `loss` plus `l2` times the squared norms of the ID rows `ids` (users', items'), plus
    /// `text_l2` times those of the text parts `texts`, each per sample of a batch of `b`.
    fn penalised(
        &self,
        loss: Tensor,
        ids: (&Tensor, &Tensor),
        texts: (&Option<Tensor>, &Option<Tensor>),
        l2: f64,
        b: i64,
    ) -> Tensor {
        let per_sample = 1.0 / b.max(1) as f64;
        let mut penalties = Vec::new();
        if l2 != 0.0 {
            let norms = ids.0.square().sum(Kind::Float) + ids.1.square().sum(Kind::Float);
            penalties.push(norms * (l2 * per_sample));
        }
        if let (Some(ut), Some(it)) = texts {
            if self.config.text_l2 != 0.0 {
                let norms = ut.square().sum(Kind::Float) + it.square().sum(Kind::Float);
                penalties.push(norms * (self.config.text_l2 * per_sample));
            }
        }
        penalties.into_iter().fold(loss, |loss, p| loss + p)
    }
}

/// `Some(n)` when `negatives` are every item `0..n` in order, each positive among them, and
/// nothing corrects the logits: the full softmax (ids read on the host; a device tensor is
/// copied, a few thousand ids once a micro-batch).
fn every_item(pos: &Tensor, negatives: &Tensor, log_expected: Option<&Tensor>) -> Option<i64> {
    if log_expected.is_some() {
        return None;
    }
    let host = |t: &Tensor| Vec::<i64>::try_from(t.to_device(tch::Device::Cpu)).ok();
    let (negatives, pos) = (host(negatives)?, host(pos)?);
    let n = negatives.len() as i64;
    let in_order = negatives.iter().zip(0..).all(|(&id, k)| id == k);
    (n > 0 && in_order && pos.iter().all(|&p| (0..n).contains(&p))).then_some(n)
}

/// Row `k`'s entry at column `ids[k]` of `scores` [b, n] → [b].
fn pick(scores: &Tensor, ids: &Tensor) -> Tensor {
    let ids = runtime::host_read::to_device(ids, scores.device());
    scores.gather(1, &ids.unsqueeze(1), false).squeeze_dim(1)
}

/// The popularity baseline: every item scored by its number of training interactions.
pub fn popularity_scores(train: &[Vec<u32>], n_items: usize) -> Vec<f32> {
    let mut counts = vec![0f32; n_items];
    for items in train {
        for &i in items {
            if let Some(c) = counts.get_mut(i as usize) {
                *c += 1.0;
            }
        }
    }
    counts
}

mod pools;
#[cfg(test)]
mod tests;
mod tokens;
