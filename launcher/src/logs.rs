//! torchrun's log layout, so that the tools and habits built on it keep working:
//! `DIR/<run>_<random>/attempt_<restart>/<local rank>/{stdout.log,stderr.log,error.json}`, one
//! `<run>_<random>` directory per `launch` (as torchrun's `mkdtemp`, so nodes sharing `DIR` never
//! collide), a fresh `attempt_N` per restart. `<run>` is the run id when it is torchrun's public
//! `none`, else its fingerprint: a secret id is never written into a path others can list.
//!
//! Without `--log-dir`, as torchrun, the layout lives in a temporary directory: only for the
//! error files (`TORCHELASTIC_ERROR_FILE`), removed at the end; with `--tee`/`--redirects` its
//! logs are kept and their place said. Owns the paths and directories; must not decide what
//! reaches the console (the console policy's) or read the error files (the report's).

use std::path::{Path, PathBuf};

use crate::output::Stream;

/// Where this launch's logs and error files go.
#[derive(Debug)]
pub struct Layout {
    /// `DIR/<run>_<random>`.
    run_dir: PathBuf,
    /// Whether the workers' streams are written there (`--log-dir`, or `--tee`/`--redirects`).
    pub streams: bool,
    /// A temporary directory of error files only: removed when the layout is dropped.
    temporary: bool,
}

impl Layout {
    /// The layout under `root` (`--log-dir`), or under a fresh temporary directory; `streams`:
    /// whether the workers' streams go to files.
    pub fn create(root: Option<&Path>, run_id: &str, streams: bool) -> std::io::Result<Layout> {
        let base = match root {
            Some(root) => {
                std::fs::create_dir_all(root)?;
                root.to_path_buf()
            }
            None => tempfile::Builder::new()
                .prefix("torchelastic_")
                .tempdir()?
                .keep(),
        };
        let name = if run_id == common::job_shape::PUBLIC_RUN_ID {
            run_id.to_string()
        } else {
            store::run_fingerprint(run_id).replace(':', "-")
        };
        let run_dir = tempfile::Builder::new()
            .prefix(&format!("{name}_"))
            .rand_bytes(8)
            .tempdir_in(&base)?
            .keep();
        Ok(Layout {
            run_dir,
            streams,
            temporary: root.is_none() && !streams,
        })
    }

    /// `DIR/<run>_<random>`, said at the start when logs are kept there.
    pub fn run_dir(&self) -> &Path {
        &self.run_dir
    }

    /// Makes `attempt_<restart>` afresh (as torchrun: what a previous launch left under that
    /// name is removed) with one directory per local rank.
    pub fn begin_attempt(&self, restart: u32, nproc: u32) -> std::io::Result<()> {
        let attempt = self.attempt(restart);
        match std::fs::remove_dir_all(&attempt) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        for local_rank in 0..nproc {
            std::fs::create_dir_all(attempt.join(local_rank.to_string()))?;
        }
        Ok(())
    }

    fn attempt(&self, restart: u32) -> PathBuf {
        self.run_dir.join(format!("attempt_{restart}"))
    }

    /// The file whose presence tells our workers that a SIGTERM is a preemption
    /// ([`common::env_contract::PREEMPT_FILE_VAR`]).
    pub fn preempt_marker(&self) -> PathBuf {
        self.run_dir.join("preempting")
    }

    /// `TORCHELASTIC_ERROR_FILE` of `local_rank` in attempt `restart`.
    pub fn error_file(&self, restart: u32, local_rank: u32) -> PathBuf {
        self.attempt(restart)
            .join(local_rank.to_string())
            .join("error.json")
    }

    /// The file `stream` of `local_rank` is written to in attempt `restart`, when streams are.
    pub fn stream_file(&self, restart: u32, local_rank: u32, stream: Stream) -> Option<PathBuf> {
        let name = match stream {
            Stream::Stdout => "stdout.log",
            Stream::Stderr => "stderr.log",
        };
        self.streams.then(|| {
            self.attempt(restart)
                .join(local_rank.to_string())
                .join(name)
        })
    }
}

impl Drop for Layout {
    fn drop(&mut self) {
        if self.temporary {
            // The run directory's parent is the temporary directory made for it.
            let dir = self.run_dir.parent().unwrap_or(&self.run_dir);
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torchruns_paths_per_attempt_and_rank_and_no_secret_in_them() {
        let root = tempfile::tempdir().unwrap();
        let secret = "launch-0123456789abcdef";
        let layout = Layout::create(Some(root.path()), secret, true).unwrap();
        let name = layout.run_dir().file_name().unwrap().to_str().unwrap();
        assert!(
            name.starts_with("sha256-") && !name.contains(secret),
            "{name}"
        );
        layout.begin_attempt(0, 2).unwrap();
        let out = layout.stream_file(0, 1, Stream::Stdout).unwrap();
        assert!(out.ends_with("attempt_0/1/stdout.log"), "{}", out.display());
        std::fs::write(&out, "old").unwrap();
        // A restart's attempt is fresh; the earlier one stays.
        layout.begin_attempt(1, 2).unwrap();
        assert!(out.exists());
        let err = layout.error_file(1, 0);
        assert!(err.ends_with("attempt_1/0/error.json"));
        assert!(err.parent().unwrap().is_dir());
        // A second launch under the same directory gets its own run directory.
        let other = Layout::create(Some(root.path()), secret, true).unwrap();
        assert_ne!(other.run_dir(), layout.run_dir());
        let public = Layout::create(Some(root.path()), "none", true).unwrap();
        let name = public.run_dir().file_name().unwrap().to_str().unwrap();
        assert!(name.starts_with("none_"), "{name}");
    }

    #[test]
    fn a_temporary_layout_holds_error_files_only_and_is_removed() {
        let layout = Layout::create(None, "x", false).unwrap();
        let dir = layout.run_dir().parent().unwrap().to_path_buf();
        layout.begin_attempt(0, 1).unwrap();
        assert_eq!(layout.stream_file(0, 0, Stream::Stderr), None);
        assert!(dir.is_dir());
        drop(layout);
        assert!(!dir.exists());
        // Kept when streams are written there (--redirects without --log-dir).
        let kept = Layout::create(None, "x", true).unwrap();
        let dir = kept.run_dir().parent().unwrap().to_path_buf();
        drop(kept);
        assert!(dir.is_dir());
        std::fs::remove_dir_all(dir).unwrap();
    }
}
