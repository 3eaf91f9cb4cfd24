//! Which CPUs each worker of this node runs on when the user asks for pinning (torchrun's
//! `--numa-binding`, our `--pin`): the CPUs `launch` itself may use (its affinity, so Slurm's or
//! a container's limits hold) split into disjoint sets, one per local rank, in the order of their
//! NUMA nodes so that a set stays on one node where the counts allow; or, binding by node, every
//! allowed CPU of the NUMA node(s) a rank's share lies on.
//!
//! Owns: reading the affinity and the NUMA layout, and the split. Must not: pin anything (the
//! spawn does, between fork and exec) or decide whether to pin (the plan's: only when asked).

use std::fmt::Write as _;

/// The CPUs of each local rank, and the NUMA node(s) each set lies on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuMap {
    pub sets: Vec<Vec<usize>>,
    pub nodes: Vec<Vec<usize>>,
    /// The sets are disjoint (each rank's own CPUs), so `OMP_NUM_THREADS` can be a set's size.
    pub exclusive: bool,
}

impl CpuMap {
    /// `local rank 0: 0-3 (NUMA 0); local rank 1: 4-7 (NUMA 1)`.
    pub fn describe(&self) -> String {
        let mut out = String::new();
        for (rank, (set, nodes)) in self.sets.iter().zip(&self.nodes).enumerate() {
            let sep = if rank == 0 { "" } else { "; " };
            let nodes: Vec<String> = nodes.iter().map(usize::to_string).collect();
            let _ = write!(
                out,
                "{sep}local rank {rank}: {} (NUMA {})",
                ranges(set),
                nodes.join(",")
            );
        }
        out
    }
}

/// torchrun's `--numa-binding` modes, as `launch` applies them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Binding {
    /// `exclusive` (and `core-complex`, and our `--pin`): each rank its own disjoint share.
    Exclusive,
    /// `node` (and `socket`): every allowed CPU of the NUMA node(s) of the rank's share, shared
    /// with the other ranks there.
    Node,
}

impl Binding {
    /// `--numa-binding`'s value, as torchrun 2.11 spells its modes.
    pub fn parse(mode: &str) -> Result<Binding, String> {
        match mode {
            "exclusive" | "core-complex" => Ok(Binding::Exclusive),
            "node" | "socket" => Ok(Binding::Node),
            other => Err(format!(
                "expected node, socket, exclusive or core-complex (torchrun's modes), got {other:?}"
            )),
        }
    }
}

/// The map for `nproc` workers on this machine; `None` when there are fewer usable CPUs than
/// workers (nothing to split) or the affinity cannot be read.
pub fn plan(nproc: u32, binding: Binding) -> Option<CpuMap> {
    let allowed = allowed_cpus()?;
    let numa = numa_nodes();
    let map = split(&allowed, &numa, nproc as usize)?;
    Some(match binding {
        Binding::Exclusive => map,
        Binding::Node => widen_to_nodes(map, &allowed, &numa),
    })
}

/// Each rank's set widened to every allowed CPU of its NUMA node(s) (unchanged without a NUMA
/// layout to read).
fn widen_to_nodes(map: CpuMap, allowed: &[usize], numa: &[(usize, Vec<usize>)]) -> CpuMap {
    if numa.is_empty() {
        return map;
    }
    let sets = map
        .nodes
        .iter()
        .map(|nodes| {
            let of_nodes = |c: &usize| {
                numa.iter()
                    .any(|(n, cpus)| nodes.contains(n) && cpus.contains(c))
            };
            allowed.iter().copied().filter(of_nodes).collect()
        })
        .collect();
    CpuMap {
        sets,
        nodes: map.nodes,
        exclusive: false,
    }
}

/// Splits `allowed` into `nproc` disjoint sets of consecutive CPUs in NUMA order (`numa`:
/// node -> its CPUs), the first sets one CPU larger when they do not divide evenly.
fn split(allowed: &[usize], numa: &[(usize, Vec<usize>)], nproc: usize) -> Option<CpuMap> {
    if nproc == 0 || allowed.len() < nproc {
        return None;
    }
    let node_of = |cpu: usize| {
        numa.iter()
            .find(|(_, cpus)| cpus.contains(&cpu))
            .map(|(n, _)| *n)
    };
    let mut ordered = allowed.to_vec();
    ordered.sort_by_key(|&c| (node_of(c).unwrap_or(0), c));
    let (each, extra) = (ordered.len() / nproc, ordered.len() % nproc);
    let mut sets = Vec::with_capacity(nproc);
    let mut rest = ordered.as_slice();
    for rank in 0..nproc {
        let (set, after) = rest.split_at(each + usize::from(rank < extra));
        sets.push(set.to_vec());
        rest = after;
    }
    let nodes = sets
        .iter()
        .map(|set| {
            let mut n: Vec<usize> = set.iter().map(|&c| node_of(c).unwrap_or(0)).collect();
            n.dedup();
            n
        })
        .collect();
    Some(CpuMap {
        sets,
        nodes,
        exclusive: true,
    })
}

/// The CPUs this process may run on.
fn allowed_cpus() -> Option<Vec<usize>> {
    use nix::sched::{sched_getaffinity, CpuSet};
    let set = sched_getaffinity(nix::unistd::Pid::from_raw(0)).ok()?;
    let cpus: Vec<usize> = (0..CpuSet::count())
        .filter(|&c| set.is_set(c).unwrap_or(false))
        .collect();
    (!cpus.is_empty()).then_some(cpus)
}

/// Each NUMA node and its CPUs, from `/sys/devices/system/node` (empty where it is not there).
fn numa_nodes() -> Vec<(usize, Vec<usize>)> {
    let Ok(dir) = std::fs::read_dir("/sys/devices/system/node") else {
        return Vec::new();
    };
    let mut nodes: Vec<(usize, Vec<usize>)> = dir
        .flatten()
        .filter_map(|e| {
            let id = e.file_name().to_str()?.strip_prefix("node")?.parse().ok()?;
            let list = std::fs::read_to_string(e.path().join("cpulist")).ok()?;
            Some((id, parse_cpulist(&list)?))
        })
        .collect();
    nodes.sort();
    nodes
}

/// The kernel's CPU list form, `0-3,8,10-11`.
fn parse_cpulist(text: &str) -> Option<Vec<usize>> {
    let mut cpus = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => cpus.extend(a.parse::<usize>().ok()?..=b.parse::<usize>().ok()?),
            None => cpus.push(part.parse().ok()?),
        }
    }
    Some(cpus)
}

/// `[0, 1, 2, 5]` as `0-2,5`.
fn ranges(cpus: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let start = i;
        while i + 1 < cpus.len() && cpus[i + 1] == cpus[i] + 1 {
            i += 1;
        }
        out.push(match i - start {
            0 => cpus[start].to_string(),
            _ => format!("{}-{}", cpus[start], cpus[i]),
        });
        i += 1;
    }
    out.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpus_split_into_disjoint_sets_in_numa_order() {
        let numa = vec![(0, vec![0, 1, 2, 3, 8, 9]), (1, vec![4, 5, 6, 7, 10, 11])];
        let all: Vec<usize> = (0..12).collect();
        let map = split(&all, &numa, 2).unwrap();
        assert_eq!(
            map.sets,
            vec![vec![0, 1, 2, 3, 8, 9], vec![4, 5, 6, 7, 10, 11]]
        );
        assert_eq!(map.nodes, vec![vec![0], vec![1]]);
        assert_eq!(
            map.describe(),
            "local rank 0: 0-3,8-9 (NUMA 0); local rank 1: 4-7,10-11 (NUMA 1)"
        );
        // Uneven: the first sets get one more; every CPU is used once.
        let map = split(&all[..8], &[], 3).unwrap();
        assert_eq!(map.sets, vec![vec![0, 1, 2], vec![3, 4, 5], vec![6, 7]]);
        assert!(split(&[0, 1], &[], 3).is_none(), "fewer CPUs than workers");
        assert_eq!(parse_cpulist("0-2,5,7-8\n"), Some(vec![0, 1, 2, 5, 7, 8]));
        assert_eq!(parse_cpulist("x"), None);
    }

    #[test]
    fn binding_by_node_gives_each_rank_its_whole_node() {
        let numa = vec![(0, vec![0, 1, 2, 3]), (1, vec![4, 5, 6, 7])];
        let all: Vec<usize> = (0..8).collect();
        let map = widen_to_nodes(split(&all, &numa, 4).unwrap(), &all, &numa);
        assert_eq!(
            map.sets,
            vec![
                vec![0, 1, 2, 3],
                vec![0, 1, 2, 3],
                vec![4, 5, 6, 7],
                vec![4, 5, 6, 7]
            ]
        );
        // Only CPUs this process may use, even of its node.
        let allowed = [1, 2, 5, 6];
        let map = widen_to_nodes(split(&allowed, &numa, 2).unwrap(), &allowed, &numa);
        assert_eq!(map.sets, vec![vec![1, 2], vec![5, 6]]);
        assert_eq!(Binding::parse("socket"), Ok(Binding::Node));
        assert_eq!(Binding::parse("core-complex"), Ok(Binding::Exclusive));
        assert!(Binding::parse("rack").is_err());
    }

    #[test]
    fn this_process_has_an_affinity() {
        let cpus = allowed_cpus().expect("sched_getaffinity");
        assert!(!cpus.is_empty());
        assert_eq!(
            plan(cpus.len() as u32, Binding::Exclusive).map(|m| m.sets.len()),
            Some(cpus.len())
        );
    }
}
