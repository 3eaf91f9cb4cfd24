//! Memory as the worker measures it: how much this process uses and its device has (RSS and
//! available RAM on the CPU; NVML's or the CUDA runtime's figures on a GPU), the budget it may
//! plan with, and how a failure is recognised as an allocation failure. The [`tracker`] turns
//! such a failure into the out-of-memory report.
//!
//! It never decides what to do about memory — the caller stops or picks another plan — and the
//! arithmetic of the estimate lives in `common::memory`.

pub mod tracker;

use common::memory::{self as estimate, DeviceKind};
use tch::Device;

pub use tracker::{PhaseTracker, RunFacts, EXIT_OUT_OF_MEMORY};

/// Whether an error text is an allocation failure: CUDA's caching allocator ("CUDA out of
/// memory"), a CUDA runtime error ("out of memory"), or libtorch's CPU allocator.
pub fn is_oom(text: &str) -> bool {
    let t = text.to_ascii_lowercase();
    t.contains("out of memory")
        || t.contains("can't allocate memory")
        || t.contains("not enough memory")
        || t.contains("cudaerrormemoryallocation")
        || t.contains("cublas_status_alloc_failed")
}

/// The message of a panic payload (`&str` or `String`; libtorch's errors arrive as panics from
/// tch's infallible calls), or a placeholder.
pub fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_string())
}

/// How one caught step of the `micro = "auto"` probe ended.
#[derive(Debug, PartialEq)]
pub enum ProbeOutcome<T> {
    /// It ran; the value the step returned.
    Fits(T),
    /// A real allocation failure: the next, smaller candidate may fit.
    OutOfMemory(String),
    /// Anything else (a device mismatch, a cuBLAS error, a bug): reported as itself, never as
    /// "does not fit".
    Failed(String),
}

/// Sorts a caught step (its error, or the payload of its panic) into a [`ProbeOutcome`].
pub fn classify_probe<T>(
    outcome: std::thread::Result<Result<T, tch::TchError>>,
) -> ProbeOutcome<T> {
    let text = match outcome {
        Ok(Ok(value)) => return ProbeOutcome::Fits(value),
        Ok(Err(e)) => e.to_string(),
        Err(payload) => panic_text(payload.as_ref()),
    };
    let line = first_line(&text);
    if is_oom(&text) {
        ProbeOutcome::OutOfMemory(line)
    } else {
        ProbeOutcome::Failed(line)
    }
}

/// Memory figures of this process and its device (bytes).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Usage {
    /// What this process uses: RSS on the CPU, its NVML figure on a GPU.
    pub used: u64,
    /// What is still free: available RAM, or free device memory.
    pub free: u64,
    /// All there is: RAM, or the device's memory.
    pub total: u64,
}

/// Bytes of a `/proc` line such as `VmRSS:   1234 kB`.
fn proc_kb(file: &str, key: &str) -> Option<u64> {
    std::fs::read_to_string(file).ok().and_then(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kb| kb * 1024)
    })
}

/// Current resident memory of this process.
pub fn rss_bytes() -> u64 {
    proc_kb("/proc/self/status", "VmRSS:").unwrap_or(0)
}

/// Peak resident memory of this process (the kernel's high-water mark).
pub fn peak_rss_bytes() -> u64 {
    proc_kb("/proc/self/status", "VmHWM:").unwrap_or(0)
}

/// What a CUDA device has and where the figures came from.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuMemory {
    pub free: u64,
    pub total: u64,
    /// This process's own use, when the source can tell (NVML's per-process figure).
    pub mine: Option<u64>,
    pub name: String,
    /// `NVML` or `CUDA runtime`.
    pub source: &'static str,
}

/// NVML, initialised once per process (on the first memory sample; every later sample, a few
/// a second while training, reuses it); `None` where it cannot load (no NVIDIA driver).
fn nvml() -> Option<&'static nvml_wrapper::Nvml> {
    static NVML: std::sync::OnceLock<Option<nvml_wrapper::Nvml>> = std::sync::OnceLock::new();
    NVML.get_or_init(|| nvml_wrapper::Nvml::init().ok())
        .as_ref()
}

/// NVML's figures for `cuda:index`: the whole GPU, or the MIG instance `CUDA_VISIBLE_DEVICES`
/// names (by its `MIG-<uuid>` id).
fn nvml_memory(index: usize) -> Option<GpuMemory> {
    use common::cuda_visible::Visible;
    let nvml = nvml()?;
    let count = nvml.device_count().ok()?;
    let all: Vec<(u32, String)> = (0..count)
        .map(|i| {
            let uuid = nvml
                .device_by_index(i)
                .ok()
                .and_then(|d| d.uuid().ok())
                .unwrap_or_default();
            (i, uuid)
        })
        .collect();
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let order = common::cuda_visible::select_visible(
        visible.as_deref(),
        &all.iter()
            .map(|(i, u)| (*i, u.as_str()))
            .collect::<Vec<_>>(),
    );
    let device = match order.get(index)? {
        Visible::Gpu(pos) => nvml.device_by_index(all.get(*pos)?.0).ok()?,
        Visible::Mig(id) => nvml.device_by_uuid(id.as_str()).ok()?,
    };
    let info = device.memory_info().ok()?;
    let pid = std::process::id();
    let mine = device.running_compute_processes().ok().and_then(|ps| {
        ps.into_iter()
            .find(|p| p.pid == pid)
            .and_then(|p| match p.used_gpu_memory {
                nvml_wrapper::enums::device::UsedGpuMemory::Used(b) => Some(b),
                nvml_wrapper::enums::device::UsedGpuMemory::Unavailable => None,
            })
    });
    Some(GpuMemory {
        free: info.free,
        total: info.total,
        mine,
        name: device.name().unwrap_or_else(|_| "GPU".into()),
        source: "NVML",
    })
}

/// The CUDA runtime's own figures for `cuda:index` (any device CUDA sees, MIG included).
fn cuda_memory(index: usize) -> Option<GpuMemory> {
    let runtime = runtime::cuda_runtime::CudaRuntime::load().ok()?;
    let (free, total) = runtime.memory(index).ok()?;
    Some(GpuMemory {
        free,
        total,
        mine: None,
        name: "GPU".into(),
        source: "CUDA runtime",
    })
}

/// `cuda:index`'s memory: NVML when it can map the device, else the CUDA runtime.
pub fn gpu_memory(index: usize) -> Option<GpuMemory> {
    nvml_memory(index).or_else(|| cuda_memory(index))
}

/// Memory of this process and what its device has left, and the device's name.
pub fn usage(device: Device) -> (Usage, String) {
    match device {
        Device::Cuda(i) => {
            let (u, name) = match gpu_memory(i) {
                Some(m) => (
                    Usage {
                        // Without a per-process figure (some containers), the device's use.
                        used: m.mine.unwrap_or(m.total.saturating_sub(m.free)),
                        free: m.free,
                        total: m.total,
                    },
                    m.name,
                ),
                None => (Usage::default(), "memory unknown".into()),
            };
            (u, format!("cuda:{i} ({name})"))
        }
        _ => {
            let host = common::host_memory::host_memory();
            (
                Usage {
                    used: rss_bytes(),
                    free: host.as_ref().map_or(0, |m| m.available),
                    total: host.as_ref().map_or(0, |m| m.total),
                },
                match host.and_then(|m| m.cgroup) {
                    Some(cgroup) => format!("cpu in cgroup {cgroup}"),
                    None => "cpu".to_string(),
                },
            )
        }
    }
}

/// `GPTREC_MEMORY_LIMIT_MB=N[@rank]`: pretend the device has N MiB (on `rank` only, when
/// given). A test and planning aid: `batch.micro = "auto"` and the estimate's checks use it.
pub fn simulated_limit(rank: u32) -> Result<Option<u64>, String> {
    let Ok(text) = std::env::var("GPTREC_MEMORY_LIMIT_MB") else {
        return Ok(None);
    };
    let (bytes, only) = estimate::parse_memory_limit(&text)?;
    Ok(only.is_none_or(|r| r == rank).then_some(bytes))
}

/// The memory one worker may plan with, and where the figure came from.
#[derive(Debug, Clone, PartialEq)]
pub struct Budget {
    pub bytes: u64,
    pub source: String,
}

/// The budget: the simulated limit when set; on a GPU, what is free now plus what this process
/// already holds (other processes use GPUs too; the card's total is not ours), from NVML or
/// else the CUDA runtime — `None` when neither can tell; on the CPU, its share of the available
/// RAM (shared by the `local_world` workers of the node) plus what it already holds.
pub fn budget(device: Device, limit: Option<u64>, local_world: u32) -> Option<Budget> {
    match device {
        Device::Cuda(i) => gpu_budget(limit, || nvml_memory(i), || cuda_memory(i)),
        _ => Some(limit.map_or_else(
            || {
                // This process's share of what the host (or its cgroup) has left, plus what it
                // holds already (as `usage` counts it on the CPU), read once.
                let host = common::host_memory::host_memory();
                let free = host.as_ref().map_or(0, |m| m.available);
                let source = host.map_or_else(|| "available RAM".into(), |m| m.source());
                Budget {
                    bytes: free / u64::from(local_world.max(1)) + rss_bytes(),
                    source: format!("{source} / {local_world} workers"),
                }
            },
            simulated_budget,
        )),
    }
}

fn simulated_budget(bytes: u64) -> Budget {
    Budget {
        bytes,
        source: "GPTREC_MEMORY_LIMIT_MB".into(),
    }
}

/// The GPU budget's fallback order: limit, NVML, CUDA runtime.
fn gpu_budget(
    limit: Option<u64>,
    nvml: impl FnOnce() -> Option<GpuMemory>,
    cuda: impl FnOnce() -> Option<GpuMemory>,
) -> Option<Budget> {
    if let Some(bytes) = limit {
        return Some(simulated_budget(bytes));
    }
    let m = nvml().or_else(cuda)?;
    Some(Budget {
        bytes: m.free + m.mine.unwrap_or(0),
        source: format!(
            "free{} per {}",
            if m.mine.is_some() {
                " + this process's"
            } else {
                ""
            },
            m.source
        ),
    })
}

/// The device kind of the estimate for a libtorch device.
pub fn device_kind(device: Device) -> DeviceKind {
    match device {
        Device::Cuda(_) => DeviceKind::Cuda,
        _ => DeviceKind::Cpu,
    }
}

/// Where this worker runs, for the memory estimate: its device's kind and the ranks on its host
/// (`LOCAL_WORLD_SIZE`).
pub fn placement(device: Device, local_world_size: u32) -> common::memory::Placement {
    common::memory::Placement::new(device_kind(device), u64::from(local_world_size))
}

/// Bytes as MiB (for records and JSON).
pub fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// The first line of libtorch's message. tch's infallible calls panic with the error's `Debug`
/// form, all on one line (as seen on an H200): ``called `Result::unwrap()` on an `Err` value:
/// Torch("CUDA out of memory. ...\n...")``; that wrapper is taken off and the message read up
/// to its first line break.
pub(crate) fn first_line(text: &str) -> String {
    const WRAPPER: &str = "called `Result::unwrap()` on an `Err` value: Torch(\"";
    let line = text.lines().next().unwrap_or(text).trim();
    match line.strip_prefix(WRAPPER) {
        Some(escaped) => unescape_first_line(escaped).trim().to_string(),
        None => line.to_string(),
    }
}

/// A `Debug`-escaped string's text up to its first line break or its closing quote.
fn unescape_first_line(escaped: &str) -> String {
    let mut out = String::new();
    let mut chars = escaped.chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => break,
            '\\' => match chars.next() {
                Some('n') | Some('r') | None => break,
                Some('t') => out.push(' '),
                Some(other @ ('"' | '\\' | '\'')) => out.push(other),
                Some(other) => {
                    out.push('\\');
                    out.push(other);
                }
            },
            _ => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libtorch_s_message_is_taken_out_of_tch_s_panic() {
        // As a real CUDA out-of-memory in a forward pass reached the report (H200, 2026-11-27).
        let panic = r#"called `Result::unwrap()` on an `Err` value: Torch("CUDA out of memory. Tried to allocate 3.38 GiB. GPU 0 has a total capacity of 139.80 GiB of which 1.67 GiB is free. See \"Memory Management\"\nException raised from malloc at /pytorch/c10/cuda/CUDACachingAllocator.cpp:1487 (most recent call first):\nframe #0: ...")"#;
        assert_eq!(
            first_line(panic),
            r#"CUDA out of memory. Tried to allocate 3.38 GiB. GPU 0 has a total capacity of 139.80 GiB of which 1.67 GiB is free. See "Memory Management""#
        );
        assert_eq!(
            first_line(r#"called `Result::unwrap()` on an `Err` value: Torch("short")"#),
            "short"
        );
        assert_eq!(first_line("  plain text\nsecond line"), "plain text");
        // Escaped backslashes and quotes come back as they were; a path's `\n` is no line break.
        let message = "cannot open C:\\new\\file \"x\"\tnow\nsecond line";
        let panic = format!(
            "called `Result::unwrap()` on an `Err` value: {:?}",
            tch::TchError::Torch(message.to_string())
        );
        assert_eq!(first_line(&panic), "cannot open C:\\new\\file \"x\" now");
    }

    #[test]
    fn allocation_failures_are_recognised() {
        assert!(is_oom(common::memory::SIMULATED_OOM));
        assert!(is_oom("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.19 GiB"));
        assert!(is_oom("CUDA error: out of memory"));
        assert!(is_oom("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: you tried to allocate 1234 bytes."));
        assert!(!is_oom("shape '[2, 3]' is invalid for input of size 5"));
    }

    #[test]
    fn only_a_real_out_of_memory_moves_the_probe_on() {
        let panic_of = |text: &str| -> std::thread::Result<Result<u64, tch::TchError>> {
            Err(Box::new(text.to_string()))
        };
        assert_eq!(classify_probe(Ok(Ok(7u64))), ProbeOutcome::Fits(7));
        assert!(matches!(
            classify_probe(panic_of("CUDA out of memory. Tried to allocate 2.00 GiB.\nmore")),
            ProbeOutcome::OutOfMemory(line) if line == "CUDA out of memory. Tried to allocate 2.00 GiB."
        ));
        assert!(matches!(
            classify_probe::<u64>(Ok(Err(tch::TchError::Torch(
                "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`".into()
            )))),
            ProbeOutcome::OutOfMemory(_)
        ));
        let device_mismatch = "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!";
        assert!(matches!(
            classify_probe::<u64>(Ok(Err(tch::TchError::Torch(device_mismatch.into())))),
            ProbeOutcome::Failed(line) if line.ends_with(device_mismatch)
        ));
        assert!(matches!(
            classify_probe(panic_of(
                "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx`"
            )),
            ProbeOutcome::Failed(_)
        ));
        let odd: std::thread::Result<Result<u64, tch::TchError>> = Err(Box::new(42u8));
        assert!(matches!(classify_probe(odd), ProbeOutcome::Failed(_)));
    }

    #[test]
    fn the_gpu_budget_is_free_memory_from_the_best_source() {
        let nvml = || {
            Some(GpuMemory {
                free: 30 << 30,
                total: 80 << 30,
                mine: Some(2 << 30),
                name: "H100".into(),
                source: "NVML",
            })
        };
        let cuda = || {
            Some(GpuMemory {
                free: 29 << 30,
                total: 80 << 30,
                mine: None,
                name: "GPU".into(),
                source: "CUDA runtime",
            })
        };
        // The simulated limit first, then NVML (free + ours, not the card's 80 GiB) ...
        assert_eq!(
            gpu_budget(Some(5 << 30), nvml, cuda).unwrap().bytes,
            5 << 30
        );
        let b = gpu_budget(None, nvml, cuda).unwrap();
        assert_eq!(b.bytes, 32 << 30);
        assert!(b.source.contains("NVML"), "{b:?}");
        // ... then the CUDA runtime when NVML cannot map the device (a MIG id, no NVML) ...
        let b = gpu_budget(None, || None, cuda).unwrap();
        assert_eq!(
            (b.bytes, b.source.contains("CUDA runtime")),
            (29 << 30, true)
        );
        // ... and never 0 for "unknown".
        assert_eq!(gpu_budget(None, || None, || None), None);
    }

    #[test]
    fn cpu_usage_is_read_from_proc() {
        let (u, name) = usage(Device::Cpu);
        assert_eq!(name, "cpu");
        assert!(u.used > 0 && u.total > u.used && u.free > 0, "{u:?}");
        assert!(peak_rss_bytes() >= rss_bytes() / 2);
    }
}
