//! Which rank is slow: every rank's time per step split into compute, data, collectives and
//! the update, gathered at the end of a run, and the straggler named — the rank whose own work
//! takes markedly longer than the others' (who then wait for it in every all-reduce). It must
//! not decide anything about the run: it only reports.

use std::time::Duration;

use runtime::collective::{Collective, OpContext};
use runtime::ddp::StepTime;
use tch::Tensor;

use super::TrainError;

/// A rank is a straggler when its own work per step is at least this many times the median of
/// the others'...
const SLOWER_BY: f64 = 1.25;
/// ...and longer by at least this much: below it, scheduling noise. On a loaded 2-core host a
/// rank of a 1.4 ms step was named for 0.3 ms that other processes took from it; a millisecond
/// a step is what a user would notice.
const AT_LEAST_MS: f64 = 1.0;

/// One rank's mean time per optimizer step (milliseconds).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RankTime {
    /// Forward and backward passes (without the data).
    pub compute_ms: f64,
    /// Assembling the micro-batches (sampling negatives, building tensors).
    pub data_ms: f64,
    /// Inside collectives: moving gradients and waiting for the other ranks.
    pub collective_ms: f64,
    /// Touched-row masks, clipping and the optimizer update.
    pub update_ms: f64,
}

impl RankTime {
    /// The mean over `steps` of the summed `time`, with `data` (part of the engine's compute)
    /// moved to its own column.
    pub fn per_step(time: StepTime, data: Duration, steps: u64) -> RankTime {
        let ms = |d: Duration| d.as_secs_f64() * 1000.0 / steps.max(1) as f64;
        RankTime {
            compute_ms: ms(time.compute.saturating_sub(data)),
            data_ms: ms(data),
            collective_ms: ms(time.collective),
            update_ms: ms(time.update),
        }
    }

    /// What the rank does itself (everything but waiting in collectives).
    pub fn own_ms(&self) -> f64 {
        self.compute_ms + self.data_ms + self.update_ms
    }

    fn to_array(self) -> [f64; 4] {
        [
            self.compute_ms,
            self.data_ms,
            self.collective_ms,
            self.update_ms,
        ]
    }
}

/// Every rank's [`RankTime`], in rank order (a collective: every rank calls it).
pub fn gather(
    comm: &mut dyn Collective,
    mine: RankTime,
    ctx: OpContext,
) -> Result<Vec<RankTime>, TrainError> {
    let all = comm.all_gather(&Tensor::from_slice(&mine.to_array()), ctx)?;
    all.iter()
        .map(|t| {
            let v = Vec::<f64>::try_from(t)?;
            Ok(RankTime {
                compute_ms: v[0],
                data_ms: v[1],
                collective_ms: v[2],
                update_ms: v[3],
            })
        })
        .collect()
}

/// The slowest rank, if it is a straggler: `(rank, its own ms/step, the others' median)`.
pub fn straggler(times: &[RankTime]) -> Option<(usize, f64, f64)> {
    let (rank, slowest) = times
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.own_ms().total_cmp(&b.1.own_ms()))?;
    let mut others: Vec<f64> = times
        .iter()
        .enumerate()
        .filter(|(r, _)| *r != rank)
        .map(|(_, t)| t.own_ms())
        .collect();
    if others.is_empty() {
        return None;
    }
    others.sort_by(f64::total_cmp);
    let median = others[others.len() / 2];
    let own = slowest.own_ms();
    (own >= SLOWER_BY * median && own - median >= AT_LEAST_MS).then_some((rank, own, median))
}

/// The summary's lines: a row per rank, then the straggler, if any. On a GPU the phases are
/// timed on the host, which does not wait for queued kernels: their time shows up in the phase
/// that first waits for them (on an H100, "collectives" held 55 ms of a GPT-2 backward at world
/// 1), and the header says so.
pub fn lines(times: &[RankTime], on_gpu: bool) -> Vec<String> {
    if times.is_empty() {
        return Vec::new(); // no step taken: nothing to show
    }
    let clock = if on_gpu {
        "ms on the host; GPU work counts where the host waits for it"
    } else {
        "ms"
    };
    let mut lines = vec![format!(
        "  time per step by rank ({clock}): compute, data, collectives, update"
    )];
    for (rank, t) in times.iter().enumerate() {
        lines.push(format!(
            "    rank {rank}: {:.2}, {:.2}, {:.2}, {:.2}",
            t.compute_ms, t.data_ms, t.collective_ms, t.update_ms
        ));
    }
    if let Some((rank, own, median)) = straggler(times) {
        lines.push(format!(
            "  straggler: rank {rank} works {own:.2} ms per step against the others' {median:.2} ({:.1}x); they wait for it in every all-reduce",
            own / median.max(1e-9)
        ));
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(compute_ms: f64, collective_ms: f64) -> RankTime {
        RankTime {
            compute_ms,
            data_ms: 0.1,
            collective_ms,
            update_ms: 0.4,
        }
    }

    #[test]
    fn names_the_rank_that_works_markedly_longer() {
        let times = [t(1.0, 2.0), t(1.1, 1.9), t(3.0, 0.1), t(0.9, 2.1)];
        let (rank, own, median) = straggler(&times).unwrap();
        assert_eq!(rank, 2);
        assert!((own - 3.5).abs() < 1e-9 && (median - 1.5).abs() < 1e-9);
        assert!(lines(&times, false).last().unwrap().starts_with(
            "  straggler: rank 2 works 3.50 ms per step against the others' 1.50 (2.3x)"
        ));
    }

    #[test]
    fn no_straggler_when_ranks_are_close_or_alone() {
        assert_eq!(straggler(&[t(1.0, 0.3), t(1.2, 0.1)]), None);
        // 2x, but by less than the noise floor.
        assert_eq!(straggler(&[t(0.05, 0.0), t(0.2, 0.0)]), None);
        // A loaded host's scheduling noise on a 1.4 ms step (seen in CI): 1.3x, 0.35 ms.
        assert_eq!(straggler(&[t(0.6, 0.3), t(0.95, 0.1)]), None);
        assert_eq!(straggler(&[t(5.0, 0.0)]), None);
        assert_eq!(lines(&[t(1.0, 0.3), t(1.2, 0.1)], false).len(), 3);
        let header = |on_gpu| lines(&[t(1.0, 0.3)], on_gpu)[0].clone();
        assert_eq!(
            header(false),
            "  time per step by rank (ms): compute, data, collectives, update"
        );
        assert!(
            header(true).contains("(ms on the host; GPU work counts where the host waits for it)")
        );
    }

    #[test]
    fn data_is_taken_out_of_compute() {
        let time = StepTime {
            compute: Duration::from_millis(40),
            collective: Duration::from_millis(10),
            update: Duration::from_millis(6),
        };
        let r = RankTime::per_step(time, Duration::from_millis(8), 4);
        assert_eq!(
            r,
            RankTime {
                compute_ms: 8.0,
                data_ms: 2.0,
                collective_ms: 2.5,
                update_ms: 1.5
            }
        );
    }
}
