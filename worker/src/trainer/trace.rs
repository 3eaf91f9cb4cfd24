//! `GPTREC_TRACE_SAMPLES=DIR`: each rank appends the dataset indices of every optimizer step
//! to `DIR/trace-<restart>-<rank>.txt` (`epoch step unix_ms i,j,...` per line: the wall time
//! when the step ended), so that a test can
//! check exactly which samples a run trained — across a resume at another world size
//! included, and a benchmark time the restart of a group. A test aid, like the fault
//! variables; nothing reads it back.

use std::io::Write as _;

/// The open trace file of this rank, when tracing was asked for.
pub(super) struct SampleTrace {
    file: std::fs::File,
}

impl SampleTrace {
    /// Opens the file when `GPTREC_TRACE_SAMPLES` is set (a warning, and no trace, when it
    /// cannot be opened).
    pub(super) fn from_env(rank: usize) -> Option<SampleTrace> {
        let dir = std::env::var_os("GPTREC_TRACE_SAMPLES")?;
        let restart = std::env::var("TORCHELASTIC_RESTART_COUNT").unwrap_or_else(|_| "0".into());
        let path = std::path::Path::new(&dir).join(format!("trace-{restart}-{rank}.txt"));
        match std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
        {
            Ok(file) => Some(SampleTrace { file }),
            Err(e) => {
                tracing::warn!("GPTREC_TRACE_SAMPLES: cannot open {}: {e}", path.display());
                None
            }
        }
    }

    /// Records the step taken over `window` (its 1-based number is `step`).
    pub(super) fn record(&mut self, epoch: u64, step: u64, window: &[Vec<usize>]) {
        let indices: Vec<String> = window.iter().flatten().map(usize::to_string).collect();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        let _ = writeln!(self.file, "{epoch} {step} {now} {}", indices.join(","));
    }
}
