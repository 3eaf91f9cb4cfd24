//! The recommender end to end: `launch` starts real `worker` processes on the built-in default
//! config (generated data, tiny GPT-2, cached text), they train over the TCP ring, and the
//! results on disk are checked — the loss falls, the GPT-2 recommender beats the popularity
//! baseline on the same test data, the best model is kept, early stopping stops.

mod support;

use std::path::Path;

use serde_json::Value;
use support::*;

fn records(run_dir: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).expect("metrics.jsonl");
    text.lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

fn of_kind<'a>(records: &'a [Value], kind: &str) -> Vec<&'a Value> {
    records.iter().filter(|r| r["kind"] == kind).collect()
}

fn test_record(records: &[Value]) -> &Value {
    records
        .iter()
        .find(|r| r["kind"] == "eval" && r["split"] == "test")
        .expect("a test evaluation in metrics.jsonl")
}

fn run(out_dir: &Path, name: &str, extra: &[&str]) -> Output {
    launch_default_config(out_dir, name, None, &[], extra)
}

#[test]
fn default_config_trains_and_beats_popularity() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(dir.path(), "gpt2rec", &[]);
    assert_eq!(out.code(), Some(0), "{}\n{}", out.stdout, out.stderr);
    let run_dir = dir.path().join("gpt2rec");
    let recs = records(&run_dir);

    // The loss falls: the mean of the last epoch's steps is well below the first epoch's.
    let steps = of_kind(&recs, "step");
    // Every step record says the largest peak memory of the two ranks (at least libtorch's
    // start-up footprint) and whose it is.
    for r in &steps {
        let mib = r["peak_mem_mib"].as_f64().unwrap_or(0.0);
        assert!((100.0..100_000.0).contains(&mib), "{r}");
        assert!(
            r["peak_mem_rank"].as_u64().is_some_and(|rank| rank < 2),
            "{r}"
        );
    }
    let mean_loss = |epoch: u64| {
        let l: Vec<f64> = steps
            .iter()
            .filter(|r| r["epoch"] == epoch)
            .map(|r| r["loss"].as_f64().unwrap())
            .collect();
        assert!(!l.is_empty(), "no steps logged in epoch {epoch}");
        l.iter().sum::<f64>() / l.len() as f64
    };
    let last_epoch = steps
        .iter()
        .map(|r| r["epoch"].as_u64().unwrap())
        .max()
        .unwrap();
    assert!(last_epoch >= 2, "{}", out.stderr);
    let (first, last) = (mean_loss(1), mean_loss(last_epoch));
    // The default's softmax over its 720 warm items starts near ln 720 = 6.58 and its last
    // epoch's mean is about 10% lower (BPR's loss, near ln 2 at first, halves): a model that
    // does not learn stays within noise of where it started.
    assert!(last < first * 0.95, "loss {first} -> {last}");

    // The baseline on the same (cached) data.
    let pop = run(dir.path(), "pop", &["model.kind=\"pop\""]);
    assert_eq!(pop.code(), Some(0), "{}\n{}", pop.stdout, pop.stderr);
    let pop_recs = records(&dir.path().join("pop"));
    let (ours, theirs) = (test_record(&recs), test_record(&pop_recs));
    assert_eq!(ours["users"], theirs["users"]);
    let (r_ours, r_pop) = (
        ours["recall@10"].as_f64().unwrap(),
        theirs["recall@10"].as_f64().unwrap(),
    );
    assert!(
        r_ours > r_pop,
        "test Recall@10 {r_ours} <= popularity's {r_pop}"
    );
    cold_start_is_tested_and_text_knows_cold_items(dir.path(), &recs, &pop_recs, &out.stdout);

    // Every evaluation has every metric at every K; the best model and the summary are there.
    for r in of_kind(&recs, "eval") {
        for k in [10, 20] {
            for m in ["recall", "ndcg", "mrr", "hit", "precision"] {
                let v = r[format!("{m}@{k}")].as_f64().unwrap();
                assert!((0.0..=1.0).contains(&v), "{m}@{k} = {v}");
            }
        }
    }
    assert!(run_dir.join("best/latest").is_file());
    assert!(run_dir.join("config.resolved.toml").is_file());
    let summary = of_kind(&recs, "summary");
    assert_eq!(summary.len(), 1);
    assert_eq!(summary[0]["peak_rss_mib"].as_array().unwrap().len(), 2);
    let lines = rank_lines(&out.stdout);
    let headline = lines
        .iter()
        .find(|(r, t)| *r == 0 && t.starts_with("  test ndcg@10:"))
        .unwrap_or_else(|| panic!("no test line in {}", out.stdout));
    ease_is_beside_ours_with_the_paired_interval(&headline.1);
    // Only rank 0 reports.
    assert!(!lines
        .iter()
        .any(|(r, t)| *r == 1 && t.starts_with("summary")));
}

/// `  test ndcg@10: 0.2913 vs popularity 0.1313 (+121.9%), EASE 0.2935 (-0.7%, 95% CI -3.5% to
/// +2.0%)`: both models ranked the same users, so the change is the ratio of the two printed
/// means, inside its interval.
fn ease_is_beside_ours_with_the_paired_interval(line: &str) {
    let number = |s: &str| -> f64 {
        let s = s.trim_matches(['(', ')', ',', '%', '+']);
        s.parse().unwrap_or_else(|_| panic!("{s:?} in {line:?}"))
    };
    let words: Vec<&str> = line.split_whitespace().collect();
    let at = |word: &str| words.iter().position(|w| *w == word);
    let (Some(score), Some(e)) = (at("ndcg@10:"), at("EASE")) else {
        panic!("no score or EASE in {line:?}");
    };
    assert!(words.len() > e + 7, "{line}");
    assert_eq!(
        (words[e + 3], words[e + 4], words[e + 6]),
        ("95%", "CI", "to"),
        "{line}"
    );
    let (ours, ease) = (number(words[score + 1]), number(words[e + 1]));
    let (change, low, high) = (
        number(words[e + 2]),
        number(words[e + 5]),
        number(words[e + 7]),
    );
    // The printed means are rounded to 4 places: the change agrees to within that rounding.
    let expected = (ours / ease - 1.0) * 100.0;
    assert!(
        (change - expected).abs() < 0.2,
        "{change} vs {expected}: {line}"
    );
    // Symmetric about the change (to the printed rounding), and about ±5% wide for the
    // default's 900 test users, not the whole range: an interval computed from the users.
    assert!(low < change && change < high, "{line}");
    assert!(((high - change) - (change - low)).abs() <= 0.15, "{line}");
    assert!(high - low > 1.0 && high - low < 30.0, "{line}");
}

/// The default holds out 10% of the items and of the users: both are tested after training
/// (records and printed comparison). On cold items, the GPT-2 recommender (text) beats
/// popularity (no counts for them), and BPR (IDs only, which it never trained for them) ranks
/// them exactly as popularity does, by the fixed tie order: it knows nothing of them.
fn cold_start_is_tested_and_text_knows_cold_items(
    out_dir: &Path,
    recs: &[Value],
    pop_recs: &[Value],
    stdout: &str,
) {
    let split = |recs: &[Value], name: &str| -> Value {
        recs.iter()
            .find(|r| r["kind"] == "eval" && r["split"] == name)
            .unwrap_or_else(|| panic!("no {name} evaluation in {recs:?}"))
            .clone()
    };
    let ndcg = |r: &Value| r["ndcg@10"].as_f64().unwrap();
    for name in ["cold_items", "cold_users"] {
        let (ours, pop) = (split(recs, name), split(pop_recs, name));
        assert_eq!(ours["users"], pop["users"], "{name}");
        assert!(ours["users"].as_u64().unwrap() >= 10, "{name}: {ours}");
    }
    let (ours, pop) = (split(recs, "cold_items"), split(pop_recs, "cold_items"));
    assert!(
        ndcg(&ours) > 1.5 * ndcg(&pop),
        "cold items: gpt2rec {ours} vs pop {pop}"
    );
    for line in ["  cold items ndcg@10:", "  cold users ndcg@10:"] {
        assert!(stdout.contains(line), "no {line:?} in\n{stdout}");
    }
    let bpr = run(out_dir, "bpr", &["model.kind=\"bpr\"", "train.epochs=2"]);
    assert_eq!(bpr.code(), Some(0), "{}", bpr.all());
    let bpr = split(&records(&out_dir.join("bpr")), "cold_items");
    for m in ["recall@10", "ndcg@10", "mrr@20", "hit@20"] {
        assert_eq!(bpr[m], pop[m], "bpr {bpr} vs pop {pop}");
    }
}

/// A learning rate too small to move any f32 parameter: validation never improves.
const STUCK: &[&str] = &[
    "data.synthetic=\"tiny\"",
    "model.kind=\"bpr\"",
    "train.lr=1e-12",
    "train.epochs=6",
    "eval.patience=2",
];

#[test]
fn patience_stops_a_run_that_does_not_improve() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(dir.path(), "stuck", STUCK);
    assert_eq!(out.code(), Some(0), "{}\n{}", out.stdout, out.stderr);
    out.assert_stderr("early stopping after epoch 3");
    let recs = records(&dir.path().join("stuck"));
    let valid: Vec<_> = of_kind(&recs, "eval")
        .into_iter()
        .filter(|r| r["split"] == "valid")
        .collect();
    assert_eq!(valid.len(), 3);
    // The test metrics are those of the best model, from epoch 1.
    assert_eq!(test_record(&recs)["epoch"], 1);
    assert!(out.stdout.contains("(stopped early)"), "{}", out.stdout);

    // Resuming a run that stopped early trains no further: it only evaluates the test split.
    let again = run(dir.path(), "stuck", STUCK);
    assert_eq!(again.code(), Some(0), "{}\n{}", again.stdout, again.stderr);
    again.assert_stderr("resuming from");
    assert!(!again.stderr.contains("epoch 4/6"), "{}", again.stderr);
}

#[test]
fn a_bad_data_dir_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nowhere");
    let set = format!("data.dir={:?}", missing.display().to_string());
    let out = run(dir.path(), "bad", &[&set]);
    assert_ne!(out.code(), Some(0));
    out.assert_stderr("nowhere");
    assert!(!out.stderr.contains("panicked"), "{}", out.stderr);
}

/// A finished run started again only evaluates, says so, and keeps the training's own summary
/// (one record, its samples/s); more epochs then train on under a schedule that spans them.
#[test]
fn a_finished_run_keeps_its_summary_and_more_epochs_train_on() {
    let dir = tempfile::tempdir().unwrap();
    let tiny = [
        "data.synthetic=\"tiny\"",
        "model.kind=\"bpr\"",
        "train.epochs=1",
    ];
    let first = run(dir.path(), "done", &tiny);
    assert_eq!(first.code(), Some(0), "{}\n{}", first.stdout, first.stderr);
    let run_dir = dir.path().join("done");
    let trained = of_kind(&records(&run_dir), "summary")[0].clone();
    assert!(
        trained["samples_per_s"].as_f64().unwrap() > 0.0,
        "{trained}"
    );

    let again = run(dir.path(), "done", &tiny);
    assert_eq!(again.code(), Some(0), "{}\n{}", again.stdout, again.stderr);
    again.assert_stderr("the run is complete (1 of 1 epoch(s)), nothing left to train");
    assert!(
        again
            .stdout
            .contains("(trained by an earlier run; this one only evaluated)"),
        "{}",
        again.stdout
    );
    let summaries: Vec<Value> = of_kind(&records(&run_dir), "summary")
        .into_iter()
        .cloned()
        .collect();
    assert_eq!(summaries, vec![trained.clone()]);

    let more = [
        "data.synthetic=\"tiny\"",
        "model.kind=\"bpr\"",
        "train.epochs=2",
    ];
    let longer = run(dir.path(), "done", &more);
    assert_eq!(
        longer.code(),
        Some(0),
        "{}\n{}",
        longer.stdout,
        longer.stderr
    );
    longer.assert_stderr("the learning-rate schedule now spans");
    let recs = records(&run_dir);
    let epoch2: Vec<&Value> = of_kind(&recs, "step")
        .into_iter()
        .filter(|r| r["epoch"] == 2)
        .collect();
    assert!(!epoch2.is_empty(), "no step of epoch 2");
    assert!(epoch2[0]["lr"].as_f64().unwrap() > 0.0, "{}", epoch2[0]);
    assert_eq!(of_kind(&recs, "summary").len(), 1);
}

/// `launch --num-processes N` on the default config with tiny data, the softmax loss and the
/// history tower beside the ID rows: 24 shared negatives and history dropout, or (`item_item`)
/// the full softmax, no dropout and the item-item matrix (its rows summed once per user).
fn softmax_run(
    out_dir: &Path,
    name: &str,
    nproc: &str,
    micro: &str,
    item_item: bool,
) -> Vec<(u64, f64)> {
    softmax_run_with(out_dir, name, nproc, micro, item_item, &[]).0
}

/// [`softmax_run`] with `extra` settings; also gives rank 0's log.
fn softmax_run_with(
    out_dir: &Path,
    name: &str,
    nproc: &str,
    micro: &str,
    item_item: bool,
    extra: &[&str],
) -> (Vec<(u64, f64)>, String) {
    let mut sets = vec![
        format!("run.output_dir={:?}", out_dir.display().to_string()),
        format!("run.name={name:?}"),
        "data.synthetic=\"tiny\"".into(),
        "train.epochs=2".into(),
        "train.loss=\"softmax\"".into(),
        "model.user_tower=\"both\"".into(),
        format!("batch.micro={micro}"),
    ];
    sets.extend(if item_item {
        ["train.negatives=0", "model.item_item=true"]
            .map(String::from)
            .to_vec()
    } else {
        [
            "train.negatives=24",
            "train.negative_power=0.75",
            "model.history_dropout=0.3",
        ]
        .map(String::from)
        .to_vec()
    });
    sets.extend(extra.iter().map(|s| s.to_string()));
    let mut args = vec![
        "--num-processes",
        nproc,
        "--master-port",
        "0",
        "configs/default.toml",
    ];
    for set in &sets {
        args.extend(["--set", set.as_str()]);
    }
    let out = wait_output(
        launch_cmd(&args).spawn().expect("start launch"),
        std::time::Duration::from_secs(300),
    );
    assert_eq!(
        out.code(),
        Some(0),
        "{name}: {}\n{}",
        out.stdout,
        out.stderr
    );
    let steps = of_kind(&records(&out_dir.join(name)), "step")
        .iter()
        .map(|r| (r["step"].as_u64().unwrap(), r["loss"].as_f64().unwrap()))
        .collect();
    (steps, out.stderr)
}

/// `train.bf16` on the CPU trains under the CPU's bf16 autocast: rank 0 says so (natively, or
/// emulated with a warning), every step's loss differs from f32's by bf16's rounding only, and
/// one process with two micro-batches a step trains as two processes with one each.
#[test]
fn bf16_on_the_cpu_trains_under_autocast_the_same_at_any_world_size() {
    let dir = tempfile::tempdir().unwrap();
    let bf16 = ["train.bf16=true"];
    let (f32_steps, _) = softmax_run_with(dir.path(), "f32", "1", "96", true, &[]);
    let (one, log) = softmax_run_with(dir.path(), "w1", "1", "96", true, &bf16);
    let (two, _) = softmax_run_with(dir.path(), "w2", "2", "96", true, &bf16);
    assert!(
        log.contains("train.bf16: bf16 autocast on the CPU")
            || log.contains("train.bf16: this CPU has no native bf16"),
        "{log}"
    );
    assert_eq!(one.len(), f32_steps.len());
    assert!(one.len() >= 10, "{one:?}");
    let mut differ = false;
    for ((s, l16), (_, l32)) in one.iter().zip(&f32_steps) {
        assert!(
            (l16 - l32).abs() <= 2e-2 * l32.abs(),
            "step {s}: bf16 {l16}, f32 {l32}"
        );
        differ |= l16 != l32;
    }
    assert!(
        differ,
        "every bf16 loss equals f32's: autocast did not apply"
    );
    for ((s1, l1), (s2, l2)) in one.iter().zip(&two) {
        assert_eq!(s1, s2);
        assert!(
            (l1 - l2).abs() <= 1e-4 * l1.abs().max(1.0),
            "step {s1}: loss {l1} at world 1, {l2} at world 2"
        );
    }
}

/// The softmax's negatives are drawn once a step from the seed and the step, shared by every
/// rank and micro-batch: one process with two micro-batches a step and two processes with one
/// each train the same run (every step's loss equal up to float summation order; per-rank
/// negatives, as BPR draws them, already differ at the first step: 3.3254 against 3.3326).
#[test]
fn the_softmax_run_is_the_same_at_any_world_size() {
    same_at_worlds_1_and_2(false);
}

/// The same with the item-item matrix, whose training pools sum each user's rows once per
/// micro-batch.
#[test]
fn the_item_item_run_is_the_same_at_any_world_size() {
    same_at_worlds_1_and_2(true);
}

fn same_at_worlds_1_and_2(item_item: bool) {
    let dir = tempfile::tempdir().unwrap();
    let one = softmax_run(dir.path(), "w1", "1", "96", item_item);
    let two = softmax_run(dir.path(), "w2", "2", "96", item_item);
    assert_eq!(one.len(), two.len());
    assert!(one.len() >= 10, "{one:?}");
    for ((s1, l1), (s2, l2)) in one.iter().zip(&two) {
        assert_eq!(s1, s2);
        assert!(
            (l1 - l2).abs() <= 1e-4 * l1.abs().max(1.0),
            "step {s1}: loss {l1} at world 1, {l2} at world 2"
        );
    }
    assert!(
        one.last().unwrap().1 < one[0].1,
        "the loss did not fall: {one:?}"
    );
}
