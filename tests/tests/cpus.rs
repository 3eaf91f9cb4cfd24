//! CPU placement: by default, as under torchrun, nothing is pinned (a worker and the processes
//! it starts, DataLoader workers say, may use every CPU `launch` may); asked (`--pin`,
//! torchrun's `--numa-binding`), each worker runs on its own disjoint set with `OMP_NUM_THREADS`
//! set to their number; the dry run says which.

mod support;

use std::time::Duration;

use support::*;

/// Each rank's `Cpus_allowed_list` and `OMP_NUM_THREADS`, as its worker saw them.
fn placement(extra: &[&str], n: &str) -> Vec<(u32, String)> {
    let mut args = vec!["--num-processes", n, "--master-port", "0"];
    args.extend(extra);
    let script =
        "echo cpus=$(grep Cpus_allowed_list /proc/self/status | cut -f2) omp=$OMP_NUM_THREADS";
    args.extend(["--", "sh", "-c", script]);
    let mut cmd = launch_cmd(&args);
    cmd.env_remove("OMP_NUM_THREADS");
    let out = wait_output(cmd.spawn().unwrap(), Duration::from_secs(60));
    out.assert_code(0);
    let mut lines = rank_lines(&out.stdout);
    lines.sort();
    lines
}

/// The CPUs of `line` (`cpus=0-1 omp=...`), counted.
fn count_of(line: &str) -> usize {
    let cpus = line
        .split_whitespace()
        .next()
        .unwrap()
        .trim_start_matches("cpus=");
    cpus.split(',')
        .map(|r| match r.split_once('-') {
            Some((a, b)) => b.parse::<usize>().unwrap() - a.parse::<usize>().unwrap() + 1,
            None => 1,
        })
        .sum()
}

#[test]
fn workers_are_pinned_to_disjoint_cpus_only_when_asked() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cores < 2 {
        eprintln!("skipped: {cores} CPU here, nothing to split");
        return;
    }
    for asked in [&["--pin"][..], &["--numa-binding", "exclusive"]] {
        let pinned = placement(asked, "2");
        let sets: Vec<&str> = pinned.iter().map(|(_, l)| l.as_str()).collect();
        assert_eq!(sets.len(), 2, "{pinned:?}");
        assert_ne!(sets[0], sets[1], "the two workers share CPUs: {pinned:?}");
        for (_, line) in &pinned {
            assert!(line.ends_with(&format!("omp={}", count_of(line))), "{line}");
        }
    }
    // Not asked (and the old --no-pin): every worker may use every CPU.
    for asked in [&[][..], &["--no-pin"]] {
        let free = placement(asked, "2");
        for (_, line) in &free {
            assert_eq!(count_of(line), cores, "{free:?}");
        }
    }
    let dry = |extra: &[&str]| {
        let mut args = vec!["--dry-run", "--num-processes", "2"];
        args.extend(extra);
        args.extend(["--", "true"]);
        launch(&args, Duration::from_secs(30))
    };
    dry(&["--numa-binding", "exclusive"]).assert_stdout_all(&[
        "  cpus:         local rank 0: ",
        "; local rank 1: ",
        "[--numa-binding exclusive]",
    ]);
    dry(&[]).assert_stdout_all(&["  cpus:         not pinned (--numa-binding MODE or --pin"]);
    let out = dry(&["--numa-binding", "rack"]);
    out.assert_code(2);
    out.assert_stderr("--numa-binding");
}

/// A worker's children (a DataLoader's worker processes) get every CPU by default, as under
/// torchrun; pinned, they share their worker's.
#[test]
fn a_workers_children_are_not_confined_by_default() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cores < 2 {
        eprintln!("skipped: {cores} CPU here");
        return;
    }
    let script = "sh -c 'echo cpus=$(grep Cpus_allowed_list /proc/self/status | cut -f2)'";
    let run = |extra: &[&str]| {
        let mut args = vec!["--num-processes", "2"];
        args.extend(extra);
        args.extend(["--", "sh", "-c", script]);
        let out = launch(&args, Duration::from_secs(60));
        out.assert_code(0);
        rank_lines(&out.stdout)
    };
    for (_, line) in run(&[]) {
        assert_eq!(count_of(&line), cores, "{line}");
    }
    for (_, line) in run(&["--pin"]) {
        assert_eq!(count_of(&line), cores / 2, "{line}");
    }
}
