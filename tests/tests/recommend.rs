//! `recommend RUN_DIR`: a real training run (`launch`, tiny generated data), then its best model
//! turned into recommendations and exported vectors by the `recommend` binary. Checked against
//! the data files themselves: nothing a user rated is recommended to them, and the exported
//! vectors give the same top items as the printed list; new users are placed by text; bad
//! requests are one-line errors with exit code 2.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use support::*;

/// Trains `name` (1 process, tiny data, 2 epochs) under `out` and returns its run directory.
fn train(out: &Path, name: &str, sets: &[&str]) -> PathBuf {
    let mut args = vec![
        "--num-processes".to_string(),
        "1".into(),
        "--master-port".into(),
        "0".into(),
        "configs/default.toml".into(),
    ];
    let mut all = vec![
        format!("run.output_dir={:?}", out.display().to_string()),
        format!("run.name={name:?}"),
        "data.synthetic=\"tiny\"".into(),
        "train.epochs=2".into(),
    ];
    all.extend(sets.iter().map(|s| s.to_string()));
    for set in all {
        args.extend(["--set".into(), set]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    launch(&args, Duration::from_secs(300)).assert_code(0);
    out.join(name)
}

fn recommend(args: &[&str]) -> Output {
    let child = Command::new(bin("recommend"))
        .args(args)
        .current_dir(repo_root())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start recommend");
    wait_output(child, Duration::from_secs(120))
}

/// Every movie each user rated, from the generated `ratings.dat` (any number of stars).
fn rated(out: &Path) -> BTreeMap<u32, BTreeSet<u32>> {
    let data = std::fs::read_dir(out.join("data"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.join("ratings.dat").is_file())
        .expect("the generated data");
    let mut rated: BTreeMap<u32, BTreeSet<u32>> = BTreeMap::new();
    for line in std::fs::read_to_string(data.join("ratings.dat"))
        .unwrap()
        .lines()
    {
        let f: Vec<u32> = line
            .split("::")
            .take(2)
            .map(|x| x.parse().unwrap())
            .collect();
        rated.entry(f[0]).or_default().insert(f[1]);
    }
    rated
}

/// The `[movie N]` ids of the lines after `header`, in order.
fn listed(stdout: &str, header: &str) -> Vec<u32> {
    stdout
        .lines()
        .skip_while(|l| !l.starts_with(header))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .map(|l| {
            let id = l
                .split("[movie ")
                .nth(1)
                .unwrap()
                .split(']')
                .next()
                .unwrap();
            id.parse().unwrap()
        })
        .collect()
}

#[test]
fn recommendations_leave_out_what_was_rated_and_match_the_exported_vectors() {
    let tmp = tempfile::tempdir().unwrap();
    let run = train(tmp.path(), "rec", &[]);
    let export = tmp.path().join("export");
    let run_s = run.display().to_string();
    let export_s = export.display().to_string();
    let out = recommend(&[
        &run_s,
        "--user",
        "7",
        "--user",
        "150",
        "--new-user",
        "F,25,12",
        "--top",
        "5",
        "--export",
        &export_s,
    ]);
    out.assert_code(0);
    let rated = rated(tmp.path());
    for user in [7u32, 150] {
        let top = listed(&out.stdout, &format!("user {user} ("));
        assert_eq!(top.len(), 5, "{}", out.stdout);
        for movie in &top {
            assert!(
                !rated[&user].contains(movie),
                "user {user} rated movie {movie}"
            );
        }
    }
    assert_eq!(
        listed(
            &out.stdout,
            "new user (female, aged 25-34, works as programmer)"
        )
        .len(),
        5
    );

    // The exported vectors rank the same: dot products, what user 7 rated left out.
    let tensors = read_f32_tensors(&export.join("vectors.safetensors"));
    let ids: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(export.join("ids.json")).unwrap()).unwrap();
    let users: Vec<u32> = serde_json::from_value(ids["users"].clone()).unwrap();
    let items: Vec<u32> = serde_json::from_value(ids["items"].clone()).unwrap();
    let dim = tensors["users"].len() / users.len();
    assert_eq!(tensors["items"].len(), items.len() * dim);
    let row = users.iter().position(|&u| u == 7).unwrap();
    let u = &tensors["users"][row * dim..(row + 1) * dim];
    let mut scored: Vec<(f32, u32)> = items
        .iter()
        .enumerate()
        .filter(|(_, m)| !rated[&7].contains(m))
        .map(|(i, &m)| {
            let v = &tensors["items"][i * dim..(i + 1) * dim];
            (u.iter().zip(v).map(|(a, b)| a * b).sum(), m)
        })
        .collect();
    scored.sort_by(|a, b| b.0.total_cmp(&a.0));
    let from_vectors: Vec<u32> = scored.iter().take(5).map(|s| s.1).collect();
    assert_eq!(from_vectors, listed(&out.stdout, "user 7 ("));
}

#[test]
fn bad_requests_are_one_line_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let bpr = train(tmp.path(), "bpr", &["model.kind=\"bpr\""]);
    let bpr_s = bpr.display().to_string();
    let cases: [(Vec<&str>, &str); 4] = [
        (
            vec![&bpr_s, "--user", "99999"],
            "--user 99999: no such user",
        ),
        (
            vec![&bpr_s, "--new-user", "F,26,1"],
            "age must be one of ML-1M's codes",
        ),
        (vec![&bpr_s, "--new-user", "F,25,1"], "has no text tower"),
        (vec![&bpr_s], "nothing to do"),
    ];
    for (args, needle) in cases {
        let out = recommend(&args);
        out.assert_code(2);
        out.assert_stderr(needle);
        assert_eq!(out.stderr.trim().lines().count(), 1, "{}", out.stderr);
    }
    // A run directory without a best model.
    let empty = tmp.path().join("bpr-copy");
    std::fs::create_dir_all(&empty).unwrap();
    std::fs::copy(
        bpr.join("config.resolved.toml"),
        empty.join("config.resolved.toml"),
    )
    .unwrap();
    let out = recommend(&[&empty.display().to_string(), "--user", "7"]);
    out.assert_code(2);
    out.assert_stderr("no complete best model");
    let out = recommend(&[
        &tmp.path().join("nothing").display().to_string(),
        "--user",
        "7",
    ]);
    out.assert_code(2);
    out.assert_stderr("config.resolved.toml");
}
