//! Which GPUs this node can see, without libtorch: NVML (loaded at run time, so `launch` builds
//! and runs on machines without NVIDIA drivers) filtered by `CUDA_VISIBLE_DEVICES`. It only
//! reports; choosing how many workers to start, and on which GPUs, is the plan's job.

pub mod holders;

use common::cuda_visible::{select_visible, Visible};
use common::job_shape::{Count, CountError};
pub use holders::Holder;
use nvml_wrapper::Nvml;

/// `GPTREC_SIMULATE_GPUS=N`: pretend N GPUs of [`SIMULATED_BYTES`] each are present (tests and
/// dry runs on machines without GPUs; the workers still run on what they find).
pub const SIMULATE_VAR: &str = "GPTREC_SIMULATE_GPUS";
const SIMULATED_BYTES: u64 = 80 << 30;

/// One GPU a worker may use, in the order CUDA numbers the visible devices.
#[derive(Debug, Clone, PartialEq)]
pub struct Gpu {
    /// Index in CUDA's numbering after `CUDA_VISIBLE_DEVICES` (what `--gpu-ids` selects).
    pub cuda_index: usize,
    /// NVML's index: the number `nvidia-smi` shows (PCI bus order); for a MIG instance, that
    /// of no whole GPU (see `mig`).
    pub nvml_index: u32,
    /// The MIG instance's id, when `CUDA_VISIBLE_DEVICES` names one instead of a whole GPU.
    pub mig: Option<String>,
    pub name: String,
    pub total_bytes: u64,
    pub free_bytes: u64,
    /// The processes holding memory on it (NVML; none known for a MIG instance).
    pub holders: Vec<Holder>,
}

/// Why the visible GPUs are not known.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// None could be looked up (no NVML, ...): the plan goes on without GPUs, with a notice.
    #[error("{0}")]
    Unavailable(String),
    /// More GPUs than one node may run workers on ([`Count::Processes`]), or a simulation
    /// variable that cannot be read: a usage error.
    #[error("{0}")]
    TooMany(String),
}

/// The visible GPUs, or why none were found (for the notice).
pub fn visible_gpus() -> Result<Vec<Gpu>, GpuError> {
    let simulate = std::env::var(SIMULATE_VAR).ok();
    let all = match &simulate {
        Some(text) => simulated(text)?,
        None => nvml_gpus().map_err(GpuError::Unavailable)?,
    };
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let selected = select_visible(
        visible.as_deref(),
        &all.iter()
            .map(|(gpu, uuid)| (gpu.nvml_index, uuid.as_str()))
            .collect::<Vec<_>>(),
    );
    // MIG ids are not checked against devices, so the list alone bounds them.
    Count::Processes
        .at_most(selected.len() as u64)
        .map_err(|why| {
            GpuError::TooMany(format!(
                "environment variable CUDA_VISIBLE_DEVICES lists {} devices: {why}",
                selected.len()
            ))
        })?;
    Ok(selected
        .into_iter()
        .enumerate()
        .map(|(cuda_index, v)| match v {
            Visible::Gpu(physical) => Gpu {
                cuda_index,
                ..all[physical].0.clone()
            },
            Visible::Mig(id) => Gpu {
                cuda_index,
                ..mig_instance(&id, simulate.is_some())
            },
        })
        .collect())
}

/// A MIG instance by id: NVML finds `MIG-<uuid>` ids; the older `MIG-GPU-...` form, or no
/// NVML, leaves its memory unknown (0).
fn mig_instance(id: &str, simulated: bool) -> Gpu {
    let found = (!simulated)
        .then(|| Nvml::init().ok())
        .flatten()
        .and_then(|nvml| {
            let device = nvml.device_by_uuid(id).ok()?;
            let memory = device.memory_info().ok()?;
            Some((
                device.name().unwrap_or_else(|_| "MIG instance".into()),
                memory.total,
                memory.free,
            ))
        });
    let (name, total_bytes, free_bytes) =
        found.unwrap_or_else(|| ("MIG instance, memory unknown to NVML".into(), 0, 0));
    Gpu {
        cuda_index: 0,
        nvml_index: u32::MAX,
        mig: Some(id.to_string()),
        name,
        total_bytes,
        free_bytes,
        holders: Vec::new(),
    }
}

fn nvml_gpus() -> Result<Vec<(Gpu, String)>, String> {
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
            Gpu {
                cuda_index: 0,
                nvml_index: index,
                mig: None,
                name: device.name().unwrap_or_else(|_| "unknown GPU".into()),
                total_bytes: memory.as_ref().map_or(0, |m| m.total),
                free_bytes: memory.as_ref().map_or(0, |m| m.free),
                holders: holders::of_device(&device),
            },
            device.uuid().unwrap_or_default(),
        ));
    }
    Ok(all)
}

fn simulated(text: &str) -> Result<Vec<(Gpu, String)>, GpuError> {
    let count = Count::Processes.parse(text).map_err(|e| match e {
        CountError::NotANumber => {
            GpuError::Unavailable(format!("{SIMULATE_VAR}={text:?} is not a number of GPUs"))
        }
        CountError::TooMany(why) => GpuError::TooMany(format!(
            "environment variable {SIMULATE_VAR}={text:?}: {why}"
        )),
    })?;
    (0..count)
        .map(|index| {
            let holders = holders::simulated(index).map_err(GpuError::TooMany)?;
            let held: u64 = holders.iter().filter_map(|h| h.bytes).sum();
            Ok((
                Gpu {
                    cuda_index: 0,
                    nvml_index: index,
                    mig: None,
                    name: format!("simulated GPU ({SIMULATE_VAR})"),
                    total_bytes: SIMULATED_BYTES,
                    free_bytes: SIMULATED_BYTES.saturating_sub(held),
                    holders,
                },
                format!("GPU-simulated-{index:04}"),
            ))
        })
        .collect()
}
