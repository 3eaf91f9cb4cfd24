//! GPT-2 (the base transformer, no language-model head) and its BPE tokenizer.
//!
//! Owns: the architecture, its parameter names/layouts (exactly Hugging Face's `GPT2Model`
//! safetensors: `wte.weight`, `h.{i}.attn.c_attn.weight` [in, out], ...), HF-style
//! initialisation, loading a HF safetensors file into a `VarStore`, mean pooling, activation
//! checkpointing of the blocks (recomputed during backward, see [`Gpt2::finish_backward`]), and
//! the GPT-2 tokenizer (tiktoken's `r50k_base`, embedded in the binary — no network).
//!
//! Must not: know about training loops, DDP, optimizers or the recommender's head; download
//! anything; transpose weights on load (Conv1D weights are *stored* [in, out] and computed as
//! `addmm(b, x, w)`, as HF does). `load_hf_safetensors` finds the model at the root of its `VarStore` or under
//! one prefix; other variables in the store (e.g. a head under its own path) are left alone and
//! listed in the report.

use std::cell::{Cell, RefCell};

use common::config::Gpt2Preset;
use common::memory::Gpt2Dims;
use runtime::ddp::ParamGate;
use serde::Deserialize;
use tch::{nn, Kind, Tensor};

mod hf_dir;
mod weights;
pub use hf_dir::HfDir;
pub use weights::{check_weights, expected_shapes, load_hf_safetensors, LoadReport};

/// GPT-2 pad/end-of-text token id (`<|endoftext|>`), used to pad batches.
pub const PAD_TOKEN_ID: i64 = 50256;

/// Errors of loading weights or building the tokenizer.
#[derive(Debug, thiserror::Error)]
pub enum Gpt2Error {
    #[error("reading safetensors: {0}")]
    Read(#[from] tch::TchError),
    #[error("reading safetensors: {0}")]
    Io(#[from] std::io::Error),
    /// A weights file that cannot be opened (the message names it).
    #[error("{0}")]
    Input(#[from] common::files::InputError),
    #[error("not a valid safetensors file: {0}")]
    Format(String),
    #[error("{name}: shape {expected:?} expected, file has {found:?}")]
    Shape {
        name: String,
        expected: Vec<i64>,
        found: Vec<i64>,
    },
    #[error("tensors missing from the file: {}", .0.join(", "))]
    Missing(Vec<String>),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A Hugging Face model directory that cannot be used (the message names the file).
    #[error("{0}")]
    Dir(String),
}

/// Hyper-parameters. Field names are Hugging Face `GPT2Config`'s, so a HF `config.json`
/// deserialises directly (unknown fields ignored).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Config {
    /// Number of transformer blocks (HF `n_layer`).
    pub n_layer: i64,
    /// Attention heads per block (HF `n_head`).
    pub n_head: i64,
    /// Model width `d` (HF `n_embd`).
    pub n_embd: i64,
    /// Learned positions, the longest input (HF `n_positions`).
    pub n_positions: i64,
    /// Token vocabulary (HF `vocab_size`).
    pub vocab_size: i64,
    /// Layer-norm epsilon (HF `layer_norm_epsilon`, whose default is 1e-5).
    #[serde(default = "default_epsilon")]
    pub layer_norm_epsilon: f64,
    /// Dropout on embeddings (HF `embd_pdrop`).
    #[serde(default = "default_pdrop")]
    pub embd_pdrop: f64,
    /// Dropout on attention probabilities (HF `attn_pdrop`).
    #[serde(default = "default_pdrop")]
    pub attn_pdrop: f64,
    /// Dropout on each residual branch (HF `resid_pdrop`).
    #[serde(default = "default_pdrop")]
    pub resid_pdrop: f64,
}

fn default_pdrop() -> f64 {
    0.1
}

fn default_epsilon() -> f64 {
    1e-5
}

impl Config {
    /// A preset's dimensions (one table, `common::memory::Gpt2Dims`, which the memory estimate
    /// reads too) with GPT-2's epsilon and dropouts.
    fn preset(preset: Gpt2Preset) -> Self {
        let d = Gpt2Dims::of(preset);
        Self {
            n_layer: d.n_layer as i64,
            n_head: d.n_head as i64,
            n_embd: d.n_embd as i64,
            n_positions: d.n_positions as i64,
            vocab_size: d.vocab_size as i64,
            layer_norm_epsilon: 1e-5,
            embd_pdrop: 0.1,
            attn_pdrop: 0.1,
            resid_pdrop: 0.1,
        }
    }

    /// GPT-2 small ("gpt2" on the Hugging Face hub, 124M parameters: 12 layers, 12 heads,
    /// width 768, 1024 positions, 50257 tokens).
    pub fn gpt2() -> Self {
        Self::preset(Gpt2Preset::Gpt2)
    }

    /// A tiny model with GPT-2's vocabulary, for tests and smoke runs (2 layers, 2 heads,
    /// width 64, 128 positions).
    pub fn tiny() -> Self {
        Self::preset(Gpt2Preset::Tiny)
    }
}

/// HF initialisation of weights: normal, std 0.02.
const INIT_STD: f64 = 0.02;

fn normal(vs: &nn::Path, name: &str, dims: &[i64]) -> Tensor {
    // Drawn in place, randn's draws then scaled: the numbers `nn::Init::Randn` gives, without
    // its temporary second copy of the tensor (the token table is 147 MiB in `gpt2`).
    let var = vs.var(name, dims, nn::Init::Const(0.0));
    tch::no_grad(|| {
        let _ = var
            .shallow_clone()
            .normal_(0.0, 1.0)
            .g_mul_scalar_(INIT_STD);
    });
    var
}

/// HF `Conv1D`: weight stored [in, out], `y = x @ w + b`.
#[derive(Debug)]
struct Conv1D {
    weight: Tensor,
    bias: Tensor,
    n_in: i64,
    n_out: i64,
}

impl Conv1D {
    fn new(vs: nn::Path, n_in: i64, n_out: i64) -> Self {
        Self {
            weight: normal(&vs, "weight", &[n_in, n_out]),
            bias: vs.zeros("bias", &[n_out]),
            n_in,
            n_out,
        }
    }

    /// `x` [.., n_in] → [.., n_out], as HF's `torch.addmm(bias, x.view(-1, n_in), weight)`: the
    /// bias is fused into the matmul, so under bf16 autocast the output stays bf16 (a separate
    /// `+ bias` in f32 would promote every activation after it back to f32).
    fn forward(&self, x: &Tensor) -> Tensor {
        let mut shape = x.size();
        if let Some(last) = shape.last_mut() {
            *last = self.n_out;
        }
        self.bias
            .addmm(&x.reshape([-1, self.n_in]), &self.weight)
            .view(shape.as_slice())
    }
}

#[derive(Debug)]
struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f64,
    dim: i64,
}

impl LayerNorm {
    fn new(vs: nn::Path, dim: i64, eps: f64) -> Self {
        Self {
            weight: vs.ones("weight", &[dim]),
            bias: vs.zeros("bias", &[dim]),
            eps,
            dim,
        }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        x.layer_norm(
            [self.dim],
            Some(&self.weight),
            Some(&self.bias),
            self.eps,
            true,
        )
    }
}

#[derive(Debug)]
struct Attention {
    c_attn: Conv1D,
    c_proj: Conv1D,
    n_head: i64,
    attn_pdrop: f64,
    resid_pdrop: f64,
}

impl Attention {
    fn new(vs: nn::Path, cfg: &Config) -> Self {
        let d = cfg.n_embd;
        Self {
            c_attn: Conv1D::new(&vs / "c_attn", d, 3 * d),
            c_proj: Conv1D::new(&vs / "c_proj", d, d),
            n_head: cfg.n_head,
            attn_pdrop: cfg.attn_pdrop,
            resid_pdrop: cfg.resid_pdrop,
        }
    }

    /// `x` [b, t, d] → [b, t, d]: causal self-attention through PyTorch's fused
    /// `scaled_dot_product_attention` (FlashAttention or memory-efficient kernels on GPUs, no
    /// [b, heads, t, t] scores kept). No padding mask is needed: texts are right-padded, so a
    /// real token's earlier keys are all real; pad positions attend among themselves and are
    /// never read (pooling skips them).
    fn forward(&self, x: &Tensor, train: bool) -> Tensor {
        let (b, t, d) = x
            .size3()
            .expect("attention input must be [batch, seq, dim]");
        let hd = d / self.n_head;
        let heads = |y: &Tensor| y.view([b, t, self.n_head, hd]).transpose(1, 2);
        let qkv = self.c_attn.forward(x).split(d, 2);
        let (q, k, v) = (heads(&qkv[0]), heads(&qkv[1]), heads(&qkv[2]));
        let dropout = if train { self.attn_pdrop } else { 0.0 };
        let y = Tensor::scaled_dot_product_attention(
            &q,
            &k,
            &v,
            None::<Tensor>,
            dropout,
            true,
            None,
            false,
        )
        .transpose(1, 2)
        .contiguous()
        .view([b, t, d]);
        self.c_proj.forward(&y).dropout(self.resid_pdrop, train)
    }
}

#[derive(Debug)]
struct Mlp {
    c_fc: Conv1D,
    c_proj: Conv1D,
    resid_pdrop: f64,
}

impl Mlp {
    fn new(vs: nn::Path, cfg: &Config) -> Self {
        let d = cfg.n_embd;
        Self {
            c_fc: Conv1D::new(&vs / "c_fc", d, 4 * d),
            c_proj: Conv1D::new(&vs / "c_proj", 4 * d, d),
            resid_pdrop: cfg.resid_pdrop,
        }
    }

    fn forward(&self, x: &Tensor, train: bool) -> Tensor {
        // HF "gelu_new" is GELU with the tanh approximation.
        let h = self.c_fc.forward(x).gelu("tanh");
        self.c_proj.forward(&h).dropout(self.resid_pdrop, train)
    }
}

#[derive(Debug)]
struct Block {
    ln_1: LayerNorm,
    attn: Attention,
    ln_2: LayerNorm,
    mlp: Mlp,
}

impl Block {
    fn new(vs: nn::Path, cfg: &Config) -> Self {
        let (d, eps) = (cfg.n_embd, cfg.layer_norm_epsilon);
        Self {
            ln_1: LayerNorm::new(&vs / "ln_1", d, eps),
            attn: Attention::new(&vs / "attn", cfg),
            ln_2: LayerNorm::new(&vs / "ln_2", d, eps),
            mlp: Mlp::new(&vs / "mlp", cfg),
        }
    }

    fn forward(&self, x: &Tensor, train: bool) -> Tensor {
        let x = x + self.attn.forward(&self.ln_1.forward(x), train);
        let h = self.mlp.forward(&self.ln_2.forward(&x), train);
        x + h
    }

    /// Whether any of the block's weights trains (a frozen block keeps no activations).
    fn trains(&self) -> bool {
        [
            &self.ln_1.weight,
            &self.ln_1.bias,
            &self.attn.c_attn.weight,
            &self.attn.c_attn.bias,
            &self.attn.c_proj.weight,
            &self.attn.c_proj.bias,
            &self.ln_2.weight,
            &self.ln_2.bias,
            &self.mlp.c_fc.weight,
            &self.mlp.c_fc.bias,
            &self.mlp.c_proj.weight,
            &self.mlp.c_proj.bias,
        ]
        .iter()
        .any(|w| w.requires_grad())
    }
}

/// What the backward pass needs to recompute the checkpointed blocks of one training forward:
/// each block's input (the only activations kept) and the dropout seeds.
#[derive(Debug)]
struct Recompute {
    /// Index of the first checkpointed block.
    first: usize,
    /// `inputs[k]`: the (detached) input of block `first + k`.
    inputs: Vec<Tensor>,
    /// `seeds[k]`: the generator seed block `first + k` ran its dropout with.
    seeds: Vec<i64>,
    /// The segment's input as the graph below it sees it (embeddings or frozen blocks that
    /// lead back to trainable weights), or `None` when nothing below trains.
    below: Option<Tensor>,
    /// The segment's output: a leaf the rest of the forward continued from, so the loss's
    /// backward leaves the gradient with respect to it here.
    output: Tensor,
}

/// The GPT-2 transformer (HF `GPT2Model`): token + learned position embeddings, pre-norm
/// blocks with causal self-attention, final layer norm. Returns the last hidden state.
#[derive(Debug)]
pub struct Gpt2 {
    wte: Tensor,
    wpe: Tensor,
    h: Vec<Block>,
    ln_f: LayerNorm,
    embd_pdrop: f64,
    config: Config,
    /// Run the trainable blocks without keeping their activations (see `forward`).
    checkpointing: bool,
    /// Checkpointed segments of the forward passes since the last `finish_backward`.
    pending: RefCell<Vec<Recompute>>,
    /// A training forward ran since the last `finish_backward` (checkpointing or not).
    trained: Cell<bool>,
    /// Each block's variable-name prefix: its ZeRO stage 3 unit.
    units: Vec<String>,
    /// ZeRO stage 3's gate, where the engine shards the parameters: each block is gathered
    /// around its forward and its backward (see [`Gpt2::set_param_gate`]).
    gate: Option<ParamGate>,
}

impl Gpt2 {
    /// Creates the variables under `vs` (pass `vs.root()` so names match HF files), initialised
    /// like HF: weights normal(0, 0.02), biases 0, layer norms weight 1 / bias 0.
    pub fn new(vs: &nn::Path, config: &Config) -> Self {
        assert!(
            config.n_embd % config.n_head == 0,
            "n_embd ({}) must be a multiple of n_head ({})",
            config.n_embd,
            config.n_head
        );
        let h = (0..config.n_layer)
            .map(|i| Block::new(vs / "h" / i, config))
            .collect();
        let units = (0..config.n_layer)
            .map(|i| (vs / "h" / i).path(""))
            .collect();
        Self {
            wte: normal(&(vs / "wte"), "weight", &[config.vocab_size, config.n_embd]),
            wpe: normal(
                &(vs / "wpe"),
                "weight",
                &[config.n_positions, config.n_embd],
            ),
            h,
            ln_f: LayerNorm::new(vs / "ln_f", config.n_embd, config.layer_norm_epsilon),
            embd_pdrop: config.embd_pdrop,
            config: config.clone(),
            checkpointing: false,
            pending: RefCell::new(Vec::new()),
            trained: Cell::new(false),
            units,
            gate: None,
        }
    }

    /// The units ZeRO stage 3 gathers one at a time (`runtime::ddp::DdpConfig::units`), in
    /// forward order: the blocks. The embedding tables are not: the recommender runs GPT-2
    /// several times a step (users' and items' texts, each micro-batch), and gathering its token
    /// table for each lookup moved 2.5x DDP's bytes a step (`scripts/bench/zero3.sh`, tiny
    /// preset, world 2); they are gathered once per step with the other parameters.
    pub fn units(&self) -> &[String] {
        &self.units
    }

    /// From now on each block's parameters are gathered through `gate` just before the block
    /// runs, and released after (in a recorded forward, gathered again for its backward).
    pub fn set_param_gate(&mut self, gate: ParamGate) {
        self.gate = Some(gate);
    }

    /// Block `i` on `x`, its parameters gathered first; `release`: released after (the
    /// recomputation of a checkpointed block leaves that to its backward).
    fn run_block(&self, i: usize, x: &Tensor, train: bool, release: bool) -> Tensor {
        let unit = &self.units[i];
        self.gated(unit, "gather", |gate| gate.enter(unit));
        let y = self.h[i].forward(x, train);
        if release {
            self.gated(unit, "release", |gate| gate.leave(unit, &[x], &[&y]));
        }
        y
    }

    /// Runs `step` on the gate, if any. The forward cannot fail: a gathering that does (a peer
    /// gone) ends the rank as a failed libtorch call would, with the cause.
    fn gated(
        &self,
        unit: &str,
        what: &str,
        step: impl FnOnce(&ParamGate) -> Result<(), runtime::ddp::DdpError>,
    ) {
        if let Some(Err(e)) = self.gate.as_ref().map(step) {
            panic!("ZeRO stage 3 could not {what} GPT-2's unit {unit}: {e}");
        }
    }

    /// Activation checkpointing: training forwards keep only each trainable block's input and
    /// recompute the block during backward (one block's activations at a time instead of all
    /// of them), at the cost of a second forward of those blocks. A model using it must have
    /// [`Gpt2::finish_backward`] called after each `loss.backward()`.
    pub fn set_activation_checkpointing(&mut self, on: bool) {
        self.checkpointing = on;
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// `input_ids` [b, t] i64, `attention_mask` [b, t] (1 real, 0 pad; any numeric kind;
    /// right-padded, as [`Tokenizer::encode_batch`] pads) → last hidden state [b, t, d]; the
    /// states at pad positions are not meaningful. Dropout is active only when `train`.
    ///
    /// In training, each block's dropout draws from a seed taken from torch's generator at the
    /// start of the pass, so a checkpointed block recomputes exactly the masks it used (with
    /// checkpointing on or off the model computes the same numbers). With checkpointing on and
    /// gradients enabled, the blocks from the first trainable one up run without autograd and
    /// the pass is recorded for [`Gpt2::finish_backward`].
    ///
    /// Panics if `t` exceeds `n_positions` or a CPU mask is not right-padded.
    pub fn forward(&self, input_ids: &Tensor, attention_mask: &Tensor, train: bool) -> Tensor {
        let (b, t) = input_ids.size2().expect("input_ids must be [batch, seq]");
        assert!(
            t <= self.config.n_positions,
            "sequence length {t} exceeds n_positions {}",
            self.config.n_positions
        );
        let device = input_ids.device();
        let positions = Tensor::arange(t, (Kind::Int64, device));
        let tok = Tensor::embedding(&self.wte, input_ids, -1, false, false);
        let pos = Tensor::embedding(&self.wpe, &positions, -1, false, false);
        let mut x = (tok + pos.unsqueeze(0)).dropout(self.embd_pdrop, train);

        check_right_padded(attention_mask, b, t);

        let seeds = block_seeds(self.h.len(), train);
        if train {
            self.trained.set(true);
        }
        let seed = |i: usize| {
            if let Some(s) = seeds.get(i) {
                tch::manual_seed(*s);
            }
        };
        let first = if self.checkpointing && train && grad_enabled() {
            (0..self.h.len()).find(|&i| x.requires_grad() || self.h[i].trains())
        } else {
            None
        };
        let end = first.unwrap_or(self.h.len());
        for i in 0..end {
            seed(i);
            x = self.run_block(i, &x, train, true);
        }
        if let Some(first) = first {
            let below = x.requires_grad().then(|| x.shallow_clone());
            let mut inputs = Vec::with_capacity(self.h.len() - first);
            let mut h = x.detach();
            {
                let _no_grad = tch::no_grad_guard();
                for i in first..self.h.len() {
                    inputs.push(h.shallow_clone());
                    seed(i);
                    h = self.run_block(i, &h, train, true);
                }
            }
            let output = h.set_requires_grad(true);
            self.pending.borrow_mut().push(Recompute {
                first,
                inputs,
                seeds: seeds.get(first..).map(<[i64]>::to_vec).unwrap_or_default(),
                below,
                output: output.shallow_clone(),
            });
            x = output;
        }
        self.ln_f.forward(&x)
    }

    /// How many blocks a training forward checkpoints: from the first one that trains (or that
    /// trainable embeddings feed) to the top; 0 without checkpointing.
    pub fn checkpointed_blocks(&self) -> usize {
        if !self.checkpointing {
            return 0;
        }
        let first = if self.wte.requires_grad() || self.wpe.requires_grad() {
            Some(0)
        } else {
            self.h.iter().position(Block::trains)
        };
        first.map_or(0, |f| self.h.len() - f)
    }

    /// Completes the backward pass of the checkpointed forwards since the last call, after the
    /// caller's `loss.backward()` left gradients at their outputs: each block, top down, runs
    /// again from its saved input with its dropout seed, and its part of the backward is taken
    /// (weights' gradients accumulate as usual). Must run under the same autocast setting as
    /// the forward.
    ///
    /// After a training forward, checkpointing or not, it draws one number from torch's
    /// generator and reseeds it with that at the end, so the generator's stream after it is the
    /// same with checkpointing on or off.
    pub fn finish_backward(&self) -> Result<(), tch::TchError> {
        if !self.trained.replace(false) {
            return Ok(());
        }
        let next = Tensor::f_randint(i64::MAX, [1], (Kind::Int64, tch::Device::Cpu))?
            .f_int64_value(&[0])?;
        let result = self.recompute_pending();
        tch::manual_seed(next);
        result
    }

    fn recompute_pending(&self) -> Result<(), tch::TchError> {
        let pending = std::mem::take(&mut *self.pending.borrow_mut());
        for r in pending.into_iter().rev() {
            let mut grad = r.output.grad();
            if !grad.defined() {
                // This pass did not reach the loss.
                continue;
            }
            for k in (r.first..self.h.len()).rev() {
                let x = r.inputs[k - r.first].detach().set_requires_grad(true);
                if let Some(s) = r.seeds.get(k - r.first) {
                    tch::manual_seed(*s);
                }
                // Only training passes are checkpointed: dropout is on. The block's backward
                // follows at once: its gradients' hooks release it.
                let y = self.run_block(k, &x, true, false);
                // d(sum(y * g))/dθ = gᵀ ∂y/∂θ: the vector-Jacobian product backward needs.
                (y * &grad).f_sum(Kind::Float)?.f_backward()?;
                grad = x.grad();
            }
            if let Some(below) = r.below {
                (below * grad).f_sum(Kind::Float)?.f_backward()?;
            }
        }
        Ok(())
    }

    /// Forgets the checkpointed passes not yet finished (a micro-batch abandoned before its
    /// backward).
    pub fn discard_pending(&self) {
        self.pending.borrow_mut().clear();
        self.trained.set(false);
    }

    /// Mean of `hidden` [b, t, d] over the real tokens of `attention_mask` [b, t] → [b, d].
    /// Rows without any real token give zeros.
    pub fn mean_pool(hidden: &Tensor, attention_mask: &Tensor) -> Tensor {
        let m = attention_mask
            .to_device(hidden.device())
            .to_kind(hidden.kind())
            .unsqueeze(-1);
        let sum = (hidden * &m).sum_dim_intlist([1i64].as_slice(), false, hidden.kind());
        let count = m.sum_dim_intlist([1i64].as_slice(), false, hidden.kind());
        sum / count.clamp_min(1.0)
    }
}

/// One dropout seed per block for a training pass, drawn from torch's generator (so a
/// reseeded generator gives the same seeds); none outside training.
fn block_seeds(n: usize, train: bool) -> Vec<i64> {
    if !train {
        return Vec::new();
    }
    let base = Tensor::randint(i64::MAX, [1], (Kind::Int64, tch::Device::Cpu)).int64_value(&[0]);
    // A SplitMix64 stream from the base: unrelated seeds for neighbouring blocks.
    let mut state = base as u64;
    (0..n)
        .map(|_| (runtime::rng::splitmix64(&mut state) >> 1) as i64)
        .collect()
}

/// Panics unless `attention_mask` [b, t] is right-padded (each row's real tokens first), which
/// the attention relies on. Checked where the mask lives on the CPU (where
/// [`Tokenizer::encode_batch`] builds it); a mask on a GPU is not read back (a host wait).
fn check_right_padded(attention_mask: &Tensor, b: i64, t: i64) {
    assert_eq!(
        attention_mask.size(),
        [b, t],
        "attention_mask must be [batch, seq] like input_ids"
    );
    if t > 1 && attention_mask.device() == tch::Device::Cpu {
        let real = attention_mask.ne(0);
        let pad_before_real = real
            .narrow(1, 1, t - 1)
            .logical_and(&real.narrow(1, 0, t - 1).logical_not());
        assert!(
            !bool::try_from(pad_before_real.any()).unwrap_or(true),
            "attention_mask must be right-padded: a pad comes before a real token"
        );
    }
}

/// Whether autograd records operations here (not under `no_grad`).
fn grad_enabled() -> bool {
    let probe = Tensor::zeros([1], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
    (probe * 1.0).requires_grad()
}

/// GPT-2's byte-level BPE (tiktoken `r50k_base`).
pub struct Tokenizer {
    bpe: tiktoken_rs::CoreBPE,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tokenizer(r50k_base)")
    }
}

impl Tokenizer {
    pub fn new() -> Result<Self, Gpt2Error> {
        let bpe = tiktoken_rs::r50k_base().map_err(|e| Gpt2Error::Tokenizer(e.to_string()))?;
        Ok(Self { bpe })
    }

    /// Token ids of `text` (special-token text such as `<|endoftext|>` is encoded as plain text).
    pub fn encode(&self, text: &str) -> Vec<i64> {
        self.bpe
            .encode_ordinary(text)
            .into_iter()
            .map(i64::from)
            .collect()
    }

    pub fn decode(&self, ids: &[i64]) -> Result<String, Gpt2Error> {
        let ranks = ids
            .iter()
            .map(|&i| u32::try_from(i).map_err(|_| Gpt2Error::Tokenizer(format!("bad id {i}"))))
            .collect::<Result<Vec<u32>, _>>()?;
        self.bpe
            .decode(&ranks)
            .map_err(|e| Gpt2Error::Tokenizer(e.to_string()))
    }

    /// Encodes each text, truncated to `max_len` tokens, right-padded with `PAD_TOKEN_ID` to the
    /// longest in the batch (at least 1). Returns (ids [b, t] i64, mask [b, t] f32), on the CPU.
    pub fn encode_batch(&self, texts: &[String], max_len: usize) -> (Tensor, Tensor) {
        let encoded: Vec<Vec<i64>> = texts
            .iter()
            .map(|t| {
                let mut ids = self.encode(t);
                ids.truncate(max_len);
                ids
            })
            .collect();
        let t = encoded.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let mut ids = Vec::with_capacity(texts.len() * t);
        let mut mask = Vec::with_capacity(texts.len() * t);
        for row in &encoded {
            ids.extend_from_slice(row);
            ids.extend(std::iter::repeat_n(PAD_TOKEN_ID, t - row.len()));
            mask.extend(std::iter::repeat_n(1f32, row.len()));
            mask.extend(std::iter::repeat_n(0f32, t - row.len()));
        }
        let shape = [texts.len() as i64, t as i64];
        (
            Tensor::from_slice(&ids).view(shape),
            Tensor::from_slice(&mask).view(shape),
        )
    }
}

#[cfg(test)]
mod tests;
