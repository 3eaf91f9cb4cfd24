//! GPUs someone else holds: the dry run and `launch` name, per GPU they plan to use, the processes
//! holding memory there (pid, user, command, MiB), and `launch` refuses in one line when what is
//! left free does not hold the memory estimate, unless `--force`. Through the simulated GPUs
//! (`GPTREC_SIMULATE_GPUS`) and their simulated holders (`GPTREC_SIMULATE_GPU_HOLDERS`: real
//! processes, whose user and command come from `/proc`).

mod support;

use std::time::Duration;

use support::*;

const T: Duration = Duration::from_secs(120);

#[test]
fn a_gpu_held_by_another_process_is_named_and_refused_unless_forced() {
    let mut stale = std::process::Command::new("sleep")
        .arg("300")
        .spawn()
        .unwrap();
    let holders = format!("0:{}:81800", stale.id());
    let dir = tempfile::tempdir().unwrap();
    let run = |extra: &[&str]| {
        let mut args = vec!["--num-processes", "auto", "--master-port", "0"];
        args.extend(extra);
        args.push("configs/default.toml");
        let sets = tiny_bpr_sets(dir.path());
        args.extend(sets.iter().map(String::as_str));
        let mut cmd = launch_cmd(&args);
        cmd.env("GPTREC_SIMULATE_GPUS", "2")
            .env("GPTREC_SIMULATE_GPU_HOLDERS", &holders);
        wait_output(cmd.spawn().unwrap(), T)
    };
    let held = format!("pid {} (user ", stale.id());
    let dry = run(&["--dry-run"]);
    dry.assert_code(0);
    dry.assert_stdout_all(&[
        format!("    held by: {held}"),
        ": sleep 300, 81800 MiB)".to_string(),
        "  refused:      launch would not start: local rank 0's GPU 0 has 120.0 MiB free".into(),
    ]);
    let refused = run(&[]);
    refused.assert_code(2);
    refused.assert_stderr_all(&[
        "launch: error: local rank 0's GPU 0 has 120.0 MiB free, less than the estimate "
            .to_string(),
        format!("other processes hold it: {held}"),
        "; stop them, choose other GPUs (--gpu-ids), or --force to start anyway".into(),
    ]);
    assert!(
        !refused.stdout.contains("[rank "),
        "nothing started: {}",
        refused.stdout
    );
    run(&["--force"]).assert_code(0);
    let _ = stale.kill();
    let _ = stale.wait();
    // Nobody holds it: no line, no refusal.
    let mut cmd = launch_cmd(&[
        "--dry-run",
        "--num-processes",
        "auto",
        "configs/default.toml",
    ]);
    cmd.env("GPTREC_SIMULATE_GPUS", "2");
    let clean = wait_output(cmd.spawn().unwrap(), T);
    assert!(
        !clean.stdout.contains("held by") && !clean.stdout.contains("refused"),
        "{}",
        clean.stdout
    );
}
