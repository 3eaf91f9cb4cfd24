//! Real data's path end to end: the card's command on a fresh box stops at the pre-flight with
//! one line naming the path and the `fetch` command (before any worker starts, dry run or
//! not); files that are FIFOs, directories or empty are refused the same way, never a hang;
//! and a data directory in MovieLens-100k's layout (`u.data`, `u.user`, `u.item`) trains and
//! serves recommendations for a new user described in its own terms.

mod support;

use std::path::Path;
use std::time::Duration;

use support::*;

/// `launch ARGS` with `GPTREC_CACHE=cache`, run in `cwd`.
fn launch_in(cwd: &Path, cache: &Path, args: &[&str]) -> Output {
    let mut cmd = launch_cmd(args);
    cmd.current_dir(cwd).env("GPTREC_CACHE", cache);
    wait_output(cmd.spawn().expect("start launch"), Duration::from_secs(60))
}

fn train_toml() -> String {
    repo_root().join("configs/train.toml").display().to_string()
}

#[test]
fn the_cards_command_on_a_fresh_box_ends_at_the_preflight() {
    let cwd = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let config = train_toml();
    for dry in [false, true] {
        let mut args = vec!["--num-processes", "3", config.as_str()];
        if dry {
            args.insert(0, "--dry-run");
        }
        let out = launch_in(cwd.path(), cache.path(), &args);
        out.assert_code(2);
        let expected = cache.path().join("data").join("ml-1m");
        let line = format!(
            "launch: error: data.dir: {}: no such directory; run `fetch ml-1m` to download it",
            expected.display()
        );
        assert_eq!(out.stderr.trim(), line, "dry run {dry}");
        assert!(
            !out.stderr.contains("[rank"),
            "a worker started: {}",
            out.stderr
        );
        assert!(
            !cwd.path().join("runs").exists(),
            "the pre-flight wrote a run directory"
        );
        out.assert_ended_within(10);
    }
    // With the data there, the next thing missing is GPT-2's weights, named the same way.
    let data = cache.path().join("data").join("ml-1m");
    std::fs::create_dir_all(&data).unwrap();
    for f in ["ratings.dat", "users.dat", "movies.dat"] {
        std::fs::write(data.join(f), "x").unwrap();
    }
    let out = launch_in(cwd.path(), cache.path(), &["--dry-run", &config]);
    out.assert_code(2);
    out.assert_stderr_all(&[
        "model.gpt2_weights: ",
        "models/gpt2: no such file or directory; run `fetch gpt2` to download it",
    ]);
}

#[test]
fn fifos_directories_and_empty_files_are_refused_before_any_worker_starts() {
    let cwd = tempfile::tempdir().unwrap();
    let data = cwd.path().join("ml");
    std::fs::create_dir(&data).unwrap();
    std::fs::write(data.join("u.data"), "1\t1\t5\t1\n").unwrap();
    std::fs::write(data.join("u.user"), "").unwrap();
    std::fs::create_dir(data.join("u.item")).unwrap();
    let mkfifo = |p: &Path| nix::unistd::mkfifo(p, nix::sys::stat::Mode::S_IRWXU).unwrap();
    let config = repo_root().join("configs/default.toml");
    let config = config.display().to_string();
    let set = format!("data.dir={:?}", data.display().to_string());
    let run = |args: &[&str]| launch_in(cwd.path(), cwd.path(), args);

    let out = run(&["--num-processes", "2", &config, "--set", &set]);
    out.assert_code(2);
    out.assert_stderr("u.user: is empty (MovieLens-100k needs it)");
    std::fs::write(data.join("u.user"), "1|24|M|writer|1\n").unwrap();
    let out = run(&["--num-processes", "2", &config, "--set", &set]);
    out.assert_code(2);
    out.assert_stderr("u.item: is a directory, not a file");
    std::fs::remove_dir(data.join("u.item")).unwrap();
    mkfifo(&data.join("u.item"));
    let out = run(&["--dry-run", &config, "--set", &set]);
    out.assert_code(2);
    out.assert_stderr("u.item: is a FIFO, not a file");
    out.assert_ended_within(10);

    // A config that is a FIFO is refused at once, not waited on.
    let fifo = cwd.path().join("fifo.toml");
    mkfifo(&fifo);
    let out = run(&["--dry-run", &fifo.display().to_string()]);
    out.assert_code(2);
    out.assert_stderr("fifo.toml: it is not a regular file");
    out.assert_ended_within(10);
    assert_eq!(out.stderr.trim().lines().count(), 1, "{}", out.stderr);
}

/// A small data set in MovieLens-100k's layout: 60 users who each rate 20 of 80 movies.
fn write_ml100k(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let occupations = ["librarian", "writer", "technician", "student", "none"];
    let users: String = (1..=60)
        .map(|u| {
            let g = if u % 2 == 0 { "F" } else { "M" };
            let occ = occupations[u % occupations.len()];
            format!("{u}|{}|{g}|{occ}|{:05}\n", 18 + u % 50, 10000 + u)
        })
        .collect();
    let items: String = (1..=80)
        .map(|i| {
            let flags: Vec<&str> = (0..19)
                .map(|g| if g == 1 + i % 18 { "1" } else { "0" })
                .collect();
            format!(
                "{i}|Movie {i} (19{:02})|01-Jan-19{:02}||http://x|{}\n",
                i % 100,
                i % 100,
                flags.join("|")
            )
        })
        .collect();
    let mut ratings = String::new();
    for u in 1..=60u32 {
        for k in 0..20u32 {
            // Users of a parity prefer movies of that parity: there is something to learn.
            let i = 1 + (u * 7 + k * 4 + (u % 2)) % 80;
            let r = 3 + (u + k) % 3;
            ratings.push_str(&format!("{u}\t{i}\t{r}\t{}\n", 880000000 + u * 100 + k));
        }
    }
    std::fs::write(dir.join("u.user"), users).unwrap();
    std::fs::write(dir.join("u.item"), items).unwrap();
    std::fs::write(dir.join("u.data"), ratings).unwrap();
}

#[test]
fn an_ml100k_directory_trains_and_recommends_for_a_new_user_in_its_terms() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("ml-100k");
    write_ml100k(&data);
    let set_data = format!("data.dir={:?}", data.display().to_string());
    let out = launch_default_config(
        dir.path(),
        "ml100k",
        None,
        &[],
        &[&set_data, "train.epochs=2", "data.cold_users=0.1"],
    );
    assert_eq!(out.code(), Some(0), "{}\n{}", out.stdout, out.stderr);
    for needle in ["test ndcg@10:", "cold users ndcg@10:"] {
        assert!(out.all().contains(needle), "no {needle:?} in {}", out.all());
    }
    let run_dir = dir.path().join("ml100k");
    let rec = std::process::Command::new(bin("recommend"))
        .arg(&run_dir)
        .args(["--new-user", "F,31,librarian", "--top", "3"])
        .output()
        .expect("run recommend");
    let stdout = String::from_utf8_lossy(&rec.stdout);
    let stderr = String::from_utf8_lossy(&rec.stderr);
    assert!(rec.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("Movie "), "{stdout}");
    // ML-1M's codes mean nothing here: the age is in years, the occupation a word.
    let rec = std::process::Command::new(bin("recommend"))
        .arg(&run_dir)
        .args([
            "--new-user",
            "F,31,12345678901234567890123456789012345678901",
        ])
        .output()
        .expect("run recommend");
    assert_eq!(rec.status.code(), Some(2), "{rec:?}");
    let stderr = String::from_utf8_lossy(&rec.stderr);
    assert!(stderr.contains("occupation must be a word"), "{stderr}");
}
