//! The cross-rank parameter check (`DdpConfig::check_params_every`): what each rank compares
//! (every variable's checksum, and for memory kept once per host what can still go wrong
//! there), and the message naming what differs and where.

use tch::Tensor;

use super::{Ddp, DdpError};

impl Ddp {
    /// What the parameter check compares across ranks, by name: each variable's checksum; and
    /// for memory kept once per host, which every rank sees alike by construction, what can
    /// still go wrong. A shared table: the averaged gradient each rank updated its rows from
    /// (the same on every rank after a correct exchange) and whether the rank's parameter is the
    /// host's copy. Sharded: whether each parameter and its gradient are the host's memory, and
    /// the rows a table's gradient touched outside the exchange (counted at the check's step).
    fn agreement_entries(&self) -> Result<Vec<(String, Entry)>, DdpError> {
        let mut entries = Vec::with_capacity(self.variables.len());
        // Under ZeRO stage 3 the dense parameters' values exist once, in the ranks' shards:
        // there is no copy to compare (nor values to read between steps).
        let held_once = |name: &String| {
            let zero = self.zero.as_ref().filter(|_| self.gate.is_some());
            let index = self.param_names.iter().position(|n| n == name);
            zero.zip(index).is_some_and(|(z, i)| z.in_bucket(i))
        };
        for (name, p) in self.variables.iter().filter(|(n, _)| !held_once(n)) {
            entries.push((name.clone(), Entry::Same(checksum(p)?)));
        }
        if let Some(shards) = &self.shards {
            let rank = self.rank();
            for (i, (name, param)) in self.param_names.iter().zip(&self.params).enumerate() {
                let here = shards.is_shared_copy(i, param, rank);
                entries.push((name.clone(), Entry::SharedCopy(here)));
            }
            for (table, &count) in self.sparse.iter().zip(&self.left_out) {
                entries.push((table.name.clone(), Entry::LeftOut(count)));
            }
        }
        if let Some(shared) = &self.shared {
            for table in self.sparse.iter().filter(|t| shared.holds(t.index)) {
                let param = &self.params[table.index];
                let grad = param.grad();
                let sum = if grad.defined() { checksum(&grad)? } else { 0 };
                entries.push((format!("{} (its gradient)", table.name), Entry::Same(sum)));
                let here = shared.is_shared_copy(table.index, param);
                entries.push((table.name.clone(), Entry::SharedCopy(here)));
            }
        }
        Ok(entries)
    }

    /// Fails loudly if any rank's parameters differ from the others' (see
    /// [`Ddp::agreement_entries`] for what is compared), naming what differs and where.
    pub fn check_params(&mut self, step: u64) -> Result<(), DdpError> {
        let entries = self.agreement_entries()?;
        let values: Vec<i64> = entries.iter().map(|(_, e)| e.value()).collect();
        let all = self
            .comm
            .all_gather(&Tensor::from_slice(&values), self.ctx(step))?;
        let ranks: Vec<Vec<i64>> = all
            .iter()
            .map(Vec::<i64>::try_from)
            .collect::<Result<_, _>>()?;
        match disagreement(&entries, &ranks) {
            Some(detail) => Err(DdpError::Diverged { step, detail }),
            None => Ok(()),
        }
    }
}

/// One value the parameter check compares across ranks.
#[derive(Debug, Clone, Copy)]
enum Entry {
    /// Must be the same on every rank.
    Same(i64),
    /// Whether this rank's parameter is the host's one copy of a shared table (or, sharded, of
    /// a shared parameter with its gradient in the rank's block): must hold on every rank.
    SharedCopy(bool),
    /// Rows a table's gradient touched that were left out of a sharded step's reduction: must
    /// be 0 on every rank.
    LeftOut(u64),
}

impl Entry {
    fn value(self) -> i64 {
        match self {
            Entry::Same(v) => v,
            Entry::SharedCopy(here) => i64::from(here),
            Entry::LeftOut(count) => count as i64,
        }
    }
}

/// What differs between the ranks' `values` (rank order; each in the order of `entries`), in
/// words: at most three entries, then a count. `None` when they agree.
fn disagreement(entries: &[(String, Entry)], values: &[Vec<i64>]) -> Option<String> {
    let mut found = Vec::new();
    for (i, (name, entry)) in entries.iter().enumerate() {
        let of = |r: usize| values[r].get(i).copied();
        let odd: Vec<String> = (0..values.len())
            .filter(|&r| match entry {
                Entry::Same(_) => of(r) != of(0),
                Entry::SharedCopy(_) => of(r) != Some(1),
                Entry::LeftOut(_) => of(r) != Some(0),
            })
            .map(|r| r.to_string())
            .collect();
        if odd.is_empty() {
            continue;
        }
        found.push(match entry {
            Entry::Same(_) => format!(
                "`{name}` differs from rank 0's on rank(s) {}",
                odd.join(", ")
            ),
            Entry::SharedCopy(_) => format!(
                "`{name}` is not the host's shared copy on rank(s) {}",
                odd.join(", ")
            ),
            Entry::LeftOut(_) => format!(
                "`{name}` has gradient rows the model did not report as used (left out of the exchange) on rank(s) {}",
                odd.join(", ")
            ),
        });
    }
    let more = found.len().saturating_sub(3);
    found.truncate(3);
    (!found.is_empty()).then(|| match more {
        0 => found.join("; "),
        n => format!("{} (and {n} more)", found.join("; ")),
    })
}

/// A checksum of a tensor's bits (FNV-1a over its bytes, so any difference shows).
fn checksum(t: &Tensor) -> Result<i64, DdpError> {
    let t = t
        .f_detach()?
        .f_to_device(tch::Device::Cpu)?
        .f_contiguous()?;
    let n = t.numel();
    let mut bytes = vec![0u8; n * t.f_kind()?.elt_size_in_bytes()];
    t.f_copy_data_u8(&mut bytes, n)?;
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    Ok(hash as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disagreement_names_what_differs_and_where() {
        let entries: Vec<(String, Entry)> = ["a", "b", "c", "d"]
            .iter()
            .map(|n| (n.to_string(), Entry::Same(0)))
            .chain([("t".to_string(), Entry::SharedCopy(true))])
            .collect();
        let same = vec![vec![1, 2, 3, 4, 1]; 3];
        assert_eq!(disagreement(&entries, &same), None);
        let mut odd = same.clone();
        odd[2][1] = 9;
        assert_eq!(
            disagreement(&entries, &odd).unwrap(),
            "`b` differs from rank 0's on rank(s) 2"
        );
        let all_off = vec![vec![1, 2, 3, 4, 0]; 2];
        assert_eq!(
            disagreement(&entries, &all_off).unwrap(),
            "`t` is not the host's shared copy on rank(s) 0, 1"
        );
        let many = vec![vec![0; 5], vec![5, 5, 5, 5, 1]];
        assert_eq!(
            disagreement(&entries, &many).unwrap(),
            "`a` differs from rank 0's on rank(s) 1; `b` differs from rank 0's on rank(s) 1; `c` differs from rank 0's on rank(s) 1 (and 2 more)"
        );
    }
}
