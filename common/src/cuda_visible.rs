//! `CUDA_VISIBLE_DEVICES` as CUDA reads it: which physical devices (NVML indices) the visible
//! CUDA devices 0, 1, ... are. Pure logic, shared by the launcher (which GPUs to plan for) and the
//! worker (which NVML device its `cuda:LOCAL_RANK` is, for memory figures).

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
