//! Placing a finished asset in the cache atomically: a staging directory beside the final one
//! (same filesystem), files synced, one rename into place, then the `.complete` marker (with
//! every placed file's size and digest, `marker`) written last. A final directory without the
//! marker, or whose files do not match it, is never trusted: it is moved aside and replaced.
//! Also the per-name lock that keeps two `fetch`es of one name apart.
//!
//! Must not: download, unpack, or decide what goes into the directory.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};

use crate::error::FetchError;
use crate::input::Input;
use crate::marker::{Marker, MARKER};

/// The exclusive lock of `name` (`<cache>/.partial/<name>.lock`), waited for when another
/// `fetch` holds it; released when dropped.
pub fn lock(partial_root: &Path, name: &str) -> Result<Flock<File>, FetchError> {
    fs::create_dir_all(partial_root).map_err(FetchError::io_at("creating", partial_root))?;
    let path = partial_root.join(format!("{name}.lock"));
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(FetchError::io_at("opening", &path))?;
    match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(lock) => Ok(lock),
        Err((file, Errno::EWOULDBLOCK)) => {
            eprintln!(
                "fetch: waiting for another fetch of {name} ({})",
                path.display()
            );
            Flock::lock(file, FlockArg::LockExclusive)
                .map_err(|(_, e)| FetchError::io("locking", &path, e.into()))
        }
        Err((_, e)) => Err(FetchError::io("locking", &path, e.into())),
    }
}

/// A staging directory beside the final one; removed when dropped unless committed.
pub struct Staging {
    pub dir: PathBuf,
    final_dir: PathBuf,
    committed: bool,
}

impl Staging {
    /// A new, empty `<parent>/.<name>.incoming-<pid>` (leftovers of earlier runs of this name
    /// removed: the caller holds the name's lock).
    pub fn new(final_dir: &Path) -> Result<Staging, FetchError> {
        let parent = parent_of(final_dir);
        fs::create_dir_all(parent).map_err(FetchError::io_at("creating", parent))?;
        remove_leftovers(final_dir)?;
        let dir = sibling(final_dir, &format!("incoming-{}", std::process::id()));
        fs::create_dir(&dir).map_err(FetchError::io_at("creating", &dir))?;
        Ok(Staging {
            dir,
            final_dir: final_dir.to_path_buf(),
            committed: false,
        })
    }

    /// Renames the staging directory to the final one (replacing one without a marker), syncs
    /// the parent, then writes the marker.
    pub fn commit(mut self, marker: &Marker) -> Result<(), FetchError> {
        sync_dir(&self.dir)?;
        set_aside(&self.final_dir)?;
        fs::rename(&self.dir, &self.final_dir)
            .map_err(FetchError::io_at("renaming into", &self.final_dir))?;
        self.committed = true;
        sync_dir(parent_of(&self.final_dir))?;
        write_marker(&self.final_dir, marker)
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.committed {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

/// Moves an incomplete final directory (no marker, or files that do not match it: the caller
/// said which) out of the way and removes it.
fn set_aside(final_dir: &Path) -> Result<(), FetchError> {
    if fs::symlink_metadata(final_dir).is_err() {
        return Ok(());
    }
    if fs::symlink_metadata(final_dir.join(MARKER)).is_err() {
        eprintln!(
            "fetch: replacing {} (it has no {MARKER} marker)",
            final_dir.display()
        );
    }
    let aside = sibling(final_dir, &format!("old-{}", std::process::id()));
    fs::rename(final_dir, &aside).map_err(FetchError::io_at("moving aside", final_dir))?;
    fs::remove_dir_all(&aside).map_err(FetchError::io_at("removing", &aside))
}

/// Writes `dir/.complete` through a temporary file, synced.
fn write_marker(dir: &Path, marker: &Marker) -> Result<(), FetchError> {
    let tmp = dir.join(format!("{MARKER}.tmp"));
    let text = serde_json::to_string_pretty(marker)
        .map_err(|e| FetchError::io("writing", &tmp, std::io::Error::other(e)))?;
    write_synced(&tmp, format!("{text}\n").as_bytes())?;
    let path = dir.join(MARKER);
    fs::rename(&tmp, &path).map_err(FetchError::io_at("renaming into", &path))?;
    sync_dir(dir)
}

/// Writes `bytes` to a new file at `path` and syncs it.
pub fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), FetchError> {
    let mut file = File::create(path).map_err(FetchError::io_at("creating", path))?;
    file.write_all(bytes)
        .map_err(FetchError::io_at("writing", path))?;
    file.sync_all().map_err(FetchError::io_at("syncing", path))
}

/// Copies what `from` held when it was opened to a new file `to` and syncs it.
pub fn copy_synced(from: &Input, to: &Path) -> Result<(), FetchError> {
    let mut file = File::create(to).map_err(FetchError::io_at("creating", to))?;
    from.copy_to(&mut file, to)?;
    file.sync_all().map_err(FetchError::io_at("syncing", to))
}

/// Syncs a directory (its entries' names).
pub fn sync_dir(dir: &Path) -> Result<(), FetchError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(FetchError::io_at("syncing", dir))
}

/// Removes `.<name>.incoming-*` and `.<name>.old-*` beside `final_dir`.
fn remove_leftovers(final_dir: &Path) -> Result<(), FetchError> {
    let parent = parent_of(final_dir);
    let prefix = sibling(final_dir, "");
    let prefix = prefix
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let entries = fs::read_dir(parent).map_err(FetchError::io_at("reading", parent))?;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let ours = name
            .strip_prefix(&prefix)
            .is_some_and(|rest| rest.starts_with("incoming-") || rest.starts_with("old-"));
        if ours {
            let _ = fs::remove_dir_all(entry.path());
        }
    }
    Ok(())
}

/// `<parent>/.<name>.<suffix>`.
fn sibling(final_dir: &Path, suffix: &str) -> PathBuf {
    let name = final_dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    parent_of(final_dir).join(format!(".{name}.{suffix}"))
}

fn parent_of(path: &Path) -> &Path {
    path.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::marker::{Depth, MarkedFile, State};

    fn marker() -> Marker {
        Marker {
            name: "ml-1m".into(),
            source: "http://x".into(),
            files: vec![MarkedFile {
                file: "ml-1m.zip".into(),
                size: 3,
                sha256: "ab".into(),
            }],
            placed: vec![MarkedFile {
                file: "ratings.dat".into(),
                size: 1,
                sha256: "ab".into(),
            }],
        }
    }

    fn is_complete(dir: &Path) -> bool {
        matches!(crate::marker::state(dir, Depth::Sizes), State::Complete(_))
    }

    #[test]
    fn a_commit_places_the_directory_then_the_marker() {
        let root = tempfile::tempdir().unwrap();
        let final_dir = root.path().join("data/ml-1m");
        let staging = Staging::new(&final_dir).unwrap();
        fs::write(staging.dir.join("ratings.dat"), b"x").unwrap();
        assert!(!final_dir.exists());
        staging.commit(&marker()).unwrap();
        assert!(is_complete(&final_dir));
        assert_eq!(fs::read(final_dir.join("ratings.dat")).unwrap(), b"x");
        let left: Vec<_> = fs::read_dir(root.path().join("data")).unwrap().collect();
        assert_eq!(left.len(), 1, "only the final directory is left");
    }

    #[test]
    fn a_dropped_staging_leaves_nothing_and_an_unmarked_directory_is_replaced() {
        let root = tempfile::tempdir().unwrap();
        let final_dir = root.path().join("data/ml-1m");
        fs::create_dir_all(&final_dir).unwrap();
        fs::write(final_dir.join("half"), b"x").unwrap();
        assert!(!is_complete(&final_dir));
        drop(Staging::new(&final_dir).unwrap());
        assert_eq!(fs::read_dir(root.path().join("data")).unwrap().count(), 1);
        let staging = Staging::new(&final_dir).unwrap();
        fs::write(staging.dir.join("ratings.dat"), b"y").unwrap();
        staging.commit(&marker()).unwrap();
        assert!(!final_dir.join("half").exists());
        assert!(is_complete(&final_dir));
    }

    #[test]
    fn leftovers_of_a_crashed_run_are_removed() {
        let root = tempfile::tempdir().unwrap();
        let final_dir = root.path().join("ml-1m");
        fs::create_dir_all(root.path().join(".ml-1m.incoming-1/x")).unwrap();
        fs::create_dir_all(root.path().join(".ml-100k.incoming-1")).unwrap();
        let staging = Staging::new(&final_dir).unwrap();
        assert!(!root.path().join(".ml-1m.incoming-1").exists());
        assert!(root.path().join(".ml-100k.incoming-1").exists());
        drop(staging);
    }
}
