//! CPU placement: each worker runs on its own disjoint set of the CPUs `launch` may use, with
//! `OMP_NUM_THREADS` set to their number, the dry run prints the map, and `--no-pin` turns it off.

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

#[test]
fn workers_are_pinned_to_disjoint_cpus_unless_asked_not_to() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cores < 2 {
        eprintln!("skipped: {cores} CPU here, nothing to split");
        return;
    }
    let pinned = placement(&[], "2");
    let sets: Vec<&str> = pinned.iter().map(|(_, l)| l.as_str()).collect();
    assert_eq!(sets.len(), 2, "{pinned:?}");
    assert_ne!(sets[0], sets[1], "the two workers share CPUs: {pinned:?}");
    for (_, line) in &pinned {
        let cpus = line
            .split_whitespace()
            .next()
            .unwrap()
            .trim_start_matches("cpus=");
        let count: usize = cpus
            .split(',')
            .map(|r| match r.split_once('-') {
                Some((a, b)) => b.parse::<usize>().unwrap() - a.parse::<usize>().unwrap() + 1,
                None => 1,
            })
            .sum();
        assert!(line.ends_with(&format!("omp={count}")), "{line}");
    }
    let free = placement(&["--no-pin"], "2");
    assert_eq!(
        free[0].1.split(' ').next(),
        free[1].1.split(' ').next(),
        "{free:?}"
    );
    let out = launch(
        &["--dry-run", "--num-processes", "2", "--", "true"],
        Duration::from_secs(30),
    );
    out.assert_stdout_all(&["  cpus:         local rank 0: ", "; local rank 1: "]);
    let out = launch(
        &[
            "--dry-run",
            "--no-pin",
            "--num-processes",
            "2",
            "--",
            "true",
        ],
        Duration::from_secs(30),
    );
    out.assert_stdout_all(&["  cpus:         not pinned"]);
}
