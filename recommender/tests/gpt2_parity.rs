//! Our GPT-2 is the same function as Hugging Face's: a small random GPT-2 written by
//! `transformers` (`scripts/parity/gpt2_fixture.py`: `config.json` + `model.safetensors` and
//! the numbers `transformers` computed with it) is loaded through our loader, and our forward
//! pass must give its last hidden states and LM-head logits (the head tied to `wte`, as in
//! `GPT2LMHeadModel`) within 1e-5 at every real (unpadded) position.

use std::path::PathBuf;

use recommender::model::gpt2::{load_hf_safetensors, Config, Gpt2};
use tch::{nn, Device, Kind, Tensor};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gpt2-parity")
}

fn tensor_2d(value: &serde_json::Value) -> Tensor {
    let rows: Vec<Vec<i64>> = serde_json::from_value(value.clone()).unwrap();
    let b = rows.len() as i64;
    let flat: Vec<i64> = rows.into_iter().flatten().collect();
    Tensor::from_slice(&flat).view([b, -1])
}

fn tensor_3d(value: &serde_json::Value) -> Tensor {
    let x: Vec<Vec<Vec<f32>>> = serde_json::from_value(value.clone()).unwrap();
    let (b, t) = (x.len() as i64, x[0].len() as i64);
    let flat: Vec<f32> = x.into_iter().flatten().flatten().collect();
    Tensor::from_slice(&flat).view([b, t, -1])
}

/// The largest |a - b| over the positions where `mask` is 1.
fn max_diff_at_real_positions(a: &Tensor, b: &Tensor, mask: &Tensor) -> f64 {
    let keep = mask.to_kind(Kind::Float).unsqueeze(-1);
    ((a - b).abs() * keep).max().double_value(&[])
}

#[test]
fn gpt2_matches_transformers() {
    let dir = fixture();
    let config: Config =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let vs = nn::VarStore::new(Device::Cpu);
    let model = Gpt2::new(&vs.root(), &config);
    load_hf_safetensors(&vs, None, &dir.join("model.safetensors")).unwrap();
    let ids = tensor_2d(&expected["input_ids"]);
    let mask = tensor_2d(&expected["attention_mask"]);
    let hidden = tch::no_grad(|| model.forward(&ids, &mask, false));
    let want = tensor_3d(&expected["last_hidden_state"]);
    let diff = max_diff_at_real_positions(&hidden, &want, &mask);
    assert!(diff < 1e-5, "last hidden state differs by {diff}");
    let wte = vs
        .variables()
        .into_iter()
        .find(|(n, _)| n == "wte.weight")
        .map(|(_, t)| t)
        .unwrap();
    let logits = tch::no_grad(|| hidden.matmul(&wte.tr()));
    let want = tensor_3d(&expected["logits"]);
    let diff = max_diff_at_real_positions(&logits, &want, &mask);
    assert!(diff < 1e-5, "LM-head logits differ by {diff}");
}
