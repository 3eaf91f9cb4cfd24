//! ZeRO stage 3 (`dist.zero = 3`) through `launch`, on dynamic GPT-2 (whose blocks are the
//! units gathered one at a time) and on BPR (no units: every parameter gathered for each step):
//! DDP's step records, test metrics and checkpoint bytes, with activation checkpointing and
//! with accumulation too (stage 2 as well there), and with the optimizer offloaded to the host
//! (`dist.offload`) at stages 0 and 1 or 2; and a run saved at world 2 under stage 3, offloaded,
//! and resumed at world 3 under stage 1 continues as the one saved and resumed under DDP.

mod support;

use std::path::Path;
use std::time::Duration;

use serde_json::Value;
use support::*;

const T: Duration = Duration::from_secs(600);

/// Dynamic GPT-2 on the tiny data, one epoch, whole batches on each rank.
const GPT2: [&str; 7] = [
    "model.kind=\"gpt2rec\"",
    "model.text_mode=\"dynamic\"",
    "train.loss=\"bpr\"",
    "batch.global=256",
    "batch.micro=128",
    "dist.shard_optimizer=false",
    "dist.sparse_embeddings=false",
];

/// The optimizer's moments and update on the host.
const OFFLOAD: &str = "dist.offload=\"optimizer\"";

/// `launch` with `nproc` ranks of the default config on the tiny data into `out/name`, with
/// `sets` and `env`; its output, which must say it succeeded.
fn run_ok(nproc: u32, out: &Path, name: &str, sets: &[&str], env: &[(&str, &str)]) -> Output {
    let nproc = nproc.to_string();
    let mut args: Vec<String> = [
        "--num-processes",
        &nproc,
        "--master-port",
        "0",
        "configs/default.toml",
    ]
    .map(String::from)
    .to_vec();
    args.extend(tiny_bpr_sets(out));
    for set in std::iter::once(&format!("run.name={name:?}") as &str).chain(sets.iter().copied()) {
        args.extend(["--set".to_string(), set.to_string()]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut cmd = launch_cmd(&args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let output = wait_output(cmd.spawn().expect("start launch"), T);
    output.assert_code(0);
    output
}

/// The records of a run that do not measure time or memory: steps (loss, norm), evaluations
/// and the test line, in order.
fn results(run_dir: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).expect("metrics.jsonl");
    text.lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("a JSON record"))
        .filter(|r| r["kind"] != "summary")
        .map(|mut r| {
            let fields = r.as_object_mut().expect("an object");
            fields.retain(|k, _| !k.contains("sec") && !k.contains("per_s") && !k.contains("mem"));
            r
        })
        .collect()
}

/// The bytes of the latest checkpoint's model and optimizer files.
fn checkpoint_bytes(run_dir: &Path) -> Vec<Vec<u8>> {
    let latest = latest_checkpoint(run_dir);
    ["model.safetensors", "optimizer.safetensors"]
        .map(|f| std::fs::read(latest.join(f)).unwrap_or_else(|e| panic!("{f}: {e}")))
        .to_vec()
}

#[test]
fn stage_3_gives_ddps_records_and_checkpoints_on_gpt2_and_bpr() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path();
    let with = |base: &[&'static str], more: &[&'static str]| [base, more].concat();
    let bpr = ["dist.shard_optimizer=false", "dist.sparse_embeddings=false"];
    // BPR has no blocks to checkpoint; its global batch is 192.
    for (model, base, units, variants) in [
        (
            "gpt2",
            &GPT2[..],
            "2 units (GPT-2's blocks) gathered around their forward and backward",
            &[
                ("plain", &[][..]),
                ("ckpt", &["model.activation_checkpointing=true"][..]),
                ("accum", &["batch.micro=64"][..]),
            ][..],
        ),
        (
            "bpr",
            &bpr[..],
            "the model has no units: every parameter gathered for each step",
            &[("plain", &[][..]), ("accum", &["batch.micro=48"][..])][..],
        ),
    ] {
        for &(variant, more) in variants {
            let name = |stage: &str| format!("{model}-{variant}-{stage}");
            let ddp = with(base, more);
            run_ok(2, out, &name("ddp"), &ddp, &[]);
            // With accumulation stage 2 too: its row-sparse backward adds into dense zeros, as
            // DDP's does (the parts of a row summed in DDP's order).
            if variant == "accum" {
                run_ok(2, out, &name("zero-2"), &with(&ddp, &["dist.zero=2"]), &[]);
                let at = format!("{model}, {variant}, stage 2");
                assert_eq!(
                    results(&out.join(name("zero-2"))),
                    results(&out.join(name("ddp"))),
                    "{at}"
                );
            }
            // The optimizer offloaded to the host, without ZeRO and under stage 1 (GPT-2) or
            // 2 (BPR): the same records and checkpoints.
            if variant == "plain" {
                let stage = if model == "gpt2" { "1" } else { "2" };
                for zero in ["0", stage] {
                    let offloaded = format!("offload-{zero}");
                    let sets = [format!("dist.zero={zero}"), OFFLOAD.to_string()];
                    let sets: Vec<&str> = ddp
                        .iter()
                        .copied()
                        .chain(sets.iter().map(|s| s.as_str()))
                        .collect();
                    let ran = run_ok(2, out, &name(&offloaded), &sets, &[]);
                    ran.assert_stderr(
                        "AdamW moments in host memory, each step's update on the host's",
                    );
                    let at = format!("{model}, stage {zero}, offloaded");
                    assert_eq!(
                        results(&out.join(name(&offloaded))),
                        results(&out.join(name("ddp"))),
                        "{at}"
                    );
                    assert!(
                        checkpoint_bytes(&out.join(name(&offloaded)))
                            == checkpoint_bytes(&out.join(name("ddp"))),
                        "{at}: the checkpoint differs from DDP's"
                    );
                }
            }
            let zero_3 = with(&ddp, &["dist.zero=3"]);
            let ran = run_ok(2, out, &name("zero-3"), &zero_3, &[]);
            ran.assert_stderr(format!(
                "ZeRO stage 3 (dist.zero = 3): each of the 2 ranks keeps the parameters, AdamW moments and reduced gradients of its shard of every gradient bucket only; {units}"
            ));
            let at = format!("{model}, {variant}");
            let (want, got) = (
                results(&out.join(name("ddp"))),
                results(&out.join(name("zero-3"))),
            );
            assert!(
                want.iter().filter(|r| r["kind"] == "step").count() >= 10,
                "{at}: {want:?}"
            );
            for (g, w) in got.iter().zip(&want) {
                assert_eq!(g, w, "{at}: stage 3's record against DDP's");
            }
            assert_eq!(got.len(), want.len(), "{at}");
            assert!(
                checkpoint_bytes(&out.join(name("zero-3")))
                    == checkpoint_bytes(&out.join(name("ddp"))),
                "{at}: stage 3's checkpoint differs from DDP's"
            );
        }
    }
    // Saved at world 2 under stage 3 with the optimizer offloaded and resumed at world 3 under
    // stage 1 without (two epochs, stopped after the first): as saved and resumed under DDP.
    // A global batch both worlds divide: micro 64 x grad_accum 3 x 2 = 64 x 2 x 3.
    let two_epochs = with(
        &GPT2,
        &["train.epochs=2", "batch.global=384", "batch.micro=64"],
    );
    let stop = [("GPTREC_STOP_AFTER_EPOCH", "1")];
    run_ok(2, out, "ddp-then-3", &two_epochs, &stop);
    run_ok(
        2,
        out,
        "zero-3-then-1",
        &with(&two_epochs, &["dist.zero=3", OFFLOAD]),
        &stop,
    );
    run_ok(3, out, "ddp-then-3", &two_epochs, &[]).assert_stderr("resuming with world 3");
    let resumed = run_ok(
        3,
        out,
        "zero-3-then-1",
        &with(&two_epochs, &["dist.zero=1"]),
        &[],
    );
    resumed.assert_stderr_all(&["resuming with world 3", "ZeRO stage 1 (dist.zero = 1)"]);
    assert_eq!(
        results(&out.join("zero-3-then-1")),
        results(&out.join("ddp-then-3")),
        "resumed at world 3 under stage 1 from stage 3's checkpoint, against DDP's"
    );
}
