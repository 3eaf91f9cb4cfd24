//! A run owns what it reports and loses no file it wrote: real `launch` runs of tiny BPR on
//! loopback, in run directories that earlier runs left behind, two at once, killed mid-record,
//! on a full disk, with every checkpoint damaged, and resumed with another world size.

mod support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;
use support::*;

const T: Duration = Duration::from_secs(300);

/// `launch -n NPROC configs/default.toml` on tiny BPR in `out/NAME`, with extra `--set`s.
fn run_args(nproc: u32, out: &Path, name: &str, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = [
        "--num-processes",
        &nproc.to_string(),
        "--master-port",
        "0",
        "configs/default.toml",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(tiny_bpr_sets(out));
    args.push("--set".into());
    args.push(format!("run.name={name:?}"));
    for e in extra {
        args.push("--set".into());
        args.push(e.to_string());
    }
    args
}

fn run(nproc: u32, out: &Path, name: &str, extra: &[&str], env: &[(&str, &str)]) -> Output {
    let args = run_args(nproc, out, name, extra);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut cmd = launch_cmd(&args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    wait_output(cmd.spawn().expect("start launch"), T)
}

/// [`run`], asserting that it exits 0.
#[track_caller]
fn run_ok(nproc: u32, out: &Path, name: &str, extra: &[&str], env: &[(&str, &str)]) -> Output {
    let output = run(nproc, out, name, extra, env);
    output.assert_code(0);
    output
}

/// [`run_ok`] with 2 processes, stopped after epoch `epoch` (GPTREC_STOP_AFTER_EPOCH).
#[track_caller]
fn run_stopped_after(epoch: &str, out: &Path, name: &str, extra: &[&str]) -> Output {
    run_ok(2, out, name, extra, &[("GPTREC_STOP_AFTER_EPOCH", epoch)])
}

/// [`run_stopped_after`] in a fresh temporary directory: the directory and the run's directory.
#[track_caller]
fn fresh_stopped_run(epoch: &str, name: &str, extra: &[&str]) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    run_stopped_after(epoch, dir.path(), name, extra);
    let run_dir = dir.path().join(name);
    (dir, run_dir)
}

/// Every line of `metrics.jsonl`, each of which must be a JSON object.
fn records(run_dir: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).expect("metrics.jsonl");
    assert!(
        text.is_empty() || text.ends_with('\n'),
        "unterminated: {text}"
    );
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l:?}")))
        .collect()
}

fn tests_of(records: &[Value]) -> Vec<&Value> {
    records
        .iter()
        .filter(|r| r["kind"] == "eval" && r["split"] == "test")
        .collect()
}

/// Panics unless the run's `metrics.jsonl` has exactly one test and one summary record.
#[track_caller]
fn assert_one_test_and_summary(run_dir: &Path) {
    let recs = records(run_dir);
    assert_eq!(tests_of(&recs).len(), 1);
    assert_eq!(recs.iter().filter(|r| r["kind"] == "summary").count(), 1);
}

/// The names in `dir` that `keep` accepts, in directory order (none if `dir` cannot be read).
fn names_in(dir: &Path, keep: impl Fn(&str) -> bool) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| keep(n))
                .collect()
        })
        .unwrap_or_default()
}

/// The `step-*` checkpoints in `dir`, sorted.
fn steps_in(dir: &Path) -> Vec<String> {
    let mut names = names_in(dir, |n| n.starts_with("step-"));
    names.sort();
    names
}

/// The test metrics line without its timing.
fn test_metrics(run_dir: &Path) -> Value {
    let recs = records(run_dir);
    let tests = tests_of(&recs);
    assert_eq!(tests.len(), 1, "{recs:?}");
    let mut t = tests[0].clone();
    t.as_object_mut().unwrap().remove("seconds");
    t
}

/// A fresh run (`checkpoint.resume = "never"`) in a directory an earlier, longer run left:
/// it keeps its own checkpoints, `latest` names one of them, the earlier run's files are moved
/// aside (not deleted), and its test line is its own — equal to the same run in an empty
/// directory. The next automatic resume continues this run, not the earlier one.
#[test]
fn a_fresh_run_in_an_old_run_dir_reports_only_its_own_results() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path();
    let keep = ["checkpoint.every_n_steps=20", "checkpoint.keep=3"];
    run_ok(2, out, "r", &[&["train.epochs=3"][..], &keep].concat(), &[]);
    let run_dir = out.join("r");
    let a_steps = steps_in(&run_dir.join("checkpoints"));
    let a_last = a_steps.last().cloned().unwrap();

    let fresh = [
        &["checkpoint.resume=\"never\"", "train.epochs=1"][..],
        &keep,
    ]
    .concat();
    let b = run_ok(2, out, "r", &fresh, &[]);
    b.assert_stderr("left by an earlier run");
    let b_steps = steps_in(&run_dir.join("checkpoints"));
    assert!(!b_steps.contains(&a_last), "{b_steps:?}");
    assert!(!b_steps.is_empty(), "the new run's checkpoints were pruned");
    let latest = std::fs::read_to_string(run_dir.join("checkpoints/latest")).unwrap();
    assert!(
        run_dir.join("checkpoints").join(latest.trim()).is_dir(),
        "{latest}"
    );
    let superseded: Vec<PathBuf> = std::fs::read_dir(run_dir.join("superseded"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(superseded.len(), 1);
    assert!(superseded[0].join("checkpoints").join(&a_last).is_dir());
    assert!(superseded[0].join("metrics.jsonl").is_file());

    // The same run in an empty directory gives the same test line.
    run_ok(2, out, "clean", &fresh, &[]);
    assert_eq!(test_metrics(&run_dir), test_metrics(&out.join("clean")));

    // Resuming picks up this run's end, not the earlier run's.
    let d = run_ok(2, out, "r", &[&["train.epochs=1"][..], &keep].concat(), &[]);
    d.assert_stderr(format!(
        "resuming from {}",
        run_dir.join("checkpoints").join(latest.trim()).display()
    ));
    // A finished run resumed writes no second test or summary record.
    assert_one_test_and_summary(&run_dir);
}

/// The best model is saved after its epoch's checkpoint, its model file a hard link to that
/// checkpoint's. A run that stopped between the two (here: `best/` removed after a finished
/// run) saves it again from the checkpoint when resumed, and tests it; the test line is the
/// same.
#[test]
fn a_best_model_lost_after_its_checkpoint_is_saved_again_from_it() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    run_ok(2, dir.path(), "relink", &["train.epochs=1"], &[]);
    let run_dir = dir.path().join("relink");
    let best = steps_in(&run_dir.join("best"));
    assert_eq!(best.len(), 1, "{best:?}");
    let (in_best, in_checkpoint) = (
        run_dir
            .join("best")
            .join(&best[0])
            .join("model.safetensors"),
        run_dir
            .join("checkpoints")
            .join(&best[0])
            .join("model.safetensors"),
    );
    let ino = |p: &Path| std::fs::metadata(p).unwrap().ino();
    assert_eq!(
        ino(&in_best),
        ino(&in_checkpoint),
        "best/ is not a link to the checkpoint"
    );
    let tested = test_metrics(&run_dir);

    std::fs::remove_dir_all(run_dir.join("best")).unwrap();
    let again = run_ok(2, dir.path(), "relink", &["train.epochs=1"], &[]);
    let step = best[0].trim_start_matches("step-").trim_start_matches('0');
    again.assert_stderr(format!(
        "the best model (step {step}) was not in {}: saved again from {}",
        run_dir.join("best").display(),
        run_dir.join("checkpoints").join(&best[0]).display()
    ));
    assert!(in_best.is_file());
    assert_one_test_and_summary(&run_dir);
    assert_eq!(test_metrics(&run_dir), tested);
}

/// A second run in a run directory that is in use refuses before writing anything, naming the
/// holder; the first goes on undisturbed.
#[test]
fn a_second_run_in_a_busy_run_dir_refuses_and_names_the_holder() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path();
    let args = run_args(1, out, "busy", &["train.epochs=400", "eval.patience=0"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let first = Live::new(launch_cmd(&args).spawn().unwrap());
    first.wait_stderr("epoch 1/400 done", Duration::from_secs(120));
    let before = std::fs::read_to_string(out.join("busy/metrics.jsonl")).unwrap();

    let second = run(1, out, "busy", &["train.epochs=1"], &[]);
    second.assert_code(2);
    let line = second
        .stderr
        .lines()
        .find(|l| l.contains("is in use by"))
        .unwrap_or_else(|| panic!("{}", second.stderr));
    assert!(
        line.contains(&format!("run directory {}", out.join("busy").display())),
        "{line}"
    );
    assert!(
        line.contains("pid ") && line.contains(" since ") && line.contains("run sha256:"),
        "{line}"
    );
    assert!(line.contains("another run.name"), "{line}");
    assert!(
        !out.join("busy/superseded").exists(),
        "the second run moved files"
    );

    let _ = nix::sys::signal::kill(first.pid(), nix::sys::signal::Signal::SIGTERM);
    let _ = first.finish(Duration::from_secs(60));
    let after = std::fs::read_to_string(out.join("busy/metrics.jsonl")).unwrap();
    assert!(
        after.starts_with(&before),
        "the first run's records changed"
    );
    // Every line of the first run is whole.
    records(&out.join("busy"));
}

/// A kill in the middle of a record leaves half a line; the resumed run drops it and the file
/// parses again, with one test and one summary record.
#[test]
fn a_half_written_record_is_dropped_on_resume() {
    let (dir, run_dir) = fresh_stopped_run("1", "half", &["train.epochs=2"]);
    let path = run_dir.join("metrics.jsonl");
    let mut text = std::fs::read_to_string(&path).unwrap();
    text.push_str("{\"epoch\":1,\"hit@10\":");
    std::fs::write(&path, text).unwrap();
    run_ok(2, dir.path(), "half", &["train.epochs=2"], &[]);
    assert_one_test_and_summary(&run_dir);
}

/// Unmounts the test's tmpfs however the test ends.
struct Mount(PathBuf);

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
    }
}

/// On a full disk rank 0 fails first, with its real error as the root cause, and no
/// temporary checkpoint directory stays behind.
#[test]
fn a_full_disk_names_rank_0s_real_error_and_leaves_no_temporaries() {
    let dir = tempfile::tempdir().unwrap();
    let mnt = dir.path().join("small");
    std::fs::create_dir_all(&mnt).unwrap();
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=256k", "tmpfs"])
        .arg(&mnt)
        .output();
    if !mounted.as_ref().is_ok_and(|o| o.status.success()) {
        eprintln!("skipped: cannot mount a tmpfs here (needs root)");
        return;
    }
    let _mount = Mount(mnt.clone());
    let out = run(2, &mnt, "full", &[], &[]);
    assert_ne!(out.code(), Some(0), "{}", out.stderr);
    let root = out
        .stderr
        .lines()
        .find(|l| l.contains("root cause:"))
        .unwrap_or_else(|| panic!("{}", out.stderr));
    assert!(root.contains("rank 0"), "{root}\n{}", out.stderr);
    out.assert_stderr("No space left on device");
    for sub in ["full/checkpoints", "full/best"] {
        let left = names_in(&mnt.join(sub), |n| n.starts_with('.'));
        assert!(left.is_empty(), "{sub}: {left:?}");
    }
}

/// With every checkpoint damaged, an automatic resume says in one line that it starts from
/// step 0, and moves the damaged ones aside.
#[test]
fn all_checkpoints_unusable_is_said_in_one_line() {
    let (dir, run_dir) = fresh_stopped_run("2", "bad", &["train.epochs=3"]);
    let checkpoints = run_dir.join("checkpoints");
    let damaged = steps_in(&checkpoints);
    assert!(!damaged.is_empty());
    for step in &damaged {
        truncate_to_fraction(&checkpoints.join(step).join("model.safetensors"), 2);
    }
    let b = run_ok(2, dir.path(), "bad", &["train.epochs=1"], &[]);
    let line = format!(
        "no usable checkpoint in {} ({} unusable, listed above): starting from step 0",
        checkpoints.display(),
        damaged.len()
    );
    assert!(b.stderr.contains(&line), "{line:?}\n{}", b.stderr);
    assert!(!b.stderr.contains("resuming from"), "{}", b.stderr);
}

/// Resuming with another world size says so, and the learning-rate schedule keeps the length it
/// started with.
#[test]
fn a_resume_with_another_world_size_says_so_and_keeps_the_schedule() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path();
    let epochs = ["train.epochs=3"];
    let a = run_stopped_after("1", out, "w", &epochs);
    let total = |text: &str| -> Vec<String> {
        text.lines()
            .filter_map(|l| l.split(" step ").nth(1))
            .filter_map(|rest| rest.split_whitespace().next())
            .filter_map(|frac| frac.split_once('/').map(|(_, t)| t.to_string()))
            .collect()
    };
    let first = total(&a.stderr);
    assert!(!first.is_empty(), "{}", a.stderr);
    let b = run_ok(3, out, "w", &epochs, &[]);
    b.assert_stderr_all(&[
        "resuming with world 3 from a checkpoint of world 2",
        "not bit-exactly",
    ]);
    let second = total(&b.stderr);
    assert!(!second.is_empty(), "{}", b.stderr);
    assert!(
        second.iter().all(|t| *t == first[0]),
        "{first:?} vs {second:?}"
    );
}

/// Two ranks keep the BPR tables once in shared memory, each updating its share of the rows
/// (`dist.shared_tables`), or every parameter, its moments and their gradients, each rank
/// reducing and updating its share (`dist.shard_optimizer`, the default): the run gives the
/// results of tables each rank keeps for itself, bit for bit, and so does a sharded run stopped
/// after an epoch and resumed (rank 0 loads the parameters into the shared memory; the moments
/// move there at the first step).
#[test]
fn shared_and_sharded_parameters_give_the_results_of_private_ones_through_a_resume() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path();
    let epochs = "train.epochs=2";
    let (unsharded, not_shared) = ("dist.shard_optimizer=false", "dist.shared_tables=false");
    let shared_line = "kept once in shared memory: each of the 2 ranks updates its share";
    let sharded_line = "each of the 2 ranks reduces, clips and updates its share of every parameter's rows (dist.shard_optimizer)";
    let private = run_ok(2, out, "private", &[epochs, not_shared, unsharded], &[]);
    assert!(!private.stderr.contains(shared_line), "{}", private.stderr);
    assert!(!private.stderr.contains(sharded_line), "{}", private.stderr);
    let tables = run_ok(2, out, "tables", &[epochs, unsharded], &[]);
    tables.assert_stderr(format!(
        "embedding tables item_id.weight, user_id.weight {shared_line}"
    ));
    let whole = run_ok(2, out, "whole", &[epochs], &[]);
    whole.assert_stderr(sharded_line);
    run_stopped_after("1", out, "resumed", &[epochs]);
    let resumed = run_ok(2, out, "resumed", &[epochs], &[]);
    resumed.assert_stderr_all(&["resum", sharded_line]);
    let last_loss = |name: &str| {
        let recs = records(&out.join(name));
        let summary = recs
            .iter()
            .find(|r| r["kind"] == "summary")
            .expect("summary");
        summary["last_loss"].clone()
    };
    let want = test_metrics(&out.join("private"));
    for name in ["tables", "whole", "resumed"] {
        assert_eq!(test_metrics(&out.join(name)), want, "{name}");
        assert_eq!(last_loss(name), last_loss("private"), "{name}");
    }
}

/// The model of a run's newest checkpoint, by name.
fn latest_model(run_dir: &Path) -> std::collections::BTreeMap<String, Vec<f32>> {
    let checkpoints = run_dir.join("checkpoints");
    let latest = std::fs::read_to_string(checkpoints.join("latest")).expect("checkpoints/latest");
    read_f32_tensors(&checkpoints.join(latest.trim()).join("model.safetensors"))
}

/// `checkpoint.resume` naming another run starts a new run from its weights (fine-tuning): step
/// 0 of this run's own schedule, on other data and with another learning rate, a fresh optimizer
/// unless `checkpoint.load_optimizer`; run again, it continues its own checkpoint; another model
/// is refused in one line.
#[test]
fn a_run_starts_from_another_runs_weights() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path();
    run_ok(2, out, "base", &["train.epochs=2"], &[]);
    let from = format!(
        "checkpoint.resume={:?}",
        out.join("base").display().to_string()
    );
    // A learning rate so small that the weights stay where they started, to see where that was.
    let tune = [from.as_str(), "train.lr=1e-10", "data.min_rating=4"];
    let scratch = run_ok(2, out, "scratch", &tune[1..], &[]);
    let tuned = run_ok(2, out, "tuned", &tune, &[]);
    tuned.assert_stderr_all(&[
        format!(
            "starting from the weights of {}",
            out.join("base/checkpoints/step-").display()
        ),
        "at step 0 of this run, with a fresh optimizer".to_string(),
    ]);
    assert!(
        !scratch.stderr.contains("starting from"),
        "{}",
        scratch.stderr
    );
    let base = latest_model(&out.join("base"));
    let from_base = max_abs_diff(&latest_model(&out.join("tuned")), &base);
    let from_scratch = max_abs_diff(&latest_model(&out.join("scratch")), &base);
    assert!(
        from_base < 1e-6,
        "the tuned run moved {from_base} from the base weights"
    );
    assert!(
        from_scratch > 1e-2,
        "a fresh model is {from_scratch} from the base weights"
    );
    assert_eq!(
        steps_in(&out.join("tuned/checkpoints")),
        steps_in(&out.join("scratch/checkpoints"))
    );
    // Run again, the fine-tuning run continues from its own checkpoint.
    let again = run_ok(
        2,
        out,
        "tuned",
        &[tune[0], tune[1], tune[2], "train.epochs=2"],
        &[],
    );
    again.assert_stderr_all(&[
        "is another run's, but this run has a checkpoint of its own".to_string(),
        format!(
            "resuming from {}",
            out.join("tuned/checkpoints/step-").display()
        ),
    ]);
    let moments = run_ok(
        2,
        out,
        "moments",
        &[tune[0], "checkpoint.load_optimizer=true"],
        &[],
    );
    moments.assert_stderr("with its optimizer state (checkpoint.load_optimizer = true)");
    let other = run(2, out, "other", &[tune[0], "model.embedding_dim=16"], &[]);
    assert_ne!(other.code(), Some(0), "{}", other.stderr);
    other.assert_stderr(
        "a run can start from another run's weights only when the model is the same",
    );
}

/// Every tensor of a safetensors file as (dtype, raw bytes), by name.
fn tensor_bytes(path: &Path) -> std::collections::BTreeMap<String, (String, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    let data = &bytes[8 + header_len..];
    let tensors = header.as_object().unwrap().iter();
    tensors
        .filter(|(name, _)| *name != "__metadata__")
        .map(|(name, info)| {
            let at = |k: usize| info["data_offsets"][k].as_u64().unwrap() as usize;
            let dtype = info["dtype"].as_str().unwrap().to_string();
            (name.clone(), (dtype, data[at(0)..at(1)].to_vec()))
        })
        .collect()
}

/// ZeRO stages 1 and 2 (`dist.zero = 1`, `2`; `shard_optimizer` off so that they apply on one
/// host, dense tables so that they are sharded) give DDP's results, and their checkpoints are
/// DDP's byte for byte (the moments gathered on save: one format whatever the stage), so a run
/// saved at world 2 under stage 2 and resumed at world 3 under stage 1 ends as the one saved
/// and resumed under stage 0. With `dist.overlap_backward` stage 1's buckets are
/// reduce-scattered during backward: the same.
#[test]
fn zero_stages_give_ddps_results_and_checkpoints_that_any_world_and_stage_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path();
    let ddp = [
        "train.epochs=2",
        "dist.shard_optimizer=false",
        "dist.shared_tables=false",
        "dist.sparse_embeddings=false",
    ];
    let zero = [&ddp[..], &["dist.zero=1"]].concat();
    let zero_line = "ZeRO stage 1 (dist.zero = 1): each of the 2 ranks keeps the AdamW moments";
    let plain = run_ok(2, out, "ddp", &ddp, &[]);
    assert!(!plain.stderr.contains(zero_line), "{}", plain.stderr);
    // Asked to overlap: the buckets are reduce-scattered during backward, said once, and the
    // results stay DDP's.
    let overlapped = [&zero[..], &["dist.overlap_backward=true"]].concat();
    let zero_run = run_ok(2, out, "zero", &overlapped, &[]);
    zero_run.assert_stderr(zero_line);
    let during = "reduce-scattered during the backward pass as they become ready";
    assert_eq!(
        zero_run.stderr.matches(during).count(),
        1,
        "{}",
        zero_run.stderr
    );
    assert!(
        !zero_run.stderr.contains("does nothing"),
        "{}",
        zero_run.stderr
    );
    assert_eq!(
        test_metrics(&out.join("zero")),
        test_metrics(&out.join("ddp"))
    );
    // Stage 2 (the gradients sharded too, reduce-scattered during backward): the same.
    let zero_2 = [&ddp[..], &["dist.zero=2"]].concat();
    run_ok(2, out, "zero-2", &zero_2, &[]).assert_stderr_all(&[
        "ZeRO stage 2 (dist.zero = 2): each of the 2 ranks keeps the AdamW moments and the reduced gradients",
        "reduce-scattered during the backward pass as they become ready (ZeRO stage 2)",
    ]);
    assert_eq!(
        test_metrics(&out.join("zero-2")),
        test_metrics(&out.join("ddp"))
    );
    // Stage 2 asked for with the shared-memory optimizer on (its default on one CPU host),
    // which then runs instead: said.
    let sharded = [
        "train.epochs=1",
        "dist.sparse_embeddings=false",
        "dist.zero=2",
    ];
    run_ok(2, out, "zero-2-sharded", &sharded, &[]).assert_stderr(
        "dist.zero = 2 does nothing in this run: dist.shard_optimizer (one CPU host, shared memory) runs instead",
    );
    // With accumulation stage 2 saves nothing at the peak: said, with the way out.
    let accumulating = [&zero_2[..], &["batch.micro=48"]].concat();
    run_ok(2, out, "zero-2-accum", &accumulating, &[]).assert_stderr(
        "ZeRO stage 2 with batch.grad_accum = 2: the micro-batches before the last keep whole gradients",
    );
    assert_eq!(
        test_metrics(&out.join("zero-2-accum")),
        test_metrics(&out.join("ddp"))
    );
    for file in ["model.safetensors", "optimizer.safetensors"] {
        let of = |run: &str| tensor_bytes(&latest_checkpoint(&out.join(run)).join(file));
        let want = of("ddp");
        assert!(want.keys().any(|k| k.starts_with("exp_avg")) || file == "model.safetensors");
        for run in ["zero", "zero-2"] {
            assert!(
                of(run) == want,
                "{file}: the {run} run's checkpoint differs from DDP's"
            );
        }
    }
    // Saved at world 2 and resumed at world 3 under another stage (2 then 1): rank 0 reads
    // the whole state and every rank keeps its shard of it.
    run_stopped_after("1", out, "zero-then-3", &zero_2);
    run_stopped_after("1", out, "ddp-then-3", &ddp);
    let resumed = run_ok(3, out, "zero-then-3", &zero, &[]);
    resumed.assert_stderr_all(&["resuming with world 3", "each of the 3 ranks keeps"]);
    run_ok(3, out, "ddp-then-3", &ddp, &[]).assert_stderr("resuming with world 3");
    let metrics = |name: &str| test_metrics(&out.join(name));
    assert_eq!(metrics("zero-then-3"), metrics("ddp-then-3"));
}

/// Each rank counts the bytes it hands to the others during its steps, and the summary (and
/// its record) gives them per step: ZeRO stage 1 sends DDP's bytes over the ring and through
/// shared memory alike (its reduce-scatter and all-gather are the all-reduce's two halves).
#[test]
fn every_rank_counts_what_it_sends_and_stage_1_sends_ddps_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path();
    let sent = |name: &str, sets: &[&str]| -> Vec<f64> {
        let mut all = vec![
            "train.epochs=1",
            "dist.shard_optimizer=false",
            "dist.shared_tables=false",
            "dist.sparse_embeddings=false",
        ];
        all.extend(sets);
        let ran = run_ok(2, out, name, &all, &[]);
        ran.assert_stdout_all(&["  traffic: sent per step per rank ["]);
        let summary = records(&out.join(name))
            .into_iter()
            .rev()
            .find(|r| r["kind"] == "summary")
            .expect("a summary record");
        let per_rank: Vec<f64> = summary["sent_mib_per_step"]
            .as_array()
            .unwrap_or_else(|| panic!("no sent_mib_per_step: {summary}"))
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert_eq!(per_rank.len(), 2, "{summary}");
        assert!(per_rank.iter().all(|&m| m > 0.0), "{summary}");
        per_rank
    };
    for (transport, sets) in [("ring", vec!["dist.shared_memory=false"]), ("shm", vec![])] {
        let ddp = sent(&format!("{transport}-ddp"), &sets);
        let zero = sent(
            &format!("{transport}-zero"),
            &[&sets[..], &["dist.zero=1"]].concat(),
        );
        for (z, d) in zero.iter().zip(&ddp) {
            assert!(
                (z / d - 1.0).abs() < 0.02,
                "{transport}: stage 1 {zero:?} vs DDP {ddp:?}"
            );
        }
    }
}
