//! Which rank is slow, end to end: two workers under `launch`, one slowed by
//! `GPTREC_FAULT_SLOW`; the summary has a row of timings per rank and names the slow one, and
//! so does the summary record of `metrics.jsonl`. A rank 0 slow to serve the rendezvous store
//! (`GPTREC_FAULT_SLOW_START`) is waited for, not taken for a stranger on the port.

mod support;

use std::time::Duration;

use support::*;

#[test]
fn the_summary_names_the_slow_rank() {
    let dir = tempfile::tempdir().unwrap();
    let mut args: Vec<String> = ["--num-processes", "2", "--master-port", "0"]
        .map(String::from)
        .to_vec();
    args.push("configs/default.toml".into());
    args.extend(tiny_bpr_sets(dir.path()));
    args.extend(["--set".into(), "run.name=\"slow\"".into()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut cmd = launch_cmd(&args);
    // 10 ms more per micro-batch on rank 1: far above the noise of a tiny model's step.
    cmd.env("GPTREC_FAULT_SLOW", "10@1");
    let out = wait_output(cmd.spawn().expect("start launch"), Duration::from_secs(180));
    out.assert_code(0);
    out.assert_stdout_all(&[
        "time per step by rank (ms): compute, data, collectives, update",
        "rank 0: ",
        "rank 1: ",
        "straggler: rank 1 works ",
    ]);
    let metrics = std::fs::read_to_string(dir.path().join("slow/metrics.jsonl")).unwrap();
    let summary: serde_json::Value = metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["kind"] == "summary")
        .expect("a summary record");
    assert_eq!(summary["straggler_rank"], 1, "{summary}");
    let times = summary["time_per_step_ms"].as_array().unwrap();
    assert_eq!(times.len(), 2, "{summary}");
    // Rank 0 waits for rank 1 in the all-reduce: its collective time holds rank 1's delay.
    let (fast, slow) = (&times[0], &times[1]);
    assert!(slow["compute"].as_f64().unwrap() >= 10.0, "{summary}");
    assert!(
        fast["collective"].as_f64().unwrap() > slow["collective"].as_f64().unwrap(),
        "{summary}"
    );
}

#[test]
fn a_bad_slow_fault_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let mut args: Vec<String> = vec!["configs/default.toml".into()];
    args.extend(tiny_bpr_sets(dir.path()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut cmd = launch_cmd(&args);
    cmd.env("GPTREC_FAULT_SLOW", "fast");
    let out = wait_output(cmd.spawn().expect("start launch"), Duration::from_secs(120));
    assert_ne!(out.code(), Some(0), "{}", out.all());
    assert!(
        out.stderr
            .contains("GPTREC_FAULT_SLOW=fast: expected MS or MS@RANK"),
        "{}",
        out.all()
    );
}

#[test]
fn a_rank_0_slow_to_serve_the_store_is_waited_for_not_taken_for_a_stranger() {
    // Rank 0 sleeps past the handshake's 10 s before it serves the store on the port launch
    // holds for it: the old client gave up after 10 s ("another program holds that port") and
    // the job failed; now the other rank waits, says so once, and the job finishes.
    let dir = tempfile::tempdir().unwrap();
    let mut args: Vec<String> = ["--num-processes", "3", "--master-port", "0"]
        .map(String::from)
        .to_vec();
    args.push("configs/default.toml".into());
    args.extend(tiny_bpr_sets(dir.path()));
    args.extend(["--set".into(), "run.name=\"late\"".into()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut cmd = launch_cmd(&args);
    cmd.env("GPTREC_FAULT_SLOW_START", "11500@0");
    let out = wait_output(cmd.spawn().expect("start launch"), Duration::from_secs(180));
    out.assert_code(0);
    let all = out.all();
    let said = all
        .matches("rank 0 has not answered the rendezvous store's handshake")
        .count();
    assert_eq!(said, 1, "{all}");
    assert!(!all.contains("another program holds that port"), "{all}");
}
