//! `model.gpt2_weights` naming a Hugging Face GPT-2 directory (`config.json` +
//! `model.safetensors`, as `save_pretrained` writes them): the GPT-2 dimensions come from its
//! `config.json` instead of `model.preset`.
//!
//! Owns: reading and checking `config.json` (a GPT-2 this project computes exactly: `model_type`
//! "gpt2", activation "gelu_new", a width divisible by the heads), so the launcher's dry run,
//! the memory estimate and validation see the same dimensions the worker builds. Must not: read
//! the weights (the worker's loader checks every tensor's shape against these dimensions).

use std::path::{Path, PathBuf};

use super::{ConfigError, ModelConfig};
use crate::memory::Gpt2Dims;

/// Tokens of GPT-2's tokenizer (`r50k_base`), which the texts are encoded with: a model with a
/// smaller vocabulary would be indexed past its embedding table.
pub const TOKENIZER_VOCAB: u64 = 50257;

/// A Hugging Face GPT-2 directory's `config.json`, checked.
#[derive(Debug, Clone)]
pub struct HfGpt2Config {
    /// Where it was read from.
    pub path: PathBuf,
    /// Its dimensions.
    pub dims: Gpt2Dims,
    /// The whole file, for readers that want more fields (epsilon, dropouts).
    pub json: serde_json::Value,
}

impl HfGpt2Config {
    /// Reads `dir/config.json`. Errors name the file and say what is wrong.
    pub fn read(dir: &Path) -> Result<HfGpt2Config, String> {
        let path = dir.join("config.json");
        let text =
            std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| format!("{}: not JSON: {e}", path.display()))?;
        let at = |problem: String| format!("{}: {problem}", path.display());
        let text_field = |name: &str| json.get(name).and_then(|v| v.as_str());
        if let Some(kind) = text_field("model_type").filter(|k| *k != "gpt2") {
            return Err(at(format!("model_type is {kind:?}, not \"gpt2\"")));
        }
        if let Some(act) = text_field("activation_function").filter(|a| *a != "gelu_new") {
            return Err(at(format!(
                "activation_function is {act:?}; only GPT-2's \"gelu_new\" is implemented"
            )));
        }
        let number = |name: &str| -> Result<u64, String> {
            match json.get(name) {
                Some(v) => v
                    .as_u64()
                    .filter(|n| *n > 0)
                    .ok_or_else(|| at(format!("{name} must be a positive integer (got {v})"))),
                None => Err(at(format!("{name} is missing"))),
            }
        };
        let dims = Gpt2Dims {
            n_layer: number("n_layer")?,
            n_head: number("n_head")?,
            n_embd: number("n_embd")?,
            n_positions: number("n_positions")?,
            vocab_size: number("vocab_size")?,
        };
        if dims.n_embd % dims.n_head != 0 {
            return Err(at(format!(
                "n_embd {} is not a multiple of n_head {}",
                dims.n_embd, dims.n_head
            )));
        }
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
}
