//! The PyTorch + transformers peer of our dynamic GPT-2 training step, on the CPU with the tiny
//! preset: `scripts/bench/vs_pytorch_gpt2.sh` trains ours with `GPTREC_DUMP_PEER`, the peer
//! (`scripts/bench/gpt2_peer.py`) checks that its loss on the dumped micro batch equals ours, then
//! both report their training samples/s. Timings are never asserted, only that each side gave
//! one. Needs the venv `scripts/setup.sh` makes, with transformers; without it the test says so
//! and passes as skipped.

mod support;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use support::{bin_dir, launch_default_config, repo_root, wait_output};

/// The venv's Python when it can import transformers; `None`, after a `skipped:` line, without.
fn python_with_transformers() -> Option<PathBuf> {
    let venv = std::env::var_os("GPTREC_TORCH_VENV").map(PathBuf::from);
    let python = venv.map(|v| v.join("bin/python")).filter(|p| {
        Command::new(p)
            .args(["-c", "import torch, transformers, safetensors"])
            .output()
            .is_ok_and(|o| o.status.success())
    });
    if python.is_none() {
        eprintln!("skipped: no venv with transformers (run scripts/setup.sh)");
    }
    python
}

/// The samples/s cell of the table row whose first cell is `side`.
fn samples_per_s(table: &str, side: &str) -> f64 {
    let row = table
        .lines()
        .find(|l| l.starts_with(&format!("| {side} |")))
        .unwrap_or_else(|| panic!("no row for {side} in:\n{table}"));
    let cells: Vec<&str> = row.split('|').map(str::trim).collect();
    // "", side, precision, plan, samples/s, ...
    cells[4]
        .parse()
        .unwrap_or_else(|_| panic!("samples/s of {side} is not a number: {row}"))
}

#[test]
fn the_peer_computes_our_loss_and_both_sides_report_their_speed() {
    let Some(python) = python_with_transformers() else {
        return;
    };
    let out = tempfile::tempdir().unwrap();
    let mut cmd = Command::new("bash");
    cmd.arg(repo_root().join("scripts/bench/vs_pytorch_gpt2.sh"))
        .env("GPTREC_BIN", bin_dir())
        .env("PYTHON", &python)
        .env("BENCH_OUT", out.path())
        .env("PEER_STEPS", "20")
        .env("OMP_NUM_THREADS", "1")
        .env_remove("PEER_DEVICE")
        // bf16: our CPU autocast (`train.bf16`) against `torch.autocast("cpu")`.
        .env("PRECISION", "f32 bf16")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let run = wait_output(cmd.spawn().expect("start bash"), Duration::from_secs(300));
    assert_eq!(run.code(), Some(0), "{}", run.all());
    eprintln!("{}", run.stdout);
    for (precision, tolerance) in [("f32", "1e-05"), ("bf16", "2e-02")] {
        let parity = run
            .stdout
            .lines()
            .find(|l| l.contains(&format!("peer parity {precision}: ")))
            .unwrap_or_else(|| panic!("no {precision} parity line:\n{}", run.all()));
        assert!(
            parity.ends_with(&format!("(tolerance {tolerance}): ok")),
            "{parity}"
        );
    }
    for side in ["ours", "PyTorch + transformers"] {
        let rate = samples_per_s(&run.stdout, side);
        assert!(rate.is_finite() && rate > 0.0, "{side}: {rate}");
    }
    // The dump the peer read: the model, the tables, the micro batch and our losses.
    let dump = out.path().join("dump-f32-m16");
    for file in [
        "weights.safetensors",
        "tables.safetensors",
        "batch.safetensors",
        "meta.json",
    ] {
        assert!(dump.join(file).is_file(), "{file} missing in {dump:?}");
    }
}

/// The step records (loss, grad_norm) of a run's `metrics.jsonl`.
fn steps(run_dir: &std::path::Path) -> Vec<(f64, f64)> {
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    text.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|r| r["kind"] == "step")
        .map(|r| {
            (
                r["loss"].as_f64().unwrap(),
                r["grad_norm"].as_f64().unwrap(),
            )
        })
        .collect()
}

/// `GPTREC_DUMP_PEER` changes nothing in training: two ranks (rank 0 dumps), every step's loss
/// and gradient norm as without it, bit for bit. A model the peer does not mirror is refused.
#[test]
fn the_dump_leaves_training_unchanged() {
    let out = tempfile::tempdir().unwrap();
    let dump = out.path().join("dump");
    let dump_text = dump.display().to_string();
    let sets = [
        "data.synthetic=\"tiny\"",
        "model.text_mode=\"dynamic\"",
        "train.loss=\"bpr\"",
        "model.user_tower=\"id\"",
        "model.max_text_tokens=4",
        "train.epochs=1",
        "batch.global=64",
        "batch.micro=16",
        "eval.patience=0",
    ];
    let with = launch_default_config(
        out.path(),
        "with",
        None,
        &[("GPTREC_DUMP_PEER", &dump_text)],
        &sets,
    );
    with.assert_code(0);
    let without = launch_default_config(out.path(), "without", None, &[], &sets);
    without.assert_code(0);
    let (a, b) = (
        steps(&out.path().join("with")),
        steps(&out.path().join("without")),
    );
    assert!(!a.is_empty());
    assert_eq!(a, b, "the dump changed the training");
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dump.join("meta.json")).unwrap()).unwrap();
    assert_eq!(meta["batch"]["world"], 2);
    assert_eq!(meta["batch"]["grad_accum"], 2);
    let loss = meta["loss"].as_f64().unwrap();
    assert!(loss.is_finite() && loss > 0.0, "{meta}");

    let cached = launch_default_config(
        out.path(),
        "cached",
        None,
        &[("GPTREC_DUMP_PEER", &dump_text)],
        &["data.synthetic=\"tiny\"", "train.epochs=1"],
    );
    cached.assert_code(1);
    cached.assert_stderr("GPTREC_DUMP_PEER=");
    cached.assert_stderr(
        "the peer mirrors model.kind = \"gpt2rec\" with model.text_mode = \"dynamic\"",
    );
    let history = [&sets[..], &["model.user_tower=\"history\""]].concat();
    let pooled = launch_default_config(
        out.path(),
        "pooled",
        None,
        &[("GPTREC_DUMP_PEER", &dump_text)],
        &history,
    );
    pooled.assert_code(1);
    pooled.assert_stderr("the peer mirrors model.user_tower = \"id\"");
}

/// A bad setting is one line naming it, before anything runs.
#[test]
fn bad_settings_are_one_line_errors() {
    for (key, value, says) in [
        (
            "PRECISION",
            "fp8",
            "PRECISION=fp8: expected f32, tf32 or bf16",
        ),
        ("PRECISION", "tf32", "PRECISION=tf32 needs PEER_DEVICE=cuda"),
        ("MICRO", "0", "MICRO=0: expected a whole number >= 1"),
        ("PRESET", "large", "PRESET=large: expected tiny or gpt2"),
    ] {
        let mut cmd = Command::new("bash");
        cmd.arg(repo_root().join("scripts/bench/vs_pytorch_gpt2.sh"))
            .env("GPTREC_BIN", bin_dir())
            .env(key, value)
            .env_remove("PEER_DEVICE")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let run = wait_output(cmd.spawn().expect("start bash"), Duration::from_secs(30));
        assert_eq!(run.code(), Some(2), "{key}={value}: {}", run.all());
        let lines: Vec<&str> = run.stderr.lines().collect();
        assert_eq!(lines.len(), 1, "{key}={value}: {}", run.stderr);
        assert!(
            lines[0].starts_with("vs_pytorch_gpt2.sh: error: ") && lines[0].contains(says),
            "{key}={value}: {}",
            run.stderr
        );
    }
}
