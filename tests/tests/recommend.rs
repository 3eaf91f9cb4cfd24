//! `recommend RUN_DIR`: a real training run (`launch`, tiny generated data), then its best model
//! turned into recommendations and exported vectors by the `recommend` binary. Checked against
//! the data files themselves: nothing a user rated is recommended to them, and the exported
//! vectors give the same top items as the printed list; new users are placed by text; bad
//! requests are one-line errors with exit code 2. The export is all or nothing and writes
//! nothing through links planted in its directory; FIFOs in a run directory are refused at once;
//! a run is found from any directory, its data never generated, and a best model trained on
//! other data (another seed or split) is refused.

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
    recommend_in(&repo_root(), args)
}

/// `recommend ARGS` run from `dir`.
fn recommend_in(dir: &Path, args: &[&str]) -> Output {
    let child = Command::new(bin("recommend"))
        .args(args)
        .current_dir(dir)
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
    recommend_and_export(&[]);
}

/// With the item-item matrix a user's row ends with its item scores and an item's with an
/// identity: the exported vectors still rank as the printed lists do.
#[test]
fn an_item_item_model_s_exported_vectors_rank_as_its_lists() {
    recommend_and_export(&["model.user_tower=\"history\"", "model.item_item=true"]);
}

/// Trains the default config with `sets`, then checks its lists and its exported vectors.
fn recommend_and_export(sets: &[&str]) {
    let tmp = tempfile::tempdir().unwrap();
    let run = train(tmp.path(), "rec", sets);
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

/// Copies a run's `config.resolved.toml` and `best/` to `to`.
fn copy_run(run: &Path, to: &Path) {
    fn copy_dir(from: &Path, to: &Path) {
        std::fs::create_dir_all(to).unwrap();
        for entry in std::fs::read_dir(from).unwrap() {
            let path = entry.unwrap().path();
            let target = to.join(path.file_name().unwrap());
            if path.is_dir() {
                copy_dir(&path, &target);
            } else {
                std::fs::copy(&path, &target).unwrap();
            }
        }
    }
    copy_dir(&run.join("best"), &to.join("best"));
    std::fs::copy(
        run.join("config.resolved.toml"),
        to.join("config.resolved.toml"),
    )
    .unwrap();
}

/// Edits `RUN/config.resolved.toml`: each `key = value` line of `set` replaces the line of
/// that key in its section, or is added at the section's top.
fn edit_config(run: &Path, section: &str, set: &[(&str, String)]) {
    let path = run.join("config.resolved.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    let mut lines: Vec<String> = text.lines().map(String::from).collect();
    let header = format!("[{section}]");
    let start = lines.iter().position(|l| *l == header).unwrap();
    for (key, value) in set {
        let line = format!("{key} = {value}");
        let end = (start + 1..lines.len())
            .find(|&i| lines[i].starts_with('['))
            .unwrap_or(lines.len());
        match (start + 1..end).find(|&i| lines[i].starts_with(&format!("{key} = "))) {
            Some(i) => lines[i] = line,
            None => lines.insert(start + 1, line),
        }
    }
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
}

/// The names in `dir`, sorted.
fn names_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Links at the old fixed temporary names and at the final names point outside the export
/// directory: nothing outside changes. A name that cannot be replaced (a directory) leaves the
/// previous export as it was and no temporary behind. FIFOs in a run directory are one line at
/// once, and a missing file's cause is said once.
#[test]
fn the_export_is_all_or_nothing_and_nothing_outside_is_written() {
    use std::os::unix::fs::symlink;
    let tmp = tempfile::tempdir().unwrap();
    let run = train(tmp.path(), "exp", &["model.kind=\"bpr\""]);
    let run_s = run.display().to_string();
    let (export, outside) = (tmp.path().join("export"), tmp.path().join("outside"));
    std::fs::create_dir_all(&export).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    let planted = [
        ".ids.json.tmp",
        ".vectors.safetensors.tmp",
        "ids.json",
        "vectors.safetensors",
    ];
    for name in planted {
        std::fs::write(outside.join(name), "precious").unwrap();
        symlink(outside.join(name), export.join(name)).unwrap();
    }
    let export_s = export.display().to_string();
    let out = recommend(&[&run_s, "--export", &export_s]);
    out.assert_code(0);
    for name in planted {
        let text = std::fs::read_to_string(outside.join(name)).unwrap();
        assert_eq!(text, "precious", "{name} outside was written");
    }
    for name in ["ids.json", "vectors.safetensors"] {
        let meta = export.join(name).symlink_metadata().unwrap();
        assert!(meta.is_file(), "{name} is still a link");
    }
    assert_eq!(
        read_f32_tensors(&export.join("vectors.safetensors")).len(),
        2
    );
    assert_eq!(names_in(&export), {
        let mut all = planted.map(String::from).to_vec();
        all.sort();
        all
    });

    // ids.json cannot be replaced: the previous vectors stay, nothing new is left.
    let blocked = tmp.path().join("blocked");
    std::fs::create_dir_all(blocked.join("ids.json")).unwrap();
    std::fs::write(blocked.join("vectors.safetensors"), "old").unwrap();
    let out = recommend(&[&run_s, "--export", &blocked.display().to_string()]);
    out.assert_code(2);
    out.assert_stderr("ids.json: is a directory");
    assert_eq!(out.stderr.trim().lines().count(), 1, "{}", out.stderr);
    let old = std::fs::read_to_string(blocked.join("vectors.safetensors")).unwrap();
    assert_eq!(old, "old");
    assert_eq!(names_in(&blocked), ["ids.json", "vectors.safetensors"]);

    // FIFOs where the config and the best model's state are.
    let fifo = |path: &Path| {
        let _ = std::fs::remove_file(path);
        nix::unistd::mkfifo(path, nix::sys::stat::Mode::S_IRWXU).unwrap();
    };
    let copy = tmp.path().join("fifo-config");
    copy_run(&run, &copy);
    fifo(&copy.join("config.resolved.toml"));
    let state = tmp.path().join("fifo-state");
    copy_run(&run, &state);
    let step = std::fs::read_dir(state.join("best"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.is_dir())
        .unwrap();
    fifo(&step.join("state.json"));
    for (dir, needle) in [
        (&copy, "config.resolved.toml: not a finished run's config"),
        (&state, "state.json: is a FIFO, not a file"),
    ] {
        let out = recommend(&[&dir.display().to_string(), "--user", "7"]);
        out.assert_code(2);
        out.assert_stderr(needle);
        assert_eq!(out.stderr.trim().lines().count(), 1, "{}", out.stderr);
        out.assert_ended_within(30);
    }

    // The cause of a missing config, once.
    let out = recommend(&[
        &tmp.path().join("nothing").display().to_string(),
        "--user",
        "7",
    ]);
    out.assert_code(2);
    assert_eq!(
        out.stderr.matches("No such file or directory").count(),
        1,
        "{}",
        out.stderr
    );
}

/// Run from another directory, `recommend` finds the run's data where the run was started
/// (relative paths included) and generates nothing; data that is not there is one line; a
/// best model trained with another seed or split is refused.
#[test]
fn a_run_is_found_from_anywhere_and_other_data_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let out_dir = tmp.path().join("out");
    let run = train(&out_dir, "far", &["model.kind=\"bpr\""]);
    let synthetic = std::fs::read_dir(out_dir.join("data"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.join("ratings.dat").is_file())
        .unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    let run_s = run.display().to_string();

    // As if started in tmp with relative paths: output_dir = "out", then data.dir too.
    edit_config(&run, "run", &[("output_dir", "\"out\"".into())]);
    let bare = tmp.path().join("bare");
    copy_run(&run, &bare.join("far"));
    let out = recommend_in(elsewhere.path(), &[&run_s, "--user", "7", "--top", "3"]);
    out.assert_code(0);
    let name = synthetic
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    edit_config(&run, "data", &[("dir", format!("\"out/data/{name}\""))]);
    let out = recommend_in(elsewhere.path(), &[&run_s, "--user", "7", "--top", "3"]);
    out.assert_code(0);
    assert!(
        names_in(elsewhere.path()).is_empty(),
        "written where it ran"
    );

    // Away from its data: refused, nothing generated.
    let moved = tmp.path().join("moved").join("far");
    copy_run(&run, &moved);
    edit_config(&moved, "data", &[("dir", "\"out/data/gone\"".into())]);
    for (dir, needle) in [
        (
            &moved,
            "data.dir = \"out/data/gone\" in the run's config.resolved.toml",
        ),
        (&bare.join("far"), "the run's synthetic data is not there"),
    ] {
        let out = recommend_in(
            elsewhere.path(),
            &[&dir.display().to_string(), "--user", "7"],
        );
        out.assert_code(2);
        out.assert_stderr(needle);
        assert_eq!(out.stderr.trim().lines().count(), 1, "{}", out.stderr);
    }
    assert_eq!(names_in(&bare), ["far"], "data generated");
    assert!(
        names_in(elsewhere.path()).is_empty(),
        "written where it ran"
    );

    // Another seed, the same data and sizes: the split differs, and the fingerprint says so
    // (before, the best model was loaded against the other split and the exit code was 0).
    let other = out_dir.join("other-seed");
    copy_run(&run, &other);
    edit_config(&other, "run", &[("seed", "7".into())]);
    let out = recommend(&[&other.display().to_string(), "--user", "7"]);
    out.assert_code(2);
    out.assert_stderr("trained on other data or another split");
    assert_eq!(out.stderr.trim().lines().count(), 1, "{}", out.stderr);
}
