//! End-to-end tests of the distributed runtime (issue: rendezvous, collectives, DDP engine,
//! sampler, checkpoints) with real processes under `launch`, the `tcp` backend on the CPU, and
//! the `ddp-fixture` worker (a small MLP regression task driven by the real engine).

mod support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use support::*;

const T: Duration = Duration::from_secs(240);

/// A fixture config in `dir`: 480 samples, global batch 8 (60 steps per epoch).
fn write_config(dir: &Path, name: &str, epochs: u32, extra: &str) -> PathBuf {
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(
        &path,
        format!(
            "[run]\nname = \"{name}\"\noutput_dir = \"{}\"\nseed = 11\n\n[train]\nepochs = {epochs}\nlr = 0.01\n\n[batch]\nglobal = 8\nmicro = 4\n\n[dist]\nbackend = \"tcp\"\ntimeout_s = 30\n{extra}",
            dir.join("runs").display()
        ),
    )
    .unwrap();
    path
}

fn fixture(nproc: u32, config: &Path, sets: &[&str], env: &[(&str, &str)]) -> Output {
    let fixture = bin("ddp-fixture");
    let mut args: Vec<String> = vec![
        "--num-processes".into(),
        nproc.to_string(),
        "--master-port".into(),
        "0".into(),
        "--grace-period".into(),
        "2".into(),
        "--worker".into(),
        fixture.display().to_string(),
    ];
    for s in sets {
        args.push("--set".into());
        args.push(s.to_string());
    }
    args.push(config.display().to_string());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut cmd = launch_cmd(&args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    wait_output(cmd.spawn().unwrap(), T)
}

/// [`fixture`], asserting that it exits 0.
#[track_caller]
fn fixture_ok(nproc: u32, config: &Path, sets: &[&str], env: &[(&str, &str)]) -> Output {
    let out = fixture(nproc, config, sets, env);
    out.assert_code(0);
    out
}

fn params(dir: &Path, name: &str, rank: u32) -> std::collections::BTreeMap<String, Vec<f32>> {
    read_f32_tensors(
        &dir.join("runs")
            .join(name)
            .join(format!("params-rank{rank}.safetensors")),
    )
}

fn losses(dir: &Path, name: &str) -> Vec<(u64, f64)> {
    std::fs::read_to_string(dir.join("runs").join(name).join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap())
        })
        .collect()
}

/// Panics unless runs `a` and `b` logged the same losses and their 2 ranks ended with the same
/// parameters.
#[track_caller]
fn assert_same_run(dir: &Path, a: &str, b: &str) {
    assert_eq!(losses(dir, a), losses(dir, b));
    for rank in 0..2 {
        assert_eq!(params(dir, a, rank), params(dir, b, rank));
    }
}

/// Same model, data and global batch (8) as (world 2, micro 4, accum 1), (world 1, micro 4,
/// accum 2) and (world 1, micro 8, accum 1): the same parameters after 60 steps, up to float
/// summation order. Tolerance 1e-5: the three runs add the same per-sample gradients in a
/// different order (ring vs. local accumulation), which changes the last bits of each step's
/// gradient (relative 1e-7); 60 AdamW steps at lr 1e-2 move parameters by O(0.1), so
/// differences of order 1e-6 are float noise, while any real mistake (a missing or doubled
/// micro-batch, a wrong average) moves them by 1e-3 or more.
#[test]
fn world_sizes_and_accumulation_give_the_same_model() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("w2m4", 2, "batch.micro=4"),
        ("w1m4a2", 1, "batch.micro=4"),
        ("w1m8", 1, "batch.micro=8"),
    ];
    for (name, nproc, micro) in cases {
        let config = write_config(dir.path(), name, 1, "");
        let out = fixture(nproc, &config, &[micro], &[]);
        assert_eq!(out.code(), Some(0), "{name}: {}", out.stderr);
    }
    let reference = params(dir.path(), "w2m4", 0);
    for (name, _, _) in &cases[1..] {
        let diff = max_abs_diff(&reference, &params(dir.path(), name, 0));
        eprintln!("{name}: max |difference| from w2m4 = {diff:e}");
        assert!(diff <= 1e-5, "{name} differs from w2m4 by {diff}");
    }
    // And the runs did train: the loss fell.
    let l = losses(dir.path(), "w2m4");
    let first: f64 = l[..5].iter().map(|x| x.1).sum::<f64>() / 5.0;
    let last: f64 = l[l.len() - 5..].iter().map(|x| x.1).sum::<f64>() / 5.0;
    assert!(last < first * 0.8, "loss did not fall: {first} -> {last}");
}

/// Every rank ends with bit-identical parameters (and the engine's own checksum comparison,
/// run every step, agrees).
#[test]
fn every_rank_ends_bit_identical() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "w3", 1, "check_params_every = 1\n");
    fixture_ok(3, &config, &["batch.global=12"], &[]);
    let p0 = params(dir.path(), "w3", 0);
    for rank in 1..3 {
        assert_eq!(
            params(dir.path(), "w3", rank),
            p0,
            "rank {rank} differs from rank 0"
        );
    }
}

/// 4 epochs in one run, and 2 epochs + resume for 2 more, give bit-identical parameters and
/// identical logged losses.
#[test]
fn resume_continues_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let whole = write_config(dir.path(), "whole", 4, "");
    fixture_ok(2, &whole, &[], &[]);

    let split = write_config(dir.path(), "split", 4, "");
    fixture_ok(2, &split, &[], &[("GPTREC_STOP_AFTER_EPOCH", "2")]);
    assert_eq!(
        losses(dir.path(), "split").len(),
        120,
        "stopped after 2 epochs"
    );
    let out = fixture_ok(2, &split, &[], &[]);
    out.assert_stderr("resuming from");

    assert_same_run(dir.path(), "split", "whole");
}

/// A crash in the middle of an epoch, between checkpoints: the resumed run (from the newest
/// checkpoint, itself mid-epoch) ends exactly where an uninterrupted one does, even with
/// dropout drawing random numbers; the steps logged after that checkpoint are not duplicated.
#[test]
fn crash_mid_epoch_then_resume_is_exact() {
    let dir = tempfile::tempdir().unwrap();
    let dropout = [("GPTREC_FIXTURE_DROPOUT", "0.2")];
    let whole = write_config(dir.path(), "whole", 2, "[checkpoint]\nevery_n_steps = 45\n");
    fixture_ok(2, &whole, &[], &dropout);

    let crash = write_config(dir.path(), "crash", 2, "[checkpoint]\nevery_n_steps = 45\n");
    let out = fixture(
        2,
        &crash,
        &[],
        &[dropout[0], ("GPTREC_FIXTURE_EXIT_AT_CALL", "100")],
    );
    out.assert_code(3);
    let out = fixture_ok(2, &crash, &[], &dropout);
    out.assert_stderr("step-000090 (epoch 2, step 90");

    assert_same_run(dir.path(), "crash", "whole");
}

/// Preemption: `launch` gets SIGTERM in the middle of an epoch (as Slurm or Kubernetes send it;
/// here from rank 0 after step 30) and passes it on; every rank finishes its step, they agree to
/// stop after the same one, rank 0 checkpoints it and they exit "preempted, resumable". The
/// rerun resumes from that step and ends exactly as an uninterrupted run does.
#[test]
fn sigterm_mid_epoch_checkpoints_and_the_rerun_resumes_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let whole = write_config(dir.path(), "whole", 2, "");
    fixture_ok(2, &whole, &[], &[]);

    let preempted = write_config(dir.path(), "preempted", 2, "");
    let out = fixture(2, &preempted, &[], &[("GPTREC_FAULT_TERM_LAUNCH", "30")]);
    out.assert_code(143);
    out.assert_stderr_all(&[
        "preempted (SIGTERM): stopped after step ",
        "run the same command again to resume",
    ]);
    let checkpoints = dir.path().join("runs/preempted/checkpoints");
    let latest = std::fs::read_to_string(checkpoints.join("latest")).unwrap();
    let step: u64 = latest.trim().trim_start_matches("step-").parse().unwrap();
    assert!(
        (31..60).contains(&step),
        "checkpoint {latest} is not mid-epoch"
    );
    // No rank is reported as failed: they stopped as asked.
    assert!(
        !out.stderr.contains("worker group failed"),
        "{}",
        out.stderr
    );

    let out = fixture_ok(2, &preempted, &[], &[]);
    out.assert_stderr(format!("{} (epoch 1, step {step}", latest.trim()));
    assert_same_run(dir.path(), "preempted", "whole");
}

/// Slurm's way: SIGTERM to `launch` and to every worker at the same moment (Slurm signals every
/// process of the step), so each worker gets two (Slurm's and the one `launch` passes on). The
/// workers still stop together at a checkpoint, and the rerun resumes from it exactly.
#[test]
fn sigterm_to_launch_and_its_workers_at_once_still_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let whole = write_config(dir.path(), "whole", 2, "");
    fixture_ok(2, &whole, &[], &[]);

    let config = write_config(dir.path(), "slurm", 2, "");
    let run_id = unique_run_id("preempt");
    let fixture = bin("ddp-fixture").display().to_string();
    let config_arg = config.display().to_string();
    let args = [
        "--num-processes",
        "2",
        "--master-port",
        "0",
        "--run-id",
        &run_id,
        "--worker",
        &fixture,
        &config_arg,
    ];
    let mut cmd = launch_cmd(&args);
    cmd.env("GPTREC_FAULT_SLOW", "10");
    let job = Live::new(cmd.spawn().unwrap());
    job.wait_output("step 24/120", T);
    let workers = processes_of_run(&run_id);
    assert_eq!(workers.len(), 2, "{workers:?}");
    let term = nix::sys::signal::Signal::SIGTERM;
    let _ = nix::sys::signal::kill(job.pid(), term);
    for pid in workers {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), term);
    }
    let out = job.finish(T);
    out.assert_code(143);
    out.assert_stderr_all(&[
        "preempted (SIGTERM): stopped after step ",
        "every worker stopped at a checkpoint",
    ]);
    let out = fixture_ok(2, &config, &[], &[]);
    out.assert_stderr("resuming from");
    assert_same_run(dir.path(), "slurm", "whole");
}

/// Resuming with another world size is allowed when the global batch is unchanged; another
/// global batch or another model config is refused with a clear message.
#[test]
fn resume_across_world_sizes_and_refusals() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "elastic", 2, "");
    fixture_ok(2, &config, &[], &[("GPTREC_STOP_AFTER_EPOCH", "1")]);

    let out = fixture(1, &config, &["batch.global=16"], &[]);
    assert_ne!(out.code(), Some(0));
    out.assert_stderr_all(&["global batch 8, this run has 16", "set batch.global = 8"]);

    let out = fixture(1, &config, &["model.embedding_dim=32"], &[]);
    assert_ne!(out.code(), Some(0));
    out.assert_stderr("different model config");

    // World 1 (micro 4 x grad_accum 2) continues what world 2 started.
    let out = fixture_ok(1, &config, &[], &[]);
    out.assert_stderr("written by 2 rank(s); now 1");
    assert_eq!(losses(dir.path(), "elastic").len(), 120);
}

/// A checkpoint cut short by a crash is skipped; the run resumes from the one before.
#[test]
fn truncated_checkpoint_is_skipped_on_resume() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "trunc", 3, "");
    fixture_ok(2, &config, &[], &[("GPTREC_STOP_AFTER_EPOCH", "2")]);
    let newest = dir
        .path()
        .join("runs/trunc/checkpoints/step-000120/model.safetensors");
    truncate_to_fraction(&newest, 3);
    let out = fixture_ok(2, &config, &[], &[]);
    out.assert_stderr_all(&["skipping checkpoint", "step-000060 (epoch 2, step 60"]);
}

/// One worker stops answering (SIGSTOP): the others fail within the timeout plus a few seconds,
/// naming the collective, the step and the silent rank; the launcher tears everything down.
#[test]
fn a_stopped_worker_makes_the_others_fail_in_time() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "hang", 1, "");
    let id = unique_run_id("hang");
    let fixture_bin = bin("ddp-fixture");
    let child = launch_cmd(&[
        "--num-processes",
        "3",
        "--master-port",
        "0",
        "--grace-period",
        "1",
        "--run-id",
        &id,
        "--worker",
        fixture_bin.to_str().unwrap(),
        "--set",
        "dist.timeout_s=3",
        "--set",
        "dist.rendezvous_timeout_s=60",
        "--set",
        "batch.global=12",
        config.to_str().unwrap(),
    ])
    .env("GPTREC_FIXTURE_STOP_RANK", "1")
    .spawn()
    .unwrap();
    let out = wait_output(child, Duration::from_secs(60));
    out.assert_code(1);
    out.assert_stderr_all(&[
        "all_reduce at step 3 timed out after 3.0 s",
        "no answer from rank(s) [1]",
    ]);
    out.assert_ended_within(25);
    assert_no_processes(&id, Duration::from_secs(5));
}
