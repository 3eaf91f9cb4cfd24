//! Checkpoints on disk (written by rank 0 only): `checkpoints/step-000123/` with
//! `model.safetensors`, `optimizer.safetensors` and `state.json`, written into a temporary
//! directory, fsynced and renamed into place, then `checkpoints/latest` is updated (last). The
//! newest K are kept. A checkpoint is only ever loaded when it is complete: `state.json` records
//! the size and SHA-256 of both tensor files (and `state.sha256` its own), so one left
//! half-written by a crash is skipped, and its step must agree with the directory's name.
//! A commit waits for the disk twice: once for the files (the writeback of all of them started
//! before the first fsync, so that one journal commit covers them) and once for the directory
//! after both renames. A crash before that leaves the previous checkpoint as `latest`; one during it may
//! leave a `latest` that names a missing checkpoint or nothing, which [`find_latest`] reports
//! before taking the newest complete one.
//! This module reads and writes files (reading none that is not a regular file, so a FIFO in a
//! run directory is refused, not waited on); it must not decide when to checkpoint (the trainer
//! does).

use std::fs::{self, File};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tch::Tensor;

mod consistent;
mod finite;

use consistent::STATE_DIGEST_FILE;

const MODEL_FILE: &str = "model.safetensors";
const OPTIMIZER_FILE: &str = "optimizer.safetensors";
const STATE_FILE: &str = "state.json";
const LATEST: &str = "latest";

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {detail}")]
    Invalid { path: String, detail: String },
    #[error("{path}: {source}")]
    Tensors { path: String, source: tch::TchError },
    /// A file that cannot be opened for reading (a FIFO, a device, missing): the message
    /// names it.
    #[error("{0}")]
    Input(#[from] common::files::InputError),
}

/// Largest `state.json` or `latest` read (they are a few KiB).
const MAX_STATE_FILE: u64 = 16 << 20;

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Size and digest of one file of a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileDigest {
    pub bytes: u64,
    pub sha256: String,
}

/// Everything needed to continue a run exactly, besides the tensors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainState {
    /// Epoch in progress (0-based); equal to the epoch count when training finished.
    pub epoch: u64,
    /// Optimizer steps taken in total.
    pub step: u64,
    /// Samples of the global batch stream consumed in `epoch` (position in the sampler).
    pub samples_in_epoch: u64,
    /// Seed of the run (sampler order and initialisation).
    pub seed: u64,
    /// World size and global batch the checkpoint was written with.
    pub world_size: u64,
    pub global_batch: u64,
    /// Fingerprint of the model config; resuming with another model is refused.
    pub model_hash: String,
    /// How the run's random numbers are derived (so that resuming reproduces them).
    #[serde(default)]
    pub rng: String,
    /// Digests of the tensor files, filled in by [`save`].
    #[serde(default)]
    pub files: std::collections::BTreeMap<String, FileDigest>,
    /// What the trainer keeps across a resume besides the position (its best model so far,
    /// early stopping): its own fields, stored next to these in `state.json`; this module does
    /// not read them.
    #[serde(flatten)]
    pub trainer: serde_json::Map<String, serde_json::Value>,
    /// The learning-rate schedule's length in optimizer steps, fixed at the run's first start
    /// (a resume with another world size can change the steps per epoch by one; the schedule
    /// keeps its length). Absent in checkpoints of older versions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule_steps: Option<u64>,
}

/// Writes checkpoint `step` under `dir` atomically, points `latest` at it and keeps the newest
/// `keep` checkpoints. Returns its directory. On failure (a full disk) the temporary directory
/// is removed again: nothing half-written stays behind.
pub fn save(
    dir: &Path,
    model: &[(String, Tensor)],
    optimizer: &[(String, Tensor)],
    state: &TrainState,
    keep: usize,
) -> Result<PathBuf, CheckpointError> {
    stage(dir, model, optimizer, state)?.commit(keep)
}

/// The name of the directory of the checkpoint of `step` (`step-000123`).
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:06}")
}

/// Saves into `dir` the model of the complete checkpoint `from` (of `step`) as a checkpoint of
/// its own, without optimizer state (an empty file), as the best model is kept: the model file
/// is a hard link to `from`'s (a copy where the file system makes none), so it is not written
/// or hashed again; `from`'s state is kept but for the optimizer file's digest. Committed as
/// [`save`] commits; its directory.
pub fn save_linked(
    dir: &Path,
    from: &Path,
    step: u64,
    keep: usize,
) -> Result<PathBuf, CheckpointError> {
    let staged = Staged::new(dir, step)?;
    if let Err(e) = staged.link_model_of(from) {
        let _ = fs::remove_dir_all(&staged.tmp);
        return Err(e);
    }
    staged.commit(keep)
}

/// `to` as a hard link to `from`; a copy only where the file system cannot link them (another
/// file system, no links, too many): any other failure (`to` exists) is an error, never a
/// copy over a file another checkpoint may share.
fn link_or_copy(from: &Path, to: &Path) -> Result<(), CheckpointError> {
    let Err(e) = fs::hard_link(from, to) else {
        return Ok(());
    };
    let unlinkable = [libc::EXDEV, libc::EPERM, libc::EOPNOTSUPP, libc::EMLINK];
    if !e
        .raw_os_error()
        .is_some_and(|code| unlinkable.contains(&code))
    {
        return Err(io_err(to)(e));
    }
    fs::copy(from, to).map(drop).map_err(io_err(from))
}

/// A checkpoint written into its temporary directory, not yet synced or in place: the tensors
/// as they were when it was staged, whatever happens to them afterwards.
pub struct Staged {
    dir: PathBuf,
    tmp: PathBuf,
    name: String,
    step: u64,
}

/// [`save`]'s first half: the files written into a temporary directory (in the page cache,
/// not synced), their digests in `state.json`.
pub fn stage(
    dir: &Path,
    model: &[(String, Tensor)],
    optimizer: &[(String, Tensor)],
    state: &TrainState,
) -> Result<Staged, CheckpointError> {
    let staged = Staged::new(dir, state.step)?;
    match staged.write_files(model, optimizer, state) {
        Ok(()) => Ok(staged),
        Err(e) => {
            let _ = fs::remove_dir_all(&staged.tmp);
            Err(e)
        }
    }
}

impl Staged {
    /// A new temporary directory in `dir` for the checkpoint of `step`.
    fn new(dir: &Path, step: u64) -> Result<Staged, CheckpointError> {
        fs::create_dir_all(dir).map_err(io_err(dir))?;
        let name = step_dir_name(step);
        // Unique within the process too: two checkpoints of one step may wait to be committed.
        static STAGED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let seq = STAGED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(Staged {
            tmp: dir.join(format!(".tmp-{name}-{}-{seq}", std::process::id())),
            dir: dir.to_path_buf(),
            name,
            step,
        })
    }

    /// [`save`]'s second half: the files synced, renamed into place, `latest` updated, the
    /// newest `keep` kept. Its directory; on failure the temporary directory is removed.
    pub fn commit(self, keep: usize) -> Result<PathBuf, CheckpointError> {
        let committed = self.put_in_place();
        if committed.is_err() {
            let _ = fs::remove_dir_all(&self.tmp);
            let _ = fs::remove_file(self.dir.join(format!(".{LATEST}.tmp")));
        }
        let final_dir = committed?;
        prune(&self.dir, keep, self.step)?;
        Ok(final_dir)
    }

    fn write_files(
        &self,
        model: &[(String, Tensor)],
        optimizer: &[(String, Tensor)],
        state: &TrainState,
    ) -> Result<(), CheckpointError> {
        self.fresh_tmp()?;
        let mut state = state.clone();
        for (file, tensors) in [(MODEL_FILE, model), (OPTIMIZER_FILE, optimizer)] {
            let path = self.tmp.join(file);
            let failed = |source| CheckpointError::Tensors {
                path: path.display().to_string(),
                source,
            };
            // safetensors takes contiguous tensors only (a copy in memory is one already).
            let contiguous = tensors
                .iter()
                .map(|(name, t)| Ok((name.clone(), t.f_contiguous()?)))
                .collect::<Result<Vec<_>, tch::TchError>>()
                .map_err(failed)?;
            Tensor::write_safetensors(&contiguous, &path).map_err(failed)?;
            state.files.insert(file.to_string(), digest(&path)?);
        }
        self.write_state(&state)
    }

    /// The model file of the complete checkpoint `from` linked in (see [`save_linked`]), an
    /// empty optimizer file, and `from`'s state with that file's digest.
    fn link_model_of(&self, from: &Path) -> Result<(), CheckpointError> {
        self.fresh_tmp()?;
        let mut state = read_state(from)?;
        link_or_copy(&from.join(MODEL_FILE), &self.tmp.join(MODEL_FILE))?;
        let path = self.tmp.join(OPTIMIZER_FILE);
        Tensor::write_safetensors::<&str, Tensor, _>(&[], &path).map_err(|source| {
            CheckpointError::Tensors {
                path: path.display().to_string(),
                source,
            }
        })?;
        state
            .files
            .insert(OPTIMIZER_FILE.to_string(), digest(&path)?);
        self.write_state(&state)
    }

    /// The temporary directory, empty (a leftover of the same name removed first).
    fn fresh_tmp(&self) -> Result<(), CheckpointError> {
        let tmp = &self.tmp;
        if tmp.exists() {
            fs::remove_dir_all(tmp).map_err(io_err(tmp))?;
        }
        fs::create_dir_all(tmp).map_err(io_err(tmp))
    }

    /// `state.json`, and its digest beside it (`state.sha256`).
    fn write_state(&self, state: &TrainState) -> Result<(), CheckpointError> {
        let state_path = self.tmp.join(STATE_FILE);
        let json = serde_json::to_vec_pretty(state).map_err(|e| CheckpointError::Invalid {
            path: state_path.display().to_string(),
            detail: e.to_string(),
        })?;
        fs::write(&state_path, &json).map_err(io_err(&state_path))?;
        let digest_path = self.tmp.join(STATE_DIGEST_FILE);
        let digest = format!("{}\n", consistent::state_digest(&json));
        fs::write(&digest_path, digest).map_err(io_err(&digest_path))
    }

    /// The staged files synced, then renamed into place, then `latest`, with one sync of the
    /// directory for both renames (see the module doc for what a crash leaves).
    fn put_in_place(&self) -> Result<PathBuf, CheckpointError> {
        let (dir, tmp, name) = (&self.dir, &self.tmp, &self.name);
        let files = [MODEL_FILE, OPTIMIZER_FILE, STATE_FILE, STATE_DIGEST_FILE]
            .map(|name| tmp.join(name))
            .into_iter()
            .map(|path| File::open(&path).map(|file| (file, path)))
            .collect::<std::io::Result<Vec<_>>>()
            .map_err(io_err(tmp))?;
        // All three on their way to the disk before the first fsync waits: one journal commit
        // then covers them (here, on the committing thread: starting writeback can block).
        files.iter().for_each(|(file, _)| start_writeback(file));
        for (file, path) in &files {
            file.sync_all().map_err(io_err(path))?;
        }
        sync_dir(tmp)?;
        let final_dir = dir.join(name);
        // Replacing a checkpoint of the same step: move the old one aside first, so that a crash
        // at any moment leaves one complete copy.
        let aside = dir.join(format!(".old-{name}-{}", std::process::id()));
        let replaced = final_dir.exists();
        if replaced {
            fs::rename(&final_dir, &aside).map_err(io_err(&final_dir))?;
        }
        fs::rename(tmp, &final_dir).map_err(io_err(&final_dir))?;
        // `latest` last, itself replaced atomically; not synced on its own: a `latest` lost or
        // emptied by a crash only makes `find_latest` report it and take the newest complete
        // checkpoint, which this one is once the directory is synced.
        let latest_tmp = dir.join(format!(".{LATEST}.tmp"));
        fs::write(&latest_tmp, format!("{name}\n")).map_err(io_err(&latest_tmp))?;
        fs::rename(&latest_tmp, dir.join(LATEST)).map_err(io_err(dir))?;
        sync_dir(dir)?;
        if replaced {
            fs::remove_dir_all(&aside).map_err(io_err(&aside))?;
        }
        Ok(final_dir)
    }
}

/// Checkpoints made durable on a thread of their own, while training goes on: [`save`] there
/// waits for each file to reach the disk (fsync) several times, milliseconds a checkpoint that
/// nothing else needs to wait for. Each [`Background::save`] keeps the tensors as they are then
/// (a copy in memory when they are small, [`Background::COPY_BELOW`]; the files staged at once
/// otherwise) and hands them to one committing thread, which writes what is left and puts each
/// checkpoint in place in the order they were saved; [`Background::wait`] (or dropping it)
/// waits until all are. At most [`Background::IN_FLIGHT`] wait to be committed: a save beyond
/// that waits for the oldest.
#[derive(Default)]
pub struct Background {
    committer: Option<Committer>,
    /// Steps handed over and not yet heard back from, oldest first.
    in_flight: std::collections::VecDeque<u64>,
    /// The first commit that failed and has not been reported yet.
    failed: Option<SaveFailed>,
    /// [`Background::COPY_BELOW`] unless a test sets another.
    copy_below: Option<usize>,
}

/// What the committing thread gets: a checkpoint to write from copies of its tensors, or one
/// already staged; with how many checkpoints to keep.
enum Job {
    Copied {
        dir: PathBuf,
        model: NamedTensors,
        optimizer: NamedTensors,
        state: Box<TrainState>,
        keep: usize,
    },
    Staged(Staged, usize),
    /// [`save_linked`].
    Linked {
        dir: PathBuf,
        from: PathBuf,
        step: u64,
        keep: usize,
    },
}

impl Job {
    fn commit(self) -> Result<PathBuf, CheckpointError> {
        match self {
            Job::Copied {
                dir,
                model,
                optimizer,
                state,
                keep,
            } => stage(&dir, &model, &optimizer, &state)?.commit(keep),
            Job::Staged(staged, keep) => staged.commit(keep),
            Job::Linked {
                dir,
                from,
                step,
                keep,
            } => save_linked(&dir, &from, step, keep),
        }
    }
}

/// The committing thread, its queue and its answers (one per checkpoint, in order).
struct Committer {
    jobs: std::sync::mpsc::Sender<Job>,
    outcomes: std::sync::mpsc::Receiver<Result<PathBuf, CheckpointError>>,
    thread: std::thread::JoinHandle<()>,
}

/// A checkpoint that could not be written.
#[derive(Debug, thiserror::Error)]
#[error("writing the checkpoint of step {step}: {source}")]
pub struct SaveFailed {
    pub step: u64,
    #[source]
    pub source: CheckpointError,
}

impl Background {
    /// Checkpoints staged and not yet in place, at most (a best model and an epoch's
    /// checkpoint come one after the other).
    pub const IN_FLIGHT: usize = 2;

    /// Checkpoints whose tensors (model and optimizer) are smaller than this are copied in
    /// memory and written on the committing thread: writing and hashing the files was 2 ms of
    /// each checkpoint of a small model, which every rank waited for. Larger ones are staged at
    /// once (their copies would be memory the run's memory plan does not count).
    pub const COPY_BELOW: usize = 64 << 20;

    /// Keeps this checkpoint as it is now and hands it over to be written and committed. An
    /// earlier commit that failed is this call's error (reported once).
    pub fn save(
        &mut self,
        dir: &Path,
        model: &[(String, Tensor)],
        optimizer: &[(String, Tensor)],
        state: &TrainState,
        keep: usize,
    ) -> Result<(), SaveFailed> {
        self.make_room()?;
        let step = state.step;
        let failed = |source| SaveFailed { step, source };
        let bytes: usize = model
            .iter()
            .chain(optimizer)
            .map(|(_, t)| tensor_bytes(t))
            .sum();
        let job = if bytes < self.copy_below.unwrap_or(Self::COPY_BELOW) {
            let copied = |tensors| copy_tensors(tensors, dir);
            Job::Copied {
                dir: dir.to_path_buf(),
                model: copied(model).map_err(failed)?,
                optimizer: copied(optimizer).map_err(failed)?,
                state: Box::new(state.clone()),
                keep,
            }
        } else {
            Job::Staged(stage(dir, model, optimizer, state).map_err(failed)?, keep)
        };
        self.hand_over(job, step, dir)
    }

    /// Hands over [`save_linked`] of `from`, a checkpoint of `step` saved before through this
    /// `Background` (it is in place first: checkpoints are committed in order). An earlier
    /// commit that failed is this call's error.
    pub fn save_linked(
        &mut self,
        dir: &Path,
        from: &Path,
        step: u64,
        keep: usize,
    ) -> Result<(), SaveFailed> {
        self.make_room()?;
        let job = Job::Linked {
            dir: dir.to_path_buf(),
            from: from.to_path_buf(),
            step,
            keep,
        };
        self.hand_over(job, step, dir)
    }

    /// Waits until fewer than [`Background::IN_FLIGHT`] checkpoints are in flight; an earlier
    /// commit that failed is the error (reported once).
    fn make_room(&mut self) -> Result<(), SaveFailed> {
        while self.in_flight.len() >= Self::IN_FLIGHT {
            self.hear_one();
        }
        self.hear_finished();
        match self.failed.take() {
            Some(failed) => Err(failed),
            None => Ok(()),
        }
    }

    /// `job` (the checkpoint of `step` into `dir`) to the committing thread, started if need be.
    fn hand_over(&mut self, job: Job, step: u64, dir: &Path) -> Result<(), SaveFailed> {
        let failed = |source| SaveFailed { step, source };
        let committer = match self.committer.take() {
            Some(c) => c,
            None => Committer::start().map_err(|e| failed(io_err(dir)(e)))?,
        };
        let sent = committer.jobs.send(job);
        self.committer = Some(committer);
        if let Err(std::sync::mpsc::SendError(job)) = sent {
            // The thread is gone (it cannot be, short of a panic): commit here instead.
            return job.commit().map(drop).map_err(failed);
        }
        self.in_flight.push_back(step);
        Ok(())
    }

    /// Until every checkpoint saved is on disk and in place: the directory of the last one, or
    /// the first that is not there and why.
    pub fn wait(&mut self) -> Result<Option<PathBuf>, SaveFailed> {
        let mut last = None;
        while !self.in_flight.is_empty() {
            last = self.hear_one().or(last);
        }
        match self.failed.take() {
            Some(failed) => Err(failed),
            None => Ok(last),
        }
    }

    /// Blocks for the oldest checkpoint in flight: its directory if it was put in place.
    fn hear_one(&mut self) -> Option<PathBuf> {
        let step = self.in_flight.pop_front()?;
        let outcome = match &self.committer {
            Some(c) => c.outcomes.recv().unwrap_or_else(|_| Err(Self::lost(step))),
            None => Err(Self::lost(step)),
        };
        self.record(step, outcome)
    }

    /// The outcomes that have come in, without waiting.
    fn hear_finished(&mut self) {
        while let Some(&step) = self.in_flight.front() {
            let Some(outcome) = self
                .committer
                .as_ref()
                .and_then(|c| c.outcomes.try_recv().ok())
            else {
                return;
            };
            self.in_flight.pop_front();
            self.record(step, outcome);
        }
    }

    fn record(&mut self, step: u64, outcome: Result<PathBuf, CheckpointError>) -> Option<PathBuf> {
        match outcome {
            Ok(path) => Some(path),
            Err(source) => {
                self.failed.get_or_insert(SaveFailed { step, source });
                None
            }
        }
    }

    fn lost(step: u64) -> CheckpointError {
        CheckpointError::Invalid {
            path: step_dir_name(step),
            detail: "the thread writing it ended before it".into(),
        }
    }
}

impl Committer {
    fn start() -> std::io::Result<Committer> {
        let (jobs, queue) = std::sync::mpsc::channel::<Job>();
        let (answer, outcomes) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("checkpoint".into())
            .spawn(move || {
                for job in queue {
                    let committed = job.commit();
                    if let Ok(path) = &committed {
                        tracing::info!("checkpoint {}", path.display());
                    }
                    if answer.send(committed).is_err() {
                        return;
                    }
                }
            })?;
        Ok(Committer {
            jobs,
            outcomes,
            thread,
        })
    }
}

impl Drop for Background {
    /// On a path that did not wait (an error ends the run): what was saved is still put in
    /// place before the process goes on.
    fn drop(&mut self) {
        if let Err(e) = self.wait() {
            tracing::error!("{e}");
        }
        if let Some(Committer { jobs, thread, .. }) = self.committer.take() {
            drop(jobs);
            let _ = thread.join();
        }
    }
}

/// Bytes of a tensor's elements.
fn tensor_bytes(t: &Tensor) -> usize {
    t.numel() * t.kind().elt_size_in_bytes()
}

/// Copies of `tensors` in CPU memory, contiguous, as they are now (`dir`: the checkpoint they
/// are for, named when a copy fails).
fn copy_tensors(tensors: &[(String, Tensor)], dir: &Path) -> Result<NamedTensors, CheckpointError> {
    let _guard = tch::no_grad_guard();
    let copy = |t: &Tensor| -> Result<Tensor, tch::TchError> {
        let out = Tensor::f_empty(t.size(), (t.kind(), tch::Device::Cpu))?;
        out.shallow_clone().f_copy_(t)?;
        Ok(out)
    };
    tensors
        .iter()
        .map(|(name, t)| Ok((name.clone(), copy(t)?)))
        .collect::<Result<_, tch::TchError>>()
        .map_err(|source| CheckpointError::Tensors {
            path: dir.display().to_string(),
            source,
        })
}

/// The newest complete checkpoint under `dir`: the one `latest` names if it is complete,
/// otherwise the newest complete `step-*` directory. Incomplete ones are reported through
/// `skipped` and never loaded.
pub fn find_latest(
    dir: &Path,
    skipped: &mut Vec<String>,
) -> Result<Option<(PathBuf, TrainState)>, CheckpointError> {
    if !dir.is_dir() {
        return Ok(None);
    }
    let mut candidates = step_dirs(dir)?;
    candidates.reverse(); // newest first
    if let Ok(latest) = common::files::read_input_text(&dir.join(LATEST), MAX_STATE_FILE) {
        let named = dir.join(latest.trim());
        if let Some(pos) = candidates.iter().position(|c| *c == named) {
            let first = candidates.remove(pos);
            candidates.insert(0, first);
        } else {
            // Reported, not silently replaced by whatever else is there.
            skipped.push(format!(
                "{}: names {}, which does not exist",
                dir.join(LATEST).display(),
                latest.trim()
            ));
        }
    }
    for candidate in candidates {
        match verify(&candidate) {
            Ok(state) => return Ok(Some((candidate, state))),
            Err(e) => skipped.push(e.to_string()),
        }
    }
    Ok(None)
}

/// Checks that a checkpoint directory is complete and returns its state. Nothing is read
/// that is not a regular file (a FIFO planted in a run directory is refused, not waited on),
/// and a tensor file of another size than recorded is refused without being read.
pub fn verify(path: &Path) -> Result<TrainState, CheckpointError> {
    let state = read_state(path)?;
    consistent::check_step_name(path, &state)?;
    let state_path = path.join(STATE_FILE);
    for file in [MODEL_FILE, OPTIMIZER_FILE] {
        let expected = state
            .files
            .get(file)
            .ok_or_else(|| CheckpointError::Invalid {
                path: state_path.display().to_string(),
                detail: format!("no digest for {file}"),
            })?;
        check_file(&path.join(file), expected)?;
    }
    Ok(state)
}

/// The `state.json` of the checkpoint at `path`, read and checked against the digest beside it,
/// not against its files.
fn read_state(path: &Path) -> Result<TrainState, CheckpointError> {
    let state_path = path.join(STATE_FILE);
    let text = common::files::read_input(&state_path, MAX_STATE_FILE)?;
    consistent::check_state_digest(&state_path, &text)?;
    serde_json::from_slice(&text).map_err(|e| CheckpointError::Invalid {
        path: state_path.display().to_string(),
        detail: format!("unreadable state ({e}): incomplete checkpoint"),
    })
}

/// The file at `path` has the recorded size and digest (the size compared before reading).
fn check_file(path: &Path, expected: &FileDigest) -> Result<(), CheckpointError> {
    let short = |sha: &str| sha.chars().take(12).collect::<String>();
    let damaged = |actual: String| {
        CheckpointError::Invalid {
        path: path.display().to_string(),
        detail: format!(
            "{actual} but state.json recorded {} bytes (sha256 {}): incomplete or damaged checkpoint",
            expected.bytes,
            short(&expected.sha256)
        ),
    }
    };
    let (_, len) = common::files::open_input(path, u64::MAX)?;
    if len != expected.bytes {
        return Err(damaged(format!("{len} bytes")));
    }
    let actual = digest(path)?;
    if actual != *expected {
        return Err(damaged(format!(
            "{} bytes (sha256 {})",
            actual.bytes,
            short(&actual.sha256)
        )));
    }
    Ok(())
}

/// Named tensors, as stored in a safetensors file.
pub type NamedTensors = Vec<(String, Tensor)>;

/// Loads a verified checkpoint: (model tensors, optimizer tensors, state). A tensor holding a
/// value that is not finite (NaN or infinite) is refused, naming it: the digests only say the
/// files are as written, and a model of NaNs would otherwise be trained on or evaluated as if
/// it were one (a diverged run, or a file edited with its digests updated). So is a state that
/// disagrees with itself: its step with the directory's name or the optimizer's own count, its
/// bytes with `state.sha256` (see `checkpoint/consistent.rs`).
pub fn load(path: &Path) -> Result<(NamedTensors, NamedTensors, TrainState), CheckpointError> {
    let state = verify(path)?;
    let read = |file: &str| {
        let p = path.join(file);
        let named = Tensor::read_safetensors(&p).map_err(|source| CheckpointError::Tensors {
            path: p.display().to_string(),
            source,
        })?;
        finite::all_finite(&p, &named)?;
        Ok::<_, CheckpointError>(named)
    };
    let (model, optimizer) = (read(MODEL_FILE)?, read(OPTIMIZER_FILE)?);
    consistent::check_optimizer_step(&path.join(OPTIMIZER_FILE), &optimizer, &state)?;
    Ok((model, optimizer, state))
}

/// The step number of a `step-000123` directory name.
fn step_of(path: &Path) -> Option<u64> {
    path.file_name()?
        .to_str()?
        .strip_prefix("step-")?
        .parse()
        .ok()
}

/// `step-*` directories, oldest (lowest step) first.
fn step_dirs(dir: &Path) -> Result<Vec<PathBuf>, CheckpointError> {
    let mut dirs: Vec<PathBuf> = fs::read_dir(dir)
        .map_err(io_err(dir))?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.is_dir() && step_of(p).is_some())
        .collect();
    // By number: step-1000000 comes after step-999999.
    dirs.sort_by_key(|p| step_of(p));
    Ok(dirs)
}

/// Keeps the checkpoint of `current` (just written) and the `keep - 1` newest below it; older
/// ones go. Directories above `current` are not this run's to delete (the trainer moves them
/// aside when it starts), so pruning leaves them alone.
fn prune(dir: &Path, keep: usize, current: u64) -> Result<(), CheckpointError> {
    let older: Vec<PathBuf> = step_dirs(dir)?
        .into_iter()
        .filter(|p| step_of(p).is_some_and(|s| s < current))
        .collect();
    let excess = older.len().saturating_sub(keep.max(1) - 1);
    for old in &older[..excess] {
        fs::remove_dir_all(old).map_err(io_err(old))?;
    }
    Ok(())
}

/// Size and SHA-256 of a file, streamed (a tensor file is never held whole for this).
fn digest(path: &Path) -> Result<FileDigest, CheckpointError> {
    let (mut file, _) = common::files::open_input(path, u64::MAX)?;
    let mut sha = Sha256::new();
    let bytes = std::io::copy(&mut file, &mut sha).map_err(io_err(path))?;
    Ok(FileDigest {
        bytes,
        sha256: common::hex(&sha.finalize()),
    })
}

/// Starts writing `file`'s data to the disk without waiting for it: the fsyncs that follow
/// then find every staged file's blocks already allocated, and one journal commit (on ext4)
/// covers them all instead of one per file. Only a hint: the fsyncs still make each file
/// durable.
fn start_writeback(file: &File) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: a plain syscall on an open descriptor; its failure changes nothing.
        unsafe { libc::sync_file_range(file.as_raw_fd(), 0, 0, libc::SYNC_FILE_RANGE_WRITE) };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = file;
}

fn sync_dir(path: &Path) -> Result<(), CheckpointError> {
    File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(io_err(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A state of `step` (the fields a test does not look at filled in).
    pub(super) fn state(step: u64) -> TrainState {
        TrainState {
            epoch: 1,
            step,
            samples_in_epoch: 32,
            seed: 7,
            world_size: 2,
            global_batch: 16,
            model_hash: "abc".into(),
            rng: String::new(),
            files: Default::default(),
            trainer: Default::default(),
            schedule_steps: None,
        }
    }

    fn tensors(v: f32) -> Vec<(String, Tensor)> {
        vec![("w".into(), Tensor::from_slice(&[v, v + 1.0]))]
    }

    #[test]
    fn save_then_load_round_trips_and_keeps_the_newest() {
        let dir = tempfile::tempdir().unwrap();
        for step in [1, 2, 3, 4] {
            save(
                dir.path(),
                &tensors(step as f32),
                &tensors(0.5),
                &state(step),
                2,
            )
            .unwrap();
        }
        let names: Vec<String> = step_dirs(dir.path())
            .unwrap()
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, vec!["step-000003", "step-000004"]);
        let mut skipped = Vec::new();
        let (path, st) = find_latest(dir.path(), &mut skipped).unwrap().unwrap();
        assert!(skipped.is_empty());
        assert_eq!(st.step, 4);
        let (model, optim, _) = load(&path).unwrap();
        assert_eq!(model[0].1, Tensor::from_slice(&[4.0f32, 5.0]));
        assert_eq!(optim[0].0, "w");
    }

    #[test]
    fn a_checkpoint_holding_a_nan_is_refused_naming_the_tensor() {
        // Written by `save`, so its digests match: only the values say it is unusable.
        let dir = tempfile::tempdir().unwrap();
        let model = vec![
            ("ok".to_string(), Tensor::from_slice(&[1.0f32, 2.0])),
            (
                "item_id.weight".to_string(),
                Tensor::from_slice(&[1.0f32, f32::NAN, f32::INFINITY]),
            ),
            ("ids".to_string(), Tensor::from_slice(&[3i64, 4])),
        ];
        let path = save(dir.path(), &model, &tensors(0.0), &state(5), 2).unwrap();
        let err = match load(&path) {
            Ok(_) => panic!("a NaN model loaded"),
            Err(e) => e.to_string(),
        };
        assert!(
            err.contains("model.safetensors")
                && err.contains("item_id.weight holds 2 of its 3 values that are not finite"),
            "{err}"
        );
        let path = save(
            dir.path(),
            &tensors(1.0),
            &tensors(f32::NEG_INFINITY),
            &state(6),
            2,
        )
        .unwrap();
        let err = match load(&path) {
            Ok(_) => panic!("an infinite moment loaded"),
            Err(e) => e.to_string(),
        };
        assert!(
            err.contains("optimizer.safetensors") && err.contains("w holds 2 of its 2"),
            "{err}"
        );
    }

    #[test]
    fn truncated_checkpoint_is_skipped() {
        let dir = tempfile::tempdir().unwrap();
        save(dir.path(), &tensors(1.0), &tensors(0.0), &state(10), 3).unwrap();
        let newest = save(dir.path(), &tensors(2.0), &tensors(0.0), &state(20), 3).unwrap();
        // A crash mid-write: the model file is cut short.
        let model = newest.join(MODEL_FILE);
        let len = fs::metadata(&model).unwrap().len();
        fs::OpenOptions::new()
            .write(true)
            .open(&model)
            .unwrap()
            .set_len(len / 2)
            .unwrap();
        let mut skipped = Vec::new();
        let (path, st) = find_latest(dir.path(), &mut skipped).unwrap().unwrap();
        assert_eq!(st.step, 10);
        assert!(path.ends_with("step-000010"));
        assert_eq!(skipped.len(), 1);
        assert!(
            skipped[0].contains("incomplete or damaged"),
            "{}",
            skipped[0]
        );
    }

    /// FIFOs planted in a checkpoint (its state, its model, `latest`) are refused at once,
    /// not waited on; the older complete checkpoint is used.
    #[test]
    fn fifos_in_a_checkpoint_are_refused_without_blocking() {
        let fifo = |path: &Path| {
            let _ = fs::remove_file(path);
            nix::unistd::mkfifo(path, nix::sys::stat::Mode::S_IRWXU).unwrap();
        };
        for planted in [STATE_FILE, MODEL_FILE] {
            let dir = tempfile::tempdir().unwrap();
            save(dir.path(), &tensors(1.0), &tensors(0.0), &state(10), 3).unwrap();
            let newest = save(dir.path(), &tensors(2.0), &tensors(0.0), &state(20), 3).unwrap();
            fifo(&newest.join(planted));
            fifo(&dir.path().join(LATEST));
            let mut skipped = Vec::new();
            let (path, _) = find_latest(dir.path(), &mut skipped).unwrap().unwrap();
            assert!(path.ends_with("step-000010"), "{planted}");
            assert_eq!(skipped.len(), 1, "{skipped:?}");
            assert!(
                skipped[0].ends_with(&format!("{planted}: is a FIFO, not a file")),
                "{}",
                skipped[0]
            );
        }
    }

    #[test]
    fn steps_sort_by_number_and_a_step_can_be_rewritten() {
        let dir = tempfile::tempdir().unwrap();
        save(dir.path(), &tensors(1.0), &tensors(0.0), &state(999_999), 2).unwrap();
        save(
            dir.path(),
            &tensors(2.0),
            &tensors(0.0),
            &state(1_000_000),
            2,
        )
        .unwrap();
        save(
            dir.path(),
            &tensors(3.0),
            &tensors(0.0),
            &state(1_000_000),
            2,
        )
        .unwrap();
        let mut skipped = Vec::new();
        let (path, st) = find_latest(dir.path(), &mut skipped).unwrap().unwrap();
        assert_eq!(st.step, 1_000_000);
        let (model, _, _) = load(&path).unwrap();
        assert_eq!(model[0].1, Tensor::from_slice(&[3.0f32, 4.0]));
        assert_eq!(step_dirs(dir.path()).unwrap().len(), 2);
    }

    #[test]
    fn leftover_temporary_directories_are_ignored() {
        let dir = tempfile::tempdir().unwrap();
        save(dir.path(), &tensors(1.0), &tensors(0.0), &state(5), 3).unwrap();
        fs::create_dir_all(dir.path().join(".tmp-step-000006-1")).unwrap();
        fs::write(
            dir.path().join(".tmp-step-000006-1").join(MODEL_FILE),
            b"junk",
        )
        .unwrap();
        let mut skipped = Vec::new();
        let (_, st) = find_latest(dir.path(), &mut skipped).unwrap().unwrap();
        assert_eq!(st.step, 5);
        assert!(skipped.is_empty());
    }

    #[test]
    fn the_trainers_fields_travel_next_to_ours() {
        let dir = tempfile::tempdir().unwrap();
        let mut st = state(5);
        st.trainer
            .insert("evals_since_best".into(), serde_json::json!(2));
        let path = save(dir.path(), &tensors(1.0), &tensors(1.0), &st, 2).unwrap();
        let text = fs::read_to_string(path.join(STATE_FILE)).unwrap();
        // Flat in state.json, as checkpoints of earlier versions have them.
        assert!(text.contains("\n  \"evals_since_best\": 2"), "{text}");
        assert_eq!(verify(&path).unwrap().trainer["evals_since_best"], 2);
    }

    #[test]
    fn pruning_never_removes_what_was_just_written() {
        let dir = tempfile::tempdir().unwrap();
        let ck = dir.path();
        // An earlier run's higher steps (the trainer sets them aside; pruning must not pick
        // the new ones over them).
        save(ck, &tensors(9.0), &tensors(9.0), &state(464), 2).unwrap();
        for step in [50, 100, 150] {
            save(ck, &tensors(1.0), &tensors(1.0), &state(step), 2).unwrap();
        }
        let mut names: Vec<String> = fs::read_dir(ck)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("step-"))
            .collect();
        names.sort();
        assert_eq!(names, ["step-000100", "step-000150", "step-000464"]);
        assert_eq!(
            fs::read_to_string(ck.join(LATEST)).unwrap(),
            "step-000150\n"
        );
    }

    #[test]
    fn a_latest_naming_a_missing_directory_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let ck = dir.path();
        save(ck, &tensors(1.0), &tensors(1.0), &state(100), 3).unwrap();
        fs::write(ck.join(LATEST), "step-000232\n").unwrap();
        let mut skipped = Vec::new();
        let (path, _) = find_latest(ck, &mut skipped).unwrap().unwrap();
        assert!(path.ends_with("step-000100"));
        assert_eq!(skipped.len(), 1, "{skipped:?}");
        assert!(
            skipped[0].contains("names step-000232, which does not exist"),
            "{skipped:?}"
        );
        // `latest` is not synced on its own: a crash may leave it empty.
        save(ck, &tensors(2.0), &tensors(2.0), &state(200), 3).unwrap();
        fs::write(ck.join(LATEST), "").unwrap();
        let mut skipped = Vec::new();
        let (path, _) = find_latest(ck, &mut skipped).unwrap().unwrap();
        assert!(path.ends_with("step-000200"), "{}", path.display());
        assert_eq!(skipped.len(), 1, "{skipped:?}");
    }

    #[test]
    fn a_failed_write_leaves_no_temporary_directory() {
        let dir = tempfile::tempdir().unwrap();
        let ck = dir.path().join("ck");
        fs::create_dir_all(&ck).unwrap();
        // A tensor safetensors has no type for (complex) fails the write half-way, after the
        // temporary directory was made.
        let complex = Tensor::zeros([2], (tch::Kind::ComplexFloat, tch::Device::Cpu));
        let bad = vec![("x".to_string(), complex)];
        assert!(save(&ck, &bad, &[], &state(7), 2).is_err());
        let left: Vec<String> = fs::read_dir(&ck)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }

    #[test]
    fn missing_state_is_incomplete() {
        let dir = tempfile::tempdir().unwrap();
        let path = save(dir.path(), &tensors(1.0), &tensors(0.0), &state(5), 3).unwrap();
        fs::remove_file(path.join(STATE_FILE)).unwrap();
        let mut skipped = Vec::new();
        assert!(find_latest(dir.path(), &mut skipped).unwrap().is_none());
        assert_eq!(skipped.len(), 1);
    }

    /// Saved in the background: each checkpoint lands, in order, with `latest` naming the last
    /// one and the newest `keep` kept; the tensors are those of the moment of each save.
    #[test]
    fn background_saves_land_in_order_with_the_tensors_of_their_moment() {
        // Copied in memory (small tensors) and staged at once (large ones).
        for copy_below in [None, Some(0)] {
            saves_land_in_order_with_the_tensors_of_their_moment(copy_below);
        }
    }

    fn saves_land_in_order_with_the_tensors_of_their_moment(copy_below: Option<usize>) {
        let dir = tempfile::tempdir().unwrap();
        let ck = dir.path().join("ck");
        let mut saver = Background::default();
        saver.copy_below = copy_below;
        for step in 1..=5u64 {
            let model = tensors(step as f32);
            saver.save(&ck, &model, &[], &state(step), 3).unwrap();
            // Changed at once: the checkpoint keeps the values it was saved with.
            let _ = model[0].1.shallow_clone().fill_(-1.0);
        }
        let last = saver.wait().unwrap().unwrap();
        assert_eq!(last, ck.join("step-000005"));
        let latest = fs::read_to_string(ck.join(LATEST)).unwrap();
        assert_eq!(latest.trim(), "step-000005");
        let kept: Vec<u64> = step_dirs(&ck)
            .unwrap()
            .iter()
            .filter_map(|p| step_of(p))
            .collect();
        assert_eq!(kept, vec![3, 4, 5]);
        for step in 3..=5u64 {
            let (model, _, state) = load(&ck.join(format!("step-{step:06}"))).unwrap();
            assert_eq!(state.step, step);
            assert_eq!(model[0].1.double_value(&[0]), step as f64);
        }
        assert_eq!(saver.wait().unwrap(), None);
    }

    /// A checkpoint saved as links shares its source's model file (nothing written twice), has
    /// no optimizer state, loads as a checkpoint, and outlives the source's pruning.
    #[test]
    fn a_checkpoint_saved_as_links_shares_the_model_and_outlives_its_source() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let (ck, best) = (dir.path().join("ck"), dir.path().join("best"));
        let mut saver = Background::default();
        saver
            .save(&ck, &tensors(7.0), &tensors(8.0), &state(100), 1)
            .unwrap();
        let from = ck.join("step-000100");
        saver.save_linked(&best, &from, 100, 1).unwrap();
        assert_eq!(saver.wait().unwrap(), Some(best.join("step-000100")));
        assert_eq!(
            fs::read_to_string(best.join(LATEST)).unwrap().trim(),
            "step-000100"
        );
        let ino = |d: &Path| fs::metadata(d.join(MODEL_FILE)).unwrap().ino();
        assert_eq!(ino(&from), ino(&best.join("step-000100")));
        // The source pruned (keep 1) by the next checkpoint: the link keeps the model.
        save(&ck, &tensors(1.0), &tensors(1.0), &state(200), 1).unwrap();
        assert!(!from.exists());
        let (model, optimizer, state) = load(&best.join("step-000100")).unwrap();
        assert_eq!(state.step, 100);
        assert_eq!(model[0].1.double_value(&[0]), 7.0);
        assert!(optimizer.is_empty());
    }

    /// A file in the way is an error, never a copy over it (it may be another checkpoint's).
    #[test]
    fn a_link_onto_an_existing_file_fails_and_leaves_it_alone() {
        let dir = tempfile::tempdir().unwrap();
        let (from, to) = (dir.path().join("a"), dir.path().join("b"));
        fs::write(&from, b"model").unwrap();
        fs::hard_link(&from, &to).unwrap();
        assert!(link_or_copy(&from, &to).is_err());
        assert_eq!(fs::read(&from).unwrap(), b"model");
    }

    /// Where no link can be made (here: across file systems) the files are copied.
    #[test]
    fn a_checkpoint_saved_as_links_across_file_systems_is_copied() {
        let Ok(shm) = tempfile::tempdir_in("/dev/shm") else {
            eprintln!("skipped: no /dev/shm");
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        save(shm.path(), &tensors(3.0), &tensors(4.0), &state(5), 1).unwrap();
        let from = shm.path().join("step-000005");
        let best = dir.path().join("best");
        save_linked(&best, &from, 5, 1).unwrap();
        fs::remove_dir_all(&from).unwrap();
        let (model, _, _) = load(&best.join("step-000005")).unwrap();
        assert_eq!(model[0].1.double_value(&[0]), 3.0);
    }

    /// Links to a checkpoint that is not there fail with its step, leaving nothing behind.
    #[test]
    fn links_to_a_missing_checkpoint_are_reported_with_their_step() {
        let dir = tempfile::tempdir().unwrap();
        let best = dir.path().join("best");
        let mut saver = Background::default();
        saver
            .save_linked(&best, &dir.path().join("ck/step-000009"), 9, 1)
            .unwrap();
        let failed = saver.wait().unwrap_err();
        assert_eq!(failed.step, 9);
        assert!(failed.to_string().contains("step-000009"), "{failed}");
        assert_eq!(fs::read_dir(&best).unwrap().count(), 0);
    }

    /// A commit that fails is reported with its step, by the next wait (once).
    #[test]
    fn a_background_commit_that_fails_is_reported_with_its_step() {
        for copy_below in [None, Some(0)] {
            a_commit_that_fails_is_reported_with_its_step(copy_below);
        }
    }

    fn a_commit_that_fails_is_reported_with_its_step(copy_below: Option<usize>) {
        let dir = tempfile::tempdir().unwrap();
        let ck = dir.path().join("ck");
        // `latest` cannot be replaced: a directory with something in it.
        fs::create_dir_all(ck.join(LATEST).join("x")).unwrap();
        let mut saver = Background::default();
        saver.copy_below = copy_below;
        saver.save(&ck, &tensors(1.0), &[], &state(3), 2).unwrap();
        let failed = saver.wait().unwrap_err();
        assert_eq!(failed.step, 3);
        assert!(
            failed
                .to_string()
                .starts_with("writing the checkpoint of step 3: "),
            "{failed}"
        );
        assert_eq!(saver.wait().unwrap(), None);
        let left: Vec<String> = fs::read_dir(&ck)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(".tmp-"))
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }

    /// A checkpoint written from copies whose files cannot be written (its directory is a
    /// file) is reported with its step, and saving goes on afterwards.
    #[test]
    fn a_copied_checkpoint_that_cannot_be_written_is_reported_with_its_step() {
        let dir = tempfile::tempdir().unwrap();
        let blocked = dir.path().join("blocked");
        fs::write(&blocked, b"a file, not a directory").unwrap();
        let mut saver = Background::default();
        // Handed over at once: the files are written on the committing thread.
        saver
            .save(&blocked, &tensors(1.0), &[], &state(7), 2)
            .unwrap();
        let failed = saver.wait().unwrap_err();
        assert_eq!(failed.step, 7, "{failed}");
        assert!(failed.to_string().contains("blocked"), "{failed}");
        let ck = dir.path().join("ck");
        saver.save(&ck, &tensors(3.0), &[], &state(9), 2).unwrap();
        assert_eq!(saver.wait().unwrap(), Some(ck.join("step-000009")));
    }

    /// A tensor that is not contiguous (a transposed view) is saved as its values, whether the
    /// checkpoint is copied in memory or staged at once.
    #[test]
    fn tensors_that_are_not_contiguous_are_saved_on_both_paths() {
        for copy_below in [None, Some(0)] {
            let dir = tempfile::tempdir().unwrap();
            let ck = dir.path().join("ck");
            let base = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]).view([2, 3]);
            let model = vec![("w".to_string(), base.tr())];
            let mut saver = Background::default();
            saver.copy_below = copy_below;
            saver.save(&ck, &model, &[], &state(1), 2).unwrap();
            let dir = saver.wait().unwrap().unwrap();
            let (loaded, _, _) = load(&dir).unwrap();
            assert_eq!(loaded[0].1.size(), vec![3, 2]);
            let values = Vec::<f32>::try_from(loaded[0].1.flatten(0, -1)).unwrap();
            assert_eq!(values, vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0], "{copy_below:?}");
        }
    }
}
