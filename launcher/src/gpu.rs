//! Which GPUs this node can see, without libtorch: NVML (loaded at run time, so `launch` builds
//! and runs on machines without NVIDIA drivers) filtered by `CUDA_VISIBLE_DEVICES`. It only
//! reports; choosing how many workers to start is the plan's job.

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

/// Applies CUDA's `CUDA_VISIBLE_DEVICES` rules to the physical devices `(nvml index, uuid)`:
/// entries are indices or (prefixes of) UUIDs; the list ends at the first invalid or repeated
/// entry, as CUDA does. Returns positions into `devices`.
pub fn select_visible(visible: Option<&str>, devices: &[(u32, &str)]) -> Vec<usize> {
    let Some(visible) = visible else {
        return (0..devices.len()).collect();
    };
    let mut chosen = Vec::new();
    for entry in visible.split(',').map(str::trim) {
        if entry.is_empty() {
            break;
        }
        let found = if let Ok(index) = entry.parse::<u32>() {
            devices.iter().position(|(i, _)| *i == index)
        } else {
            let want = entry.strip_prefix("GPU-").unwrap_or(entry);
            let matches: Vec<usize> = devices
                .iter()
                .enumerate()
                .filter(|(_, (_, uuid))| {
                    uuid.strip_prefix("GPU-").unwrap_or(uuid).starts_with(want)
                })
                .map(|(pos, _)| pos)
                .collect();
            (matches.len() == 1).then(|| matches[0])
        };
        match found {
            Some(pos) if !chosen.contains(&pos) => chosen.push(pos),
            _ => break,
        }
    }
    chosen
}

#[cfg(test)]
mod tests {
    use super::select_visible;

    const DEVICES: [(u32, &str); 4] = [
        (0, "GPU-aaaa-1111"),
        (1, "GPU-bbbb-2222"),
        (2, "GPU-cccc-3333"),
        (3, "GPU-abcd-4444"),
    ];

    #[test]
    fn unset_means_all() {
        assert_eq!(select_visible(None, &DEVICES), vec![0, 1, 2, 3]);
    }

    #[test]
    fn indices_and_uuids_in_the_given_order() {
        assert_eq!(select_visible(Some("2,0"), &DEVICES), vec![2, 0]);
        assert_eq!(select_visible(Some("GPU-bbbb,3"), &DEVICES), vec![1, 3]);
    }

    #[test]
    fn list_stops_at_first_invalid_entry() {
        assert_eq!(select_visible(Some("1,7,2"), &DEVICES), vec![1]);
        assert_eq!(select_visible(Some("-1"), &DEVICES), Vec::<usize>::new());
        assert_eq!(select_visible(Some(""), &DEVICES), Vec::<usize>::new());
        // "GPU-a" is ambiguous (aaaa and abcd): invalid.
        assert_eq!(select_visible(Some("0,GPU-a"), &DEVICES), vec![0]);
        assert_eq!(select_visible(Some("0,0"), &DEVICES), vec![0]);
    }
}
