//! `gpt2-encode MODEL_DIR --ids ...` on the parity fixture (a random GPT-2 that `transformers`
//! wrote, with the hidden states it computed): the printed last hidden state is
//! `transformers`' within 1e-5, and bad directories and ids are one-line errors with exit 2.

mod support;

use std::process::Command;

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
