//! A Hugging Face GPT-2 directory as `save_pretrained` writes it and users keep on disk
//! (`gpt2`, `distilgpt2`, `gpt2-medium`, a fine-tuned one): `config.json` gives the dimensions,
//! positions, layer-norm epsilon and vocabulary; `model.safetensors` the weights.
//!
//! Owns: finding the two files, turning `config.json` into our [`Config`] (the checks of a
//! GPT-2 this module computes exactly, and of every field's range, live in `common`, where
//! validation makes them too), and checking the weights' header against it, so that a
//! directory that opens can be built and loaded. Must not: read the weights' values (the
//! loader does), or allocate anything the size of the model.

use std::path::{Path, PathBuf};

use common::config::HfGpt2Config;

use super::{check_weights, Config, Gpt2Error};

/// A GPT-2 directory: its config and where its weights are.
#[derive(Debug, Clone)]
pub struct HfDir {
    pub config: Config,
    pub weights: PathBuf,
}

impl HfDir {
    /// Reads `dir/config.json` (checked by [`HfGpt2Config::read`], the checks the launcher's
    /// validation makes too) and checks that `dir/model.safetensors` holds every tensor of that
    /// GPT-2 with its shape (its header only: nothing is built yet).
    pub fn open(dir: &Path) -> Result<HfDir, Gpt2Error> {
        let hf = HfGpt2Config::read(dir).map_err(Gpt2Error::Dir)?;
        let config: Config = serde_json::from_value(hf.json)
            .map_err(|e| Gpt2Error::Dir(format!("{}: {e}", hf.path.display())))?;
        let weights = dir.join("model.safetensors");
        match check_weights(&weights, &config) {
            Ok(()) => Ok(HfDir { config, weights }),
            Err(Gpt2Error::Input(common::files::InputError::Missing { .. })) => {
                Err(Gpt2Error::Dir(format!(
                    "{} is missing (only safetensors weights are read)",
                    weights.display()
                )))
            }
            Err(e @ Gpt2Error::Input(_)) => Err(e),
            Err(e) => Err(Gpt2Error::Dir(format!("{}: {e}", weights.display()))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::gpt2::expected_shapes;
    use tch::{Device, Kind, Tensor};

    /// Zero weights of every tensor a GPT-2 of `config` has, as `transformers` names them.
    fn write_weights(path: &Path, config: &str) {
        let config: Config = serde_json::from_str(config).unwrap();
        let tensors: Vec<(String, Tensor)> = expected_shapes(&config)
            .into_iter()
            .map(|(n, s)| {
                let t = Tensor::zeros(s.as_slice(), (Kind::Float, Device::Cpu));
                (format!("transformer.{n}"), t)
            })
            .collect();
        Tensor::write_safetensors(&tensors, path).unwrap();
    }

    fn dir_with(config: &str, weights: bool) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), config).unwrap();
        if weights {
            write_weights(&dir.path().join("model.safetensors"), GPT2);
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

    /// A config.json that disagrees with its weights is refused from the header alone: a
    /// width of 4096 would allocate 1.6 GB before the loader could compare shapes.
    #[test]
    fn a_config_that_disagrees_with_its_weights_is_refused_before_anything_is_built() {
        let err = |config: &str| {
            let dir = dir_with(&GPT2.replace("\"n_embd\": 32", config), true);
            HfDir::open(dir.path()).unwrap_err().to_string()
        };
        let e = err("\"n_embd\": 4096");
        assert!(
            e.contains(
                "model.safetensors: wte.weight: shape [96, 4096] expected, file has [96, 32]"
            ),
            "{e}"
        );
        let dir = dir_with(&GPT2.replace("\"n_layer\": 2", "\"n_layer\": 3"), true);
        let e = HfDir::open(dir.path()).unwrap_err().to_string();
        assert!(
            e.contains("tensors missing from the file: h.2.ln_1.weight, h.2.ln_1.bias")
                && e.ends_with(", and 4 more"),
            "{e}"
        );
        let e = err("\"n_embd\": 65536");
        assert!(e.contains("parameters, more than the"), "{e}");
    }

    #[test]
    fn weights_that_are_a_fifo_or_not_safetensors_are_refused_at_once() {
        let dir = dir_with(GPT2, false);
        let weights = dir.path().join("model.safetensors");
        let c = std::ffi::CString::new(weights.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = HfDir::open(dir.path()).unwrap_err().to_string();
        assert!(
            e.ends_with("model.safetensors: is a FIFO, not a file"),
            "{e}"
        );
        std::fs::remove_file(&weights).unwrap();
        std::fs::write(&weights, b"").unwrap();
        let e = HfDir::open(dir.path()).unwrap_err().to_string();
        assert!(
            e.contains("model.safetensors: not a valid safetensors file"),
            "{e}"
        );
    }
}
