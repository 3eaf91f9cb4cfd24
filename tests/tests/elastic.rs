//! Elastic jobs (`--nnodes MIN:MAX`) on loopback: each `launch` process is a node, with real
//! workers training a tiny config. A node that is SIGKILLed is dropped and the others re-form
//! with the same global batch from the last checkpoint; a late node joins at the next restart;
//! losing the node that hosts the rendezvous store ends the job with a clear message.

mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use support::*;

const T: Duration = Duration::from_secs(180);

/// `launch` as one node of an elastic job of 1-process nodes on `port` (tiny bpr, global 12,
/// micro 2: world 3 takes grad_accum 2, world 2 grad_accum 3; a checkpoint every 100 steps).
fn node(dir: &Path, port: u16, run_id: &str, range: &str, epochs: u32) -> Live {
    let endpoint = format!("127.0.0.1:{port}");
    let mut args: Vec<String> = [
        "--nnodes",
        range,
        "--num-processes",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        &endpoint,
        "--rdzv-id",
        run_id,
        "--rdzv-conf",
        "last_call_timeout=1",
        "--max-restarts",
        "3",
        "--grace-period",
        "2",
        "configs/default.toml",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(tiny_bpr_sets(dir));
    for set in [
        format!("train.epochs={epochs}"),
        "eval.patience=0".into(),
        "batch.global=12".into(),
        "batch.micro=2".into(),
        "checkpoint.every_n_steps=100".into(),
    ] {
        args.push("--set".into());
        args.push(set);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut cmd = launch_cmd(&args);
    cmd.env("OMP_NUM_THREADS", "1");
    Live::new(cmd.spawn().expect("spawn launch"))
}

/// Waits until stdout or stderr of `live` contains `needle`.
fn wait_for(live: &Live, needle: &str, timeout: Duration) {
    let start = Instant::now();
    while !(live.stderr_now().contains(needle) || live.stdout_now().contains(needle)) {
        assert!(
            start.elapsed() < timeout,
            "never saw {needle:?}:\n{}\n{}",
            live.stdout_now(),
            live.stderr_now()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The worker processes `launch` (pid) started.
fn children(pid: Pid) -> Vec<i32> {
    let path = format!("/proc/{pid}/task/{pid}/children");
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .filter(|&p: &i32| {
            std::fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.trim() == "worker")
        })
        .collect()
}

fn gone(pids: &[i32], timeout: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < timeout {
        let alive = pids.iter().any(|&p| {
            std::fs::read_to_string(format!("/proc/{p}/stat")).is_ok_and(|s| !s.contains(") Z "))
        });
        if !alive {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

fn summary(dir: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(dir.join("default/metrics.jsonl")).expect("metrics.jsonl");
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|r| r["kind"] == "summary")
        .expect("a summary record")
}

#[test]
fn a_killed_node_is_dropped_and_the_others_finish_with_the_same_global_batch() {
    let dir = tempfile::tempdir().unwrap();
    let (port, run_id) = (free_port(), unique_run_id("elastic-kill"));
    let host = node(dir.path(), port, &run_id, "2:3", 8);
    std::thread::sleep(Duration::from_millis(300)); // the first one hosts the store
    let second = node(dir.path(), port, &run_id, "2:3", 8);
    let third = node(dir.path(), port, &run_id, "2:3", 8);
    wait_for(&host, "checkpoints/step-000100", T);
    let victims = children(third.pid());
    assert_eq!(victims.len(), 1, "the third node's worker");
    kill(third.pid(), Signal::SIGKILL).unwrap();
    assert!(
        gone(&victims, Duration::from_secs(10)),
        "the killed node's worker lives on"
    );
    let killed = third.finish(T);
    assert_eq!(killed.status.code(), None, "SIGKILLed");
    for live in [host, second] {
        let out = live.finish(T);
        out.assert_code(0);
        out.assert_stderr("world 3 -> 2: grad_accum 2 -> 3, global 12 kept");
        out.assert_stderr("re-forming the group");
    }
    let s = summary(dir.path());
    assert_eq!(s["world_size"], 2, "{s}");
    assert_no_processes(&run_id, Duration::from_secs(10));
}

#[test]
fn a_late_node_joins_at_the_next_restart() {
    let dir = tempfile::tempdir().unwrap();
    let (port, run_id) = (free_port(), unique_run_id("elastic-join"));
    let host = node(dir.path(), port, &run_id, "2:3", 6);
    std::thread::sleep(Duration::from_millis(300));
    let second = node(dir.path(), port, &run_id, "2:3", 6);
    wait_for(&host, "checkpoints/step-000100", T);
    let late = node(dir.path(), port, &run_id, "2:3", 6);
    for live in [host, second] {
        let out = live.finish(T);
        out.assert_code(0);
        out.assert_stderr("waiting to join: re-forming with 3 nodes");
        out.assert_stderr("world 2 -> 3: grad_accum 3 -> 2, global 12 kept");
    }
    let out = late.finish(T);
    out.assert_code(0);
    out.assert_stderr("round 1: 3 node(s)");
    assert_eq!(summary(dir.path())["world_size"], 3);
    assert_no_processes(&run_id, Duration::from_secs(10));
}

#[test]
fn losing_the_store_host_ends_the_job_with_a_clear_message() {
    let dir = tempfile::tempdir().unwrap();
    let (port, run_id) = (free_port(), unique_run_id("elastic-host"));
    let host = node(dir.path(), port, &run_id, "1:2", 20);
    std::thread::sleep(Duration::from_millis(300));
    let other = node(dir.path(), port, &run_id, "1:2", 20);
    wait_for(&other, "collective tcp ready", T);
    kill(host.pid(), Signal::SIGKILL).unwrap();
    let out = other.finish(Duration::from_secs(60));
    assert_ne!(out.code(), Some(0), "{}", out.stderr);
    out.assert_stderr("lost the rendezvous store");
    out.assert_stderr("cannot go on without it");
    let _ = host.finish(T);
    assert_no_processes(&run_id, Duration::from_secs(10));
}
