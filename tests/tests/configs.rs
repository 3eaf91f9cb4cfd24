//! Every shipped config works on every common GPU count: a dry run of each file in `configs/`
//! with 1, 2, 3, 4, 6 and 8 processes succeeds and keeps the config's global batch exactly.

mod support;

use std::time::Duration;

use support::{launch, repo_root};

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
    for config in &configs {
        let name = format!("configs/{}", config.file_name().unwrap().to_string_lossy());
        let mut globals = Vec::new();
        for n in COUNTS {
            let count = n.to_string();
            let out = launch(
                &["--dry-run", "--num-processes", &count, &name],
                Duration::from_secs(60),
            );
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
