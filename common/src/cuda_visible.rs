//! `CUDA_VISIBLE_DEVICES` as CUDA reads it: which physical devices (NVML indices) the visible
//! CUDA devices 0, 1, ... are. Pure logic, shared by the launcher (which GPUs to plan for) and the
//! worker (which NVML device its `cuda:LOCAL_RANK` is, for memory figures).

/// One device CUDA will number, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Visible {
    /// A whole GPU: its position in the `devices` given.
    Gpu(usize),
    /// A MIG instance, by the id given: `MIG-<uuid>` (drivers since R470) or the older
    /// `MIG-GPU-<gpu uuid>/<gpu instance>/<compute instance>`. NVML finds the first by UUID.
    Mig(String),
}

impl Visible {
    /// The GPU's position in `devices`, for a whole GPU.
    pub fn gpu(&self) -> Option<usize> {
        match self {
            Visible::Gpu(pos) => Some(*pos),
            Visible::Mig(_) => None,
        }
    }
}

/// Whether a `CUDA_VISIBLE_DEVICES` entry names a MIG instance, in either form.
pub fn is_mig_id(entry: &str) -> bool {
    let Some(rest) = entry.strip_prefix("MIG-") else {
        return false;
    };
    match rest.strip_prefix("GPU-") {
        // MIG-GPU-<uuid>/<gi>/<ci>
        Some(legacy) => {
            let parts: Vec<&str> = legacy.split('/').collect();
            parts.len() == 3
                && !parts[0].is_empty()
                && parts[1..].iter().all(|p| p.parse::<u32>().is_ok())
        }
        None => !rest.is_empty() && rest.chars().all(|c| c.is_ascii_hexdigit() || c == '-'),
    }
}

/// Applies CUDA's `CUDA_VISIBLE_DEVICES` rules to the physical devices `(nvml index, uuid)`:
/// entries are indices, (prefixes of) GPU UUIDs, or MIG instance ids; the list ends at the first
/// invalid or repeated entry, as CUDA does.
pub fn select_visible(visible: Option<&str>, devices: &[(u32, &str)]) -> Vec<Visible> {
    let Some(visible) = visible else {
        return (0..devices.len()).map(Visible::Gpu).collect();
    };
    let mut chosen = Vec::new();
    for entry in visible.split(',').map(str::trim) {
        if entry.is_empty() {
            break;
        }
        let found = if is_mig_id(entry) {
            Some(Visible::Mig(entry.to_string()))
        } else if let Ok(index) = entry.parse::<u32>() {
            devices
                .iter()
                .position(|(i, _)| *i == index)
                .map(Visible::Gpu)
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
            (matches.len() == 1).then(|| Visible::Gpu(matches[0]))
        };
        match found {
            Some(v) if !chosen.contains(&v) => chosen.push(v),
            _ => break,
        }
    }
    chosen
}

#[cfg(test)]
mod tests {
    use super::{is_mig_id, select_visible, Visible};

    fn gpus(v: Vec<Visible>) -> Vec<usize> {
        v.iter().map(|v| v.gpu().expect("a whole GPU")).collect()
    }

    const DEVICES: [(u32, &str); 4] = [
        (0, "GPU-aaaa-1111"),
        (1, "GPU-bbbb-2222"),
        (2, "GPU-cccc-3333"),
        (3, "GPU-abcd-4444"),
    ];

    #[test]
    fn unset_means_all() {
        assert_eq!(gpus(select_visible(None, &DEVICES)), vec![0, 1, 2, 3]);
    }

    #[test]
    fn indices_and_uuids_in_the_given_order() {
        assert_eq!(gpus(select_visible(Some("2,0"), &DEVICES)), vec![2, 0]);
        assert_eq!(
            gpus(select_visible(Some("GPU-bbbb,3"), &DEVICES)),
            vec![1, 3]
        );
    }

    #[test]
    fn list_stops_at_first_invalid_entry() {
        assert_eq!(gpus(select_visible(Some("1,7,2"), &DEVICES)), vec![1]);
        assert_eq!(
            gpus(select_visible(Some("-1"), &DEVICES)),
            Vec::<usize>::new()
        );
        assert_eq!(
            gpus(select_visible(Some(""), &DEVICES)),
            Vec::<usize>::new()
        );
        // "GPU-a" is ambiguous (aaaa and abcd): invalid.
        assert_eq!(gpus(select_visible(Some("0,GPU-a"), &DEVICES)), vec![0]);
        assert_eq!(gpus(select_visible(Some("0,0"), &DEVICES)), vec![0]);
    }

    #[test]
    fn mig_instances_in_both_forms() {
        let modern = "MIG-4b1a5f0e-8d2c-5a37-9e8f-1c2d3e4f5a6b";
        let legacy = "MIG-GPU-9c1c8a7e-1234-5678-9abc-def012345678/1/0";
        assert!(is_mig_id(modern) && is_mig_id(legacy));
        assert!(!is_mig_id("GPU-4b1a5f0e") && !is_mig_id("MIG-") && !is_mig_id("MIG-GPU-x/1"));
        assert_eq!(
            select_visible(Some(&format!("{modern},{legacy}")), &DEVICES),
            vec![Visible::Mig(modern.into()), Visible::Mig(legacy.into())]
        );
        // A repeated MIG id ends the list, as a repeated GPU does.
        assert_eq!(
            select_visible(Some(&format!("{modern},{modern},1")), &DEVICES),
            vec![Visible::Mig(modern.into())]
        );
    }
}
