//! The worker library: everything one data-parallel training process needs — rendezvous
//! (`store`), collectives (`collective`: `tcp`, `nccl`), the DDP engine (`ddp`), the sharded
//! sampler (`sampler`), the optimizer (`optim`), checkpoints (`checkpoint`) and the run
//! directory's integrity (`run_dir`). Each module owns
//! one concern; none of them knows the recommender model (the engine works on any `tch` model).

pub mod auto_micro;
pub mod checkpoint;
pub mod collective;
pub mod cuda_runtime;
pub mod data;
pub mod ddp;
pub mod eval;
pub mod memory;
pub mod model;
pub mod optim;
pub mod rec;
pub mod rng;
pub mod run_dir;
pub mod run_report;
pub mod sampler;
pub mod store;
pub mod trainer;
