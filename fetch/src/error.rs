//! The ways fetching one asset can fail, each a single line that says what to do next.
//!
//! Owns: `FetchError` (its messages), `UsageError` (the failures that exit with 2), and the
//! turning of an I/O error into "disk full" for the directory that was being placed.
//!
//! Must not: print, exit, touch the network or the disk.

use std::io;
use std::path::{Path, PathBuf};

/// Bad usage: an unknown name, a bad manifest, wrong arguments. `fetch` exits with 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// A download, a check or a placement that failed. `fetch` exits with 1.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// DNS failure, refused connection, connect timeout: the machine is probably offline.
    #[error("cannot reach {host} (offline?): {detail}{hint}")]
    Unreachable {
        host: String,
        detail: String,
        /// `"; download ... and run: fetch --from ..."`, added by whoever knows the asset.
        hint: String,
    },
    /// The server answered, but not with the file.
    #[error("{url} answered HTTP {status}")]
    Status { url: String, status: String },
    /// The connection broke or stalled mid-transfer; what arrived is kept for a rerun.
    #[error("download of {url} failed: {detail}")]
    Transfer { url: String, detail: String },
    /// The bytes are not the pinned ones.
    #[error("checksum mismatch for {file}: expected sha256 {expected}, got {got}{then}")]
    Checksum {
        file: String,
        expected: String,
        got: String,
        /// What happened to the file (e.g. "; the download was deleted, rerun to start over").
        then: String,
    },
    /// The size is not the expected one.
    #[error("size mismatch for {file}: expected {expected} bytes, got {got}{then}")]
    Size {
        file: String,
        expected: u64,
        got: u64,
        /// What happened to the download (e.g. "; the download was deleted").
        then: String,
    },
    /// A file's content is not what it must be (an unsafe zip entry, a config that is no GPT-2).
    #[error("{file}: {detail}")]
    BadContent { file: String, detail: String },
    /// The hub's answer lacks what is needed to check the file.
    #[error("{0}")]
    Hub(String),
    /// ENOSPC (or a quota) while writing; nothing was placed.
    #[error("disk full writing {path}: no space left on device; nothing was placed in {target}")]
    DiskFull { path: PathBuf, target: PathBuf },
    /// A file handed to `fetch` (or read back from the cache) that cannot be read as one: a
    /// FIFO, a device, too large, missing. Its message names the path.
    #[error(transparent)]
    Input(#[from] common::files::InputError),
    /// Any other I/O failure, naming what was done to which path.
    // Not a `source` (which `{:#}` would print a second time): the message holds it once.
    #[error("{what} {path}: {error}")]
    Io {
        what: &'static str,
        path: PathBuf,
        error: io::Error,
    },
}

impl FetchError {
    /// An I/O failure while doing `what` to `path`.
    pub fn io(what: &'static str, path: &Path, source: io::Error) -> FetchError {
        FetchError::Io {
            what,
            path: path.to_path_buf(),
            error: source,
        }
    }

    /// A closure for `map_err`: the I/O failure of `what` on `path`.
    pub fn io_at<'a>(
        what: &'static str,
        path: &'a Path,
    ) -> impl FnOnce(io::Error) -> FetchError + 'a {
        move |e| FetchError::io(what, path, e)
    }

    /// The same error, where it is a full disk, naming `target` as the directory not placed.
    pub fn placing(self, target: &Path) -> FetchError {
        match self {
            FetchError::Io { path, error, .. } if is_disk_full(&error) => FetchError::DiskFull {
                path,
                target: target.to_path_buf(),
            },
            FetchError::DiskFull { path, .. } => FetchError::DiskFull {
                path,
                target: target.to_path_buf(),
            },
            other => other,
        }
    }

    /// The same error, where the machine looked offline, with `hint` (how to fetch by hand).
    pub fn with_offline_hint(self, hint: &str) -> FetchError {
        match self {
            FetchError::Unreachable { host, detail, .. } => FetchError::Unreachable {
                host,
                detail,
                hint: format!("; {hint}"),
            },
            other => other,
        }
    }

    /// Whether trying again (resuming) may succeed: a cut or stalled transfer.
    pub fn is_transient(&self) -> bool {
        matches!(self, FetchError::Transfer { .. })
    }
}

/// ENOSPC or EDQUOT: no room left to write.
pub fn is_disk_full(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT))
        || e.kind() == io::ErrorKind::StorageFull
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_disk_names_the_path_and_the_target() {
        let e = FetchError::io(
            "writing",
            Path::new("/c/.partial/x.part"),
            io::Error::from_raw_os_error(libc::ENOSPC),
        )
        .placing(Path::new("/c/data/ml-1m"));
        assert_eq!(
            e.to_string(),
            "disk full writing /c/.partial/x.part: no space left on device; nothing was placed in /c/data/ml-1m"
        );
    }

    #[test]
    fn other_io_errors_stay_as_they_are() {
        let e = FetchError::io("reading", Path::new("/x"), io::Error::other("boom"))
            .placing(Path::new("/t"));
        assert_eq!(e.to_string(), "reading /x: boom");
    }

    #[test]
    fn the_offline_hint_joins_the_line() {
        let e = FetchError::Unreachable {
            host: "h".into(),
            detail: "refused".into(),
            hint: String::new(),
        }
        .with_offline_hint("do this");
        assert_eq!(e.to_string(), "cannot reach h (offline?): refused; do this");
    }
}
