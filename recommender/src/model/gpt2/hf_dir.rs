//! A Hugging Face GPT-2 directory as `save_pretrained` writes it and users keep on disk
//! (`gpt2`, `distilgpt2`, `gpt2-medium`, a fine-tuned one): `config.json` gives the dimensions,
//! positions, layer-norm epsilon and vocabulary; `model.safetensors` the weights.
//!
//! Owns: finding the two files and turning `config.json` into our [`Config`] (the checks of a
//! GPT-2 this module computes exactly live in `common`, where validation makes them too).
//! Must not: read the weights (the loader does, checking every shape against the config).

use std::path::{Path, PathBuf};

use common::config::HfGpt2Config;

use super::{Config, Gpt2Error};

/// A GPT-2 directory: its config and where its weights are.
#[derive(Debug, Clone)]
pub struct HfDir {
    pub config: Config,
    pub weights: PathBuf,
}

impl HfDir {
    /// Reads `dir/config.json` (checked by [`HfGpt2Config::read`], the checks the launcher's
    /// validation makes too) and checks that `dir/model.safetensors` exists.
    pub fn open(dir: &Path) -> Result<HfDir, Gpt2Error> {
        let hf = HfGpt2Config::read(dir).map_err(Gpt2Error::Dir)?;
        let config: Config = serde_json::from_value(hf.json)
            .map_err(|e| Gpt2Error::Dir(format!("{}: {e}", hf.path.display())))?;
        let weights = dir.join("model.safetensors");
        if !weights.is_file() {
            return Err(Gpt2Error::Dir(format!(
                "{} is missing (only safetensors weights are read)",
                weights.display()
            )));
        }
        Ok(HfDir { config, weights })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir_with(config: &str, weights: bool) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), config).unwrap();
        if weights {
            std::fs::write(dir.path().join("model.safetensors"), b"").unwrap();
        }
        dir
    }

    const GPT2: &str = r#"{"model_type": "gpt2", "activation_function": "gelu_new", "n_layer": 2,
        "n_head": 4, "n_embd": 32, "n_positions": 32, "vocab_size": 96, "layer_norm_epsilon": 1e-5}"#;

    #[test]
    fn a_gpt2_directory_opens_and_others_are_refused_naming_the_file() {
        let ok = dir_with(GPT2, true);
        let hf = HfDir::open(ok.path()).unwrap();
        assert_eq!(
            (hf.config.n_layer, hf.config.n_embd, hf.config.vocab_size),
            (2, 32, 96)
        );
        let err = |dir: &tempfile::TempDir| HfDir::open(dir.path()).unwrap_err().to_string();
        assert!(err(&dir_with(GPT2, false)).contains("model.safetensors is missing"));
        let bert = dir_with(&GPT2.replace("\"gpt2\"", "\"bert\""), true);
        assert!(err(&bert).contains("model_type is \"bert\", not \"gpt2\""));
        let gelu = dir_with(&GPT2.replace("gelu_new", "relu"), true);
        assert!(err(&gelu).contains("only GPT-2's \"gelu_new\""));
        let heads = dir_with(&GPT2.replace("\"n_head\": 4", "\"n_head\": 5"), true);
        assert!(err(&heads).contains("not a multiple of n_head 5"));
        let broken = dir_with("{", true);
        assert!(err(&broken).contains("config.json: not JSON"));
        let empty = tempfile::tempdir().unwrap();
        assert!(err(&empty).contains("config.json"));
    }
}
