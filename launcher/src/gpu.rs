//! Which GPUs this node can see, without libtorch: NVML (loaded at run time, so `launch` builds
//! and runs on machines without NVIDIA drivers) filtered by `CUDA_VISIBLE_DEVICES`. It only
//! reports; choosing how many workers to start is the plan's job.

use common::cuda_visible::select_visible;
use nvml_wrapper::Nvml;

/// One GPU a worker may use, in the order CUDA numbers the visible devices.
#[derive(Debug, Clone, PartialEq)]
pub struct Gpu {
    /// Index in CUDA's numbering after `CUDA_VISIBLE_DEVICES` (what `LOCAL_RANK` selects).
    pub cuda_index: usize,
    pub name: String,
    pub total_bytes: u64,
    pub free_bytes: u64,
}

/// The visible GPUs, or why none were found (for the notice).
pub fn visible_gpus() -> Result<Vec<Gpu>, String> {
    let nvml = Nvml::init().map_err(|e| format!("NVML is not available ({e})"))?;
    let count = nvml
        .device_count()
        .map_err(|e| format!("NVML could not count devices ({e})"))?;
    let mut all = Vec::new();
    for index in 0..count {
        let device = match nvml.device_by_index(index) {
            Ok(device) => device,
            Err(_) => continue,
        };
        let memory = device.memory_info().ok();
        all.push((
            index,
            device.uuid().unwrap_or_default(),
            Gpu {
                cuda_index: 0,
                name: device.name().unwrap_or_else(|_| "unknown GPU".into()),
                total_bytes: memory.as_ref().map_or(0, |m| m.total),
                free_bytes: memory.as_ref().map_or(0, |m| m.free),
            },
        ));
    }
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let selected = select_visible(
        visible.as_deref(),
        &all.iter()
            .map(|(i, uuid, _)| (*i, uuid.as_str()))
            .collect::<Vec<_>>(),
    );
    Ok(selected
        .into_iter()
        .enumerate()
        .map(|(cuda_index, physical)| {
            let mut gpu = all[physical].2.clone();
            gpu.cuda_index = cuda_index;
            gpu
        })
        .collect())
}
