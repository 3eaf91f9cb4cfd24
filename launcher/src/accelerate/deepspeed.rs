//! accelerate's DeepSpeed settings (`--use_deepspeed`, `--zero_stage`,
//! `--offload_optimizer_device`, ... and the config file's `distributed_type: DEEPSPEED` and
//! `deepspeed_config`): for a script, the `ACCELERATE_*` variables `accelerate launch` sets for
//! it (its own `Accelerator` reads them); for our worker, the config keys that do the same
//! (`dist.zero`, `dist.offload`, `batch.grad_accum`, `train.max_grad_norm`), and one line for
//! each setting without a counterpart.
//!
//! Owns the settings and their mapping; must not parse the command line (`cli`'s) or read the
//! file (the parent's reader hands its `deepspeed_config` section here).

use yaml_rust2::Yaml;

use super::python_text::{python_float, python_str};

use crate::cli::Cli;

/// The DeepSpeed settings of a line and its config file.
#[derive(Debug, Default, Clone, PartialEq)]
pub(super) struct DeepSpeed {
    /// `--use_deepspeed`, or the file's `distributed_type: DEEPSPEED`.
    pub used: bool,
    pub zero_stage: Option<u8>,
    pub offload_optimizer_device: Option<String>,
    pub offload_param_device: Option<String>,
    pub gradient_accumulation_steps: Option<u64>,
    pub gradient_clipping: Option<f64>,
    /// The file's `gradient_clipping` as accelerate passes it on: PyYAML's reading of it
    /// written back by Python (`1` stays `1`, `1e-5` is text to YAML 1.1); `None` when the
    /// line gave it (a float, written as Python writes floats).
    pub gradient_clipping_text: Option<String>,
    pub zero3_init_flag: Option<String>,
    pub zero3_save_16bit_model: Option<String>,
    pub config_file: Option<String>,
    pub moe_layer_cls_names: Option<String>,
    /// The launcher-side flags given (not applied: `launch` starts the workers itself).
    pub launcher_side: Vec<(String, String)>,
    /// The keys of the file's `deepspeed_config` (accelerate passes them on, so that a
    /// DeepSpeed config file's values are checked against them).
    pub file_keys: Vec<String>,
}

impl DeepSpeed {
    /// The command line's settings over `file`'s.
    pub(super) fn merged(cli: &Cli, file: DeepSpeed) -> DeepSpeed {
        let f = &cli.deepspeed;
        DeepSpeed {
            used: cli.deepspeed.use_deepspeed || file.used,
            zero_stage: f.zero_stage.or(file.zero_stage),
            offload_optimizer_device: (f.offload_optimizer_device.clone())
                .or(file.offload_optimizer_device),
            offload_param_device: f.offload_param_device.clone().or(file.offload_param_device),
            gradient_accumulation_steps: (f.gradient_accumulation_steps)
                .or(file.gradient_accumulation_steps),
            gradient_clipping: f.gradient_clipping.or(file.gradient_clipping),
            gradient_clipping_text: match f.gradient_clipping {
                Some(_) => None,
                None => file.gradient_clipping_text,
            },
            zero3_init_flag: f.zero3_init_flag.clone().or(file.zero3_init_flag),
            zero3_save_16bit_model: (f.zero3_save_16bit_model.clone())
                .or(file.zero3_save_16bit_model),
            config_file: f.deepspeed_config_file.clone().or(file.config_file),
            moe_layer_cls_names: (f.deepspeed_moe_layer_cls_names.clone())
                .or(file.moe_layer_cls_names),
            launcher_side: (f.launcher_side.given().into_iter())
                .map(|(flag, v)| (flag.to_string(), v.to_string()))
                .collect(),
            file_keys: file.file_keys,
        }
    }

    /// The file's `deepspeed_config` section; an error names the key.
    pub(super) fn read_section(&mut self, section: &Yaml) -> Result<(), String> {
        for (key, value) in super::section_entries(section)? {
            self.file_keys.push(key.to_string());
            self.read_key(key, value)
                .map_err(|e| format!("{key}: {e}"))?;
        }
        Ok(())
    }

    fn read_key(&mut self, key: &str, value: &Yaml) -> Result<(), String> {
        let text = || match value {
            Yaml::String(v) | Yaml::Real(v) => Some(v.clone()),
            Yaml::Integer(v) => Some(v.to_string()),
            Yaml::Boolean(v) => Some(v.to_string()),
            _ => None,
        };
        let device = || match text().map(|t| t.to_ascii_lowercase()).as_deref() {
            None => Ok(None),
            Some(d @ ("none" | "cpu" | "nvme")) => Ok(Some(d.to_string())),
            Some(other) => Err(format!("{other:?}: expected none, cpu or nvme")),
        };
        let shown = || text().unwrap_or_else(|| format!("{value:?}"));
        match key {
            "zero_stage" => match value {
                Yaml::Integer(n @ 0..=3) => self.zero_stage = Some(*n as u8),
                Yaml::Null => {}
                _ => return Err(format!("expected 0, 1, 2 or 3, got {}", shown())),
            },
            "offload_optimizer_device" => self.offload_optimizer_device = device()?,
            "offload_param_device" => self.offload_param_device = device()?,
            "gradient_accumulation_steps" => match value {
                Yaml::Integer(n) if *n >= 1 => self.gradient_accumulation_steps = Some(*n as u64),
                Yaml::Null => {}
                _ => return Err(format!("expected a number >= 1, got {}", shown())),
            },
            "gradient_clipping" => {
                self.gradient_clipping = match text().map(|t| t.parse::<f64>()) {
                    None => None,
                    Some(Ok(norm)) if norm.is_finite() && norm > 0.0 => Some(norm),
                    Some(Ok(_)) => return Err(format!("{}: must be a number above 0", shown())),
                    Some(Err(_)) => return Err(format!("expected a number, got {}", shown())),
                };
                self.gradient_clipping_text = self.gradient_clipping.map(|_| python_str(value));
            }
            "zero3_init_flag" => self.zero3_init_flag = text(),
            "zero3_save_16bit_model" => self.zero3_save_16bit_model = text(),
            "deepspeed_config_file" => self.config_file = text().filter(|t| !t.is_empty()),
            "deepspeed_moe_layer_cls_names" => self.moe_layer_cls_names = text(),
            // accelerate's launcher's own (across machines, NVMe paths for its generated
            // config, ...): nothing a worker reads.
            _ => {}
        }
        Ok(())
    }

    /// The variables `accelerate launch` sets for a DeepSpeed script (its
    /// `prepare_deepspeed_cmd_env`); none when DeepSpeed is not used.
    pub(super) fn env(&self) -> Vec<(String, String)> {
        if !self.used {
            return Vec::new();
        }
        let lower = |v: &str| v.to_ascii_lowercase();
        let mut env = vec![
            ("ACCELERATE_CONFIG_DS_FIELDS", self.file_keys.join(",")),
            ("ACCELERATE_USE_DEEPSPEED", "true".into()),
        ];
        let mut put = |key, value: Option<String>| {
            if let Some(v) = value {
                env.push((key, v));
            }
        };
        put(
            "ACCELERATE_DEEPSPEED_ZERO_STAGE",
            self.zero_stage.map(|s| s.to_string()),
        );
        put(
            "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
            self.gradient_accumulation_steps.map(|n| n.to_string()),
        );
        put(
            "ACCELERATE_GRADIENT_CLIPPING",
            (self.gradient_clipping_text.clone())
                .or(self.gradient_clipping.map(python_float))
                .map(|t| t.to_ascii_lowercase()),
        );
        put(
            "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
            self.offload_optimizer_device.as_deref().map(lower),
        );
        put(
            "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
            self.offload_param_device.as_deref().map(lower),
        );
        put(
            "ACCELERATE_DEEPSPEED_ZERO3_INIT",
            self.zero3_init_flag.as_deref().map(lower),
        );
        put(
            "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
            self.zero3_save_16bit_model.as_deref().map(lower),
        );
        put("ACCELERATE_DEEPSPEED_CONFIG_FILE", self.config_file.clone());
        put(
            "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES",
            self.moe_layer_cls_names.clone(),
        );
        env.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
    }

    /// Our worker's config keys for these settings (before the user's own `--set`, which win),
    /// with a line saying what was applied and one for each setting that was not.
    pub(super) fn worker_sets(&self, notices: &mut Vec<String>) -> Result<Vec<String>, String> {
        if !self.used {
            return Ok(Vec::new());
        }
        let (mut sets, mut said) = (Vec::new(), Vec::new());
        let mut set = |flag: String, key: String| {
            said.push(format!("{flag} = --set {key}"));
            sets.push(key);
        };
        // DeepSpeed's own default stage is 2 (accelerate's plugin), unless a DeepSpeed file
        // (which our worker does not read) says otherwise.
        match (self.zero_stage, &self.config_file) {
            (Some(stage), _) => set(
                format!("--zero_stage {stage}"),
                format!("dist.zero={stage}"),
            ),
            (None, None) => set(
                "no --zero_stage (DeepSpeed's default, 2)".into(),
                "dist.zero=2".into(),
            ),
            (None, Some(_)) => {}
        }
        let device = (self.offload_optimizer_device.as_deref()).map(str::to_ascii_lowercase);
        match device.as_deref() {
            Some(d @ ("none" | "cpu")) => {
                let ours = if d == "cpu" { "optimizer" } else { "none" };
                set(
                    format!("--offload_optimizer_device {d}"),
                    format!("dist.offload=\"{ours}\""),
                );
            }
            Some(other) => notices.push(format!(
                "--offload_optimizer_device {other}: not applied; our worker offloads the optimizer to host memory (cpu)"
            )),
            None => {}
        }
        if let Some(n) = self.gradient_accumulation_steps {
            set(
                format!("--gradient_accumulation_steps {n}"),
                format!("batch.grad_accum={n}"),
            );
        }
        if let Some(norm) = self.gradient_clipping {
            let shown = (self.gradient_clipping_text.clone()).unwrap_or_else(|| python_float(norm));
            if !(norm.is_finite() && norm > 0.0) {
                return Err(format!(
                    "--gradient_clipping {shown}: must be a number above 0"
                ));
            }
            set(
                format!("--gradient_clipping {shown}"),
                format!("train.max_grad_norm={}", python_float(norm)),
            );
        }
        let unused = [
            (
                "--offload_param_device",
                self.offload_param_device
                    .as_deref()
                    .filter(|d| *d != "none"),
                "our worker does not offload parameters (dist.zero = 3 shards them)",
            ),
            (
                "--zero3_save_16bit_model",
                self.zero3_save_16bit_model.as_deref(),
                "our checkpoints hold the whole f32 model whatever the stage",
            ),
            (
                "--zero3_init_flag",
                self.zero3_init_flag.as_deref(),
                "our worker builds the model once and shards it as dist.zero says",
            ),
            (
                "--deepspeed_config_file",
                self.config_file.as_deref(),
                "our worker reads its own config",
            ),
        ];
        for (flag, value, why) in unused {
            if let Some(v) = value {
                notices.push(format!("{flag} {v}: not applied; {why}"));
            }
        }
        for (flag, value) in &self.launcher_side {
            notices.push(format!(
                "{flag} {value}: not applied; launch starts the workers itself (its --hostfile, --include and --exclude)"
            ));
        }
        if !said.is_empty() {
            notices.push(format!("accelerate DeepSpeed: {}", said.join(", ")));
        }
        Ok(sets)
    }
}
