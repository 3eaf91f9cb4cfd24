//! Who holds memory on a GPU: the processes NVML lists on it (compute and graphics), each with
//! its user, command line (from `/proc`) and memory, so that a GPU taken by a stale process of
//! an earlier job is named before a worker fails on it. `GPTREC_SIMULATE_GPU_HOLDERS` plays
//! NVML's part for the simulated GPUs (tests, dry runs).
//!
//! Must not: decide anything from the holders (the plan refuses or warns), or signal them.

use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::Device;

/// `GPU:PID:MIB,...`: the simulated GPU `GPU` is held by process `PID` (a real process, whose
/// user and command are read from `/proc`), with `MIB` MiB.
pub const SIMULATE_HOLDERS_VAR: &str = "GPTREC_SIMULATE_GPU_HOLDERS";

/// A process holding memory on a GPU.
#[derive(Debug, Clone, PartialEq)]
pub struct Holder {
    pub pid: u32,
    pub user: String,
    pub command: String,
    /// Its memory there, when NVML tells.
    pub bytes: Option<u64>,
}

impl Holder {
    fn of(pid: u32, bytes: Option<u64>) -> Holder {
        Holder {
            pid,
            user: crate::process::user_of(pid),
            command: crate::process::command_line(pid),
            bytes,
        }
    }
}

impl std::fmt::Display for Holder {
    /// `pid 4242 (user alice: python3 train.py, 30000 MiB)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "pid {} (user {}: {}", self.pid, self.user, self.command)?;
        match self.bytes {
            Some(b) => write!(f, ", {} MiB)", b >> 20),
            None => write!(f, ")"),
        }
    }
}

/// The processes NVML lists on `device`.
pub fn of_device(device: &Device<'_>) -> Vec<Holder> {
    let mut found: Vec<Holder> = Vec::new();
    let listed = [
        device.running_compute_processes(),
        device.running_graphics_processes(),
    ];
    for info in listed.into_iter().flatten().flatten() {
        if found.iter().any(|h| h.pid == info.pid) {
            continue;
        }
        let bytes = match info.used_gpu_memory {
            UsedGpuMemory::Used(b) => Some(b),
            UsedGpuMemory::Unavailable => None,
        };
        found.push(Holder::of(info.pid, bytes));
    }
    found
}

/// The simulated holders of GPU `index` ([`SIMULATE_HOLDERS_VAR`]); a malformed entry is an
/// error naming it.
pub fn simulated(index: u32) -> Result<Vec<Holder>, String> {
    let Ok(text) = std::env::var(SIMULATE_HOLDERS_VAR) else {
        return Ok(Vec::new());
    };
    let mut found = Vec::new();
    for entry in text.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let parts: Vec<u64> = entry
            .split(':')
            .filter_map(|p| p.trim().parse().ok())
            .collect();
        let [gpu, pid, mib] = parts[..] else {
            return Err(format!(
                "environment variable {SIMULATE_HOLDERS_VAR}: expected GPU:PID:MIB, got {entry:?}"
            ));
        };
        if gpu == u64::from(index) {
            found.push(Holder::of(pid as u32, Some(mib << 20)));
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_holder_is_shown_with_its_user_command_and_memory() {
        let me = std::process::id();
        let h = Holder::of(me, Some(3 << 30));
        let shown = h.to_string();
        assert!(shown.starts_with(&format!("pid {me} (user ")), "{shown}");
        assert!(shown.ends_with(", 3072 MiB)"), "{shown}");
        assert!(
            !h.user.is_empty() && h.user != "unknown" && !h.command.is_empty(),
            "{h:?}"
        );
    }
}
