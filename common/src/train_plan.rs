//! The training plan: a config and the batch plan it resolves to for one world size, made once
//! per process — by `launch` to check and show it, by each worker to run it — and then read by
//! everything (the trainer, the memory estimate, the out-of-memory report, the summary) instead
//! of each resolving `[batch]` again or keeping its own copy of the plan.
//!
//! `batch.micro = "auto"` is the one change a plan sees: the worker measures, and
//! [`TrainPlan::with_measured`] gives the plan it found, with `[batch]` rewritten to say so, so
//! that `config.resolved.toml` and a resume run exactly what ran.

use std::path::{Path, PathBuf};

use crate::batch::{BatchError, BatchPlan, BatchSpec};
use crate::config::{Config, ConfigError};

/// A config and its batch plan (`micro x grad_accum x world = global`).
#[derive(Debug, Clone, PartialEq)]
pub struct TrainPlan {
    /// The config file it was read from (for messages).
    pub source: PathBuf,
    pub config: Config,
    pub batch: BatchPlan,
}

/// Why a config gives no plan.
#[derive(Debug, thiserror::Error)]
pub enum TrainPlanError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("{config}: {source}")]
    Batch {
        config: String,
        source: Box<BatchError>,
    },
}

impl TrainPlan {
    /// Reads `path` with `--set` overrides and resolves `[batch]` for `world_size` workers.
    pub fn load(
        path: &Path,
        overrides: &[String],
        world_size: u64,
    ) -> Result<TrainPlan, TrainPlanError> {
        let config = Config::load(path, overrides)?;
        TrainPlan::resolve(path, config, world_size)
    }

    /// Resolves `config`'s `[batch]` for `world_size` workers (`source` names it in errors).
    pub fn resolve(
        source: &Path,
        config: Config,
        world_size: u64,
    ) -> Result<TrainPlan, TrainPlanError> {
        let batch = config
            .batch
            .resolve(world_size)
            .map_err(|e| TrainPlanError::Batch {
                config: source.display().to_string(),
                source: Box::new(e),
            })?;
        Ok(TrainPlan {
            source: source.to_path_buf(),
            config,
            batch,
        })
    }

    /// This plan with `batch` (found by `batch.micro = "auto"`) in place of the configured
    /// one, and `[batch]` saying it in numbers.
    pub fn with_measured(&self, batch: BatchPlan) -> TrainPlan {
        let mut config = self.config.clone();
        config.batch = BatchSpec {
            global: Some(batch.global),
            micro: Some(batch.micro),
            grad_accum: Some(batch.grad_accum),
            ..Default::default()
        };
        TrainPlan {
            source: self.source.clone(),
            config,
            batch,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_measured_plan_is_written_into_the_config() {
        let config = Config {
            batch: BatchSpec {
                global: Some(256),
                micro_auto: true,
                ..Default::default()
            },
            ..Default::default()
        };
        let plan = TrainPlan::resolve(Path::new("x.toml"), config, 2).unwrap();
        let found = BatchPlan::plans_keeping_global(256, 2)
            .into_iter()
            .find(|p| p.micro == 32)
            .unwrap();
        let measured = plan.with_measured(found);
        assert_eq!(measured.batch, found);
        assert!(!measured.config.batch.micro_auto);
        // The written config resolves to the same plan on the same world.
        let again = TrainPlan::resolve(Path::new("x.toml"), measured.config.clone(), 2).unwrap();
        assert_eq!(again.batch, found);
    }

    #[test]
    fn a_batch_that_cannot_be_kept_names_the_file() {
        let config = Config {
            batch: BatchSpec {
                global: Some(10),
                micro: Some(3),
                ..Default::default()
            },
            ..Default::default()
        };
        let e = TrainPlan::resolve(Path::new("configs/x.toml"), config, 2).unwrap_err();
        assert!(e.to_string().starts_with("configs/x.toml: "), "{e}");
    }
}
