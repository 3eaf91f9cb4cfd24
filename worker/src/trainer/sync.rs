//! What every rank does together besides the DDP step: numbers gathered from every rank, JSON
//! broadcast from rank 0, and a checkpoint that rank 0 writes while the others learn whether it
//! succeeded.

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tch::Tensor;

use runtime::checkpoint::{self, TrainState};
use runtime::collective::{Collective, OpContext};
use runtime::ddp::Ddp;

use super::TrainError;

/// One number from every rank, in rank order.
pub fn gather_u64(
    comm: &mut dyn Collective,
    value: u64,
    ctx: OpContext,
) -> Result<Vec<u64>, TrainError> {
    let mine = Tensor::from_slice(&[value.min(i64::MAX as u64) as i64]);
    Ok(comm
        .all_gather(&mine, ctx)?
        .iter()
        .map(|t| t.f_int64_value(&[0]).map(|v| v.max(0) as u64))
        .collect::<Result<Vec<u64>, _>>()?)
}

/// Rank 0 stages the checkpoint and starts making it durable (`saver`); then every rank learns
/// whether that, and the checkpoint before it, succeeded (the exchange is also the barrier that
/// keeps the others from running ahead of it).
pub(super) fn save_checkpoint(
    ddp: &mut Ddp,
    saver: &mut checkpoint::Background,
    optimizer_state: &[(String, Tensor)],
    dir: &Path,
    mut state: TrainState,
    keep: usize,
    ctx: OpContext,
) -> Result<(), TrainError> {
    state.world_size = ddp.world_size() as u64;
    // Rank 0 saves whole parameters (ZeRO stage 3 keeps shards between steps): one format
    // whatever the stage.
    ddp.gather_params()?;
    saved_by_rank_0(
        ddp,
        |ddp| saver.save(dir, &ddp.named_variables(), optimizer_state, &state, keep),
        ctx,
    )
}

/// Rank 0 hands over the model of `from`, a checkpoint of `step` it saved before, into `dir`
/// as a checkpoint whose model file is a link to `from`'s
/// ([`checkpoint::Background::save_linked`]); then every rank learns whether that, and the
/// checkpoint before it, succeeded.
pub(super) fn save_linked(
    ddp: &mut Ddp,
    saver: &mut checkpoint::Background,
    dir: &Path,
    from: &Path,
    step: u64,
    ctx: OpContext,
) -> Result<(), TrainError> {
    saved_by_rank_0(ddp, |_| saver.save_linked(dir, from, step, 1), ctx)
}

/// `save` on rank 0 (nothing elsewhere), then every rank learns whether it failed.
fn saved_by_rank_0(
    ddp: &mut Ddp,
    save: impl FnOnce(&Ddp) -> Result<(), checkpoint::SaveFailed>,
    ctx: OpContext,
) -> Result<(), TrainError> {
    let saved = match ddp.rank() {
        0 => save(ddp),
        _ => Ok(()),
    };
    agree_on_failure(ddp, saved, ctx)
}

/// Every rank waits until rank 0's checkpoints are on disk (`saver`) and learns whether they
/// are.
pub(super) fn checkpoints_on_disk(
    ddp: &mut Ddp,
    saver: &mut checkpoint::Background,
    ctx: OpContext,
) -> Result<(), TrainError> {
    let waited = saver.wait().map(drop);
    agree_on_failure(ddp, waited, ctx)
}

/// Every rank learns whether rank 0 failed: rank 0 with its own error, the others with one
/// that points at it.
fn agree_on_failure(
    ddp: &mut Ddp,
    failure: Result<(), checkpoint::SaveFailed>,
    ctx: OpContext,
) -> Result<(), TrainError> {
    let mut flag = [Tensor::from_slice(&[if failure.is_err() {
        1.0f32
    } else {
        0.0
    }])];
    ddp.comm()
        .all_reduce(&mut flag, runtime::collective::ReduceOp::Sum, ctx)?;
    match failure {
        Err(e) => Err(TrainError::Plan(e.to_string())),
        Ok(()) if flag[0].f_double_value(&[0])? > 0.0 => {
            // Rank 0 has the real error: let it fail first, so the launcher names it as the
            // root cause and stops this rank; give up on our own only if nobody does.
            std::thread::sleep(LEADER_FAILS_FIRST);
            Err(TrainError::Plan(
                "rank 0 could not write a checkpoint (see its message)".into(),
            ))
        }
        Ok(()) => Ok(()),
    }
}

/// How long the other ranks wait for rank 0 to exit after it failed to write a checkpoint.
const LEADER_FAILS_FIRST: Duration = Duration::from_secs(30);

/// The largest JSON message rank 0 broadcasts (a resume decision, a failure text).
const MAX_MESSAGE_BYTES: usize = 16 << 20;

/// Broadcasts a JSON-serialisable value from rank 0 (`Some` there, `None` elsewhere).
pub(super) fn broadcast_json<T: Serialize + for<'de> Deserialize<'de>>(
    comm: &mut dyn Collective,
    value: Option<&T>,
    ctx: OpContext,
) -> Result<T, TrainError> {
    let bytes = match value {
        Some(v) => serde_json::to_vec(v).map_err(|e| TrainError::Plan(e.to_string()))?,
        None => Vec::new(),
    };
    let mut len = [Tensor::from_slice(&[bytes.len() as i64])];
    comm.broadcast(&mut len, 0, ctx)?;
    // Checked before anything is allocated for it.
    let n = usize::try_from(len[0].f_int64_value(&[0])?)
        .ok()
        .filter(|&n| n <= MAX_MESSAGE_BYTES)
        .ok_or_else(|| {
            TrainError::Plan("rank 0 announced a message of an impossible size".into())
        })?;
    let mut data = [if bytes.len() == n {
        Tensor::from_slice(&bytes)
    } else {
        Tensor::zeros([n as i64], (tch::Kind::Uint8, tch::Device::Cpu))
    }];
    comm.broadcast(&mut data, 0, ctx)?;
    let mut received = vec![0u8; n];
    data[0].f_copy_data_u8(&mut received, n)?;
    serde_json::from_slice(&received)
        .map_err(|e| TrainError::Plan(format!("rank 0 sent an unreadable message: {e}")))
}
