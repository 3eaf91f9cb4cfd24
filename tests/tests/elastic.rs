//! Elastic jobs (`--nnodes MIN:MAX`) on loopback: each `launch` process is a node, with real
//! workers training a tiny config. A node that is SIGKILLed is dropped and the others re-form
//! with the same global batch from the last checkpoint; a late node joins at the next restart;
//! losing the node that hosts the rendezvous store ends the job with a clear message. The
//! samples each epoch trained are traced (`GPTREC_TRACE_SAMPLES`) and compared with a run
//! that was not interrupted.

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
    node_with(dir, port, run_id, range, epochs, 12, &[])
}

/// [`node`] with another global batch.
fn node_with(
    dir: &Path,
    port: u16,
    run_id: &str,
    range: &str,
    epochs: u32,
    global: u32,
    extra: &[&str],
) -> Live {
    let endpoint = format!("127.0.0.1:{port}");
    let shape = [
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
    ];
    let mut args = training_args(&shape, dir, epochs);
    args.extend(["--set".to_string(), format!("batch.global={global}")]);
    args.extend(extra.iter().map(|a| a.to_string()));
    Live::new(traced_launch(&args, dir).spawn().expect("spawn launch"))
}

/// `launch ARGS` with one thread per worker and the samples traced into DIR/trace.
fn traced_launch(args: &[String], dir: &Path) -> std::process::Command {
    let mut cmd = launch_cmd(&args.iter().map(String::as_str).collect::<Vec<_>>());
    cmd.env("OMP_NUM_THREADS", "1")
        .env("GPTREC_TRACE_SAMPLES", dir.join("trace"));
    cmd
}

/// `launch` arguments: `shape`, then the tiny config (with its samples traced into DIR/trace).
fn training_args(shape: &[&str], dir: &Path, epochs: u32) -> Vec<String> {
    std::fs::create_dir_all(dir.join("trace")).unwrap();
    let mut args: Vec<String> = shape.iter().map(|s| s.to_string()).collect();
    args.push("configs/default.toml".into());
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
    args
}

/// One traced step: (restart round, epoch, step, the dataset indices of one rank).
type Traced = (u32, u64, u64, Vec<usize>);

/// Every step the ranks of a run traced (`GPTREC_TRACE_SAMPLES`).
fn traces(dir: &Path) -> Vec<Traced> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir.join("trace")).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let restart: u32 = name.split('-').nth(1).unwrap().parse().unwrap();
        for line in std::fs::read_to_string(&path).unwrap().lines() {
            let mut parts = line.split(' ');
            let epoch = parts.next().unwrap().parse().unwrap();
            let step = parts.next().unwrap().parse().unwrap();
            let _unix_ms = parts.next().unwrap();
            let indices = parts
                .next()
                .unwrap()
                .split(',')
                .map(|i| i.parse().unwrap())
                .collect();
            out.push((restart, epoch, step, indices));
        }
    }
    out
}

/// The samples each epoch trained in the run's final history: a step that a later round took
/// again (after resuming from a checkpoint before it) counts only as that round took it.
fn epochs_trained(traced: &[Traced]) -> std::collections::BTreeMap<u64, Vec<usize>> {
    let mut last_round = std::collections::BTreeMap::new();
    for (restart, _, step, _) in traced {
        let r = last_round.entry(*step).or_insert(*restart);
        *r = (*r).max(*restart);
    }
    let mut epochs: std::collections::BTreeMap<u64, Vec<usize>> = Default::default();
    for (restart, epoch, step, indices) in traced {
        if last_round[step] == *restart {
            epochs.entry(*epoch).or_default().extend(indices);
        }
    }
    for samples in epochs.values_mut() {
        samples.sort_unstable();
    }
    epochs
}

/// (step, lr) of every logged step record of the run in `dir`.
fn lrs(dir: &Path) -> Vec<(u64, f64)> {
    let text = std::fs::read_to_string(dir.join("default/metrics.jsonl")).unwrap();
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|r| r["kind"] == "step")
        .map(|r| (r["step"].as_u64().unwrap(), r["lr"].as_f64().unwrap()))
        .collect()
}

/// Waits until stdout or stderr of `live` contains `needle`.
fn wait_for(live: &Live, needle: &str, timeout: Duration) {
    live.wait_output(needle, timeout);
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
    // A fourth node, started once the two re-formed, joins at their next checkpoint.
    wait_for(&host, "world 3 -> 2", T);
    let fourth = node(dir.path(), port, &run_id, "2:3", 8);
    for live in [host, second] {
        let out = live.finish(T);
        out.assert_code(0);
        out.assert_stderr("world 3 -> 2: grad_accum 2 -> 3, global 12 kept");
        out.assert_stderr("re-forming the group");
        out.assert_stderr("world 2 -> 3: grad_accum 3 -> 2, global 12 kept");
    }
    fourth.finish(T).assert_code(0);
    let s = summary(dir.path());
    assert_eq!(s["world_size"], 3, "{s}");
    assert_no_processes(&run_id, Duration::from_secs(10));

    // The same run without the failure, at a fixed world of 2.
    let reference = tempfile::tempdir().unwrap();
    let shape = ["--num-processes", "2", "--master-port", "0"];
    let args = training_args(&shape, reference.path(), 8);
    let cmd = traced_launch(&args, reference.path()).spawn().unwrap();
    wait_output(cmd, T).assert_code(0);
    let traced = traces(dir.path());
    let resumed_at = traced
        .iter()
        .filter(|t| t.0 == 1)
        .map(|t| (t.2, t.1))
        .min()
        .expect("steps of the group re-formed after the kill");
    assert!(
        resumed_at.0 > 100,
        "resumed from a checkpoint: {resumed_at:?}"
    );
    let trained = epochs_trained(&traced);
    let expected = epochs_trained(&traces(reference.path()));
    // Twice in an epoch only where the sampler pads the epoch to whole steps by wrapping around
    // (as torch's DistributedSampler does): the same in the uninterrupted run.
    let repeats = |samples: &Vec<usize>| {
        let mut unique = samples.clone();
        unique.dedup();
        samples.len() - unique.len()
    };
    let epoch = resumed_at.1;
    assert_eq!(repeats(&trained[&epoch]), repeats(&expected[&epoch]));
    assert!(repeats(&trained[&epoch]) <= 1, "more than the padding");
    // Epoch by epoch, the same samples as the uninterrupted run: none skipped, none twice.
    assert_eq!(trained, expected);
    // The learning-rate schedule continued from the same optimizer step.
    let (ours, theirs) = (lrs(dir.path()), lrs(reference.path()));
    assert!(ours.len() > 10 && ours.iter().any(|(s, _)| *s > resumed_at.0));
    for (step, lr) in &ours {
        if let Some((_, want)) = theirs.iter().find(|(s, _)| s == step) {
            assert!((lr - want).abs() < 1e-12, "step {step}: lr {lr} vs {want}");
        }
    }
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
        // Not mid-step: every worker stopped after a checkpoint, which the new group resumed.
        out.assert_stderr("asking this node's workers to stop at their next checkpoint");
        out.assert_stderr("stopped after the checkpoint of step");
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

#[test]
fn a_world_that_cannot_keep_the_global_batch_waits_for_one_that_can() {
    let dir = tempfile::tempdir().unwrap();
    let (port, run_id) = (free_port(), unique_run_id("elastic-wait"));
    // Global 9: 2 nodes of 1 cannot keep it, 3 can.
    let host = node_with(dir.path(), port, &run_id, "2:3", 1, 9, &[]);
    std::thread::sleep(Duration::from_millis(300));
    let second = node_with(dir.path(), port, &run_id, "2:3", 1, 9, &[]);
    wait_for(&second, "waiting for a node count that does: 3", T);
    let third = node_with(dir.path(), port, &run_id, "2:3", 1, 9, &[]);
    for live in [host, second, third] {
        let out = live.finish(T);
        out.assert_code(0);
        out.assert_stderr("round 0: 3 node(s)");
        out.assert_stderr("micro 1 x grad_accum 3 x world 3 = global 9");
    }
    assert_no_processes(&run_id, Duration::from_secs(10));
}

#[test]
fn failures_beyond_max_restarts_end_the_job() {
    let dir = tempfile::tempdir().unwrap();
    let (port, run_id) = (free_port(), unique_run_id("elastic-budget"));
    let no_restart = ["--max-restarts", "0"];
    let host = node_with(dir.path(), port, &run_id, "1:2", 20, 12, &no_restart);
    std::thread::sleep(Duration::from_millis(300));
    let other = node_with(dir.path(), port, &run_id, "1:2", 20, 12, &no_restart);
    wait_for(&host, "collective tcp ready", T);
    kill(other.pid(), Signal::SIGKILL).unwrap();
    let out = host.finish(T);
    assert_ne!(out.code(), Some(0), "{}", out.stderr);
    out.assert_stderr("the worker group failed 1 time(s), more than --max-restarts 0");
    let _ = other.finish(T);
    assert_no_processes(&run_id, Duration::from_secs(10));
}

/// Stops (or continues) a launcher and the workers it started.
fn signal_node(live: &Live, signal: Signal) {
    for pid in children(live.pid()) {
        let _ = kill(Pid::from_raw(pid), signal);
    }
    kill(live.pid(), signal).unwrap();
}

#[test]
fn a_node_with_other_settings_is_refused_before_it_joins_and_the_job_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let (port, run_id) = (free_port(), unique_run_id("elastic-terms"));
    let no_restart = ["--max-restarts", "0"];
    let host = node_with(dir.path(), port, &run_id, "1:2", 6, 12, &no_restart);
    wait_for(&host, "collective tcp ready", T);
    let other_lr = ["--max-restarts", "0", "--set", "train.lr=0.002"];
    let stranger = node_with(dir.path(), port, &run_id, "1:2", 6, 12, &other_lr);
    let out = stranger.finish(T);
    out.assert_code(2);
    out.assert_stderr(
        "its settings differ from the job's: train.lr: 0.002 here vs 0.005 in the job",
    );
    assert!(!out.stderr.contains("round 0:"), "{}", out.stderr);
    let out = host.finish(T);
    out.assert_code(0);
    out.assert_stderr("is not admitted: its settings differ from the job's: train.lr");
    assert!(!out.stderr.contains("re-form"), "{}", out.stderr);
    assert_no_processes(&run_id, Duration::from_secs(10));
}

#[test]
fn nodes_with_different_process_counts_form_one_world_with_their_own_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let (port, run_id) = (free_port(), unique_run_id("elastic-nproc"));
    let host = node_with(dir.path(), port, &run_id, "2:3", 1, 12, &[]);
    std::thread::sleep(Duration::from_millis(300));
    let two = ["--num-processes", "2"];
    let second = node_with(dir.path(), port, &run_id, "2:3", 1, 12, &two);
    let (host, second) = (host.finish(T), second.finish(T));
    host.assert_code(0);
    second.assert_code(0);
    host.assert_stderr("this node is node rank 0 (ranks 0..0)");
    second.assert_stderr("this node is node rank 1 (ranks 1..2)");
    host.assert_stderr("micro 2 x grad_accum 2 x world 3 = global 12");
    assert_eq!(summary(dir.path())["world_size"], 3);
    assert_no_processes(&run_id, Duration::from_secs(10));
}

/// torchrun's fixed multi-node line, `--nnodes 2 --rdzv-backend c10d --rdzv-endpoint H:P
/// --rdzv-id J` with no node rank, forms the job at the endpoint: each node gets its own rank
/// there (not node 0 for both, with the endpoint ignored).
#[test]
fn a_fixed_node_count_without_node_ranks_gets_them_at_the_endpoint() {
    let dir = tempfile::tempdir().unwrap();
    let (port, run_id) = (free_port(), unique_run_id("fixed-rdzv"));
    let nodes: Vec<Live> = (0..2)
        .map(|_| node(dir.path(), port, &run_id, "2", 1))
        .collect();
    let outs: Vec<Output> = nodes.into_iter().map(|n| n.finish(T)).collect();
    let mut ranks = Vec::new();
    for out in &outs {
        out.assert_code(0);
        out.assert_stderr("round 0: 2 node(s)");
        let rank = (0..2).find(|r| {
            out.stderr
                .contains(&format!("this node is node rank {r} (ranks {r}..{r})"))
        });
        ranks.push(rank.unwrap_or_else(|| panic!("no node rank: {}", out.stderr)));
    }
    ranks.sort();
    assert_eq!(ranks, vec![0, 1]);
    assert_eq!(summary(dir.path())["world_size"], 2);
    assert_no_processes(&run_id, Duration::from_secs(10));
}

#[test]
fn a_joiner_that_dies_before_it_is_admitted_is_not_in_the_round() {
    let dir = tempfile::tempdir().unwrap();
    let (port, run_id) = (free_port(), unique_run_id("elastic-dead-joiner"));
    let no_restart = ["--max-restarts", "0"];
    let host = node_with(dir.path(), port, &run_id, "2:3", 6, 12, &no_restart);
    std::thread::sleep(Duration::from_millis(300));
    let second = node_with(dir.path(), port, &run_id, "2:3", 6, 12, &no_restart);
    wait_for(&host, "collective tcp ready", T);
    let late = node_with(dir.path(), port, &run_id, "2:3", 6, 12, &no_restart);
    wait_for(&host, "waiting to join: re-forming with 3 nodes", T);
    kill(late.pid(), Signal::SIGKILL).unwrap();
    let _ = late.finish(T);
    for live in [host, second] {
        let out = live.finish(T);
        out.assert_code(0);
        out.assert_stderr("round 1: 2 node(s)");
        assert!(!out.stderr.contains("round 1: 3 node(s)"), "{}", out.stderr);
    }
    assert_no_processes(&run_id, Duration::from_secs(10));
}

#[test]
fn a_member_lost_while_the_group_re_forms_counts_against_max_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let (port, run_id) = (free_port(), unique_run_id("elastic-count"));
    let no_restart = ["--max-restarts", "0"];
    let host = node_with(dir.path(), port, &run_id, "1:3", 20, 12, &no_restart);
    std::thread::sleep(Duration::from_millis(300));
    let second = node_with(dir.path(), port, &run_id, "1:3", 20, 12, &no_restart);
    wait_for(&host, "round 0: 2 node(s)", T);
    wait_for(&host, "collective tcp ready", T);
    let late = node_with(dir.path(), port, &run_id, "1:3", 20, 12, &no_restart);
    wait_for(&host, "waiting to join: re-forming with 3 nodes", T);
    signal_node(&second, Signal::SIGKILL);
    let out = host.finish(T);
    assert_ne!(out.code(), Some(0), "{}", out.stderr);
    out.assert_stderr("the worker group failed 1 time(s), more than --max-restarts 0");
    out.assert_stderr("the job's rounds: round 0 (node ids 0, 1; world 2)");
    let _ = second.finish(T);
    let _ = late.finish(T);
    assert_no_processes(&run_id, Duration::from_secs(10));
}

#[test]
fn a_node_dropped_while_stopped_exits_0_when_the_job_finished_without_it() {
    let dir = tempfile::tempdir().unwrap();
    let (port, run_id) = (free_port(), unique_run_id("elastic-dropped"));
    let host = node(dir.path(), port, &run_id, "1:2", 4);
    std::thread::sleep(Duration::from_millis(300));
    let second = node(dir.path(), port, &run_id, "1:2", 4);
    wait_for(&second, "collective tcp ready", T);
    signal_node(&second, Signal::SIGSTOP);
    // Dropped (no heartbeat), the host re-forms alone and finishes; it then waits for the
    // stopped node to hear that before it closes the store.
    wait_for(&host, "round 1: 1 node(s)", T);
    wait_for(&host, "vs popularity", T);
    std::thread::sleep(Duration::from_secs(2));
    signal_node(&second, Signal::SIGCONT);
    let out = second.finish(T);
    out.assert_code(0);
    out.assert_stderr("the job finished without this node");
    assert!(
        !out.stderr.contains("lost the rendezvous store"),
        "{}",
        out.stderr
    );
    host.finish(T).assert_code(0);
    assert_no_processes(&run_id, Duration::from_secs(10));
}

/// Sends `signal` to `live` after `after`; asserts it ends with `code` within 3 s of it, with
/// `line` on stderr.
fn assert_signal_ends_the_wait(live: Live, signal: Signal, code: i32, line: &str) {
    std::thread::sleep(Duration::from_millis(1500));
    let sent = Instant::now();
    kill(live.pid(), signal).unwrap();
    let out = live.finish(Duration::from_secs(30));
    out.assert_code(code);
    out.assert_stderr(line);
    assert!(
        sent.elapsed() < Duration::from_secs(3),
        "took {:?}",
        sent.elapsed()
    );
}

#[test]
fn a_signal_ends_the_wait_for_a_store_that_accepts_and_stays_silent() {
    for (signal, code) in [(Signal::SIGTERM, 143), (Signal::SIGINT, 130)] {
        let dir = tempfile::tempdir().unwrap();
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = silent.local_addr().unwrap().port();
        let accepted = std::thread::spawn(move || silent.accept().map(|(s, _)| s));
        let live = node(dir.path(), port, &unique_run_id("elastic-silent"), "1:2", 1);
        assert_signal_ends_the_wait(
            live,
            signal,
            code,
            "while reaching the rendezvous store at 127.0.0.1:",
        );
        drop(accepted);
    }
}

#[test]
fn a_signal_ends_the_wait_for_a_round_while_the_store_host_is_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let (port, run_id) = (free_port(), unique_run_id("elastic-stopped-host"));
    let host = node(dir.path(), port, &run_id, "3:4", 1);
    std::thread::sleep(Duration::from_millis(300));
    let joiner = node(dir.path(), port, &run_id, "3:4", 1);
    wait_for(&joiner, "waiting for nodes: 2 of at least 3 have joined", T);
    kill(host.pid(), Signal::SIGSTOP).unwrap();
    assert_signal_ends_the_wait(joiner, Signal::SIGTERM, 143, "stopped by SIGTERM");
    kill(host.pid(), Signal::SIGCONT).unwrap();
    kill(host.pid(), Signal::SIGTERM).unwrap();
    host.finish(T).assert_code(143);
    assert_no_processes(&run_id, Duration::from_secs(10));
}
