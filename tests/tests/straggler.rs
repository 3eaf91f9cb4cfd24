//! Which rank is slow, end to end: two workers under `launch`, one slowed by
//! `GPTREC_FAULT_SLOW`; the summary has a row of timings per rank and names the slow one, and
//! so does the summary record of `metrics.jsonl`.

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
