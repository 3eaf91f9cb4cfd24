//! `model.gpt2_weights` naming a Hugging Face GPT-2 directory (`config.json` +
//! `model.safetensors`, as `save_pretrained` writes them): the GPT-2 dimensions come from its
//! `config.json` instead of `model.preset`.
//!
//! Owns: reading and checking `config.json` (a GPT-2 this project computes exactly: `model_type`
//! "gpt2", activation "gelu_new", a width divisible by the heads; every size, epsilon and dropout
//! within range, and the whole within [`MAX_PARAMETERS`]), so the launcher's dry run, the memory
//! estimate, validation and the worker see the same checked dimensions before anything is
//! allocated. Must not: read the weights (the worker checks the safetensors header's shapes
//! against these dimensions before it builds the model).

use std::path::{Path, PathBuf};

use super::{ConfigError, ModelConfig};
use crate::memory::Gpt2Dims;

/// Tokens of GPT-2's tokenizer (`r50k_base`), which the texts are encoded with: a model with a
/// smaller vocabulary would be indexed past its embedding table.
pub const TOKENIZER_VOCAB: u64 = 50257;

/// The largest GPT-2 this project builds, field by field (GPT-2 XL, the largest published, has
/// 48 blocks of width 1600, 1024 positions and 50257 tokens), and in parameters: 2^33 (32 GiB
/// of f32), checked before anything is allocated.
pub const MAX_N_LAYER: u64 = 1024;
pub const MAX_N_EMBD: u64 = 65536;
pub const MAX_N_POSITIONS: u64 = 1 << 20;
pub const MAX_VOCAB: u64 = 1 << 22;
pub const MAX_PARAMETERS: u64 = 1 << 33;

/// Largest `config.json` read (GPT-2's is under 1 KiB).
const MAX_CONFIG_JSON: u64 = 1 << 20;

/// A Hugging Face GPT-2 directory's `config.json`, checked.
#[derive(Debug, Clone)]
pub struct HfGpt2Config {
    /// Where it was read from.
    pub path: PathBuf,
    /// Its dimensions.
    pub dims: Gpt2Dims,
    /// The whole file, for readers that want more fields (epsilon, dropouts), each of which
    /// [`Self::read`] has checked when present.
    pub json: serde_json::Value,
}

impl HfGpt2Config {
    /// Reads `dir/config.json` (a FIFO, a device or a file over 1 MiB is refused without
    /// blocking) and checks every field this project reads. Errors name the file and the field.
    pub fn read(dir: &Path) -> Result<HfGpt2Config, String> {
        let path = dir.join("config.json");
        let text =
            crate::files::read_input_text(&path, MAX_CONFIG_JSON).map_err(|e| e.to_string())?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| format!("{}: not JSON: {e}", path.display()))?;
        let fields = Fields { json: &json };
        let dims = fields
            .check()
            .map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(HfGpt2Config { path, dims, json })
    }

    /// [`Self::read`], and a vocabulary that covers the tokenizer's tokens (what training on
    /// texts needs; a parity fixture with a small vocabulary is read with [`Self::read`]).
    pub fn read_for_texts(dir: &Path) -> Result<HfGpt2Config, String> {
        let hf = Self::read(dir)?;
        if hf.dims.vocab_size < TOKENIZER_VOCAB {
            return Err(format!(
                "{}: vocab_size {} is smaller than the {TOKENIZER_VOCAB} tokens of GPT-2's tokenizer, which the texts are encoded with",
                hf.path.display(),
                hf.dims.vocab_size
            ));
        }
        Ok(hf)
    }
}

/// The fields of a `config.json`, checked one by one (messages name the field, not the file).
struct Fields<'a> {
    json: &'a serde_json::Value,
}

impl Fields<'_> {
    /// Every field GPT-2 is built from, within range, and the model within
    /// [`MAX_PARAMETERS`].
    fn check(&self) -> Result<Gpt2Dims, String> {
        if !self.json.is_object() {
            return Err("not a JSON object".into());
        }
        self.kind()?;
        let dims = Gpt2Dims {
            n_layer: self.integer("n_layer", MAX_N_LAYER)?,
            n_head: self.integer("n_head", MAX_N_EMBD)?,
            n_embd: self.integer("n_embd", MAX_N_EMBD)?,
            n_positions: self.integer("n_positions", MAX_N_POSITIONS)?,
            vocab_size: self.integer("vocab_size", MAX_VOCAB)?,
        };
        if dims.n_embd % dims.n_head != 0 {
            return Err(format!(
                "n_embd {} is not a multiple of n_head {}",
                dims.n_embd, dims.n_head
            ));
        }
        self.n_inner(dims.n_embd)?;
        self.number(
            "layer_norm_epsilon",
            |x| x > 0.0 && x < 1.0,
            "a number in (0, 1)",
        )?;
        for dropout in ["embd_pdrop", "attn_pdrop", "resid_pdrop"] {
            self.number(dropout, |x| (0.0..1.0).contains(&x), "a number in [0, 1)")?;
        }
        // Each field is bounded, so the count cannot overflow.
        let params = dims.params();
        if params > MAX_PARAMETERS {
            return Err(format!(
                "n_layer {}, n_embd {}, n_positions {} and vocab_size {} make {params} parameters, more than the {MAX_PARAMETERS} this project builds",
                dims.n_layer, dims.n_embd, dims.n_positions, dims.vocab_size
            ));
        }
        Ok(dims)
    }

    /// A GPT-2 this project computes exactly: `model_type` "gpt2", activation "gelu_new".
    fn kind(&self) -> Result<(), String> {
        let text = |name: &str| self.json.get(name).and_then(|v| v.as_str());
        if let Some(kind) = text("model_type").filter(|k| *k != "gpt2") {
            return Err(format!("model_type is {kind:?}, not \"gpt2\""));
        }
        if let Some(act) = text("activation_function").filter(|a| *a != "gelu_new") {
            return Err(format!(
                "activation_function is {act:?}; only GPT-2's \"gelu_new\" is implemented"
            ));
        }
        Ok(())
    }

    /// A required integer in `1..=max`.
    fn integer(&self, name: &str, max: u64) -> Result<u64, String> {
        let v = self
            .json
            .get(name)
            .ok_or_else(|| format!("{name} is missing"))?;
        match v.as_u64() {
            Some(n) if (1..=max).contains(&n) => Ok(n),
            Some(n) if n > max => Err(format!(
                "{name} is {v}, more than the {max} this project builds"
            )),
            _ => Err(format!("{name} must be a positive integer (got {v})")),
        }
    }

    /// An optional number for which `ok` holds (`what` says which).
    fn number(&self, name: &str, ok: impl Fn(f64) -> bool, what: &str) -> Result<(), String> {
        match self.json.get(name) {
            None => Ok(()),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() && ok(x) => Ok(()),
                _ => Err(format!("{name} must be {what} (got {v})")),
            },
        }
    }

    /// `n_inner` (the MLP's width) unset, or GPT-2's four times the width.
    fn n_inner(&self, n_embd: u64) -> Result<(), String> {
        match self.json.get("n_inner") {
            None | Some(serde_json::Value::Null) => Ok(()),
            Some(v) if v.as_u64() == Some(4 * n_embd) => Ok(()),
            Some(v) => Err(format!(
                "n_inner is {v}; only GPT-2's MLP of 4 × n_embd = {} is implemented",
                4 * n_embd
            )),
        }
    }
}

impl ModelConfig {
    /// The Hugging Face directory `gpt2_weights` names, if it names one (a file is a bare
    /// `model.safetensors` of the preset's shape).
    pub fn gpt2_dir(&self) -> Option<&Path> {
        self.gpt2_weights.as_deref().filter(|p| p.is_dir())
    }

    /// GPT-2's dimensions: the directory's `config.json` when `gpt2_weights` names one, else
    /// the preset's.
    pub fn gpt2_dims(&self) -> Result<Gpt2Dims, ConfigError> {
        match self.gpt2_dir() {
            Some(dir) => HfGpt2Config::read_for_texts(dir)
                .map(|hf| hf.dims)
                .map_err(|problem| ConfigError::invalid("model.gpt2_weights", problem)),
            None => Ok(Gpt2Dims::of(self.preset)),
        }
    }

    /// What GPT-2 is, for messages: `the tiny preset` or `gpt2-dir/config.json`.
    pub fn gpt2_name(&self) -> String {
        match self.gpt2_dir() {
            Some(dir) => dir.join("config.json").display().to_string(),
            None => format!("the {} preset", self.gpt2_label()),
        }
    }

    /// GPT-2 in a word or a path, for tables: `tiny`, `gpt2` or the model directory.
    pub fn gpt2_label(&self) -> String {
        match self.gpt2_dir() {
            Some(dir) => dir.display().to_string(),
            None => format!("{:?}", self.preset).to_lowercase(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GPT2: &str = r#"{"model_type": "gpt2", "activation_function": "gelu_new", "n_layer": 2,
        "n_head": 4, "n_embd": 32, "n_positions": 32, "vocab_size": 50257, "layer_norm_epsilon": 1e-5}"#;

    fn read(config: &str) -> Result<HfGpt2Config, String> {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), config).unwrap();
        HfGpt2Config::read_for_texts(dir.path())
    }

    #[test]
    fn dimensions_come_from_config_json() {
        let hf = read(GPT2).unwrap();
        assert_eq!(
            (hf.dims.n_layer, hf.dims.n_head, hf.dims.n_embd),
            (2, 4, 32)
        );
        assert_eq!((hf.dims.n_positions, hf.dims.vocab_size), (32, 50257));
        assert!(hf.path.ends_with("config.json"));
    }

    #[test]
    fn what_is_not_a_usable_gpt2_is_refused_naming_the_file() {
        let err = |text: &str| read(text).unwrap_err();
        assert!(err(&GPT2.replace("\"gpt2\"", "\"bert\""))
            .contains("config.json: model_type is \"bert\", not \"gpt2\""));
        assert!(err(&GPT2.replace("gelu_new", "relu")).contains("only GPT-2's \"gelu_new\""));
        assert!(err(&GPT2.replace("\"n_head\": 4", "\"n_head\": 5"))
            .contains("n_embd 32 is not a multiple of n_head 5"));
        assert!(err(&GPT2.replace("\"n_layer\": 2,", "")).contains("n_layer is missing"));
        assert!(err(&GPT2.replace("\"n_layer\": 2", "\"n_layer\": -1"))
            .contains("n_layer must be a positive integer (got -1)"));
        assert!(err(&GPT2.replace("50257", "96"))
            .contains("vocab_size 96 is smaller than the 50257 tokens"));
        assert!(err("{").contains("config.json: not JSON"));
        let empty = tempfile::tempdir().unwrap();
        assert!(HfGpt2Config::read(empty.path())
            .unwrap_err()
            .contains("config.json"));
    }

    /// Each hostile value is one message naming the file and the field, before anything is
    /// built from it.
    #[test]
    fn hostile_sizes_epsilons_and_dropouts_are_refused_naming_the_field() {
        let err = |from: &str, to: &str| {
            let text = GPT2.replace(from, to);
            assert_ne!(text, GPT2, "{from} not in the fixture");
            let e = read(&text).unwrap_err();
            assert!(e.contains("config.json: "), "{e}");
            e
        };
        let cases = [
            (
                "\"n_embd\": 32",
                "\"n_embd\": 1000000000",
                "n_embd is 1000000000, more than the 65536",
            ),
            (
                "\"n_embd\": 32",
                "\"n_embd\": 1e9",
                "n_embd must be a positive integer (got 1000000000.0)",
            ),
            (
                "\"vocab_size\": 50257",
                "\"vocab_size\": 1000000000000",
                "vocab_size is 1000000000000, more than the 4194304",
            ),
            (
                "\"n_positions\": 32",
                "\"n_positions\": 1000000000000",
                "n_positions is 1000000000000, more than the 1048576",
            ),
            (
                "\"n_layer\": 2",
                "\"n_layer\": 100000",
                "n_layer is 100000, more than the 1024",
            ),
            (
                "\"n_layer\": 2",
                "\"n_layer\": 0",
                "n_layer must be a positive integer (got 0)",
            ),
            (
                "\"n_head\": 4",
                "\"n_head\": 64",
                "n_embd 32 is not a multiple of n_head 64",
            ),
            (
                "\"layer_norm_epsilon\": 1e-5",
                "\"layer_norm_epsilon\": -1",
                "layer_norm_epsilon must be a number in (0, 1) (got -1)",
            ),
            (
                "\"layer_norm_epsilon\": 1e-5",
                "\"layer_norm_epsilon\": 0",
                "layer_norm_epsilon must be a number in (0, 1) (got 0)",
            ),
            (
                "\"layer_norm_epsilon\": 1e-5",
                "\"layer_norm_epsilon\": \"x\"",
                "layer_norm_epsilon must be a number",
            ),
            (
                "\"layer_norm_epsilon\": 1e-5",
                "\"embd_pdrop\": 5",
                "embd_pdrop must be a number in [0, 1) (got 5)",
            ),
            (
                "\"layer_norm_epsilon\": 1e-5",
                "\"attn_pdrop\": 1",
                "attn_pdrop must be a number in [0, 1) (got 1)",
            ),
            (
                "\"layer_norm_epsilon\": 1e-5",
                "\"resid_pdrop\": -0.1",
                "resid_pdrop must be a number in [0, 1) (got -0.1)",
            ),
            (
                "\"layer_norm_epsilon\": 1e-5",
                "\"n_inner\": 100",
                "n_inner is 100; only GPT-2's MLP of 4 × n_embd = 128",
            ),
        ];
        for (from, to, needle) in cases {
            let e = err(from, to);
            assert!(e.contains(needle), "{to}: {e}");
        }
        // Each field within its bound, the whole too large.
        let e = err("\"n_embd\": 32", "\"n_embd\": 65536");
        assert!(
            e.contains("make ") && e.contains("parameters, more than the 8589934592"),
            "{e}"
        );
        assert!(err("{\"model_type\"", "[{\"model_type\"").contains("not JSON"));
        let array = tempfile::tempdir().unwrap();
        std::fs::write(array.path().join("config.json"), "[1]").unwrap();
        assert!(HfGpt2Config::read(array.path())
            .unwrap_err()
            .ends_with("config.json: not a JSON object"));
        // The defaults HF leaves out, and n_inner = null, are fine.
        let lean = GPT2.replace(", \"layer_norm_epsilon\": 1e-5", ", \"n_inner\": null");
        assert!(read(&lean).is_ok());
    }

    #[test]
    fn a_config_json_that_is_a_fifo_or_a_directory_is_refused_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = HfGpt2Config::read(dir.path()).unwrap_err();
        assert!(e.ends_with("config.json: is a FIFO, not a file"), "{e}");
        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        let e = HfGpt2Config::read(dir.path()).unwrap_err();
        assert!(
            e.ends_with("config.json: is a directory, not a file"),
            "{e}"
        );
    }
}
