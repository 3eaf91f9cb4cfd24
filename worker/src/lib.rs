//! The worker library: the recommender (`data`: MovieLens-1M and synthetic data; `model`:
//! GPT-2 and the recommender models; `eval`: full-ranking metrics; `rec`: the recommender as a
//! trainable task) and the trainer that runs it on the distributed runtime (`dist`):
//! `trainer` (the loop), `auto_micro`, `memory` (out-of-memory reports), `run_dir` (the run
//! directory's integrity) and `run_report`. The runtime itself lives in the `dist` crate and
//! knows nothing of any of this.

pub mod auto_micro;
pub mod data;
pub mod eval;
pub mod memory;
pub mod model;
pub mod rec;
pub mod run_dir;
pub mod run_report;
pub mod trainer;
