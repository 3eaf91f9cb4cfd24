//! A Hugging Face GPT-2 directory as `save_pretrained` writes it and users keep on disk
//! (`gpt2`, `distilgpt2`, `gpt2-medium`, a fine-tuned one): `config.json` gives the dimensions,
//! positions, layer-norm epsilon and vocabulary; `model.safetensors` the weights.
//!
//! Owns: finding the two files and refusing, with the file named, a directory that is not a
//! GPT-2 this module computes exactly (another `model_type`, another activation). Must not:
//! read the weights (the loader does, checking every shape against the config).

use std::path::{Path, PathBuf};

use super::{Config, Gpt2Error};

/// A GPT-2 directory: its config and where its weights are.
#[derive(Debug, Clone)]
pub struct HfDir {
    pub config: Config,
    pub weights: PathBuf,
}

impl HfDir {
    /// Reads `dir/config.json` and checks that `dir/model.safetensors` exists.
    pub fn open(dir: &Path) -> Result<HfDir, Gpt2Error> {
        let bad = |what: String| Gpt2Error::Dir(what);
        let config_path = dir.join("config.json");
        let text = std::fs::read_to_string(&config_path)
            .map_err(|e| bad(format!("{}: {e}", config_path.display())))?;
        let value: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| bad(format!("{}: not JSON: {e}", config_path.display())))?;
        let field = |name: &str| value.get(name).and_then(|v| v.as_str()).map(str::to_string);
        if let Some(kind) = field("model_type").filter(|k| k != "gpt2") {
            return Err(bad(format!(
                "{}: model_type is {kind:?}, not \"gpt2\"",
                config_path.display()
            )));
        }
        if let Some(act) = field("activation_function").filter(|a| a != "gelu_new") {
            return Err(bad(format!(
                "{}: activation_function is {act:?}; only GPT-2's \"gelu_new\" is implemented",
                config_path.display()
            )));
        }
        let config: Config = serde_json::from_value(value)
            .map_err(|e| bad(format!("{}: {e}", config_path.display())))?;
        if config.n_head <= 0 || config.n_embd % config.n_head != 0 {
            return Err(bad(format!(
                "{}: n_embd {} is not a multiple of n_head {}",
                config_path.display(),
                config.n_embd,
                config.n_head
            )));
        }
        let weights = dir.join("model.safetensors");
        if !weights.is_file() {
            return Err(bad(format!(
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
