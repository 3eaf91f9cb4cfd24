//! Which of the GPUs this process can see is its rank's: torchrun's `cuda:LOCAL_RANK` where the
//! process sees the node's GPUs, and the one GPU it sees where the scheduler gave each task its
//! own (Slurm's `--gpus-per-task=1` or `--gpu-bind=single:1`, Kubernetes' one GPU per container).
//! Owns only that choice; it neither reads the environment nor touches CUDA.

/// The CUDA index for local rank `local_rank` among `visible` GPUs: the local rank where it is
/// one of them, the only GPU where the process sees exactly one, else an error that says so.
pub fn gpu_index(local_rank: u32, visible: u32) -> Result<u32, String> {
    match visible {
        0 => Err("no GPU is visible to this process".into()),
        // Each task bound to its own GPU: whatever its local rank, that one is its GPU.
        1 => Ok(0),
        _ if local_rank < visible => Ok(local_rank),
        _ => Err(format!(
            "LOCAL_RANK {local_rank} has no GPU: this process sees {visible} (CUDA_VISIBLE_DEVICES={}); start at most {visible} processes per node, or give each process exactly one GPU (Slurm: --gpus-per-task=1)",
            std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "unset".into())
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_local_rank_picks_among_the_nodes_gpus() {
        assert_eq!(gpu_index(0, 8), Ok(0));
        assert_eq!(gpu_index(7, 8), Ok(7));
        assert_eq!(gpu_index(2, 4), Ok(2));
    }

    #[test]
    fn a_process_bound_to_one_gpu_uses_it_whatever_its_local_rank() {
        // Slurm --gpus-per-task=1: local ranks 0..3 each see one GPU, as cuda:0.
        for rank in 0..4 {
            assert_eq!(gpu_index(rank, 1), Ok(0));
        }
    }

    #[test]
    fn too_few_gpus_for_the_local_rank_is_an_error_naming_both() {
        let e = gpu_index(3, 2).unwrap_err();
        assert!(e.contains("LOCAL_RANK 3") && e.contains("sees 2"), "{e}");
        assert!(gpu_index(0, 0).is_err());
    }
}
