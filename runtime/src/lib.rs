//! `runtime`: the distributed runtime — what any data-parallel `tch` training needs, and nothing
//! about what is trained. It uses the rendezvous store (`store`, its own crate), owns the collectives
//! (`collective`: a TCP ring on CPUs, NCCL on GPUs), the DDP engine (`ddp`: gradient
//! accumulation, bucketed all-reduce), gradient clipping (`clip`), the step's counted reads of values into the host (`host_read`), listed rows of tables (`rows`), the sharded sampler (`sampler`), AdamW and the
//! learning-rate schedule (`optim`), checkpoints (`checkpoint`), the shared generator (`rng`)
//! the few CUDA runtime calls it makes itself (`cuda_runtime`) and libtorch's TF32 switch
//! (`tf32`). It must not know about
//! recommenders, data sets or metrics: the worker's trainer wires a model to it, and the
//! `ddp-fixture` trains a plain MLP through it. Before any collective of a multi-node job,
//! `agreement` checks that every rank runs the same job (terms the caller gives); `job_watch`
//! tells every rank at once that another ended before the job finished.

pub mod agreement;
pub mod checkpoint;
pub mod clip;
pub mod collective;
pub mod cuda_runtime;
pub mod ddp;
pub mod host_read;
pub mod job_watch;
pub mod optim;
pub mod rng;
pub mod rows;
pub mod sampler;
mod shim;
pub mod tf32;
/// The rendezvous store, from its own crate (`launch` uses it too, without libtorch).
pub use ::store;
