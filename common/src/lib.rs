//! `gptrec-common`: what the launcher and the worker must agree on, without libtorch.
//!
//! This crate owns:
//! - the config schema and its validation ([`config`]): every field, its default, and the one
//!   place where field values are checked, with errors that name the file, line and key;
//! - the batch plan ([`batch`]): `micro x grad_accum x world = global`, derived and checked
//!   without ever truncating;
//! - the worker environment contract (torchrun-compatible variables);
//! - the job shape ([`job_shape`]): nodes, node rank, rendezvous, run id and processes per node
//!   from flags, Slurm ([`hostlist`]) or torchrun's `PET_*` variables, each with its source;
//! - the memory estimate ([`memory`]): each term of a worker's memory from the config and the
//!   batch plan, and the plans that keep the global batch with less memory;
//! - the job terms ([`job_terms`]): what every node of a job must agree on, and how two
//!   nodes' terms differ, by key;
//! - the flight recorder's record ([`flight`]): each rank's last collectives, in a ring file the
//!   worker maps and `launch` reads after a failure, and as JSON;
//! - the training plan ([`train_plan`]): a config and its batch plan, resolved once;
//! - the progress reports workers send `launch` for its live display ([`progress`]);
//! - the names of the shared-memory segments ([`shm_segments`]) that workers create and the
//!   launcher sweeps (and, through `/proc`, whether their creator is gone);
//! - how the tools open the files a user hands them and replace the files they write
//!   ([`files`]: never blocking on a FIFO, never writing through a planted link).
//!
//! It must not depend on libtorch (`tch`) or anything heavy: the launcher links it and must build
//! and start fast. It does no I/O beyond reading a config file (and `/proc`, and what callers
//! ask of [`files`]), spawns nothing, touches no devices, never prints, and never panics on
//! user-influenced input (errors are returned).

pub mod assets;
pub mod batch;
pub mod config;
pub mod cuda_visible;
pub mod data_layout;
pub mod env_contract;
pub mod files;
pub mod flight;
pub mod host_memory;
pub mod hostlist;
pub mod job_shape;
pub mod job_terms;
pub mod memory;
pub mod movielens;
pub mod progress;
pub mod shm_segments;
pub mod tensorboard;
pub mod train_plan;

/// Lower-case hex of `bytes` (digests in files, names and messages).
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
