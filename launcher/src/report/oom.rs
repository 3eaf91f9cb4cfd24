//! Whether the kernel's OOM killer is the likely cause of a worker's SIGKILL that `launch` did
//! not send: the host's count of OOM kills (`/proc/vmstat`'s `oom_kill`) when the job started
//! and when the failure is reported. Must not: decide anything (a line for the summary only).

use std::sync::OnceLock;

use nix::sys::signal::Signal;

use super::{Ending, WorkerRecord};

static AT_START: OnceLock<Option<u64>> = OnceLock::new();

/// Reads the count once, as the job starts (later calls keep the first).
pub fn mark_start() {
    let _ = AT_START.set(common::host_memory::oom_kills());
}

/// The summary's line for `root` when it was killed by a SIGKILL not from `launch` while the
/// host's OOM kill count went up; `None` otherwise, or when the count cannot be read.
pub fn line(root: &WorkerRecord) -> Option<String> {
    if root.ending != Ending::Signal(Signal::SIGKILL as i32) || root.sent_by_launcher.is_some() {
        return None;
    }
    let before = (*AT_START.get()?)?;
    let now = common::host_memory::oom_kills()?;
    explain(root.rank, before, now, common::host_memory::host_memory())
}

fn explain(
    rank: u32,
    before: u64,
    now: u64,
    host: Option<common::host_memory::HostMemory>,
) -> Option<String> {
    if now <= before {
        return None;
    }
    let ceiling = match host {
        Some(m) => format!("{} ({})", m.source(), common::memory::mib_text(m.total)),
        None => "this host's memory".into(),
    };
    Some(format!(
        "  the kernel's OOM killer ended {} process(es) on this host while the job ran (/proc/vmstat oom_kill {before} -> {now}): rank {rank} most likely ran out of memory under {ceiling}; `launch --dry-run` compares the memory estimate with it, and names smaller plans (batch.micro, dist.zero = 1)",
        now - before
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_rising_count_explains_a_sigkill() {
        assert_eq!(explain(1, 4, 4, None), None);
        let host = common::host_memory::HostMemory {
            available: 0,
            total: 900 << 20,
            cgroup: Some("/job".into()),
        };
        let line = explain(1, 4, 5, Some(host)).unwrap();
        assert!(line.starts_with("  the kernel's OOM killer ended 1 process(es) on this host while the job ran (/proc/vmstat oom_kill 4 -> 5): rank 1 most likely ran out of memory under the memory limit of cgroup /job (900.0 MiB)"), "{line}");
    }
}
