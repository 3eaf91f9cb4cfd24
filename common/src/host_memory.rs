//! What the host lets this process's memory grow to: `/proc/meminfo`'s available and total
//! memory, bounded by the memory limit of the cgroup the process runs in (v2 `memory.max`, v1
//! `memory.limit_in_bytes`; the tightest of the cgroup and its ancestors) less what that cgroup
//! already uses. A container's, a Slurm job's or a Kubernetes pod's limit is what the kernel's
//! OOM killer enforces, not the host's RAM, so the memory plan must see it.
//!
//! Reads files only (the parsing is pure, for tests); a figure that cannot be read is `None`,
//! never an error or a panic.

use std::path::{Path, PathBuf};

/// Memory a process on this host may still use, and its ceiling.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostMemory {
    /// Bytes the host (or the cgroup, when its limit is lower) can still give.
    pub available: u64,
    /// The ceiling: the cgroup's limit when it is below the host's RAM, else `MemTotal`.
    pub total: u64,
    /// The cgroup whose limit is the ceiling (its path in its hierarchy), when one is.
    pub cgroup: Option<String>,
}

impl HostMemory {
    /// Where the figures come from, for messages: `available RAM` or `the memory limit of
    /// cgroup /slurm/job_42`.
    pub fn source(&self) -> String {
        match &self.cgroup {
            Some(path) => format!("the memory limit of cgroup {path}"),
            None => "available RAM".into(),
        }
    }
}

/// This process's memory on this host, read now.
pub fn host_memory() -> Option<HostMemory> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let field = |key: &str| -> Option<u64> {
        meminfo
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kb| kb * 1024)
    };
    let (available, total) = (field("MemAvailable:")?, field("MemTotal:")?);
    let read = |p: &Path| std::fs::read_to_string(p).ok();
    let limit = match (
        read(Path::new("/proc/self/cgroup")),
        read(Path::new("/proc/self/mountinfo")),
    ) {
        (Some(cgroup), Some(mountinfo)) => cgroup_limit(&cgroup, &mountinfo, read),
        _ => None,
    };
    Some(bounded(available, total, limit))
}

/// Processes the kernel's OOM killer has ended on this host since it booted (`/proc/vmstat`'s
/// `oom_kill`, Linux 4.13 and later; those a cgroup's limit caused included), or `None`.
pub fn oom_kills() -> Option<u64> {
    let vmstat = std::fs::read_to_string("/proc/vmstat").ok()?;
    oom_kill_count(&vmstat)
}

fn oom_kill_count(vmstat: &str) -> Option<u64> {
    vmstat
        .lines()
        .find_map(|l| l.strip_prefix("oom_kill "))
        .and_then(|v| v.trim().parse().ok())
}

/// The host's figures under a cgroup's limit, when that limit is the lower.
fn bounded(available: u64, total: u64, limit: Option<CgroupLimit>) -> HostMemory {
    match limit {
        Some(l) if l.limit < total => HostMemory {
            available: available.min(l.headroom),
            total: l.limit,
            cgroup: Some(l.path),
        },
        _ => HostMemory {
            available,
            total,
            cgroup: None,
        },
    }
}

/// What the cgroups from a process's own up to its hierarchy's root allow: the lowest limit
/// (and the cgroup that sets it), and the least room left under any of them.
#[derive(Debug, Clone, PartialEq, Eq)]
struct CgroupLimit {
    limit: u64,
    /// The least, over the limited cgroups, of the limit less the working set (usage less the
    /// inactive page cache the kernel reclaims before it kills: what kubelet counts too).
    headroom: u64,
    path: String,
}

/// Limits at or above this are "no limit" (v1 writes 2^63 rounded down to a page).
const UNLIMITED: u64 = 1 << 62;

/// A hierarchy's files: the limit, the usage, and the `memory.stat` key of the inactive page
/// cache in it.
type Files = (&'static str, &'static str, &'static str);
const V1_FILES: Files = (
    "memory.limit_in_bytes",
    "memory.usage_in_bytes",
    "total_inactive_file",
);
const V2_FILES: Files = ("memory.max", "memory.current", "inactive_file");

/// From `/proc/self/cgroup` and `/proc/self/mountinfo`'s text, reading the controller's files
/// with `read`: the v1 memory controller's hierarchy where it is mounted (it is the one that
/// limits memory on a hybrid host), else the v2 one.
fn cgroup_limit(
    cgroup: &str,
    mountinfo: &str,
    read: impl Fn(&Path) -> Option<String>,
) -> Option<CgroupLimit> {
    let v1 = cgroup.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        controllers
            .split(',')
            .any(|c| c == "memory")
            .then_some(path)
    });
    if let Some(at) = v1.and_then(|p| mount_of(mountinfo, Some("memory"), p)) {
        return tightest(&at, V1_FILES, &read);
    }
    let v2 = cgroup.lines().find_map(|l| l.strip_prefix("0::"))?;
    tightest(&mount_of(mountinfo, None, v2)?, V2_FILES, &read)
}

/// Where the cgroup at `path` lies on disk: the mount of its hierarchy (the v1 one holding
/// `controller`, or the v2 one for `None`) whose root is `path` or one of its ancestors (the
/// longest such), and `path` below that root. `None` when no mount shows it (another
/// namespace's cgroup: better no limit than another cgroup's).
fn mount_of(mountinfo: &str, controller: Option<&str>, path: &str) -> Option<(PathBuf, String)> {
    mountinfo
        .lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let left: Vec<&str> = left.split(' ').collect();
            let right: Vec<&str> = right.split(' ').collect();
            let (fstype, options) = (*right.first()?, right.get(2).copied().unwrap_or(""));
            let wanted = match controller {
                Some(c) => fstype == "cgroup" && options.split(',').any(|o| o == c),
                None => fstype == "cgroup2",
            };
            let (root, point) = (*left.get(3)?, *left.get(4)?);
            let below = below(path, root)?;
            wanted.then(|| (root.len(), PathBuf::from(point), below.to_string()))
        })
        .max_by_key(|(len, ..)| *len)
        .map(|(_, point, below)| (point, below))
}

/// `path` relative to `root` when `root` is it or one of its ancestors (whole components).
fn below<'p>(path: &'p str, root: &str) -> Option<&'p str> {
    let root = root.trim_end_matches('/');
    let rest = path.strip_prefix(root)?;
    (rest.is_empty() || rest.starts_with('/')).then(|| rest.trim_start_matches('/'))
}

/// The limits from the cgroup at `below` (under `mount`) up to the mount's root.
fn tightest(
    (mount, below): &(PathBuf, String),
    (limit_file, usage_file, inactive_key): Files,
    read: &impl Fn(&Path) -> Option<String>,
) -> Option<CgroupLimit> {
    let mut best: Option<CgroupLimit> = None;
    let mut dir = below.clone();
    loop {
        let at = mount.join(&dir);
        let number = |file: &str| -> Option<u64> { read(&at.join(file))?.trim().parse().ok() };
        if let Some(limit) = number(limit_file).filter(|l| *l < UNLIMITED) {
            let inactive = read(&at.join("memory.stat")).and_then(|stat| {
                stat.lines()
                    .find_map(|l| l.strip_prefix(inactive_key)?.strip_prefix(' '))
                    .and_then(|v| v.trim().parse::<u64>().ok())
            });
            let used = number(usage_file)
                .unwrap_or(0)
                .saturating_sub(inactive.unwrap_or(0));
            let headroom = limit.saturating_sub(used);
            best = Some(match best {
                Some(b) if b.limit <= limit => CgroupLimit {
                    headroom: b.headroom.min(headroom),
                    ..b
                },
                b => CgroupLimit {
                    limit,
                    headroom: b.map_or(headroom, |b| b.headroom.min(headroom)),
                    path: format!("/{dir}"),
                },
            });
        }
        if dir.is_empty() {
            return best;
        }
        dir = dir
            .rsplit_once('/')
            .map_or(String::new(), |(up, _)| up.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    const V1_MOUNTS: &str = "\
30 25 0:26 / /sys/fs/cgroup/memory rw,relatime shared:12 - cgroup cgroup rw,memory
31 25 0:27 / /sys/fs/cgroup/unified rw,relatime shared:13 - cgroup2 cgroup2 rw
32 25 0:28 / /sys/fs/cgroup/cpu rw,relatime shared:14 - cgroup cgroup rw,cpu
";
    const V2_MOUNTS: &str = "\
29 23 0:25 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate
";

    fn files(entries: &[(&str, &str)]) -> impl Fn(&Path) -> Option<String> {
        let map: HashMap<PathBuf, String> = entries
            .iter()
            .map(|(p, v)| (PathBuf::from(p), v.to_string()))
            .collect();
        move |p: &Path| map.get(p).cloned()
    }

    #[test]
    fn a_v1_memory_limit_bounds_the_host_and_the_tightest_ancestor_counts() {
        let cgroup = "4:memory:/slurm/job_42/step_0\n1:cpu:/\n0::/\n";
        let read = files(&[
            (
                "/sys/fs/cgroup/memory/slurm/job_42/step_0/memory.limit_in_bytes",
                "9223372036854771712\n",
            ),
            (
                "/sys/fs/cgroup/memory/slurm/job_42/memory.limit_in_bytes",
                "2147483648\n",
            ),
            (
                "/sys/fs/cgroup/memory/slurm/job_42/memory.usage_in_bytes",
                "536870912\n",
            ),
            (
                "/sys/fs/cgroup/memory/slurm/memory.limit_in_bytes",
                "8589934592\n",
            ),
            (
                "/sys/fs/cgroup/memory/memory.limit_in_bytes",
                "9223372036854771712\n",
            ),
        ]);
        let l = cgroup_limit(cgroup, V1_MOUNTS, read).unwrap();
        assert_eq!(
            l,
            CgroupLimit {
                limit: 2 << 30,
                headroom: 1536 << 20,
                path: "/slurm/job_42".into()
            }
        );
        let m = bounded(10 << 30, 16 << 30, Some(l));
        assert_eq!((m.available, m.total), (1536 << 20, 2 << 30));
        assert_eq!(m.source(), "the memory limit of cgroup /slurm/job_42");
    }

    #[test]
    fn a_v2_memory_max_counts_and_max_means_none() {
        let cgroup = "0::/kubepods/pod1/ctr\n";
        let read = files(&[
            ("/sys/fs/cgroup/kubepods/pod1/ctr/memory.max", "max\n"),
            ("/sys/fs/cgroup/kubepods/pod1/memory.max", "1073741824\n"),
            ("/sys/fs/cgroup/kubepods/pod1/memory.current", "104857600\n"),
            ("/sys/fs/cgroup/kubepods/memory.max", "max\n"),
        ]);
        let l = cgroup_limit(cgroup, V2_MOUNTS, read).unwrap();
        assert_eq!((l.limit, l.headroom), (1 << 30, 924 << 20));
        assert_eq!(l.path, "/kubepods/pod1");
        let none = files(&[("/sys/fs/cgroup/memory.max", "max\n")]);
        assert_eq!(cgroup_limit("0::/\n", V2_MOUNTS, none), None);
    }

    #[test]
    fn inside_a_container_the_root_is_its_own_cgroup() {
        // A cgroup namespace: the process sees "/" and the mount's root is "/" too.
        let read = files(&[("/sys/fs/cgroup/memory.max", "536870912\n")]);
        let l = cgroup_limit("0::/\n", V2_MOUNTS, read).unwrap();
        assert_eq!((l.limit, l.path.as_str()), (512 << 20, "/"));
        // A mount whose root is the process's cgroup (some runtimes bind-mount it).
        let mounts = "29 23 0:25 /docker/abc /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
        let read = files(&[("/sys/fs/cgroup/memory.max", "268435456\n")]);
        let l = cgroup_limit("0::/docker/abc\n", mounts, read).unwrap();
        assert_eq!(l.limit, 256 << 20);
    }

    #[test]
    fn a_limit_above_the_ram_or_nothing_readable_leaves_the_host_figures() {
        let l = CgroupLimit {
            limit: 64 << 30,
            headroom: 64 << 30,
            path: "/big".into(),
        };
        let m = bounded(10 << 30, 16 << 30, Some(l));
        assert_eq!(
            (m.available, m.total, m.cgroup.clone()),
            (10 << 30, 16 << 30, None)
        );
        assert_eq!(m.source(), "available RAM");
        assert_eq!(cgroup_limit("garbage", "", files(&[])), None);
        assert_eq!(cgroup_limit("0::/x\n", V1_MOUNTS, files(&[])), None);
    }

    #[test]
    fn reclaimable_page_cache_is_room_and_the_least_room_of_any_ancestor_counts() {
        let cgroup = "0::/job/step\n";
        let read = files(&[
            // The step: 1 GiB limit, 900 MiB used of which 600 MiB inactive page cache.
            ("/sys/fs/cgroup/job/step/memory.max", "1073741824\n"),
            ("/sys/fs/cgroup/job/step/memory.current", "943718400\n"),
            (
                "/sys/fs/cgroup/job/step/memory.stat",
                "anon 1\ninactive_file 629145600\nactive_file 0\n",
            ),
            // The job: a larger limit, but its other steps leave it 200 MiB.
            ("/sys/fs/cgroup/job/memory.max", "2147483648\n"),
            ("/sys/fs/cgroup/job/memory.current", "1937768448\n"),
        ]);
        let l = cgroup_limit(cgroup, V2_MOUNTS, read).unwrap();
        assert_eq!(l.limit, 1 << 30);
        assert_eq!(l.path, "/job/step");
        assert_eq!(
            l.headroom,
            200 << 20,
            "the job's room, not the step's 724 MiB"
        );
    }

    #[test]
    fn the_oom_kill_count_is_read_from_vmstat() {
        assert_eq!(oom_kill_count("pgfault 12\noom_kill 3\nfoo 1\n"), Some(3));
        assert_eq!(oom_kill_count("pgfault 12\n"), None);
    }

    #[test]
    fn a_cgroup_no_mount_shows_is_no_limit_rather_than_another_ones() {
        // The mount shows /docker/abc's subtree; /docker/abcd is not under it.
        let mounts = "29 23 0:25 /docker/abc /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
        let read = files(&[("/sys/fs/cgroup/memory.max", "268435456\n")]);
        assert_eq!(cgroup_limit("0::/docker/abcd\n", mounts, read), None);
        assert_eq!(below("/docker/abc/x", "/docker/abc"), Some("x"));
        assert_eq!(below("/docker/abcd", "/docker/abc"), None);
        assert_eq!(below("/a/b", "/"), Some("a/b"));
    }
}
