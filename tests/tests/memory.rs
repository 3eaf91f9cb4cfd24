//! Memory end to end: the dry run's estimate table and its warning, an out-of-memory failure
//! simulated in every phase (`GPTREC_FAULT_OOM`) — its message, exit code, the launcher's
//! summary, no process left, the last checkpoint intact — `batch.micro = "auto"` under a
//! simulated memory cap (`GPTREC_MEMORY_LIMIT_MB`), `dist.zero = "auto"` choosing the stage
//! that fits (or stopping, naming each term), each ZeRO stage's estimate against the peak RSS
//! the ranks measure, and activation checkpointing training the same model as without it.

mod support;

use std::path::Path;
use std::time::Duration;

use support::*;

/// The plan every figure below is for (the shipped config's batch may change):
/// micro 64 x grad_accum 2 x world 2 = global 256.
const PINNED_SETS: [&str; 2] = ["batch.global=256", "batch.micro=64"];
const PINNED_BATCH: [&str; 4] = ["--set", PINNED_SETS[0], "--set", PINNED_SETS[1]];

/// The dry run of the default config with 2 workers on [`PINNED_BATCH`], `extra` as arguments,
/// with output in a fresh directory (no data measured by an earlier run: the assumed shape).
fn dry_run(env: &[(&str, &str)], extra: &[&str]) -> Output {
    let out = tempfile::tempdir().unwrap();
    let out_dir = format!("run.output_dir={:?}", out.path().display().to_string());
    let mut args = vec!["--dry-run", "--num-processes", "2", "configs/default.toml"];
    args.extend(["--set", &out_dir]);
    args.extend(PINNED_BATCH);
    args.extend(extra);
    let mut cmd = launch_cmd(&args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    wait_output(cmd.spawn().expect("start launch"), Duration::from_secs(60))
}

/// `launch` on the default config with 2 workers and tiny data, `extra` as `--set`s, under a
/// fresh run id tagged `tag`: its output and the run id.
fn run(
    out_dir: &Path,
    name: &str,
    tag: &str,
    env: &[(&str, &str)],
    extra: &[&str],
) -> (Output, String) {
    let run_id = unique_run_id(tag);
    let mut sets = vec!["data.synthetic=\"tiny\""];
    sets.extend(PINNED_SETS);
    sets.extend(extra);
    let out = launch_default_config(out_dir, name, Some(&run_id), env, &sets);
    (out, run_id)
}

/// Panics, naming `what`, unless every process of the run is gone within 10 s.
#[track_caller]
fn assert_run_gone(run_id: &str, what: &str) {
    assert!(
        wait_no_processes(run_id, Duration::from_secs(10)).is_empty(),
        "{what}: processes left"
    );
}

#[test]
fn dry_run_prints_the_estimate_and_warns_with_a_plan_that_keeps_the_global_batch() {
    let out = dry_run(&[], &[]);
    out.assert_code(0);
    out.assert_stdout_all(&[
        "memory:",
        "estimate per worker (",
        "parameters",
        "optimizer (AdamW)",
        "cached text features",
        "activations (IDs)",
        "estimated peak",
        "local rank 1:",
    ]);
    assert!(!out.stdout.contains("warning:"), "{}", out.stdout);

    // Dynamic GPT-2 with 690 MiB per worker: micro 64 does not fit; a smaller micro with the
    // same global batch is named, and so is the cached mode.
    let out = dry_run(
        &[("GPTREC_MEMORY_LIMIT_MB", "690")],
        &[
            "--set",
            "model.text_mode=\"dynamic\"",
            "--set",
            "train.loss=\"bpr\"",
        ],
    );
    out.assert_code(0);
    out.assert_stdout_all(&["activations (GPT-2)"]);
    let warning = out
        .stdout
        .lines()
        .find(|l| l.contains("warning:") && l.contains("local rank 0"))
        .unwrap_or_else(|| panic!("no warning:\n{}", out.stdout));
    assert!(warning.contains("keeps global 256"), "{warning}");
    assert!(warning.contains("micro 64 -> "), "{warning}");
    assert!(
        warning.contains("model.text_mode = \"cached\""),
        "{warning}"
    );
}

/// The peak a table or a log line gives after `marker` (`estimated peak `, `peak `), in MiB.
fn peak_after(text: &str, marker: &str) -> f64 {
    let rest = text
        .split(marker)
        .nth(1)
        .unwrap_or_else(|| panic!("no {marker:?}: {text}"));
    let number = rest.trim_start().split(' ').next().unwrap_or_default();
    number
        .parse()
        .unwrap_or_else(|_| panic!("{marker:?} {number:?}: {text}"))
}

/// Before any run has read the data the dry run says its shape is assumed; once a run has
/// measured it, the dry run gives exactly the estimate the workers gave, and the assumed one
/// again when a key that changes the data's shape does.
#[test]
fn the_dry_run_gives_the_workers_estimate_once_a_run_measured_the_data() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = format!("run.output_dir={:?}", dir.path().display().to_string());
    let dry = |extra: &[&str]| {
        let mut args = vec!["--dry-run", "--num-processes", "2", "configs/default.toml"];
        for set in [
            out_dir.as_str(),
            "data.synthetic=\"tiny\"",
            PINNED_SETS[0],
            PINNED_SETS[1],
        ]
        .iter()
        .chain(extra)
        {
            args.extend(["--set", set]);
        }
        let out = wait_output(launch_cmd(&args).spawn().unwrap(), Duration::from_secs(60));
        out.assert_code(0);
        out
    };
    let before = dry(&[]);
    before.assert_stdout_all(&[
        "assumed: the generator's synthetic tiny data until a run measures it",
    ]);
    let (ran, _) = run(dir.path(), "measured", "shape", &[], &[]);
    ran.assert_code(0);
    let worker = peak_after(&ran.stderr, "memory estimate per worker on cpu: peak ");
    let after = dry(&[]);
    after.assert_stdout_all(&[", by an earlier run):"]);
    assert_eq!(
        peak_after(&after.stdout, "estimated peak "),
        worker,
        "{}",
        after.stdout
    );
    assert_ne!(peak_after(&before.stdout, "estimated peak "), worker);
    dry(&["data.min_rating=4"])
        .assert_stdout_all(&["assumed: the generator's synthetic tiny data"]);
}

#[test]
fn an_out_of_memory_error_in_any_phase_is_explained_and_stops_the_group() {
    let dir = tempfile::tempdir().unwrap();
    // Tiny data, global 256: 17 steps per epoch; a checkpoint at step 17.
    for (phase, fault, description) in [
        ("build", "build@1", "while building the model"),
        ("caching", "caching@1", "while caching the text features"),
        ("forward", "forward@1:20", "during the forward pass"),
        ("backward", "backward@1:20", "during the backward pass"),
        ("optimizer", "optimizer@1:20", "during the optimizer step"),
        ("eval", "eval@1", "during evaluation"),
    ] {
        let (out, run_id) = run(
            dir.path(),
            phase,
            &format!("oom-{phase}"),
            &[("GPTREC_FAULT_OOM", fault)],
            &["train.epochs=2"],
        );
        let all = out.all();
        assert_eq!(out.code(), Some(3), "{phase}: {all}");
        let oom = format!("out of memory on rank 1 (cpu) {description}");
        for needle in [
            oom.as_str(),
            "libtorch said: CUDA out of memory",
            "batch plan: micro 64 x grad_accum 2 x world 2 = global 256",
            "nearest plans keeping global 256: micro 64 -> 32, grad_accum 2 -> 4 keeps global 256",
            // The launcher names the rank that ran out as the root cause.
            "root cause: rank 1 (local_rank 1",
            "exit code 3",
        ] {
            assert!(out.stderr.contains(needle), "{phase}: {needle:?}: {all}");
        }
        assert_run_gone(&run_id, phase);
        // In a training step of epoch 2, the epoch-1 checkpoint is named, intact and resumable.
        if fault.ends_with(":20") {
            let ckpt = dir
                .path()
                .join(phase)
                .join("checkpoints")
                .join("step-000014");
            assert!(
                out.stderr
                    .contains(&format!("the last checkpoint {} is intact", ckpt.display())),
                "{phase}: {all}"
            );
            assert!(ckpt.join("state.json").is_file(), "{phase}");
        }
    }
    // The run that failed in its forward pass resumes from that checkpoint and finishes.
    let (out, _) = run(
        dir.path(),
        "forward",
        "oom-resume",
        &[],
        &["train.epochs=2"],
    );
    assert_eq!(out.code(), Some(0), "{}", out.all());
    assert!(out.stdout.contains("resuming from") || out.stderr.contains("resuming from"));
    assert!(out.stderr.contains("step-000014") || out.stdout.contains("step-000014"));
}

#[test]
fn micro_auto_picks_the_largest_micro_that_fits_every_rank_and_keeps_the_global_batch() {
    let dir = tempfile::tempdir().unwrap();
    // Rank 1 gets 700 MiB: dynamic GPT-2 at micro 128 does not fit by the estimate, smaller
    // micro batches do; rank 0 is unconstrained. Both must use rank 1's choice.
    let (out, _) = run(
        dir.path(),
        "auto",
        "auto",
        &[("GPTREC_MEMORY_LIMIT_MB", "700@1")],
        &[
            "model.text_mode=\"dynamic\"",
            "train.loss=\"bpr\"",
            "batch.micro=\"auto\"",
            "train.epochs=1",
        ],
    );
    let all = out.all();
    assert_eq!(out.code(), Some(0), "{all}");
    let line = all
        .lines()
        .find(|l| l.contains("largest micro per rank"))
        .unwrap_or_else(|| panic!("no auto line:\n{all}"));
    // Rank 0 fits the largest candidate (global 256 / world 2 = 128); rank 1 fits less.
    assert!(line.contains("[128, "), "{line}");
    let resolved =
        std::fs::read_to_string(dir.path().join("auto").join("config.resolved.toml")).unwrap();
    let field = |key: &str| -> u64 {
        resolved
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{key} = ")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("{key} missing:\n{resolved}"))
    };
    let (micro, accum, global) = (field("micro"), field("grad_accum"), field("global"));
    assert!(micro < 128, "{resolved}");
    assert_eq!(micro * accum * 2, 256, "{resolved}");
    assert_eq!(global, 256);
    assert!(
        line.contains(&format!(
            "micro {micro} x grad_accum {accum} x world 2 = global 256"
        )),
        "{line}"
    );

    // A cap nothing fits in: a clear stop, exit code 3, no process left.
    let (out, run_id) = run(
        dir.path(),
        "auto-none",
        "auto-none",
        &[("GPTREC_MEMORY_LIMIT_MB", "100")],
        &["batch.micro=\"auto\"", "train.epochs=1"],
    );
    out.assert_code(3);
    out.assert_stderr("no micro batch that keeps global 256 fits on rank(s) 0, 1");
    assert_run_gone(&run_id, "auto-none");
}

/// (kind, step, loss, grad_norm, ndcg@10) of each record of a run's `metrics.jsonl`.
fn records(path: &Path) -> Vec<(String, u64, f64, f64, f64)> {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    text.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a JSON line");
            let num = |k: &str| v[k].as_f64().unwrap_or(f64::NAN);
            (
                v["kind"].as_str().unwrap_or("").to_string(),
                v["step"].as_u64().unwrap_or(0),
                num("loss"),
                num("grad_norm"),
                num("ndcg@10"),
            )
        })
        .collect()
}

#[test]
fn activation_checkpointing_trains_the_same_model() {
    // Dynamic GPT-2 with micro 64 x grad_accum 2 x world 2: the checkpointed run recomputes
    // every block (dropout on) during backward and must follow the plain run step by step.
    let dir = tempfile::tempdir().unwrap();
    // One dynamic run with `sets` on top: its whole output (it must succeed) and its records.
    let dynamic = |name: &str, sets: &[&str]| {
        let mut all_sets = vec![
            "model.text_mode=\"dynamic\"",
            "train.loss=\"bpr\"",
            "train.epochs=1",
        ];
        all_sets.extend_from_slice(sets);
        let (out, _) = run(dir.path(), name, name, &[], &all_sets);
        let all = out.all();
        assert_eq!(out.code(), Some(0), "{all}");
        (all, records(&dir.path().join(name).join("metrics.jsonl")))
    };
    let mut runs = Vec::new();
    for on in [false, true] {
        let (all, records) = dynamic(
            &format!("ckpt-{on}"),
            &[&format!("model.activation_checkpointing={on}")],
        );
        // Tiny GPT-2 has 2 blocks, both trained: both are recomputed.
        assert_eq!(
            all.contains("activation checkpointing: 2 GPT-2 block(s)"),
            on,
            "{all}"
        );
        runs.push(records);
    }
    // ZeRO stage 2 with checkpointing (no accumulation): its buckets are reduce-scattered once
    // the recomputation is done, which rank 0 says; the same records as DDP's.
    let mut zero_runs = Vec::new();
    for stage in ["0", "2"] {
        let zero = format!("dist.zero={stage}");
        let (all, records) = dynamic(
            &format!("ckpt-zero-{stage}"),
            &[
                "model.activation_checkpointing=true",
                "batch.micro=128",
                "dist.shard_optimizer=false",
                &zero,
            ],
        );
        assert_eq!(
            all.contains("ZeRO stage 2 with model.activation_checkpointing: the buckets are reduced once the recomputation is done"),
            stage == "2",
            "{all}"
        );
        zero_runs.push(records);
    }
    let bits = |runs: &[(String, u64, f64, f64, f64)]| -> Vec<(String, u64, [u64; 3])> {
        (runs.iter())
            .map(|(k, s, a, b, c)| (k.clone(), *s, [a.to_bits(), b.to_bits(), c.to_bits()]))
            .collect()
    };
    assert_eq!(
        bits(&zero_runs[0]),
        bits(&zero_runs[1]),
        "stage 2 against DDP"
    );
    let (plain, ckpt) = (&runs[0], &runs[1]);
    let close =
        |a: f64, b: f64| (a.is_nan() && b.is_nan()) || (a - b).abs() <= 1e-4 * a.abs().max(b.abs());
    let steps = plain.iter().filter(|r| r.0 == "step").count();
    assert!(steps >= 10, "{plain:?}");
    assert_eq!(plain.len(), ckpt.len(), "{plain:?}\n{ckpt:?}");
    for (p, c) in plain.iter().zip(ckpt) {
        assert_eq!((&p.0, p.1), (&c.0, c.1));
        assert!(
            close(p.2, c.2) && close(p.3, c.3) && close(p.4, c.4),
            "plain {p:?} vs checkpointed {c:?}"
        );
    }
}

/// `dist.zero = "auto"` with a memory cap between the two stages' estimates: the dry run shows
/// both stages and picks stage 1; the run takes stage 1 on every rank and trains.
#[test]
fn zero_auto_takes_the_stage_that_fits_and_the_run_uses_it() {
    let mut sets: Vec<String> = WIDE_DENSE.iter().map(|s| s.to_string()).collect();
    sets.extend([
        "data.synthetic=\"tiny\"".into(),
        "dist.zero=\"auto\"".into(),
    ]);
    let args: Vec<&str> = sets.iter().flat_map(|s| ["--set", s.as_str()]).collect();
    let roomy = dry_run(&[("GPTREC_MEMORY_LIMIT_MB", "100000")], &args);
    roomy.assert_code(0);
    roomy.assert_stdout_all(&[
        "ZeRO stages (dist.zero = \"auto\"; per worker, against the tightest local rank's ",
        "dist.zero \"auto\": by the estimate, stage 0 (",
    ]);
    let (zero, one) = (stage_peak(&roomy.stdout, 0), stage_peak(&roomy.stdout, 1));
    assert!(
        one + 20.0 < zero,
        "stage 1 shards the moments: {one} vs {zero}"
    );
    // Usable is 90% of the cap: a cap whose usable part lies halfway between the two.
    let cap = format!("{:.0}", (zero + one) / 2.0 / 0.9);
    let tight = dry_run(&[("GPTREC_MEMORY_LIMIT_MB", &cap)], &args);
    tight.assert_code(0);
    tight.assert_stdout_all(&["short by", "dist.zero \"auto\": by the estimate, stage 1 ("]);

    let dir = tempfile::tempdir().unwrap();
    let run_sets: Vec<&str> = sets.iter().map(String::as_str).collect();
    let (out, run_id) = run(
        dir.path(),
        "zero-auto",
        "zero-auto",
        &[("GPTREC_MEMORY_LIMIT_MB", &cap)],
        &run_sets,
    );
    let all = out.all();
    assert_eq!(out.code(), Some(0), "{all}");
    assert!(
        all.contains("dist.zero = \"auto\": stage 1 (the least traffic"),
        "{all}"
    );
    assert!(
        all.contains("ZeRO stage 1 (dist.zero = 1): each of the 2 ranks"),
        "{all}"
    );
    let resolved =
        std::fs::read_to_string(dir.path().join("zero-auto").join("config.resolved.toml")).unwrap();
    assert!(resolved.lines().any(|l| l == "zero = 1"), "{resolved}");
    assert_run_gone(&run_id, "zero-auto");
}

/// `dist.zero = "auto"` with `batch.micro = "auto"` under a cap no stage fits even at micro 1:
/// the dry run and the workers say so with each term of the estimate; the workers stop before
/// training with the out-of-memory exit code, nothing left running.
#[test]
fn zero_auto_stops_before_training_when_no_stage_fits_naming_each_term() {
    let mut sets: Vec<&str> = WIDE_DENSE.to_vec();
    sets.extend(["dist.zero=\"auto\"", "batch.micro=\"auto\""]);
    let args: Vec<&str> = ["data.synthetic=\"tiny\""]
        .iter()
        .chain(&sets)
        .flat_map(|s| ["--set", *s])
        .collect();
    let dry = dry_run(&[("GPTREC_MEMORY_LIMIT_MB", "300")], &args);
    dry.assert_stdout_all(&[
        "dist.zero \"auto\": by the estimate no stage fits: stage 1 at micro 1 x grad_accum 128 x world 2 = global 256 needs ",
        "; by term: ",
        "runtime (libtorch) 349.0 MiB",
    ]);
    let dir = tempfile::tempdir().unwrap();
    let (out, run_id) = run(
        dir.path(),
        "zero-none",
        "zero-none",
        &[("GPTREC_MEMORY_LIMIT_MB", "300")],
        &sets,
    );
    out.assert_code(3);
    out.assert_stderr(
        "dist.zero = \"auto\": no ZeRO stage fits even the smallest micro batch on rank(s) 0, 1 (cpu, 270.0 MiB usable); here: stage 1 at micro 1 x grad_accum 128 x world 2 = global 256 needs ",
    );
    out.assert_stderr("optimizer (AdamW) ");
    assert!(!out.all().contains("epoch 1/1 step"), "{}", out.all());
    assert_run_gone(&run_id, "zero-none");
}

/// The estimate of each built ZeRO stage against the peak RSS every rank measured: never more
/// than the safety margin (10%) under it (the estimate is what "fits" means), and not so far
/// over that a run that fits would be refused (at most 2x).
#[test]
fn each_stages_estimate_holds_what_the_ranks_measure() {
    let dir = tempfile::tempdir().unwrap();
    for stage in ["0", "1", "2", "3"] {
        let zero = format!("dist.zero={stage}");
        let mut sets = WIDE_DENSE.to_vec();
        sets.push(&zero);
        let name = format!("stage-{stage}");
        let (out, _) = run(dir.path(), &name, &name, &[], &sets);
        let all = out.all();
        assert_eq!(out.code(), Some(0), "{all}");
        let estimate = peak_after(&all, "memory estimate per worker on cpu: peak ");
        let rest = all
            .split("peak RSS per rank [")
            .nth(1)
            .unwrap_or_else(|| panic!("no peak RSS:\n{all}"));
        let measured: Vec<f64> = rest[..rest.find(']').unwrap()]
            .split(", ")
            .map(|m| m.parse().unwrap())
            .collect();
        assert_eq!(measured.len(), 2, "{all}");
        for (rank, m) in measured.iter().enumerate() {
            assert!(
                *m <= estimate * 1.1 && *m >= estimate / 2.0,
                "stage {stage}, rank {rank}: measured {m} MiB against the estimate {estimate} MiB"
            );
        }
    }
}
