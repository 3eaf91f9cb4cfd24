//! Shared memory between the ranks of one host, end to end: a training run all-reduces through
//! it and leaves nothing in `/dev/shm`, however it ends (normally, or with `launch` killed by
//! SIGKILL mid-training), and `launch` removes a segment that a dead worker left behind.
//! Other tests may be setting up groups at the same time, so "left behind" means a segment
//! whose creator is gone: one that is in use is never counted.

mod support;

use std::path::Path;
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use support::*;

const SHM: &str = "/dev/shm";
/// The random part of the stale segment one test plants (the others must not count it).
const PLANTED: &str = "5eed0f1e";

/// Segments in /dev/shm whose creating process has ended (what a run would have leaked).
fn leaked_segments() -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(SHM) else {
        return Vec::new();
    };
    entries
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| !name.ends_with(PLANTED))
        .filter(|name| {
            let pid = name
                .strip_prefix("gptrec-")
                .and_then(|rest| rest.split_once('-'))
                .and_then(|(pid, _)| pid.parse::<u32>().ok());
            pid.is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists())
        })
        .collect()
}

fn as_strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// `launch --num-processes 2 --master-port 0 --run-id ID configs/default.toml` on tiny data,
/// `epochs` epochs, files under `dir`.
fn training_args(dir: &Path, id: &str, epochs: u32) -> Vec<String> {
    let mut args: Vec<String> = ["--num-processes", "2", "--master-port", "0", "--run-id", id]
        .map(String::from)
        .to_vec();
    args.push("configs/default.toml".into());
    args.extend(tiny_bpr_sets(dir));
    args.extend(["--set".into(), format!("train.epochs={epochs}")]);
    args
}

#[test]
fn training_all_reduces_through_shared_memory_and_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let id = unique_run_id("shm-ok");
    let out = launch(
        &as_strs(&training_args(dir.path(), &id, 1)),
        Duration::from_secs(120),
    );
    out.assert_code(0);
    out.assert_stdout_all(&["[rank 0] collective tcp (shared memory) ready"]);
    // The parameters, moments and gradients in shared memory too (sharded, the default): one
    // more segment, gone as well.
    out.assert_stderr("gradients kept in shared memory: each of the 2 ranks reduces");
    assert_eq!(leaked_segments(), Vec::<String>::new());
}

#[test]
fn sigkill_of_launch_mid_training_leaves_nothing_in_dev_shm() {
    let dir = tempfile::tempdir().unwrap();
    let id = unique_run_id("shm-kill");
    let args = training_args(dir.path(), &id, 200);
    let live = Live::new(launch_cmd(&as_strs(&args)).spawn().expect("start launch"));
    live.wait_stderr("INFO epoch 1/200 step", Duration::from_secs(120));
    kill(live.pid(), Signal::SIGKILL).unwrap();
    let _ = live.finish(Duration::from_secs(30));
    assert_no_processes(&id, Duration::from_secs(10));
    assert_eq!(leaked_segments(), Vec::<String>::new());
}

#[test]
fn launch_removes_a_segment_that_a_dead_worker_left() {
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let name = format!("gptrec-{dead}-{PLANTED}");
    let path = Path::new(SHM).join(&name);
    std::fs::write(&path, b"left by a worker killed during set-up").unwrap();
    let out = launch(
        &["--num-processes", "1", "--master-port", "0", "--", "true"],
        Duration::from_secs(30),
    );
    out.assert_code(0);
    // Another test's `launch` may have swept it first; either way it must be gone.
    assert!(!path.exists(), "{name} is still in {SHM}: {}", out.stderr);
}

/// Two nodes of two ranks (two `launch` processes on loopback): all-reduce is hierarchical,
/// through shared memory inside each node and the leaders' ring between them; both finish and
/// leave nothing in `/dev/shm`.
#[test]
fn two_nodes_reduce_inside_each_through_shared_memory() {
    let dir = tempfile::tempdir().unwrap();
    let id = unique_run_id("shm-hosts");
    let port = free_port().to_string();
    let sets = tiny_bpr_sets(dir.path());
    let nodes: Vec<_> = ["0", "1"]
        .iter()
        .map(|node| {
            let mut args: Vec<&str> = vec![
                "--nnodes",
                "2",
                "--node-rank",
                node,
                "--num-processes",
                "2",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                &port,
                "--run-id",
                &id,
                "configs/default.toml",
            ];
            args.extend(sets.iter().map(String::as_str));
            launch_cmd(&args).spawn().expect("start launch")
        })
        .collect();
    let outs: Vec<Output> = nodes
        .into_iter()
        .map(|child| wait_output(child, Duration::from_secs(300)))
        .collect();
    for out in &outs {
        out.assert_code(0);
    }
    outs[0].assert_stdout_all(&[
        "[rank 0] collective tcp (shared memory in each host, ring between hosts) ready",
    ]);
    assert_eq!(leaked_segments(), Vec::<String>::new());
}
