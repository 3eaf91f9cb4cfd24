//! `model.gpt2_weights` naming a Hugging Face GPT-2 directory: the test writes one as
//! `save_pretrained` does (`config.json` + `model.safetensors`, GPT-2's vocabulary, a width and
//! depth no preset has), and `launch` plans its memory with those dimensions and trains with
//! them; directories that are not a usable GPT-2 are refused before any worker starts.

mod support;

use std::path::Path;
use std::time::Duration;

use support::*;

const VOCAB: usize = 50257;

/// `config.json` of a GPT-2 with `n_layer` blocks of width `n_embd`.
fn config_json(n_layer: usize, n_embd: usize, n_positions: usize) -> String {
    format!(
        r#"{{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "activation_function": "gelu_new",
  "n_layer": {n_layer}, "n_head": 2, "n_embd": {n_embd}, "n_positions": {n_positions},
  "n_ctx": {n_positions}, "vocab_size": {VOCAB}, "layer_norm_epsilon": 1e-05,
  "embd_pdrop": 0.1, "attn_pdrop": 0.1, "resid_pdrop": 0.1}}"#
    )
}

/// GPT2LMHeadModel's tensor names (`transformer.` prefix, the attention-mask buffers) and shapes.
fn tensors(n_layer: usize, d: usize, n_positions: usize) -> Vec<(String, Vec<usize>)> {
    let mut t = vec![
        ("transformer.wte.weight".to_string(), vec![VOCAB, d]),
        ("transformer.wpe.weight".to_string(), vec![n_positions, d]),
    ];
    for i in 0..n_layer {
        let h = format!("transformer.h.{i}");
        for (name, shape) in [
            ("ln_1.weight", vec![d]),
            ("ln_1.bias", vec![d]),
            ("attn.c_attn.weight", vec![d, 3 * d]),
            ("attn.c_attn.bias", vec![3 * d]),
            ("attn.c_proj.weight", vec![d, d]),
            ("attn.c_proj.bias", vec![d]),
            ("ln_2.weight", vec![d]),
            ("ln_2.bias", vec![d]),
            ("mlp.c_fc.weight", vec![d, 4 * d]),
            ("mlp.c_fc.bias", vec![4 * d]),
            ("mlp.c_proj.weight", vec![4 * d, d]),
            ("mlp.c_proj.bias", vec![d]),
        ] {
            t.push((format!("{h}.{name}"), shape));
        }
    }
    t.push(("transformer.ln_f.weight".to_string(), vec![d]));
    t.push(("transformer.ln_f.bias".to_string(), vec![d]));
    t
}

/// Writes a Hugging Face GPT-2 directory with small random weights (layer-norm gains 1).
fn write_gpt2_dir(dir: &Path, n_layer: usize, n_embd: usize, n_positions: usize) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("config.json"),
        config_json(n_layer, n_embd, n_positions),
    )
    .unwrap();
    let mut header = serde_json::Map::new();
    let mut data: Vec<u8> = Vec::new();
    let mut state: u64 = 0x2545_f491_4f6c_dd1d;
    for (name, shape) in tensors(n_layer, n_embd, n_positions) {
        let count: usize = shape.iter().product();
        let gain = name.contains("ln_") && name.ends_with(".weight");
        let start = data.len();
        for _ in 0..count {
            // xorshift: uniform in [-0.035, 0.035), about GPT-2's initial std of 0.02.
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let x = if gain {
                1.0
            } else {
                ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.07
            };
            data.extend_from_slice(&x.to_le_bytes());
        }
        header.insert(
            name,
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let header = serde_json::to_vec(&serde_json::Value::Object(header)).unwrap();
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&header);
    file.extend_from_slice(&data);
    std::fs::write(dir.join("model.safetensors"), file).unwrap();
}

/// `launch --num-processes 1 [--dry-run]` of the default config on tiny data with the
/// directory as `model.gpt2_weights`, plus `sets`.
fn launch_with_dir(out: &Path, gpt2: &Path, dry_run: bool, sets: &[&str]) -> Output {
    let mut args: Vec<String> = vec![
        "--num-processes".into(),
        "1".into(),
        "--master-port".into(),
        "0".into(),
    ];
    if dry_run {
        args.push("--dry-run".into());
    }
    args.push("configs/default.toml".into());
    let mut all_sets = vec![
        format!("run.output_dir={:?}", out.display().to_string()),
        "data.synthetic=\"tiny\"".into(),
        "train.epochs=1".into(),
        format!("model.gpt2_weights={:?}", gpt2.display().to_string()),
    ];
    all_sets.extend(sets.iter().map(|s| s.to_string()));
    for set in all_sets {
        args.extend(["--set".into(), set]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    launch(&args, Duration::from_secs(300))
}

#[test]
fn a_model_directory_sets_the_dimensions_the_job_plans_and_trains_with() {
    let tmp = tempfile::tempdir().unwrap();
    let gpt2 = tmp.path().join("my-gpt2");
    write_gpt2_dir(&gpt2, 3, 16, 80);
    // 3 blocks of width 16: 3 x (12 x 16² + 13 x 16) + (50257 + 48) x 16 + 2 x 16 parameters.
    let params = 3 * (12 * 16 * 16 + 13 * 16) + (VOCAB + 80) * 16 + 2 * 16;

    let dry = launch_with_dir(tmp.path(), &gpt2, true, &[]);
    dry.assert_code(0);
    let plan = dry.all();
    let name = format!("GPT-2 {} {params}", gpt2.display());
    assert!(plan.contains(&name), "no {name:?} in:\n{plan}");

    let out = launch_with_dir(tmp.path(), &gpt2, false, &[]);
    out.assert_code(0);
    out.assert_stderr(format!(
        "from {}/model.safetensors (3 blocks, width 16, 2 heads, 80 positions)",
        gpt2.display()
    ));
    assert!(tmp.path().join("default/best").is_dir(), "{}", out.all());
}

#[test]
fn what_the_directory_cannot_do_is_refused_before_any_worker_starts() {
    let tmp = tempfile::tempdir().unwrap();
    let gpt2 = tmp.path().join("short");
    write_gpt2_dir(&gpt2, 2, 16, 32);
    let config = format!("{}/config.json", gpt2.display());

    // The default 64 text tokens do not fit its 32 positions.
    let out = launch_with_dir(tmp.path(), &gpt2, true, &[]);
    out.assert_code(2);
    out.assert_stderr(format!(
        "`model.max_text_tokens` must be between 1 and 32 ({config}'s positions) (got 64)"
    ));
    let out = launch_with_dir(
        tmp.path(),
        &gpt2,
        true,
        &[
            "model.max_text_tokens=32",
            "model.text_mode=\"dynamic\"",
            "train.loss=\"bpr\"",
            "model.trainable_layers=3",
        ],
    );
    out.assert_code(2);
    out.assert_stderr(format!("is 3, but {config} has 2 blocks"));

    let text = std::fs::read_to_string(gpt2.join("config.json")).unwrap();
    std::fs::write(
        gpt2.join("config.json"),
        text.replace("\"gpt2\"", "\"llama\""),
    )
    .unwrap();
    let out = launch_with_dir(tmp.path(), &gpt2, true, &["model.max_text_tokens=32"]);
    out.assert_code(2);
    out.assert_stderr(format!("{config}: model_type is \"llama\", not \"gpt2\""));

    std::fs::write(
        gpt2.join("config.json"),
        text.replace(&format!("{VOCAB}"), "96"),
    )
    .unwrap();
    let out = launch_with_dir(tmp.path(), &gpt2, true, &["model.max_text_tokens=32"]);
    out.assert_code(2);
    out.assert_stderr("vocab_size 96 is smaller than the 50257 tokens of GPT-2's tokenizer");
}

#[test]
fn weights_that_disagree_with_config_json_fail_naming_the_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let gpt2 = tmp.path().join("liar");
    write_gpt2_dir(&gpt2, 2, 16, 32);
    // config.json says width 24; the weights are width 16.
    let text = std::fs::read_to_string(gpt2.join("config.json")).unwrap();
    std::fs::write(
        gpt2.join("config.json"),
        text.replace("\"n_embd\": 16", "\"n_embd\": 24"),
    )
    .unwrap();
    let out = launch_with_dir(tmp.path(), &gpt2, false, &["model.max_text_tokens=32"]);
    assert_ne!(out.code(), Some(0), "{}", out.all());
    out.assert_stderr("model.gpt2_weights");
    out.assert_stderr("expected, file has");
}

/// The range checks of `config.json` apply to training too: a hostile value is one line naming
/// the file and the field, before any worker starts (and quickly: nothing is allocated).
#[test]
fn hostile_config_json_values_are_refused_before_any_worker_starts() {
    let tmp = tempfile::tempdir().unwrap();
    let gpt2 = tmp.path().join("hostile");
    write_gpt2_dir(&gpt2, 2, 16, 32);
    let text = std::fs::read_to_string(gpt2.join("config.json")).unwrap();
    let config = format!("{}/config.json", gpt2.display());
    for (from, to, needle) in [
        (
            "\"n_embd\": 16",
            "\"n_embd\": 1000000000",
            "n_embd is 1000000000, more than the 65536",
        ),
        (
            "\"embd_pdrop\": 0.1",
            "\"embd_pdrop\": 5",
            "embd_pdrop must be a number in [0, 1) (got 5)",
        ),
        (
            "\"layer_norm_epsilon\": 1e-05",
            "\"layer_norm_epsilon\": -1",
            "layer_norm_epsilon must be a number in (0, 1) (got -1)",
        ),
    ] {
        assert!(text.contains(from), "{from}");
        std::fs::write(gpt2.join("config.json"), text.replace(from, to)).unwrap();
        let out = launch_with_dir(tmp.path(), &gpt2, false, &["model.max_text_tokens=32"]);
        out.assert_code(2);
        out.assert_stderr(format!("{config}: {needle}"));
        out.assert_ended_within(30);
        assert!(!tmp.path().join("default").exists(), "{}", out.all());
    }
}
