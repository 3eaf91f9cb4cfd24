//! [`Config::validate`]: the one place where field values are checked.

use super::*;

impl Config {
    /// Semantic checks that need no world size: the one place where field values are checked,
    /// section by section.
    ///
    /// Errors carry [`Location::Unknown`]; [`Config::parse`] fills in where the value came from.
    pub fn validate(&self) -> Result<(), ConfigError> {
        check_run(&self.run)?;
        check_data(&self.data)?;
        check_model(&self.model)?;
        check_eval(&self.eval)?;
        check_train(&self.train)?;
        check_loss(&self.train, &self.model)?;
        self.batch.check().map_err(|source| ConfigError::Batch {
            at: Location::Unknown,
            source: Box::new(source),
        })?;
        check_dist(&self.dist)?;
        check_checkpoint(&self.checkpoint)
    }
}

/// `[run]`: a plain directory name and an output directory.
fn check_run(run: &RunConfig) -> Result<(), ConfigError> {
    if run.name.is_empty() {
        return Err(ConfigError::invalid("run.name", "must not be empty"));
    }
    if run.name == "."
        || run.name == ".."
        || run.name.contains(['/', '\\', '\0'])
        || run.name.trim() != run.name
    {
        return Err(ConfigError::invalid(
            "run.name",
            format!(
                "must be a plain directory name (no `/`, `\\`, surrounding spaces, not `.` or `..`) (got {:?})",
                run.name
            ),
        ));
    }
    if run.output_dir.as_os_str().is_empty() {
        return Err(ConfigError::invalid("run.output_dir", "must not be empty"));
    }
    Ok(())
}

/// `[data]`.
fn check_data(data: &DataConfig) -> Result<(), ConfigError> {
    if data.dir.as_ref().is_some_and(|d| d.as_os_str().is_empty()) {
        return Err(ConfigError::invalid(
            "data.dir",
            "must not be empty (leave it out to generate synthetic data)",
        ));
    }
    if !(1..=5).contains(&data.min_rating) {
        return Err(ConfigError::invalid(
            "data.min_rating",
            format!("must be between 1 and 5 (got {})", data.min_rating),
        ));
    }
    for (key, share) in [
        ("data.cold_items", data.cold_items),
        ("data.cold_users", data.cold_users),
    ] {
        if !(0.0..=0.5).contains(&share) {
            return Err(ConfigError::invalid(
                key,
                format!("must be a share between 0 and 0.5 (got {share})"),
            ));
        }
    }
    Ok(())
}

/// `[model]`, including settings that contradict each other.
fn check_model(model: &ModelConfig) -> Result<(), ConfigError> {
    check_at_least_one("model.embedding_dim", model.embedding_dim)?;
    if model
        .gpt2_weights
        .as_ref()
        .is_some_and(|p| p.as_os_str().is_empty())
    {
        return Err(ConfigError::invalid(
            "model.gpt2_weights",
            "must not be empty (leave it out for random initialisation)",
        ));
    }

    check_non_negative("model.l2", model.l2)?;
    check_non_negative("model.text_l2", model.text_l2)?;
    check_history_dropout(model)?;
    check_preset_limits(model)?;
    if model.trainable_layers.is_some() && model.freeze_gpt2 {
        return Err(ConfigError::invalid(
            "model.trainable_layers",
            "contradicts model.freeze_gpt2 = true; set one of them",
        ));
    }
    check_dynamic_only(model)
}

/// `model.history_dropout` (a share below 1) and `model.item_item`: only where a history is
/// pooled.
fn check_history_dropout(model: &ModelConfig) -> Result<(), ConfigError> {
    let p = model.history_dropout;
    if !(0.0..1.0).contains(&p) {
        return Err(ConfigError::invalid(
            "model.history_dropout",
            format!("must be at least 0 and below 1 (got {p})"),
        ));
    }
    if p > 0.0 && model.user_tower == UserTower::Id {
        return Err(ConfigError::invalid(
            "model.history_dropout",
            "does nothing: model.user_tower is \"id\" (no history is pooled); remove it",
        ));
    }
    if model.item_item && model.user_tower == UserTower::Id {
        return Err(ConfigError::invalid(
            "model.item_item",
            "pools a user's history: set model.user_tower = \"history\" or \"both\"",
        ));
    }
    Ok(())
}

/// `model.max_text_tokens` and `model.trainable_layers` within what GPT-2 has (its positions
/// and blocks: the preset's, or a model directory's `config.json`); GPT-2's 1024 positions
/// bound the tokens whatever the model.
fn check_preset_limits(model: &ModelConfig) -> Result<(), ConfigError> {
    let gpt2rec = model.kind == ModelKind::Gpt2rec;
    let dims = if gpt2rec {
        model.gpt2_dims()?
    } else {
        crate::memory::Gpt2Dims::of(model.preset)
    };
    let gpt2 = model.gpt2_name();
    let (positions, whose) = if gpt2rec {
        (dims.n_positions as usize, format!("{gpt2}'s"))
    } else {
        (1024, "GPT-2's".to_string())
    };
    if model.max_text_tokens < 1 || model.max_text_tokens > positions {
        return Err(ConfigError::invalid(
            "model.max_text_tokens",
            format!(
                "must be between 1 and {positions} ({whose} positions) (got {})",
                model.max_text_tokens
            ),
        ));
    }
    match model.trainable_layers {
        Some(n) if u64::from(n) > dims.n_layer => Err(ConfigError::invalid(
            "model.trainable_layers",
            format!("is {n}, but {gpt2} has {} blocks", dims.n_layer),
        )),
        _ => Ok(()),
    }
}

/// Settings that act only while GPT-2 trains (`gpt2rec` with dynamic text) are refused where
/// they would do nothing, rather than accepted silently.
fn check_dynamic_only(model: &ModelConfig) -> Result<(), ConfigError> {
    let idle = if model.kind != ModelKind::Gpt2rec {
        Some("model.kind is not \"gpt2rec\"")
    } else if model.text_mode != TextMode::Dynamic {
        Some("model.text_mode is \"cached\" (GPT-2 stays frozen, its features computed once; \"dynamic\" trains it)")
    } else {
        None
    };
    let set = [
        ("model.trainable_layers", model.trainable_layers.is_some()),
        ("model.freeze_gpt2", model.freeze_gpt2),
    ];
    if let (Some(why), Some((key, _))) = (idle, set.iter().find(|(_, set)| *set)) {
        return Err(ConfigError::invalid(
            key,
            format!("does nothing: {why}; remove it"),
        ));
    }
    if model.activation_checkpointing {
        let nothing = if idle.is_some() {
            idle
        } else if model.freeze_gpt2 || model.trainable_layers == Some(0) {
            Some("no GPT-2 block trains (a frozen block keeps no activations)")
        } else {
            None
        };
        if let Some(why) = nothing {
            return Err(ConfigError::invalid(
                "model.activation_checkpointing",
                format!("has nothing to checkpoint: {why}; remove it"),
            ));
        }
    }
    Ok(())
}

/// `[eval]`: the cut-offs and the metric that picks the best model.
fn check_eval(eval: &EvalConfig) -> Result<(), ConfigError> {
    if eval.topk.is_empty() {
        return Err(ConfigError::invalid(
            "eval.topk",
            "must list at least one cut-off, e.g. [10, 20]",
        ));
    }
    for (i, &k) in eval.topk.iter().enumerate() {
        if k < 1 {
            return Err(ConfigError::invalid(
                "eval.topk",
                format!("cut-offs must be >= 1 (got {k})"),
            ));
        }
        if eval.topk[..i].contains(&k) {
            return Err(ConfigError::invalid(
                "eval.topk",
                format!("lists {k} twice"),
            ));
        }
    }
    check_at_least_one("eval.every_n_epochs", eval.every_n_epochs)?;
    check_at_least_one("eval.batch_users", eval.batch_users)?;
    if !(eval.ease_reg.is_finite() && eval.ease_reg >= 0.0) {
        return Err(ConfigError::invalid(
            "eval.ease_reg",
            format!(
                "must be >= 0 and finite (got {}); 0 leaves the EASE baseline out",
                eval.ease_reg
            ),
        ));
    }
    parse_metric(&eval.metric, &eval.topk)
        .map_err(|why| ConfigError::invalid("eval.metric", why))?;
    Ok(())
}

/// `[train]`.
fn check_train(train: &TrainConfig) -> Result<(), ConfigError> {
    check_at_least_one("train.epochs", train.epochs)?;
    check_positive("train.lr", train.lr)?;
    check_non_negative("train.weight_decay", train.weight_decay)?;
    check_positive("train.max_grad_norm", train.max_grad_norm)?;
    if !train.min_lr.is_finite() || train.min_lr < 0.0 || train.min_lr > train.lr {
        return Err(ConfigError::invalid(
            "train.min_lr",
            format!(
                "must be >= 0 and <= train.lr {} (got {})",
                train.lr, train.min_lr
            ),
        ));
    }
    Ok(())
}

/// `train.loss` and the keys that only the softmax reads.
fn check_loss(train: &TrainConfig, model: &ModelConfig) -> Result<(), ConfigError> {
    check_non_negative("train.negative_power", train.negative_power)?;
    let softmax = train.loss == LossKind::Softmax;
    let idle = [
        ("train.negatives", train.negatives != 0, !softmax),
        (
            "train.negative_power",
            train.negative_power != 0.0,
            !softmax || train.negatives == 0,
        ),
    ];
    if let Some((key, _, _)) = idle.iter().find(|(_, set, idle)| *set && *idle) {
        let why = if softmax {
            "train.negatives = 0 ranks against every item (nothing is drawn)"
        } else {
            "train.loss is \"bpr\" (one negative per positive)"
        };
        return Err(ConfigError::invalid(
            key,
            format!("does nothing: {why}; remove it"),
        ));
    }
    let dynamic = model.kind == ModelKind::Gpt2rec && model.text_mode == TextMode::Dynamic;
    if softmax && train.negatives == 0 && dynamic {
        return Err(ConfigError::invalid(
            "train.negatives",
            "= 0 (the full softmax) would run GPT-2 over every item's text in every micro-batch in dynamic text mode: set a number of shared negatives (train.negatives = 256, say) or train.loss = \"bpr\"",
        ));
    }
    Ok(())
}

/// `[dist]`.
fn check_dist(dist: &DistConfig) -> Result<(), ConfigError> {
    check_at_least_one("dist.timeout_s", dist.timeout_s)?;
    if let Some(secs) = dist.rendezvous_timeout_s {
        check_at_least_one("dist.rendezvous_timeout_s", secs)?;
    }
    check_positive("dist.bucket_mb", dist.bucket_mb)?;
    if let ZeroStage::Stage(stage) = dist.zero {
        if !ZeroStage::BUILT.contains(&stage) {
            return Err(ConfigError::invalid(
                "dist.zero",
                format!(
                    "must be 0, 1, 2, 3 or \"auto\" (got {stage}): stage 1 shards AdamW's moments, stage 2 also the gradients, stage 3 also the parameters"
                ),
            ));
        }
    }
    Ok(())
}

/// `[checkpoint]`.
fn check_checkpoint(checkpoint: &CheckpointConfig) -> Result<(), ConfigError> {
    check_at_least_one("checkpoint.keep", checkpoint.keep)?;
    if checkpoint.resume.trim().is_empty() {
        return Err(ConfigError::invalid(
            "checkpoint.resume",
            "must be \"auto\", \"never\" or a checkpoint path",
        ));
    }
    Ok(())
}

pub(super) fn check_positive(key: &str, value: f64) -> Result<(), ConfigError> {
    if !value.is_finite() {
        return Err(ConfigError::invalid(
            key,
            format!("must be a finite number > 0 (got {value})"),
        ));
    }
    if value <= 0.0 {
        return Err(ConfigError::invalid(
            key,
            format!("must be > 0 (got {value})"),
        ));
    }
    Ok(())
}

/// `value` must be a finite number >= 0.
fn check_non_negative(key: &str, value: f64) -> Result<(), ConfigError> {
    if !value.is_finite() || value < 0.0 {
        return Err(ConfigError::invalid(
            key,
            format!("must be >= 0 and finite (got {value})"),
        ));
    }
    Ok(())
}

/// A count or size that must be at least 1.
fn check_at_least_one<T>(key: &str, value: T) -> Result<(), ConfigError>
where
    T: PartialOrd + From<u8> + std::fmt::Display,
{
    if value < T::from(1) {
        return Err(ConfigError::invalid(
            key,
            format!("must be >= 1 (got {value})"),
        ));
    }
    Ok(())
}
