//! The worker library: what wires the recommender (the `recommender` crate) to the distributed
//! runtime (the `runtime` crate) and runs it as one rank of a job — `trainer` (the loop, over any
//! [`trainer::Task`]), `rec_task` (the recommender as such a task), `auto_micro`, `curves` (the run's pictures), `error_line` (the one line a binary prints for an error), `gpu_choice` (a rank's GPU), `memory`
//! (measured memory and the out-of-memory tracker), `progress_channel` (live progress for
//! `launch`), `regroup` (an elastic `launch`'s request to stop at the next checkpoint),
//! `run_dir` (the run directory's integrity), `run_report` and `single_process` (a one-process
//! collective for the tools). Neither the runtime nor the recommender knows about any of this.

pub mod auto_micro;
pub mod auto_zero;
pub mod curves;
pub mod error_line;
mod gpu_choice;
pub mod memory;
pub mod peer_dump;
pub mod preempt;
pub mod progress_channel;
pub mod rec_task;
pub mod regroup;
pub mod run_dir;
pub mod run_report;
pub mod single_process;
pub mod trainer;

pub use gpu_choice::gpu_index;
