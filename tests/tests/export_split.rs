//! `export-split`: a config's train/valid/test split written as RecBole atomic files, checked
//! against the generated data itself (tiny synthetic data, no training): the three files are
//! there with RecBole's header, their lines add up to the data's positives (ratings >= 3), and
//! no (user, item) pair is in two files; a cold-start config is refused in one line, exit 2.

mod support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use support::*;

fn export_split(out: &Path, extra: &[&str]) -> Output {
    let output_dir = format!("run.output_dir={:?}", out.display().to_string());
    let mut args = vec![
        "configs/default.toml",
        "--set",
        &output_dir,
        "--set",
        "data.synthetic=\"tiny\"",
    ];
    args.extend(extra);
    let child = Command::new(bin("export-split"))
        .args(&args)
        .current_dir(repo_root())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start export-split");
    wait_output(child, Duration::from_secs(120))
}

/// The generated `ratings.dat` under `out/data/`.
fn ratings_file(out: &Path) -> PathBuf {
    std::fs::read_dir(out.join("data"))
        .unwrap()
        .map(|e| e.unwrap().path().join("ratings.dat"))
        .find(|p| p.is_file())
        .expect("the generated data")
}

/// Distinct (user, movie) pairs rated 3 stars or more (the config's `min_rating`).
fn positives(ratings: &Path) -> BTreeSet<(u32, u32)> {
    std::fs::read_to_string(ratings)
        .unwrap()
        .lines()
        .map(|line| {
            let f: Vec<u32> = line
                .split("::")
                .take(3)
                .map(|x| x.parse().unwrap())
                .collect();
            (f[0], f[1], f[2])
        })
        .filter(|&(_, _, stars)| stars >= 3)
        .map(|(u, m, _)| (u, m))
        .collect()
}

/// The (user, item) lines of one atomic file, after checking its header.
fn inter_pairs(path: &Path) -> Vec<(u32, u32)> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("user_id:token\titem_id:token"));
    lines
        .map(|l| {
            let (u, i) = l.split_once('\t').expect("two columns");
            (u.parse().unwrap(), i.parse().unwrap())
        })
        .collect()
}

#[test]
fn the_three_files_partition_the_positives() {
    let tmp = tempfile::tempdir().unwrap();
    let split_dir = tmp.path().join("split");
    let split = split_dir.display().to_string();
    let out = export_split(
        tmp.path(),
        &[
            "--set",
            "data.cold_items=0",
            "--set",
            "data.cold_users=0",
            "--out",
            &split,
            "--name",
            "tiny",
        ],
    );
    out.assert_code(0);
    out.assert_stdout_all(&["train", "valid", "test", "tiny.{train,valid,test}.inter"]);

    let parts: Vec<Vec<(u32, u32)>> = ["train", "valid", "test"]
        .iter()
        .map(|part| inter_pairs(&split_dir.join(format!("tiny.{part}.inter"))))
        .collect();
    assert!(parts.iter().all(|p| !p.is_empty()), "an empty part");
    let all: Vec<(u32, u32)> = parts.concat();
    let distinct: BTreeSet<(u32, u32)> = all.iter().copied().collect();
    assert_eq!(
        distinct.len(),
        all.len(),
        "a (user, item) pair in two files"
    );
    let positives = positives(&ratings_file(tmp.path()));
    assert_eq!(all.len(), positives.len());
    assert_eq!(distinct, positives);
    // Only the files, no temporary left behind.
    let names: BTreeSet<String> = std::fs::read_dir(&split_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        ["tiny.test.inter", "tiny.train.inter", "tiny.valid.inter"]
            .map(String::from)
            .into()
    );
}

#[test]
fn cold_start_and_bad_names_are_refused_in_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    let split = tmp.path().join("split").display().to_string();
    let cold = export_split(
        tmp.path(),
        &["--set", "data.cold_items=0.1", "--out", &split],
    );
    cold.assert_code(2);
    cold.assert_stderr("data.cold_items = 0.1");
    assert_eq!(cold.stderr.trim().lines().count(), 1, "{}", cold.stderr);
    let bad = export_split(
        tmp.path(),
        &[
            "--set",
            "data.cold_items=0",
            "--set",
            "data.cold_users=0",
            "--out",
            &split,
            "--name",
            "a/b",
        ],
    );
    bad.assert_code(2);
    bad.assert_stderr("--name");
    assert_eq!(bad.stderr.trim().lines().count(), 1, "{}", bad.stderr);
    assert!(!tmp.path().join("split").exists(), "nothing written");
}

/// The three files' bytes.
fn split_files(dir: &Path, name: &str) -> Vec<Vec<u8>> {
    ["train", "valid", "test"]
        .iter()
        .map(|part| std::fs::read(dir.join(format!("{name}.{part}.inter"))).unwrap())
        .collect()
}

#[test]
fn data_split_seed_keeps_the_split_while_run_seed_changes() {
    let tmp = tempfile::tempdir().unwrap();
    let no_cold = ["--set", "data.cold_items=0", "--set", "data.cold_users=0"];
    let export = |dir: &str, extra: &[&str]| {
        let mut args: Vec<&str> = no_cold.to_vec();
        args.extend(extra);
        args.extend(["--out", dir, "--name", "s"]);
        let out = export_split(tmp.path(), &args);
        out.assert_code(0);
    };
    let first = tmp.path().join("first").display().to_string();
    export(&first, &[]);
    // The same data (the first export generated it at run.seed 42) under another run.seed.
    let data = ratings_file(tmp.path());
    let set_data = format!(
        "data.dir={:?}",
        data.parent().unwrap().display().to_string()
    );
    let kept = tmp.path().join("kept").display().to_string();
    export(
        &kept,
        &[
            "--set",
            &set_data,
            "--set",
            "run.seed=5",
            "--set",
            "data.split_seed=42",
        ],
    );
    let moved = tmp.path().join("moved").display().to_string();
    export(&moved, &["--set", &set_data, "--set", "run.seed=5"]);
    let files = |d: &str| split_files(Path::new(d), "s");
    assert_eq!(
        files(&first),
        files(&kept),
        "split_seed 42 is run.seed 42's split"
    );
    assert_ne!(
        files(&first),
        files(&moved),
        "run.seed alone moves the split"
    );
}
