//! The worker library: what wires the recommender (the `recommender` crate) to the distributed
//! runtime (the `dist` crate) and runs it as one rank of a job — `trainer` (the loop, over any
//! [`trainer::Task`]), `rec_task` (the recommender as such a task), `auto_micro`, `curves` (the run's pictures), `memory`
//! (measured memory and the out-of-memory tracker), `progress_channel` (live progress for
//! `launch`), `regroup` (an elastic `launch`'s request to stop at the next checkpoint),
//! `run_dir` (the run directory's integrity)
//! and `run_report`. Neither the runtime nor the recommender knows about any of this.

pub mod auto_micro;
pub mod curves;
pub mod memory;
pub mod progress_channel;
pub mod rec_task;
pub mod regroup;
pub mod run_dir;
pub mod run_report;
pub mod trainer;
