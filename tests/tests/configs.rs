//! Every shipped config works on every common GPU count: a dry run of each file in `configs/`
//! with 1, 2, 3, 4, 6 and 8 processes succeeds and keeps the config's global batch exactly.
//! The downloads the configs name (`ml-1m`, `ml-100k`, `gpt2`) are stood in for by files of
//! the right names in a cache of the test's own, so that the pre-flight passes.

mod support;

use std::time::Duration;

use std::path::Path;

use support::{bin, launch, launch_cmd, repo_root, tiny_bpr_sets, wait_output};

/// GPT-2 124M's `config.json` as the hub has it (the fields the dry run reads).
const GPT2_CONFIG: &str = r#"{"model_type": "gpt2", "activation_function": "gelu_new",
"n_layer": 12, "n_head": 12, "n_embd": 768, "n_positions": 1024, "n_ctx": 1024,
"vocab_size": 50257, "layer_norm_epsilon": 1e-05, "n_inner": null,
"embd_pdrop": 0.1, "attn_pdrop": 0.1, "resid_pdrop": 0.1}"#;

/// A cache holding stand-ins for every download a shipped config names.
fn stand_in_cache(cache: &Path) {
    let write = |dir: &Path, files: &[&str], text: &str| {
        std::fs::create_dir_all(dir).unwrap();
        for f in files {
            std::fs::write(dir.join(f), text).unwrap();
        }
    };
    // One user, movie and rating each: the pre-flight reads the data as the workers will.
    let data = cache.join("data");
    let ml1m = data.join("ml-1m");
    write(&ml1m, &["users.dat"], "1::F::1::10::48067\n");
    write(&ml1m, &["movies.dat"], "1::Toy Story (1995)::Comedy\n");
    write(&ml1m, &["ratings.dat"], "1::1::5::978300760\n");
    let ml100k = data.join("ml-100k");
    write(&ml100k, &["u.user"], "1|24|M|technician|85711\n");
    write(
        &ml100k,
        &["u.item"],
        "1|Toy Story (1995)|01-Jan-1995||http://x|0|0|0|1|1|1|0|0|0|0|0|0|0|0|0|0|0|0|0\n",
    );
    write(&ml100k, &["u.data"], "1\t1\t5\t874965758\n");
    let gpt2 = cache.join("models").join("gpt2");
    write(&gpt2, &["model.safetensors"], "x");
    write(&gpt2, &["config.json"], GPT2_CONFIG);
}

/// The process counts of common GPU boxes.
const COUNTS: [u32; 6] = [1, 2, 3, 4, 6, 8];

/// The `global N` of a dry run's batch line (`batch:        micro .. = global N`).
fn global_of(stdout: &str) -> Option<u64> {
    let line = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("batch:"))?;
    line.rsplit("global ").next()?.trim().parse().ok()
}

#[test]
fn every_shipped_config_dry_runs_on_every_common_gpu_count() {
    let mut configs: Vec<_> = std::fs::read_dir(repo_root().join("configs"))
        .expect("configs/")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    configs.sort();
    assert!(configs.len() >= 3, "{configs:?}");
    let cache = tempfile::tempdir().unwrap();
    stand_in_cache(cache.path());
    for config in &configs {
        let name = format!("configs/{}", config.file_name().unwrap().to_string_lossy());
        let mut globals = Vec::new();
        for n in COUNTS {
            let count = n.to_string();
            let mut cmd = launch_cmd(&["--dry-run", "--num-processes", &count, &name]);
            cmd.env("GPTREC_CACHE", cache.path());
            let out = wait_output(cmd.spawn().expect("start launch"), Duration::from_secs(60));
            assert_eq!(
                out.code(),
                Some(0),
                "{name} with {n} processes: {}",
                out.stderr
            );
            assert!(
                out.stdout
                    .contains(&format!("world size:   {n} = 1 node(s) x {n} process(es)")),
                "{name} with {n}: {}",
                out.stdout
            );
            let global = global_of(&out.stdout)
                .unwrap_or_else(|| panic!("{name} with {n}: no batch line:\n{}", out.stdout));
            globals.push(global);
        }
        assert!(
            globals.windows(2).all(|w| w[0] == w[1]),
            "{name}: the global batch changes with the process count: {globals:?}"
        );
    }
}

/// Tiny generated ML-1M data in `dir/data` with `extra` appended to its `ratings.dat`; the
/// `--set`s of a tiny BPR run on it.
fn data_with(dir: &Path, extra: &str) -> Vec<String> {
    let data = dir.join("data");
    let made = std::process::Command::new(bin("gen-data"))
        .args(["--size", "tiny"])
        .arg(&data)
        .output()
        .expect("run gen-data");
    assert!(made.status.success(), "{made:?}");
    let ratings = data.join("ratings.dat");
    let mut bytes = std::fs::read(&ratings).unwrap();
    bytes.extend_from_slice(extra.as_bytes());
    std::fs::write(&ratings, bytes).unwrap();
    let pairs = tiny_bpr_sets(dir);
    let mut sets: Vec<String> = pairs
        .chunks(2)
        .filter(|set| !set[1].starts_with("data.synthetic"))
        .flatten()
        .cloned()
        .collect();
    sets.extend([
        "--set".into(),
        format!("data.dir={:?}", data.display().to_string()),
    ]);
    sets.extend(["--set".into(), "data.min_rating=1".into()]);
    sets
}

#[test]
fn bad_ratings_are_refused_before_any_worker_starts_with_exit_2() {
    // A rating of 6 on the file's last line: the workers used to find it after they started
    // (exit 1); the dry run and the pre-flight find it now, in one line naming the line.
    let dir = tempfile::tempdir().unwrap();
    let sets = data_with(dir.path(), "1::1::6::978300760\n");
    let lines = std::fs::read_to_string(dir.path().join("data/ratings.dat"))
        .unwrap()
        .lines()
        .count();
    let said = format!("ratings.dat:{lines}: rating 6 not in 1..=5");
    for dry in [true, false] {
        let mut args: Vec<&str> = vec!["--num-processes", "2", "configs/default.toml"];
        if dry {
            args.insert(0, "--dry-run");
        }
        args.extend(sets.iter().map(String::as_str));
        let out = launch(&args, Duration::from_secs(60));
        out.assert_code(2);
        out.assert_stderr(&said);
        assert!(
            !out.all().contains("[rank"),
            "a worker started:\n{}",
            out.all()
        );
    }
}

#[test]
fn a_pair_rated_twice_is_said_once_at_the_dry_run_and_once_by_the_run() {
    let dir = tempfile::tempdir().unwrap();
    // gen-data's first rating is user 1's: rate the same movie again, lower.
    let first = std::fs::read_to_string({
        data_with(dir.path(), "");
        dir.path().join("data/ratings.dat")
    })
    .unwrap();
    let pair: Vec<&str> = first.lines().next().unwrap().split("::").take(2).collect();
    let sets = data_with(
        dir.path(),
        &format!("{}::{}::1::978300760\n", pair[0], pair[1]),
    );
    let rule = "each pair counts once, as a positive when any of its ratings is at or above data.min_rating = 1";
    for dry in [true, false] {
        let mut args: Vec<&str> = vec!["--num-processes", "2", "configs/default.toml"];
        if dry {
            args.insert(0, "--dry-run");
        }
        args.extend(sets.iter().map(String::as_str));
        let out = launch(&args, Duration::from_secs(180));
        out.assert_code(0);
        let all = out.all();
        assert_eq!(all.matches(rule).count(), 1, "{all}");
        assert!(
            all.contains("1 user-item pair(s) rated more than once"),
            "{all}"
        );
    }
}
