//! The run directory's integrity (rank 0 only): one run at a time (an exclusive `flock` the kernel
//! releases however the run ends), a run owns what it reports (what a fresh start or a resume
//! from an older step does not own is moved aside into `superseded/`, never deleted), temporary
//! files of crashed checkpoint writes are cleaned up, and `metrics.jsonl` holds whole records
//! only (one `write` per record; repaired atomically on resume).
//! It moves and checks files; when to checkpoint or what to resume from is the trainer's choice.

use std::fs::{self, File, OpenOptions};
use std::io::{Read as _, Seek as _, Write as _};
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};

#[derive(Debug, thiserror::Error)]
pub enum RunDirError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error(
        "run directory {dir} is in use by {holder}; wait for that run to end, stop it, or give this one another run.name or run.output_dir"
    )]
    Busy { dir: String, holder: String },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> RunDirError + '_ {
    move |source| RunDirError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// The name of the lock file in the run directory.
pub const LOCK_FILE: &str = ".lock";

/// Holds the run directory for this process; dropping it (or the process ending, however it
/// ends) releases it.
#[derive(Debug)]
pub struct RunLock {
    _lock: Flock<File>,
}

/// Who holds a run directory, as written into its lock file.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Holder {
    pid: u32,
    host: String,
    started: String,
    /// The run id's fingerprint (the id itself admits connections to the store).
    run: String,
}

/// Takes `run_dir` for this run, creating it. Another run holding it is an error naming the
/// holder (pid, host, start time, run) and the way out.
pub fn lock(run_dir: &Path, run_fingerprint: &str) -> Result<RunLock, RunDirError> {
    fs::create_dir_all(run_dir).map_err(io_err(run_dir))?;
    let path = run_dir.join(LOCK_FILE);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(io_err(&path))?;
    let mut lock = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(lock) => lock,
        Err((mut file, nix::errno::Errno::EWOULDBLOCK)) => {
            let mut text = String::new();
            let _ = file.read_to_string(&mut text);
            return Err(RunDirError::Busy {
                dir: run_dir.display().to_string(),
                holder: describe_holder(&text),
            });
        }
        Err((_, errno)) => {
            return Err(RunDirError::Io {
                path: path.display().to_string(),
                source: std::io::Error::from(errno),
            })
        }
    };
    let holder = Holder {
        pid: std::process::id(),
        host: nix::unistd::gethostname()
            .map(|h| h.to_string_lossy().into_owned())
            .unwrap_or_else(|_| "an unknown host".into()),
        started: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        run: run_fingerprint.to_string(),
    };
    let text = serde_json::to_string(&holder).unwrap_or_default() + "\n";
    lock.set_len(0).map_err(io_err(&path))?;
    lock.rewind().map_err(io_err(&path))?;
    lock.write_all(text.as_bytes()).map_err(io_err(&path))?;
    Ok(RunLock { _lock: lock })
}

fn describe_holder(text: &str) -> String {
    match serde_json::from_str::<Holder>(text.trim()) {
        Ok(h) => format!(
            "pid {} on {} since {} (run {})",
            h.pid, h.host, h.started, h.run
        ),
        Err(_) => "another process (it recorded no details)".into(),
    }
}

/// Removes what an interrupted checkpoint write left under `dir` (`.tmp-step-*`, `.latest.tmp`),
/// and puts back a checkpoint that was moved aside for replacement when its replacement never
/// arrived (`.old-step-*`). Returns one line per thing done, for the log.
pub fn clean_temporaries(dir: &Path) -> Vec<String> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut done = Vec::new();
    for entry in entries.filter_map(Result::ok) {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        let result = if name.starts_with(".tmp-step-") {
            fs::remove_dir_all(&path).map(|()| format!("removed {}", path.display()))
        } else if name == ".latest.tmp" {
            fs::remove_file(&path).map(|()| format!("removed {}", path.display()))
        } else if let Some(rest) = name.strip_prefix(".old-") {
            // `.old-step-000123-<pid>`: the complete previous copy of step-000123.
            let step = rest.rsplit_once('-').map_or(rest, |(step, _pid)| step);
            let original = dir.join(step);
            if original.exists() {
                fs::remove_dir_all(&path).map(|()| format!("removed {}", path.display()))
            } else {
                fs::rename(&path, &original).map(|()| {
                    format!(
                        "restored {} (its replacement was never written)",
                        original.display()
                    )
                })
            }
        } else {
            continue;
        };
        done.push(result.unwrap_or_else(|e| format!("could not clean {}: {e}", path.display())));
    }
    done
}

/// The step of a `step-000123` name.
pub fn step_of_name(name: &str) -> Option<u64> {
    name.strip_prefix("step-")?.parse().ok()
}

/// Moves out of `run_dir` what this run does not own, into
/// `superseded/<time>-<pid>/`: checkpoints above `start_step`, the best model unless it is the
/// one `best_step` names, and — on a fresh start — the old `metrics.jsonl`, its TensorBoard
/// event files (`tensorboard/`: TensorBoard would draw the old run's curves as this one's) and
/// `latest`.
/// Returns where things went (`None` when nothing had to move).
pub fn set_aside(
    run_dir: &Path,
    start_step: u64,
    best_step: Option<u64>,
) -> Result<Option<(PathBuf, Vec<String>)>, RunDirError> {
    let checkpoints = run_dir.join("checkpoints");
    let mut moves: Vec<(PathBuf, PathBuf)> = Vec::new();
    if let Ok(entries) = fs::read_dir(&checkpoints) {
        for entry in entries.filter_map(Result::ok) {
            let name = entry.file_name().to_string_lossy().into_owned();
            let stale = match step_of_name(&name) {
                Some(step) => step > start_step,
                None => name == "latest" && start_step == 0,
            };
            if stale {
                moves.push((entry.path(), PathBuf::from("checkpoints").join(&name)));
            }
        }
    }
    let best = run_dir.join("best");
    let best_steps: Vec<u64> = fs::read_dir(&best)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter_map(|e| step_of_name(&e.file_name().to_string_lossy()))
                .collect()
        })
        .unwrap_or_default();
    if best.exists() && (best_steps.len() != 1 || best_step != best_steps.first().copied()) {
        moves.push((best, PathBuf::from("best")));
    }
    for name in ["metrics.jsonl", "tensorboard"] {
        let old = run_dir.join(name);
        if start_step == 0 && old.exists() {
            moves.push((old, PathBuf::from(name)));
        }
    }
    if moves.is_empty() {
        return Ok(None);
    }
    moves.sort();
    let stamp = humantime::format_rfc3339_seconds(std::time::SystemTime::now())
        .to_string()
        .replace(':', "");
    let target = run_dir
        .join("superseded")
        .join(format!("{stamp}-{}", std::process::id()));
    let mut moved = Vec::new();
    for (from, rel) in moves {
        let to = target.join(&rel);
        if let Some(parent) = to.parent() {
            fs::create_dir_all(parent).map_err(io_err(parent))?;
        }
        fs::rename(&from, &to).map_err(io_err(&from))?;
        moved.push(rel.display().to_string());
    }
    Ok(Some((target, moved)))
}

/// Points `checkpoints/latest` at `step-<step>` (after a resume from an older step, so that
/// `latest` never names a directory that was moved aside).
pub fn point_latest(checkpoints: &Path, step: u64) -> Result<(), RunDirError> {
    let tmp = checkpoints.join(".latest.tmp");
    let name = runtime::checkpoint::step_dir_name(step);
    fs::write(&tmp, format!("{name}\n")).map_err(io_err(&tmp))?;
    let latest = checkpoints.join("latest");
    fs::rename(&tmp, &latest).map_err(io_err(&latest))
}

/// `metrics.jsonl`, appended to one whole record per `write`.
pub struct MetricsLog {
    file: File,
    path: PathBuf,
    /// The same records' numbers as TensorBoard scalars, when its event file could be made.
    tensorboard: Option<common::tensorboard::EventWriter>,
}

impl MetricsLog {
    /// Opens (creating) the log for appending.
    pub fn open(path: &Path) -> Result<MetricsLog, RunDirError> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(io_err(path))?;
        Ok(MetricsLog {
            file,
            path: path.to_path_buf(),
            tensorboard: None,
        })
    }

    /// Also writes each record's numbers to a new TensorBoard event file in `dir` (a warning,
    /// and no event file, when it cannot be made); a run resumed after step `resumed_after` first
    /// has TensorBoard drop the later points of the earlier files (they are written again).
    pub fn with_tensorboard(mut self, dir: &Path, resumed_after: Option<u64>) -> MetricsLog {
        let made = common::tensorboard::EventWriter::create(dir).and_then(|mut writer| {
            if let Some(step) = resumed_after {
                writer.restart_at(step + 1)?;
            }
            Ok(writer)
        });
        match made {
            Ok(writer) => self.tensorboard = Some(writer),
            Err(e) => tracing::warn!("no TensorBoard event file in {}: {e}", dir.display()),
        }
        self
    }

    /// Appends one record (a JSON object) and its newline in a single `write`, so a kill leaves
    /// either the whole line or none of it.
    pub fn append(&mut self, record: &impl serde::Serialize) -> Result<(), RunDirError> {
        let mut line = serde_json::to_vec(record).map_err(|e| RunDirError::Io {
            path: self.path.display().to_string(),
            source: std::io::Error::other(e),
        })?;
        line.push(b'\n');
        self.file.write_all(&line).map_err(io_err(&self.path))?;
        if let Some(writer) = self.tensorboard.as_mut() {
            let value = serde_json::to_value(record).unwrap_or_default();
            let (step, scalars) = tensorboard_scalars(&value);
            if let Err(e) = writer.scalars(step, &scalars) {
                tracing::warn!(
                    "TensorBoard event file {}: {e}; no more scalars there",
                    writer.path().display()
                );
                self.tensorboard = None;
            }
        }
        Ok(())
    }
}

/// A record's step and its numbers as TensorBoard tags: a step's `train/loss`, `train/lr`, ...;
/// an evaluation's `valid/ndcg@10` (its split, then the metric); a baseline's `valid_pop/...`.
/// Other records (the summary) give none.
fn tensorboard_scalars(record: &serde_json::Value) -> (u64, Vec<(String, f64)>) {
    let text = |key: &str| record.get(key).and_then(|v| v.as_str()).unwrap_or_default();
    let step = record.get("step").and_then(|v| v.as_u64()).unwrap_or(0);
    let (prefix, wanted): (String, fn(&str) -> bool) = match text("kind") {
        "step" => ("train".into(), |k| {
            !matches!(k, "kind" | "epoch" | "step" | "peak_mem_rank")
        }),
        "eval" => (text("split").to_string(), |k| k.contains('@')),
        "baseline" => (format!("{}_{}", text("split"), text("model")), |k| {
            k.contains('@')
        }),
        _ => return (step, Vec::new()),
    };
    let Some(map) = record.as_object() else {
        return (step, Vec::new());
    };
    let scalars = map
        .iter()
        .filter(|(k, _)| wanted(k))
        .filter_map(|(k, v)| Some((format!("{prefix}/{k}"), v.as_f64()?)))
        .collect();
    (step, scalars)
}

/// Before a resume from `step`: keeps the whole, parseable records of `path` up to `step`, drops
/// the rest (a half-written last line, steps that will run again) and every test and summary
/// record (the run writes its own at the end), and rewrites the file atomically (temp +
/// rename). Returns how many lines were dropped, and the dropped summary of a run that ended at
/// exactly `step` (its training figures stay true if this run trains no further).
pub fn repair_metrics(
    path: &Path,
    step: u64,
) -> Result<(usize, Option<serde_json::Value>), RunDirError> {
    let Ok(text) = fs::read_to_string(path) else {
        return Ok((0, None));
    };
    let mut lines: Vec<&str> = text.split_inclusive('\n').collect();
    let total = lines.len();
    let mut summary = None;
    lines.retain(|line| {
        let Some(body) = line.strip_suffix('\n') else {
            return false; // unterminated: cut off by a kill
        };
        let Ok(serde_json::Value::Object(record)) = serde_json::from_str(body) else {
            return false;
        };
        let kind = record.get("kind").and_then(|s| s.as_str());
        if kind == Some("summary") && record.get("steps").and_then(|s| s.as_u64()) == Some(step) {
            summary = Some(serde_json::Value::Object(record.clone()));
        }
        let is_test =
            record.get("split").and_then(|s| s.as_str()) == Some("test") || kind == Some("summary");
        let in_range = record
            .get("step")
            .and_then(|s| s.as_u64())
            .is_none_or(|s| s <= step);
        in_range && !is_test
    });
    let dropped = total - lines.len();
    if dropped > 0 {
        let tmp = path.with_extension("jsonl.tmp");
        let mut file = File::create(&tmp).map_err(io_err(&tmp))?;
        file.write_all(lines.concat().as_bytes())
            .and_then(|()| file.sync_all())
            .map_err(io_err(&tmp))?;
        fs::rename(&tmp, path).map_err(io_err(path))?;
    }
    Ok((dropped, summary))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_names_the_holder_and_the_first_is_released_on_drop() {
        let dir = tempfile::tempdir().unwrap();
        let first = lock(dir.path(), "sha256:abc").unwrap();
        let text = lock(dir.path(), "sha256:def").unwrap_err().to_string();
        assert!(
            text.contains(&format!("pid {}", std::process::id())),
            "{text}"
        );
        assert!(
            text.contains("run sha256:abc") && text.contains("since "),
            "{text}"
        );
        assert!(text.contains("another run.name"), "{text}");
        drop(first);
        lock(dir.path(), "sha256:def").unwrap();
    }

    #[test]
    fn metrics_repair_keeps_whole_records_up_to_the_step() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        fs::write(
            &path,
            concat!(
                "{\"kind\":\"step\",\"step\":1}\n",
                "not json\n",
                "{\"kind\":\"eval\",\"split\":\"valid\",\"step\":2}\n",
                "{\"kind\":\"eval\",\"split\":\"test\",\"step\":2}\n",
                "{\"kind\":\"step\",\"step\":3}\n",
                "{\"kind\":\"summary\",\"steps\":2}\n",
                "{\"epoch\":1,\"hit@10\":"
            ),
        )
        .unwrap();
        let (dropped, summary) = repair_metrics(&path, 2).unwrap();
        assert_eq!(dropped, 5);
        assert_eq!(
            summary,
            Some(serde_json::json!({"kind": "summary", "steps": 2}))
        );
        assert_eq!(
            fs::read_to_string(&path).unwrap(),
            "{\"kind\":\"step\",\"step\":1}\n{\"kind\":\"eval\",\"split\":\"valid\",\"step\":2}\n"
        );
        let mut log = MetricsLog::open(&path).unwrap();
        log.append(&serde_json::json!({"kind": "step", "step": 3}))
            .unwrap();
        assert!(fs::read_to_string(&path)
            .unwrap()
            .ends_with("\"step\":3}\n"));
    }

    #[test]
    fn a_fresh_start_sets_aside_everything_of_the_old_run() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path();
        for step in ["step-000400", "step-000464"] {
            fs::create_dir_all(run.join("checkpoints").join(step)).unwrap();
        }
        fs::write(run.join("checkpoints/latest"), "step-000464\n").unwrap();
        fs::create_dir_all(run.join("best/step-000464")).unwrap();
        fs::write(run.join("metrics.jsonl"), "{}\n").unwrap();
        fs::create_dir_all(run.join("tensorboard")).unwrap();
        let (target, moved) = set_aside(run, 0, None).unwrap().unwrap();
        assert_eq!(moved.len(), 6, "{moved:?}");
        assert!(target.join("tensorboard").is_dir() && !run.join("tensorboard").exists());
        assert!(target.join("checkpoints/step-000464").is_dir());
        assert!(target.join("best/step-000464").is_dir());
        assert!(!run.join("best").exists() && !run.join("metrics.jsonl").exists());
        assert!(!run.join("checkpoints/latest").exists());
        // Nothing left to move the second time.
        assert!(set_aside(run, 0, None).unwrap().is_none());
    }

    #[test]
    fn a_resume_from_an_older_step_sets_aside_the_newer_ones_only() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path();
        for step in ["step-000400", "step-000450", "step-000464"] {
            fs::create_dir_all(run.join("checkpoints").join(step)).unwrap();
        }
        fs::create_dir_all(run.join("best/step-000400")).unwrap();
        fs::write(run.join("metrics.jsonl"), "{}\n").unwrap();
        fs::create_dir_all(run.join("tensorboard")).unwrap();
        let (_, moved) = set_aside(run, 400, Some(400)).unwrap().unwrap();
        assert_eq!(
            moved,
            ["checkpoints/step-000450", "checkpoints/step-000464"]
        );
        assert!(run.join("best/step-000400").is_dir() && run.join("metrics.jsonl").exists());
        assert!(
            run.join("tensorboard").is_dir(),
            "a resume keeps its event files"
        );
        // A best model the resumed state does not know is not this run's.
        fs::create_dir_all(run.join("best/step-000450")).unwrap();
        let (_, moved) = set_aside(run, 400, Some(400)).unwrap().unwrap();
        assert_eq!(moved, ["best"]);
    }

    #[test]
    fn temporaries_are_removed_and_an_orphaned_old_copy_is_restored() {
        let dir = tempfile::tempdir().unwrap();
        let ck = dir.path();
        fs::create_dir_all(ck.join(".tmp-step-000840-4242")).unwrap();
        fs::create_dir_all(ck.join(".old-step-000800-4242")).unwrap();
        fs::create_dir_all(ck.join(".old-step-000700-4242")).unwrap();
        fs::create_dir_all(ck.join("step-000700")).unwrap();
        fs::write(ck.join(".latest.tmp"), "x").unwrap();
        let done = clean_temporaries(ck);
        assert_eq!(done.len(), 4, "{done:?}");
        assert!(ck.join("step-000800").is_dir(), "restored");
        assert!(ck.join("step-000700").is_dir());
        let left: Vec<String> = fs::read_dir(ck)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with('.'))
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }
}
