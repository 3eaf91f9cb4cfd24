//! accelerate's DeepSpeed flags on `launch`'s command line, as `accelerate launch` takes them.
//! Owns their parsing and their checks (a stage 0-3, a device among accelerate's); what they
//! do is `accelerate::deepspeed`'s.

/// The DeepSpeed flags of an accelerate line (with `--use_deepspeed`, or the config file's
/// `distributed_type: DEEPSPEED`).
#[derive(Debug, Default, Clone, PartialEq, clap::Args)]
pub struct DeepSpeedFlags {
    /// accelerate's `--use_deepspeed`: for a script, `ACCELERATE_USE_DEEPSPEED=true` and the
    /// DeepSpeed flags below as accelerate's variables; for our worker, those flags as its
    /// config keys (`dist.zero`, `dist.offload`, `batch.grad_accum`, `train.max_grad_norm`).
    #[arg(long = "use_deepspeed", alias = "use-deepspeed")]
    pub use_deepspeed: bool,

    /// accelerate's `--zero_stage` (with `--use_deepspeed`): `dist.zero` of our worker.
    #[arg(long = "zero_stage", alias = "zero-stage", value_name = "N", value_parser = clap::value_parser!(u8).range(0..=3))]
    pub zero_stage: Option<u8>,

    /// accelerate's `--offload_optimizer_device` (`none`, `cpu`, `nvme`): `cpu` is our
    /// worker's `dist.offload = "optimizer"`.
    #[arg(long = "offload_optimizer_device", alias = "offload-optimizer-device", value_name = "DEVICE", value_parser = ["none", "cpu", "nvme"], ignore_case = true)]
    pub offload_optimizer_device: Option<String>,

    /// accelerate's `--offload_param_device` (`none`, `cpu`, `nvme`): for a script; our
    /// worker does not offload parameters (a line says so).
    #[arg(long = "offload_param_device", alias = "offload-param-device", value_name = "DEVICE", value_parser = ["none", "cpu", "nvme"], ignore_case = true)]
    pub offload_param_device: Option<String>,

    /// accelerate's `--gradient_accumulation_steps` (DeepSpeed's): `batch.grad_accum` of our
    /// worker.
    #[arg(long = "gradient_accumulation_steps", alias = "gradient-accumulation-steps", value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub gradient_accumulation_steps: Option<u64>,

    /// accelerate's `--gradient_clipping` (DeepSpeed's): `train.max_grad_norm` of our worker.
    #[arg(
        long = "gradient_clipping",
        alias = "gradient-clipping",
        value_name = "NORM"
    )]
    pub gradient_clipping: Option<f64>,

    /// accelerate's `--zero3_init_flag` (`true`, `false`): for a script.
    #[arg(
        long = "zero3_init_flag",
        alias = "zero3-init-flag",
        value_name = "BOOL"
    )]
    pub zero3_init_flag: Option<String>,

    /// accelerate's `--zero3_save_16bit_model` (`true`, `false`): for a script.
    #[arg(
        long = "zero3_save_16bit_model",
        alias = "zero3-save-16bit-model",
        value_name = "BOOL"
    )]
    pub zero3_save_16bit_model: Option<String>,

    /// accelerate's `--deepspeed_config_file`: `ACCELERATE_DEEPSPEED_CONFIG_FILE` for a
    /// script; our worker does not read it (a line says so).
    #[arg(
        long = "deepspeed_config_file",
        alias = "deepspeed-config-file",
        value_name = "PATH"
    )]
    pub deepspeed_config_file: Option<String>,

    /// accelerate's `--deepspeed_moe_layer_cls_names`: `ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES`
    /// for a script.
    #[arg(
        long = "deepspeed_moe_layer_cls_names",
        alias = "deepspeed-moe-layer-cls-names",
        value_name = "NAMES"
    )]
    pub deepspeed_moe_layer_cls_names: Option<String>,

    /// accelerate's launcher-side DeepSpeed flags (`--offload_optimizer_nvme_path`,
    /// `--offload_param_nvme_path`, `--deepspeed_multinode_launcher`, `--deepspeed_hostfile`,
    /// `--deepspeed_inclusion_filter`, `--deepspeed_exclusion_filter`): accepted, a line says
    /// they are not applied (launch starts the workers itself: `--hostfile`, `--include`,
    /// `--exclude`).
    #[command(flatten)]
    pub launcher_side: LauncherSide,
}

/// accelerate's DeepSpeed flags for its own launcher or config generation, by name.
#[derive(Debug, Default, Clone, PartialEq, clap::Args)]
pub struct LauncherSide {
    /// accelerate's `--offload_optimizer_nvme_path`: not applied (a line says so).
    #[arg(
        long = "offload_optimizer_nvme_path",
        alias = "offload-optimizer-nvme-path",
        value_name = "PATH"
    )]
    pub offload_optimizer_nvme_path: Option<String>,
    /// accelerate's `--offload_param_nvme_path`: not applied (a line says so).
    #[arg(
        long = "offload_param_nvme_path",
        alias = "offload-param-nvme-path",
        value_name = "PATH"
    )]
    pub offload_param_nvme_path: Option<String>,
    /// accelerate's `--deepspeed_multinode_launcher`: not applied (launch is the launcher).
    #[arg(
        long = "deepspeed_multinode_launcher",
        alias = "deepspeed-multinode-launcher",
        value_name = "NAME"
    )]
    pub deepspeed_multinode_launcher: Option<String>,
    /// accelerate's `--deepspeed_hostfile`: not applied (launch's `--hostfile`).
    #[arg(
        long = "deepspeed_hostfile",
        alias = "deepspeed-hostfile",
        value_name = "PATH"
    )]
    pub deepspeed_hostfile: Option<String>,
    /// accelerate's `--deepspeed_inclusion_filter`: not applied (launch's `--include`).
    #[arg(
        long = "deepspeed_inclusion_filter",
        alias = "deepspeed-inclusion-filter",
        value_name = "FILTER"
    )]
    pub deepspeed_inclusion_filter: Option<String>,
    /// accelerate's `--deepspeed_exclusion_filter`: not applied (launch's `--exclude`).
    #[arg(
        long = "deepspeed_exclusion_filter",
        alias = "deepspeed-exclusion-filter",
        value_name = "FILTER"
    )]
    pub deepspeed_exclusion_filter: Option<String>,
}

impl LauncherSide {
    /// The flags given, by name, with their values.
    pub fn given(&self) -> Vec<(&'static str, &str)> {
        [
            (
                "--offload_optimizer_nvme_path",
                &self.offload_optimizer_nvme_path,
            ),
            ("--offload_param_nvme_path", &self.offload_param_nvme_path),
            (
                "--deepspeed_multinode_launcher",
                &self.deepspeed_multinode_launcher,
            ),
            ("--deepspeed_hostfile", &self.deepspeed_hostfile),
            (
                "--deepspeed_inclusion_filter",
                &self.deepspeed_inclusion_filter,
            ),
            (
                "--deepspeed_exclusion_filter",
                &self.deepspeed_exclusion_filter,
            ),
        ]
        .into_iter()
        .filter_map(|(flag, v)| v.as_deref().map(|v| (flag, v)))
        .collect()
    }
}
