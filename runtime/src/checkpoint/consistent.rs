//! What a checkpoint says about itself must agree: `state.json`'s bytes with the digest written
//! beside it (`state.sha256`), its step with the directory's name (`step-000038`) and with the
//! optimizer's own count of steps. The tensor files' digests only say they are as written; these
//! catch a `state.json` damaged or edited by hand, whose step would otherwise wrap the counter,
//! skip the schedule to a rate of zero, or move the run's own later checkpoints aside. Must not:
//! judge the tensors' values (`finite.rs` does) or decide what to do with a refused checkpoint.

use std::path::Path;

use sha2::{Digest, Sha256};

use super::{CheckpointError, NamedTensors, TrainState, MAX_STATE_FILE};

/// The file beside `state.json` holding its SHA-256 (hex); checkpoints of earlier versions have
/// none, and are taken without it.
pub(super) const STATE_DIGEST_FILE: &str = "state.sha256";

/// The SHA-256 of `state.json`'s bytes, as [`STATE_DIGEST_FILE`] holds it.
pub(super) fn state_digest(json: &[u8]) -> String {
    common::hex(&Sha256::digest(json))
}

/// `state.json`'s bytes (read from `state_path`) against the digest beside them, when there is
/// one.
pub(super) fn check_state_digest(state_path: &Path, json: &[u8]) -> Result<(), CheckpointError> {
    let Some(dir) = state_path.parent() else {
        return Ok(());
    };
    let digest_path = dir.join(STATE_DIGEST_FILE);
    if !digest_path.exists() {
        return Ok(());
    }
    let recorded = common::files::read_input_text(&digest_path, MAX_STATE_FILE)?;
    let actual = state_digest(json);
    if recorded.trim() != actual {
        return Err(CheckpointError::Invalid {
            path: state_path.display().to_string(),
            detail: format!(
                "its sha256 is {} but {STATE_DIGEST_FILE} recorded {}: damaged or edited checkpoint",
                &actual[..12],
                recorded.trim().chars().take(12).collect::<String>()
            ),
        });
    }
    Ok(())
}

/// The state's step against the name of the checkpoint's directory (`step-000038`), when it has
/// one of that form.
pub(super) fn check_step_name(dir: &Path, state: &TrainState) -> Result<(), CheckpointError> {
    let Some(named) = super::step_of(dir) else {
        return Ok(());
    };
    if named != state.step {
        return Err(CheckpointError::Invalid {
            path: dir.join(super::STATE_FILE).display().to_string(),
            detail: format!(
                "says step {} but its directory is {}: edited or moved checkpoint",
                state.step,
                super::step_dir_name(named)
            ),
        });
    }
    Ok(())
}

/// The optimizer's own count of steps (its `step` tensor, as `optim.rs` saves it) against the
/// state's: never fewer (more where the run started from another run's optimizer state, which
/// carries that run's count on). An optimizer file without one (the best model's) says nothing.
pub(super) fn check_optimizer_step(
    path: &Path,
    optimizer: &NamedTensors,
    state: &TrainState,
) -> Result<(), CheckpointError> {
    let Some((_, count)) = optimizer.iter().find(|(name, _)| name == "step") else {
        return Ok(());
    };
    let taken = count
        .f_flatten(0, -1)
        .and_then(|t| t.f_int64_value(&[0]))
        .map_err(|source| CheckpointError::Tensors {
            path: path.display().to_string(),
            source,
        })?;
    if u64::try_from(taken).map_or(true, |taken| taken < state.step) {
        return Err(CheckpointError::Invalid {
            path: path.display().to_string(),
            detail: format!(
                "the optimizer has taken {taken} steps but state.json says {}: edited checkpoint",
                state.step
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::tests::state;
    use super::super::*;
    use tch::Tensor;

    fn model() -> NamedTensors {
        vec![("w".into(), Tensor::from_slice(&[1.0f32, 2.0]))]
    }

    /// An AdamW state as `optim.rs` saves it after `steps` steps.
    fn optimizer(steps: i64) -> NamedTensors {
        vec![
            ("exp_avg.0".into(), Tensor::from_slice(&[0.1f32, 0.2])),
            ("exp_avg_sq.0".into(), Tensor::from_slice(&[0.01f32, 0.02])),
            ("step".into(), Tensor::from_slice(&[steps])),
        ]
    }

    /// Rewrites `state.json` of `path` with `edit` applied, as a hand would; with `keep_digest`
    /// false the digest beside it goes too (an editor who knows to remove it).
    fn edit_state(path: &Path, keep_digest: bool, edit: impl FnOnce(&mut serde_json::Value)) {
        let file = path.join(STATE_FILE);
        let mut json: serde_json::Value =
            serde_json::from_slice(&fs::read(&file).unwrap()).unwrap();
        edit(&mut json);
        fs::write(&file, serde_json::to_vec_pretty(&json).unwrap()).unwrap();
        if !keep_digest {
            fs::remove_file(path.join(STATE_DIGEST_FILE)).unwrap();
        }
    }

    fn refusal(path: &Path) -> String {
        match load(path) {
            Ok(_) => panic!("{} loaded", path.display()),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn a_state_edited_by_hand_is_refused_by_its_digest() {
        let dir = tempfile::tempdir().unwrap();
        let path = save(dir.path(), &model(), &optimizer(38), &state(38), 2).unwrap();
        assert!(path.join(STATE_DIGEST_FILE).is_file());
        load(&path).unwrap();
        edit_state(&path, true, |s| s["epoch"] = 3.into());
        let err = refusal(&path);
        assert!(
            err.contains("state.json: its sha256 is ") && err.contains("but state.sha256 recorded"),
            "{err}"
        );
        assert!(verify(&path).is_err());
    }

    #[test]
    fn a_step_that_disagrees_with_the_directory_is_refused() {
        // The counter wrapped (u64::MAX), the schedule skipped (100000), the run's own later
        // checkpoints moved aside (5): each refused, naming the directory's step.
        for step in [u64::MAX, 100_000, 5] {
            let dir = tempfile::tempdir().unwrap();
            let path = save(dir.path(), &model(), &optimizer(38), &state(38), 2).unwrap();
            edit_state(&path, false, |s| s["step"] = step.into());
            let err = refusal(&path);
            assert!(
                err.contains(&format!(
                    "says step {step} but its directory is step-000038"
                )),
                "{err}"
            );
            let mut skipped = Vec::new();
            assert!(find_latest(dir.path(), &mut skipped).unwrap().is_none());
            assert_eq!(skipped.len(), 1, "{skipped:?}");
        }
    }

    #[test]
    fn a_step_beyond_the_optimizer_s_own_count_is_refused() {
        // Directory renamed to match the edited step: the optimizer still counts 38.
        let dir = tempfile::tempdir().unwrap();
        let path = save(dir.path(), &model(), &optimizer(38), &state(38), 2).unwrap();
        edit_state(&path, false, |s| s["step"] = 100_000.into());
        let renamed = dir.path().join(step_dir_name(100_000));
        fs::rename(&path, &renamed).unwrap();
        let err = refusal(&renamed);
        assert!(
            err.contains("optimizer.safetensors")
                && err.contains("the optimizer has taken 38 steps but state.json says 100000"),
            "{err}"
        );
    }

    #[test]
    fn an_optimizer_that_counts_more_and_earlier_checkpoints_still_load() {
        let dir = tempfile::tempdir().unwrap();
        // Started from another run's optimizer state: its count carries on.
        let path = save(dir.path(), &model(), &optimizer(50), &state(12), 2).unwrap();
        load(&path).unwrap();
        // A checkpoint of an earlier version: no digest beside state.json.
        fs::remove_file(path.join(STATE_DIGEST_FILE)).unwrap();
        load(&path).unwrap();
        // The best model: no optimizer state at all.
        let best = save_linked(&dir.path().join("best"), &path, 12, 1).unwrap();
        assert!(best.join(STATE_DIGEST_FILE).is_file());
        let (_, optim, st) = load(&best).unwrap();
        assert!(optim.is_empty());
        assert_eq!(st.step, 12);
    }
}
