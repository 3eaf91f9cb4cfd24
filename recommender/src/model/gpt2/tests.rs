//! Tests of the GPT-2 model, its weights and its tokenizer.

use super::*;
use rusty_fork::rusty_fork_test;
use std::collections::BTreeMap;
use std::path::Path;
use tch::Device;

fn tiny() -> (nn::VarStore, Gpt2) {
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let model = Gpt2::new(&vs.root(), &Config::tiny());
    (vs, model)
}

fn ids(v: &[i64]) -> Tensor {
    Tensor::from_slice(v).view([1, v.len() as i64])
}

fn close(a: &Tensor, b: &Tensor) -> bool {
    a.allclose(b, 0.0, 1e-6, false)
}

#[test]
fn tiny_output_shapes() {
    let (_vs, m) = tiny();
    let x = Tensor::from_slice(&[1i64, 2, 3, 4, 5, 6]).view([2, 3]);
    let mask = Tensor::ones([2, 3], (Kind::Float, Device::Cpu));
    let h = m.forward(&x, &mask, true);
    assert_eq!(h.size(), vec![2, 3, 64]);
    assert_eq!(Gpt2::mean_pool(&h, &mask).size(), vec![2, 64]);
    let h = m.forward(&x, &mask, false);
    assert_eq!(h.size(), vec![2, 3, 64]);
}

#[test]
fn variable_names_and_layouts_match_hf() {
    let (vs, _m) = tiny();
    let vars = vs.variables();
    let d = 64;
    for (name, shape) in [
        ("wte.weight", vec![50257, d]),
        ("wpe.weight", vec![128, d]),
        ("h.1.ln_1.weight", vec![d]),
        ("h.1.attn.c_attn.weight", vec![d, 3 * d]),
        ("h.1.attn.c_attn.bias", vec![3 * d]),
        ("h.1.attn.c_proj.weight", vec![d, d]),
        ("h.1.mlp.c_fc.weight", vec![d, 4 * d]),
        ("h.1.mlp.c_proj.weight", vec![4 * d, d]),
        ("h.1.mlp.c_proj.bias", vec![d]),
        ("ln_f.bias", vec![d]),
    ] {
        assert_eq!(vars[name].size(), shape, "{name}");
    }
    assert_eq!(vars.len(), 2 + 2 * 12 + 2);
}

#[test]
fn causal_later_token_does_not_change_earlier_outputs() {
    let (_vs, m) = tiny();
    let mask = Tensor::ones([1, 5], (Kind::Float, Device::Cpu));
    let a = m.forward(&ids(&[10, 20, 30, 40, 50]), &mask, false);
    let b = m.forward(&ids(&[10, 20, 30, 41, 999]), &mask, false);
    assert!(close(&a.narrow(1, 0, 3), &b.narrow(1, 0, 3)));
    assert!(!close(&a.narrow(1, 3, 1), &b.narrow(1, 3, 1)));
}

#[test]
fn padding_does_not_change_real_positions() {
    let (_vs, m) = tiny();
    let a = m.forward(
        &ids(&[10, 20, 30]),
        &Tensor::ones([1, 3], (Kind::Float, Device::Cpu)),
        false,
    );
    let padded = ids(&[10, 20, 30, PAD_TOKEN_ID, PAD_TOKEN_ID]);
    let mask = Tensor::from_slice(&[1f32, 1., 1., 0., 0.]).view([1, 5]);
    let b = m.forward(&padded, &mask, false);
    assert!(a.allclose(&b.narrow(1, 0, 3), 0.0, 1e-5, false));
    assert!(b.isfinite().all().int64_value(&[]) == 1);
}

#[test]
fn mean_pool_ignores_padding() {
    let hidden = Tensor::from_slice(&[1f32, 2., 3., 4., 100., 100., 5., 6., 7., 8., 9., 10.])
        .view([2, 3, 2]);
    let mask = Tensor::from_slice(&[1f32, 1., 0., 1., 1., 1.]).view([2, 3]);
    let pooled = Gpt2::mean_pool(&hidden, &mask);
    let want = Tensor::from_slice(&[2f32, 3., 7., 8.]).view([2, 2]);
    assert!(close(&pooled, &want), "{pooled}");
    let none = Gpt2::mean_pool(&hidden, &Tensor::zeros([2, 3], (Kind::Float, Device::Cpu)));
    assert!(close(
        &none,
        &Tensor::zeros([2, 2], (Kind::Float, Device::Cpu))
    ));
}

#[test]
fn tokenizer_matches_gpt2_ids_and_pads() {
    let tok = Tokenizer::new().unwrap();
    let want = [48236i64, 8362, 357, 21908, 8];
    assert_eq!(tok.encode("Toy Story (1995)"), want);
    assert_eq!(tok.decode(&want).unwrap(), "Toy Story (1995)");

    let texts = vec!["Toy Story (1995)".to_string(), "Toy".to_string()];
    let (ids, mask) = tok.encode_batch(&texts, 4);
    assert_eq!(ids.size(), vec![2, 4]);
    assert_eq!(ids.kind(), Kind::Int64);
    assert_eq!(mask.kind(), Kind::Float);
    let row: Vec<i64> = Vec::try_from(ids.get(1)).unwrap();
    assert_eq!(row, [48236, PAD_TOKEN_ID, PAD_TOKEN_ID, PAD_TOKEN_ID]);
    let row: Vec<i64> = Vec::try_from(ids.get(0)).unwrap();
    assert_eq!(row, want[..4]);
    let m: Vec<f32> = Vec::try_from(mask.flatten(0, -1)).unwrap();
    assert_eq!(m, [1., 1., 1., 1., 1., 0., 0., 0.]);

    let (ids, mask) = tok.encode_batch(&[String::new()], 8);
    assert_eq!(ids.size(), vec![1, 1]);
    assert_eq!(mask.sum(Kind::Float).double_value(&[]), 0.0);
}

/// The tiny model's variables as a HF `GPT2LMHeadModel` file would name them.
fn hf_file(
    vs: &nn::VarStore,
    dir: &Path,
    edit: impl Fn(&mut Vec<(String, Tensor)>),
) -> std::path::PathBuf {
    let mut named: Vec<(String, Tensor)> = vs
        .variables()
        .into_iter()
        .map(|(n, t)| (format!("transformer.{n}"), t.detach()))
        .collect();
    named.push((
        "lm_head.weight".into(),
        vs.variables()["wte.weight"].detach(),
    ));
    named.push((
        "transformer.h.0.attn.bias".into(),
        Tensor::ones([1, 1, 4, 4], (Kind::Float, Device::Cpu)),
    ));
    edit(&mut named);
    let path = dir.join("model.safetensors");
    Tensor::write_safetensors(&named, &path).unwrap();
    path
}

#[test]
fn loads_hf_names_with_prefix_and_extras() {
    let dir = tempfile::tempdir().unwrap();
    let (src_vs, src) = tiny();
    let path = hf_file(&src_vs, dir.path(), |_| {});

    tch::manual_seed(1);
    let vs = nn::VarStore::new(Device::Cpu);
    let model = Gpt2::new(&vs.root(), &Config::tiny());
    let x = ids(&[5, 6, 7, 8]);
    let mask = Tensor::ones([1, 4], (Kind::Float, Device::Cpu));
    let want = src.forward(&x, &mask, false);
    assert!(!close(&model.forward(&x, &mask, false), &want));

    let report = load_hf_safetensors(&vs, None, &path).unwrap();
    assert_eq!(report.loaded, 28);
    assert!(report.unexpected.is_empty());
    assert!(report.skipped.is_empty());
    assert_eq!(report.ignored.len(), 2);
    assert!(model.forward(&x, &mask, false).equal(&want));
}

/// What the header check expects is exactly what the model builds.
#[test]
fn expected_shapes_are_the_built_variables() {
    let (vs, _) = tiny();
    let mut built: Vec<(String, Vec<i64>)> = vs
        .variables()
        .into_iter()
        .map(|(n, t)| (n, t.size()))
        .collect();
    built.sort();
    let mut want = expected_shapes(&Config::tiny());
    want.sort();
    assert_eq!(built, want);
}

#[test]
fn wrong_shape_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let (src_vs, _) = tiny();
    let path = hf_file(&src_vs, dir.path(), |named| {
        for (n, t) in named.iter_mut() {
            if n == "transformer.h.1.attn.c_attn.weight" {
                *t = t.tr().contiguous();
            }
        }
    });
    let (vs, _) = tiny();
    let err = load_hf_safetensors(&vs, None, &path)
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "h.1.attn.c_attn.weight: shape [64, 192] expected, file has [192, 64]"
    );
}

#[test]
fn missing_tensor_is_named_and_extra_reported() {
    let dir = tempfile::tempdir().unwrap();
    let (src_vs, _) = tiny();
    let path = hf_file(&src_vs, dir.path(), |named| {
        named.retain(|(n, _)| n != "transformer.h.0.mlp.c_fc.bias");
        named.push((
            "transformer.extra".into(),
            Tensor::zeros([2], (Kind::Float, Device::Cpu)),
        ));
    });
    let (vs, _) = tiny();
    let err = load_hf_safetensors(&vs, None, &path)
        .unwrap_err()
        .to_string();
    assert!(err.contains("h.0.mlp.c_fc.bias"), "{err}");

    let path = hf_file(&src_vs, dir.path(), |named| {
        named.push((
            "extra".into(),
            Tensor::zeros([2], (Kind::Float, Device::Cpu)),
        ));
    });
    let report = load_hf_safetensors(&vs, None, &path).unwrap();
    assert_eq!(report.unexpected, vec!["extra".to_string()]);
}

/// A model under a prefix beside other variables (as the recommender builds it) loads
/// from a file in half precision (converted on the way in), the others left alone.
#[test]
fn loads_under_a_prefix_and_converts_half_precision() {
    let dir = tempfile::tempdir().unwrap();
    let (src_vs, _) = tiny();
    let path = hf_file(&src_vs, dir.path(), |named| {
        for (_, t) in named.iter_mut() {
            *t = t.to_kind(Kind::Half);
        }
    });
    tch::manual_seed(5);
    let vs = nn::VarStore::new(Device::Cpu);
    let model = Gpt2::new(&(vs.root() / "gpt2"), &Config::tiny());
    let head = vs.root().zeros("head", &[3]);
    let report = load_hf_safetensors(&vs, Some("gpt2"), &path).unwrap();
    assert_eq!(report.loaded, 28);
    assert_eq!(report.skipped, vec!["head".to_string()]);
    let want = src_vs.variables()["h.1.mlp.c_proj.weight"].to_kind(Kind::Half);
    let got = &vs.variables()["gpt2.h.1.mlp.c_proj.weight"];
    assert!(got.to_kind(Kind::Half).equal(&want));
    assert_eq!(got.kind(), Kind::Float);
    assert!(head.equal(&Tensor::zeros([3], (Kind::Float, Device::Cpu))));
    let x = ids(&[1, 2]);
    let mask = Tensor::ones([1, 2], (Kind::Float, Device::Cpu));
    assert_eq!(model.forward(&x, &mask, false).size(), vec![1, 2, 64]);
}

/// A cut or corrupt file is refused with what is wrong, before any variable changes.
#[test]
fn a_damaged_file_is_refused_and_nothing_is_loaded() {
    let dir = tempfile::tempdir().unwrap();
    let (src_vs, _) = tiny();
    let path = hf_file(&src_vs, dir.path(), |_| {});
    let bytes = std::fs::read(&path).unwrap();
    let (vs, _) = {
        tch::manual_seed(9);
        let vs = nn::VarStore::new(Device::Cpu);
        let m = Gpt2::new(&vs.root(), &Config::tiny());
        (vs, m)
    };
    let before = vs.variables()["wte.weight"].copy();
    let cases: [(&str, Vec<u8>); 3] = [
        ("too short for a header", bytes[..5].to_vec()),
        ("header length", {
            let mut b = bytes.clone();
            b[..8].copy_from_slice(&u64::MAX.to_le_bytes());
            b
        }),
        ("do not hold", bytes[..bytes.len() - 4].to_vec()),
    ];
    for (want, damaged) in cases {
        let cut = dir.path().join("cut.safetensors");
        std::fs::write(&cut, damaged).unwrap();
        let err = load_hf_safetensors(&vs, None, &cut)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("not a valid safetensors file") && err.contains(want),
            "{err}"
        );
        assert!(vs.variables()["wte.weight"].equal(&before));
    }
}

/// Loss and every trainable variable's gradient after one training step of two forward
/// passes (as the recommender does: users, then items) with dropout on; `frozen` names
/// variable prefixes that do not train.
fn step_grads(checkpointing: bool, frozen: &[&str]) -> (f64, BTreeMap<String, Tensor>, i64) {
    let (vs, mut m) = tiny();
    for (name, var) in vs.variables() {
        if frozen.iter().any(|f| name.starts_with(f)) {
            let _ = var.set_requires_grad(false);
        }
    }
    m.set_activation_checkpointing(checkpointing);
    let expected = match (checkpointing, frozen) {
        (false, _) => 0,
        (true, [.., "h.0."]) => 1,
        (true, _) => 2,
    };
    assert_eq!(m.checkpointed_blocks(), expected, "{frozen:?}");
    let a = Tensor::from_slice(&[5i64, 6, 7, 8, 9, 10, 11, 12]).view([2, 4]);
    let mask_a = Tensor::from_slice(&[1i64, 1, 1, 1, 1, 1, 0, 0]).view([2, 4]);
    let b = Tensor::from_slice(&[300i64, 301, 302]).view([1, 3]);
    let mask_b = Tensor::ones([1, 3], (Kind::Int64, Device::Cpu));
    tch::manual_seed(42);
    let ha = Gpt2::mean_pool(&m.forward(&a, &mask_a, true), &mask_a);
    let hb = Gpt2::mean_pool(&m.forward(&b, &mask_b, true), &mask_b);
    let loss = (ha.square().sum(Kind::Float) - (ha * hb).sum(Kind::Float)).sin();
    loss.backward();
    if checkpointing && frozen.is_empty() {
        // Before the recompute the blocks have no gradient: autograd kept nothing of them.
        assert!(!vs.variables()["h.0.mlp.c_fc.weight"].grad().defined());
        assert!(vs.variables()["ln_f.weight"].grad().defined());
    }
    m.finish_backward().unwrap();
    assert!(m.pending.borrow().is_empty());
    // What the generator gives next (negatives of the next micro-batch, say).
    let next = Tensor::randint(1 << 40, [1], (Kind::Int64, Device::Cpu)).int64_value(&[0]);
    let grads = vs
        .variables()
        .into_iter()
        .filter(|(_, v)| v.requires_grad())
        .map(|(n, v)| (n, v.grad()))
        .collect();
    (loss.double_value(&[]), grads, next)
}

// In its own process: the comparison needs torch's global generator to itself (other tests
// running in parallel threads draw from it and reseed it).
rusty_fork_test! {
    #[test]
    fn checkpointing_gives_the_same_loss_and_gradients() {
        for frozen in [&[][..], &["wte.", "wpe.", "h.0."][..], &["h.1."][..]] {
            let (loss, plain, next) = step_grads(false, frozen);
            let (loss_ckpt, ckpt, next_ckpt) = step_grads(true, frozen);
            assert_eq!(loss, loss_ckpt, "frozen {frozen:?}");
            assert_eq!(next, next_ckpt, "the generator's stream differs after backward");
            assert_eq!(plain.len(), ckpt.len());
            for (name, g) in &plain {
                let c = &ckpt[name];
                assert!(g.defined() && c.defined(), "{name} has no gradient");
                assert!(
                    g.allclose(c, 1e-5, 1e-8, false),
                    "frozen {frozen:?}: {name} differs by {}",
                    (g - c).abs().max().double_value(&[])
                );
                assert!(g.abs().sum(Kind::Float).double_value(&[]) > 0.0, "{name}");
            }
        }
    }
}

#[test]
fn evaluation_and_no_grad_passes_record_nothing() {
    let (_vs, mut m) = tiny();
    m.set_activation_checkpointing(true);
    let x = ids(&[1, 2, 3]);
    let mask = Tensor::ones([1, 3], (Kind::Int64, Device::Cpu));
    let _ = m.forward(&x, &mask, false);
    let _ = tch::no_grad(|| m.forward(&x, &mask, true));
    assert!(m.pending.borrow().is_empty());
    let _ = m.forward(&x, &mask, true);
    assert_eq!(m.pending.borrow().len(), 1);
    m.discard_pending();
    assert!(m.pending.borrow().is_empty());
}

/// The attention as it was computed before the fused kernel: f32 scores, a materialised causal
/// and pad mask, softmax, no dropout.
fn masked_softmax_attention(att: &Attention, x: &Tensor, mask: &Tensor) -> Tensor {
    let (b, t, d) = x.size3().unwrap();
    let hd = d / att.n_head;
    let heads = |y: &Tensor| y.view([b, t, att.n_head, hd]).transpose(1, 2);
    let qkv = (x.matmul(&att.c_attn.weight) + &att.c_attn.bias).split(d, 2);
    let (q, k, v) = (heads(&qkv[0]), heads(&qkv[1]), heads(&qkv[2]));
    let future = Tensor::ones([t, t], (Kind::Bool, Device::Cpu)).triu(1);
    let pad_key = mask.eq(0).view([b, 1, 1, t]);
    let masked = future.view([1, 1, t, t]).logical_or(&pad_key);
    let scores = (q.matmul(&k.transpose(-2, -1)) / (hd as f64).sqrt()).masked_fill(&masked, -1e9);
    let y = scores
        .softmax(-1, Kind::Float)
        .matmul(&v)
        .transpose(1, 2)
        .contiguous()
        .view([b, t, d]);
    y.matmul(&att.c_proj.weight) + &att.c_proj.bias
}

#[test]
fn fused_attention_equals_the_masked_softmax_on_real_tokens_padding_included() {
    let (_vs, m) = tiny();
    // Biases are zero at initialisation: give them values so the fused bias is exercised.
    tch::no_grad(|| {
        for c in [&m.h[0].attn.c_attn, &m.h[0].attn.c_proj] {
            let _ = c.bias.shallow_clone().normal_(0.0, 0.5);
        }
    });
    let lengths = [6i64, 4, 1];
    let t = 6;
    let mask: Vec<f32> = lengths
        .iter()
        .flat_map(|&n| (0..t).map(move |j| if j < n { 1.0 } else { 0.0 }))
        .collect();
    let mask = Tensor::from_slice(&mask).view([3, t]);
    let x = Tensor::randn([3, t, 64], (Kind::Float, Device::Cpu));
    let att = &m.h[0].attn;
    let fused = att.forward(&x, false);
    let reference = masked_softmax_attention(att, &x, &mask);
    for (row, &n) in lengths.iter().enumerate() {
        let (a, b) = (
            fused.get(row as i64).narrow(0, 0, n),
            reference.get(row as i64).narrow(0, 0, n),
        );
        let diff = (a - b).abs().max().double_value(&[]);
        assert!(
            diff <= 1e-5,
            "row {row} ({n} real tokens) differs by {diff}"
        );
    }
}

#[test]
#[should_panic(expected = "right-padded")]
fn a_left_padded_mask_is_refused() {
    let (_vs, m) = tiny();
    let mask = Tensor::from_slice(&[0f32, 1., 1.]).view([1, 3]);
    let _ = m.forward(&ids(&[PAD_TOKEN_ID, 20, 30]), &mask, false);
}

#[test]
fn bf16_autocast_keeps_the_blocks_activations_in_bf16() {
    use crate::model::autocast::AutocastGuard;
    let (_vs, m) = tiny();
    let x = Tensor::randn([2, 5, 64], (Kind::Float, Device::Cpu));
    let input = ids(&[10, 20, 30, 40, 50]).repeat([2, 1]);
    let mask = Tensor::ones([2, 5], (Kind::Float, Device::Cpu));
    let want = m.forward(&input, &mask, false);
    let _scope = AutocastGuard::enter(Device::Cpu, true);
    let block = &m.h[0];
    let kind = |t: Tensor| t.kind();
    // As PyTorch's autocast does them: layer norms in f32, every matmul's output (with its
    // fused bias), the attention, GELU and each residual branch in bf16; the residual stream
    // itself stays f32 (f32 + bf16 promotes).
    assert_eq!(kind(block.ln_1.forward(&x)), Kind::Float);
    assert_eq!(kind(block.attn.c_attn.forward(&x)), Kind::BFloat16);
    assert_eq!(kind(block.attn.forward(&x, false)), Kind::BFloat16);
    assert_eq!(
        kind(block.mlp.c_fc.forward(&x).gelu("tanh")),
        Kind::BFloat16
    );
    assert_eq!(kind(block.mlp.forward(&x, false)), Kind::BFloat16);
    assert_eq!(kind(block.forward(&x, false)), Kind::Float);
    // The whole model agrees with f32 within bf16's precision (8 bits of mantissa: about
    // 0.4% a rounding), on outputs of unit scale after the final layer norm.
    let got = m.forward(&input, &mask, false);
    assert_eq!(got.kind(), Kind::Float);
    let diff = (&got - &want).abs();
    let (max, mean) = (
        diff.max().double_value(&[]),
        diff.mean(Kind::Float).double_value(&[]),
    );
    assert!(
        max < 0.1 && mean < 0.02,
        "bf16 differs from f32 by max {max}, mean {mean}"
    );
}
