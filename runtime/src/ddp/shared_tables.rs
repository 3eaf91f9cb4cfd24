//! Row-sparse tables kept once per host ([`super::DdpConfig::shared_tables`]): every rank's
//! parameter tensor of such a table points at one copy in memory shared by the host's ranks,
//! with the table's two AdamW moments beside it, and each rank's optimizer updates only its
//! share of the rows. After a row-sparse exchange every rank holds the same averaged gradient,
//! so the ranks together take exactly the step each would have taken alone, in 1/N of the time
//! (on embedding tables the update is a large part of a step that the sparse exchange made
//! short); a barrier then ends the step, so that nobody reads a row before its owner wrote it.
//!
//! Owns: the layout of the shared memory, pointing the parameters at it, and which rows each
//! rank updates. Must not: know what the tables mean, or step the optimizer itself.

use std::ops::Range;

use tch::{Device, Kind, Tensor};

use super::DdpError;
use crate::collective::{Collective, OpContext};
use crate::optim::AdamW;

/// Floats between the starts of two arrays: each starts on a 64-byte line.
const ALIGN: usize = 16;

/// One table in shared memory.
struct SharedTable {
    /// Index into the engine's `params`.
    index: usize,
    /// The table's values, in the shared memory.
    value: Tensor,
    /// Its moments' tensors, in the shared memory.
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    /// The rows this rank updates.
    rows: Range<i64>,
}

/// The tables of one engine that live in shared memory.
pub(super) struct SharedTables {
    tables: Vec<SharedTable>,
}

impl SharedTables {
    /// Moves the tables `which` (indices into `params`; 2-D f32 CPU tensors whose values are the
    /// same on every rank) into memory shared by all ranks. `None` when some table is not such a
    /// tensor, or the collective cannot share memory (ranks on several hosts, no shared memory,
    /// a GPU backend): the same answer on every rank.
    pub(super) fn new(
        comm: &mut dyn Collective,
        params: &[Tensor],
        which: &[usize],
        ctx: OpContext,
    ) -> Result<Option<SharedTables>, DdpError> {
        let fits =
            |t: &Tensor| t.device() == Device::Cpu && t.kind() == Kind::Float && t.dim() == 2;
        if which.is_empty() || !which.iter().all(|&i| fits(&params[i])) {
            return Ok(None);
        }
        let slot = |i: usize| params[i].numel().div_ceil(ALIGN) * ALIGN;
        let floats: usize = which.iter().map(|&i| 3 * slot(i)).sum();
        let Some(memory) = comm.host_shared(floats, ctx)? else {
            return Ok(None);
        };
        let (rank, world) = (comm.rank() as i64, comm.world_size() as i64);
        let _guard = tch::no_grad_guard();
        let mut at = 0;
        let mut tables = Vec::with_capacity(which.len());
        let mut values = Vec::with_capacity(which.len());
        for &index in which {
            let size = params[index].size();
            let mut view = || {
                assert!(
                    at + slot(index) <= memory.len(),
                    "the tables overrun their memory"
                );
                // SAFETY: `slot(index)` floats at `at` lie inside the shared memory, which stays
                // mapped until the process exits; the three arrays of each table and the tables
                // do not overlap.
                let t = unsafe {
                    Tensor::f_from_blob(
                        memory.as_ptr().add(at) as *const u8,
                        &size,
                        &[size[1], 1],
                        Kind::Float,
                        Device::Cpu,
                    )
                };
                at += slot(index);
                t
            };
            let (value, exp_avg, exp_avg_sq) = (view()?, view()?, view()?);
            let height = size[0];
            tables.push(SharedTable {
                index,
                value: value.shallow_clone(),
                exp_avg,
                exp_avg_sq,
                rows: height * rank / world..height * (rank + 1) / world,
            });
            values.push(value);
        }
        // Rank 0 fills the tables (the moments start as zeros, as the memory does); everyone
        // points their parameters at them once it has.
        if rank == 0 {
            for (table, value) in tables.iter().zip(&values) {
                value.shallow_clone().f_copy_(&params[table.index])?;
            }
        }
        comm.barrier(ctx)?;
        for (table, value) in tables.iter().zip(&values) {
            params[table.index].shallow_clone().set_data(value);
        }
        Ok(Some(SharedTables { tables }))
    }

    /// Whether `index` (into the engine's `params`) is one of the shared tables.
    pub(super) fn holds(&self, index: usize) -> bool {
        self.tables.iter().any(|t| t.index == index)
    }

    /// Whether `param` (the engine's `params[index]`) reads and writes the shared copy of table
    /// `index`, as every rank's must: one that does not trains alone, unseen by the others.
    pub(super) fn is_shared_copy(&self, index: usize, param: &Tensor) -> bool {
        self.tables
            .iter()
            .find(|t| t.index == index)
            .is_some_and(|t| t.value.data_ptr() == param.data_ptr())
    }

    /// Makes `optimizer` update only this rank's rows of each table, with the moments in the
    /// shared memory (their current values of those rows are copied there). Nothing to do when it
    /// already does.
    pub(super) fn attach(&self, optimizer: &mut AdamW) -> Result<(), DdpError> {
        for t in &self.tables {
            if optimizer.rows_updated(t.index).as_ref() == Some(&t.rows) {
                continue;
            }
            optimizer.update_rows_only(
                t.index,
                t.rows.clone(),
                t.exp_avg.shallow_clone(),
                t.exp_avg_sq.shallow_clone(),
            )?;
        }
        Ok(())
    }
}
