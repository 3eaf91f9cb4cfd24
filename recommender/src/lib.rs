//! `gptrec-recommender`: the recommender, as a library any trainer can drive.
//!
//! It owns:
//! - the data ([`data`]): MovieLens-1M's `.dat` files read and checked, the synthetic generator
//!   in their format, implicit feedback and the per-user split; [`input`] makes them the data a
//!   model trains on (texts included) and measures its shape for the memory estimate;
//! - the models ([`model`]): GPT-2 laid out like Hugging Face's, its tokenizer, and the
//!   recommender head (ID embeddings fused with text features, a scorer, BPR); [`text`] builds
//!   the text side from `[model]`;
//! - evaluation: the full-ranking metrics ([`eval`]) and their computation across ranks
//!   ([`sharded_eval`]), the popularity baseline included;
//! - [`task::RecTask`]: the model of `[model]` over the data, with a loss per micro-batch and an
//!   evaluation per split.
//!
//! It must not drive a training loop, write checkpoints, resolve batch plans or talk to the
//! launcher: that is the `worker`'s trainer, which calls [`task::RecTask`]. It uses the
//! distributed runtime (`runtime`) only through a `Collective` handed in, for the work that is
//! split across ranks (caching text features, evaluation).

pub mod data;
pub mod ease;
pub mod eval;
pub mod input;
pub mod model;
pub mod negatives;
pub mod per_user;
pub mod serve;
pub mod sharded_eval;
pub mod task;
pub mod text;

use data::DataError;
use eval::EvalError;
use model::gpt2::Gpt2Error;
use runtime::collective::CollectiveError;

pub use input::{data_shape, load_data, RecData};
pub use sharded_eval::{evaluate_baseline, evaluate_sharded, Baseline, EVAL_TIMEOUT_MIN};
pub use task::RecTask;

/// Why the recommender could not load, build, train or evaluate.
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

/// Which held-out part of the data an evaluation ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// Each warm user's validation items, among the warm items.
    Valid,
    /// Each warm user's test items, among the warm items.
    Test,
    /// Cold start (`data.cold_items`): each warm user's items among those training never saw,
    /// ranked among them.
    ColdItems,
    /// Cold start (`data.cold_users`): the items of each user training never saw, among the
    /// warm items.
    ColdUsers,
}

impl Split {
    /// `"valid"`, `"test"`, `"cold_items"` or `"cold_users"`, as records and messages say it.
    pub fn name(self) -> &'static str {
        match self {
            Split::Valid => "valid",
            Split::Test => "test",
            Split::ColdItems => "cold_items",
            Split::ColdUsers => "cold_users",
        }
    }

    /// The name in words: `test`, `cold items`.
    pub fn label(self) -> &'static str {
        match self {
            Split::Valid => "valid",
            Split::Test => "test",
            Split::ColdItems => "cold items",
            Split::ColdUsers => "cold users",
        }
    }
}
