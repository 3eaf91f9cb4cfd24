//! Every shipped config works on every common GPU count: a dry run of each file in `configs/`
//! with 1, 2, 3, 4, 6 and 8 processes succeeds and keeps the config's global batch exactly.
//! The downloads the configs name (`ml-1m`, `ml-100k`, `gpt2`) are stood in for by files of
//! the right names in a cache of the test's own, so that the pre-flight passes.

mod support;

use std::time::Duration;

use std::path::Path;

use support::{launch_cmd, repo_root, wait_output};

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
    let data = cache.join("data");
    write(
        &data.join("ml-1m"),
        &["ratings.dat", "users.dat", "movies.dat"],
        "x",
    );
    write(&data.join("ml-100k"), &["u.data", "u.user", "u.item"], "x");
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
