//! `gpt2-encode MODEL_DIR --ids ...` on the parity fixture (a random GPT-2 that `transformers`
//! wrote, with the hidden states it computed): the printed last hidden state is
//! `transformers`' within 1e-5, and bad directories and ids are one-line errors with exit 2:
//! hostile `config.json` values (sizes that would allocate gigabytes, dropouts and epsilons out
//! of range) and files that are FIFOs are refused at once, naming the file and the field.

mod support;

use std::process::{Command, Stdio};
use std::time::Duration;

use support::*;

fn fixture() -> std::path::PathBuf {
    repo_root().join("recommender/tests/fixtures/gpt2-parity")
}

fn encode(dir: &std::path::Path, args: &[&str]) -> std::process::Output {
    Command::new(bin("gpt2-encode"))
        .arg(dir)
        .args(args)
        .output()
        .expect("run gpt2-encode")
}

#[test]
fn the_printed_hidden_state_is_what_transformers_computed() {
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("expected.json")).unwrap())
            .unwrap();
    // The first sequence has no padding: every position is real.
    let ids: Vec<i64> = serde_json::from_value(expected["input_ids"][0].clone()).unwrap();
    let want: Vec<Vec<f64>> =
        serde_json::from_value(expected["last_hidden_state"][0].clone()).unwrap();
    let text: Vec<String> = ids.iter().map(i64::to_string).collect();
    let out = encode(&fixture(), &["--ids", &text.join(",")]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let got: Vec<Vec<f64>> = serde_json::from_value(got["last_hidden_state"].clone()).unwrap();
    assert_eq!((got.len(), got[0].len()), (want.len(), want[0].len()));
    let diff = got
        .iter()
        .flatten()
        .zip(want.iter().flatten())
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(diff < 1e-5, "differs from transformers by {diff}");
}

#[test]
fn bad_directories_and_ids_are_one_line_errors() {
    let empty = tempfile::tempdir().unwrap();
    // The fixture's weights under a config.json that says another width (which tensor is
    // named first depends on the store's order).
    let wider = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixture().join("model.safetensors"),
        wider.path().join("model.safetensors"),
    )
    .unwrap();
    let config = std::fs::read_to_string(fixture().join("config.json")).unwrap();
    std::fs::write(
        wider.path().join("config.json"),
        config.replace("\"n_embd\": 32", "\"n_embd\": 64"),
    )
    .unwrap();
    for (dir, args, needle) in [
        (
            wider.path().to_path_buf(),
            &["--ids", "1"][..],
            "expected, file has [",
        ),
        (
            empty.path().to_path_buf(),
            &["--ids", "1"][..],
            "config.json",
        ),
        (
            fixture(),
            &["--ids", "1,x"],
            "expected numbers separated by commas",
        ),
        (
            fixture(),
            &["--ids", "500"],
            "outside the model's vocabulary (0..96)",
        ),
        (
            fixture(),
            &["--ids", &["1"; 40].join(",")],
            "more than the model's 32 positions",
        ),
    ] {
        let out = encode(&dir, args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    }
}

/// `gpt2-encode DIR --ids 1` with a time limit (a hang is killed and fails the test).
fn encode_within(dir: &std::path::Path, limit: Duration) -> Output {
    let child = Command::new(bin("gpt2-encode"))
        .arg(dir)
        .args(["--ids", "1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start gpt2-encode");
    wait_output(child, limit)
}

/// The fixture's weights beside a `config.json` with `from` replaced by `to`.
fn hostile_dir(from: &str, to: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixture().join("model.safetensors"),
        dir.path().join("model.safetensors"),
    )
    .unwrap();
    let config = std::fs::read_to_string(fixture().join("config.json")).unwrap();
    assert!(config.contains(from), "{from}");
    std::fs::write(dir.path().join("config.json"), config.replace(from, to)).unwrap();
    dir
}

/// Each used to panic with a libtorch backtrace or abort after allocating gigabytes (sizes),
/// panic (a dropout of 5) or print all-null vectors with exit 0 (a negative epsilon).
#[test]
fn hostile_config_values_are_one_line_naming_the_field_and_quick() {
    let config = "config.json: ";
    let weights = "model.safetensors: ";
    for (from, to, file, needle) in [
        ("\"n_embd\": 32", "\"n_embd\": 1000000000", config, "n_embd"),
        (
            "\"vocab_size\": 96",
            "\"vocab_size\": 1000000000000",
            config,
            "vocab_size",
        ),
        (
            "\"n_positions\": 32",
            "\"n_positions\": 1000000000000",
            config,
            "n_positions",
        ),
        (
            "\"n_embd\": 32",
            "\"n_embd\": 65536",
            config,
            "parameters, more than",
        ),
        (
            "\"embd_pdrop\": 0.0",
            "\"embd_pdrop\": 5",
            config,
            "embd_pdrop",
        ),
        (
            "\"layer_norm_epsilon\": 1e-05",
            "\"layer_norm_epsilon\": -1",
            config,
            "layer_norm_epsilon",
        ),
        // Within every bound, but not what the weights hold: refused from their header,
        // before 1.6 GB (width 4096) or 1000 blocks are allocated.
        (
            "\"n_embd\": 32",
            "\"n_embd\": 4096",
            weights,
            "wte.weight: shape [96, 4096] expected, file has [96, 32]",
        ),
        (
            "\"n_layer\": 2",
            "\"n_layer\": 1000",
            weights,
            "tensors missing from the file: h.2.",
        ),
    ] {
        let dir = hostile_dir(from, to);
        let out = encode_within(dir.path(), Duration::from_secs(60));
        out.assert_code(2);
        out.assert_stderr_all(&[file, needle]);
        assert_eq!(out.stderr.trim_end().lines().count(), 1, "{}", out.stderr);
        assert!(out.stdout.is_empty(), "{}", out.stdout);
        out.assert_ended_within(10);
    }
}

#[test]
fn a_config_json_or_weights_that_are_a_fifo_are_refused_at_once() {
    for name in ["config.json", "model.safetensors"] {
        let dir = hostile_dir("\"n_embd\": 32", "\"n_embd\": 32");
        let path = dir.path().join(name);
        std::fs::remove_file(&path).unwrap();
        nix::unistd::mkfifo(&path, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let out = encode_within(dir.path(), Duration::from_secs(30));
        out.assert_code(2);
        out.assert_stderr(format!("{name}: is a FIFO, not a file"));
        assert_eq!(out.stderr.trim_end().lines().count(), 1, "{}", out.stderr);
        out.assert_ended_within(10);
    }
}
