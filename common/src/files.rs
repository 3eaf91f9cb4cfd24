//! How the project's tools open the files a user hands them and replace the files they write.
//!
//! Owns: opening an input without ever blocking on it (opened non-blocking, its type checked
//! through the open handle: a FIFO, a device, a socket or a directory is refused, as is a file
//! over the caller's bound), and writing a set of files into a directory all or nothing through
//! a private staging directory, so that nothing is written through a symbolic link planted at a
//! temporary or a final name and a failure leaves the previous files as they were.
//!
//! Must not: parse what it reads, choose where files go (callers name them), or follow a link
//! when it writes (inputs may be links: a Hugging Face cache keeps its files as links).

use std::fs::{File, FileType, OpenOptions};
use std::io::{self, Read as _, Write as _};
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// An input that cannot be read: one line naming the path.
#[derive(Debug, thiserror::Error)]
pub enum InputError {
    #[error("{}: no such file", .path.display())]
    Missing { path: PathBuf },
    #[error("{}: is {what}, not a file", .path.display())]
    NotAFile { path: PathBuf, what: &'static str },
    #[error("{}: is {size} bytes, more than the {max} this file may have", .path.display())]
    TooLarge { path: PathBuf, size: u64, max: u64 },
    /// The cause is part of the message (not a `source`, which would say it twice in a chain).
    #[error("{}: {error}", .path.display())]
    Io { path: PathBuf, error: io::Error },
}

impl InputError {
    fn io(path: &Path, error: io::Error) -> InputError {
        InputError::Io {
            path: path.to_path_buf(),
            error,
        }
    }
}

/// What a file that is not a regular file is, in words.
pub fn file_type_name(t: &FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt as _;
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_char_device() || t.is_block_device() {
        "a device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

/// Opens `path` for reading, refusing without blocking what is not a regular file of at most
/// `max` bytes; the file and its length.
pub fn open_input(path: &Path, max: u64) -> Result<(File, u64), InputError> {
    // O_NONBLOCK: opening a FIFO with no writer returns at once instead of waiting for one.
    let file = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
    {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(InputError::Missing {
                path: path.to_path_buf(),
            })
        }
        Err(e) => return Err(InputError::io(path, e)),
    };
    let meta = file.metadata().map_err(|e| InputError::io(path, e))?;
    if !meta.is_file() {
        return Err(InputError::NotAFile {
            path: path.to_path_buf(),
            what: file_type_name(&meta.file_type()),
        });
    }
    if meta.len() > max {
        return Err(InputError::TooLarge {
            path: path.to_path_buf(),
            size: meta.len(),
            max,
        });
    }
    Ok((file, meta.len()))
}

/// The bytes of `path`, opened by [`open_input`] (and read no further than `max` bytes, should
/// the file grow meanwhile).
pub fn read_input(path: &Path, max: u64) -> Result<Vec<u8>, InputError> {
    let (file, len) = open_input(path, max)?;
    let mut bytes = Vec::with_capacity(len as usize);
    file.take(max)
        .read_to_end(&mut bytes)
        .map_err(|e| InputError::io(path, e))?;
    Ok(bytes)
}

/// [`read_input`] as UTF-8 text.
pub fn read_input_text(path: &Path, max: u64) -> Result<String, InputError> {
    String::from_utf8(read_input(path, max)?).map_err(|_| {
        InputError::io(
            path,
            io::Error::new(io::ErrorKind::InvalidData, "not UTF-8 text"),
        )
    })
}

/// Files that could not be written: one line naming the path.
#[derive(Debug, thiserror::Error)]
pub enum OutputError {
    #[error("{}: {error}", .path.display())]
    Io { path: PathBuf, error: io::Error },
    /// Something that a file cannot replace stands at a final name.
    #[error("{}: is {what}, which a file cannot replace; nothing was written", .path.display())]
    Blocked { path: PathBuf, what: &'static str },
}

impl OutputError {
    fn io(path: &Path, error: io::Error) -> OutputError {
        OutputError::Io {
            path: path.to_path_buf(),
            error,
        }
    }
}

/// Staging directories made by this process so far (their names must differ).
static STAGINGS: AtomicU64 = AtomicU64::new(0);

/// Files written into a fresh private directory inside their target directory, then moved
/// into place together by [`Staging::commit`]; dropped without a commit (or after one), the
/// staging directory and whatever is left in it are removed.
#[derive(Debug)]
pub struct Staging {
    target: PathBuf,
    dir: PathBuf,
}

impl Staging {
    /// Creates `target` if needed and a new staging directory inside it (mode 0700, a name
    /// nothing else has: creating it fails rather than reuse what is there, a link included).
    pub fn new(target: &Path) -> Result<Staging, OutputError> {
        std::fs::create_dir_all(target).map_err(|e| OutputError::io(target, e))?;
        let mut last = None;
        for _ in 0..64 {
            let n = STAGINGS.fetch_add(1, Ordering::Relaxed);
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.subsec_nanos());
            let dir = target.join(format!(".staging-{}-{n}-{nanos}", std::process::id()));
            match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
                Ok(()) => {
                    return Ok(Staging {
                        target: target.to_path_buf(),
                        dir,
                    })
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = Some(e),
                Err(e) => return Err(OutputError::io(&dir, e)),
            }
        }
        let e = last.unwrap_or_else(|| io::Error::other("no free staging name"));
        Err(OutputError::io(target, e))
    }

    /// Where the staged file `name` is written (for writers that take a path).
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Writes `bytes` as the staged file `name`.
    pub fn write(&self, name: &str, bytes: &[u8]) -> Result<(), OutputError> {
        let path = self.path(name);
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .map_err(|e| OutputError::io(&path, e))?;
        file.write_all(bytes)
            .and_then(|()| file.sync_all())
            .map_err(|e| OutputError::io(&path, e))
    }

    /// Moves the staged files `names` to the same names in the target directory, all or none:
    /// a final name held by a directory (or anything else a file cannot replace) is refused
    /// before anything moves, and a move that fails puts back what the earlier ones replaced.
    /// A link at a final name is replaced, never written through.
    pub fn commit(self, names: &[&str]) -> Result<(), OutputError> {
        for name in names {
            self.check_destination(name)?;
        }
        let mut moved: Vec<(&str, bool)> = Vec::new();
        for name in names {
            let backed_up = self.back_up(name);
            let dest = self.target.join(name);
            if let Err(e) = std::fs::rename(self.path(name), &dest) {
                self.roll_back(&moved);
                return Err(OutputError::io(&dest, e));
            }
            moved.push((name, backed_up));
        }
        Ok(())
    }

    /// Refuses a final name that a renamed file could not replace.
    fn check_destination(&self, name: &str) -> Result<(), OutputError> {
        let dest = self.target.join(name);
        match std::fs::symlink_metadata(&dest) {
            Ok(meta) if meta.is_dir() => Err(OutputError::Blocked {
                path: dest,
                what: "a directory",
            }),
            Ok(_) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(OutputError::io(&dest, e)),
        }
    }

    /// A hard link to what stands at `name` now (the link itself, if it is one), so that a
    /// failed commit can put it back; whether there is one.
    fn back_up(&self, name: &str) -> bool {
        std::fs::hard_link(self.target.join(name), self.backup(name)).is_ok()
    }

    fn backup(&self, name: &str) -> PathBuf {
        self.dir.join(format!(".previous-{name}"))
    }

    fn roll_back(&self, moved: &[(&str, bool)]) {
        for &(name, backed_up) in moved.iter().rev() {
            let dest = self.target.join(name);
            let _ = if backed_up {
                std::fs::rename(self.backup(name), &dest)
            } else {
                std::fs::remove_file(&dest)
            };
        }
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn fifo(path: &Path) {
        let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    }

    #[test]
    fn inputs_that_are_not_bounded_regular_files_are_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path();
        fifo(&p.join("fifo"));
        std::fs::write(p.join("big"), [b'x'; 100]).unwrap();
        std::fs::write(p.join("ok"), "hello").unwrap();
        let err = |name: &str| read_input(&p.join(name), 10).unwrap_err().to_string();
        assert!(
            err("fifo").ends_with("fifo: is a FIFO, not a file"),
            "{}",
            err("fifo")
        );
        assert!(err(".").contains("is a directory"));
        assert!(err("big").ends_with("big: is 100 bytes, more than the 10 this file may have"));
        assert!(err("none").ends_with("none: no such file"));
        let dev = read_input(Path::new("/dev/zero"), 10).unwrap_err();
        assert!(dev.to_string().contains("is a device"), "{dev}");
        assert_eq!(read_input_text(&p.join("ok"), 10).unwrap(), "hello");
        std::fs::write(p.join("bin"), [0xff, 0xfe]).unwrap();
        assert!(read_input_text(&p.join("bin"), 10)
            .unwrap_err()
            .to_string()
            .ends_with("bin: not UTF-8 text"));
    }

    #[test]
    fn a_commit_replaces_links_at_final_names_instead_of_writing_through_them() {
        let dir = tempfile::tempdir().unwrap();
        let outside = dir.path().join("outside");
        std::fs::write(&outside, "precious").unwrap();
        let target = dir.path().join("target");
        std::fs::create_dir(&target).unwrap();
        symlink(&outside, target.join("a.txt")).unwrap();
        let staging = Staging::new(&target).unwrap();
        staging.write("a.txt", b"new").unwrap();
        staging.commit(&["a.txt"]).unwrap();
        assert_eq!(std::fs::read_to_string(&outside).unwrap(), "precious");
        assert!(!std::fs::symlink_metadata(target.join("a.txt"))
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(
            std::fs::read_to_string(target.join("a.txt")).unwrap(),
            "new"
        );
        assert_eq!(
            std::fs::read_dir(&target).unwrap().count(),
            1,
            "staging left"
        );
    }

    #[test]
    fn a_commit_blocked_at_one_name_moves_nothing_and_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path();
        std::fs::write(target.join("a.txt"), "old").unwrap();
        std::fs::create_dir(target.join("b.txt")).unwrap();
        let staging = Staging::new(target).unwrap();
        staging.write("a.txt", b"new").unwrap();
        staging.write("b.txt", b"new").unwrap();
        let err = staging.commit(&["a.txt", "b.txt"]).unwrap_err().to_string();
        assert!(err.contains("b.txt: is a directory"), "{err}");
        assert_eq!(
            std::fs::read_to_string(target.join("a.txt")).unwrap(),
            "old"
        );
        let mut left: Vec<String> = std::fs::read_dir(target)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["a.txt", "b.txt"]);
    }

    #[test]
    fn a_move_that_fails_midway_puts_back_what_it_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path();
        std::fs::write(target.join("a.txt"), "old").unwrap();
        let staging = Staging::new(target).unwrap();
        staging.write("a.txt", b"new").unwrap();
        // "b.txt" was never staged: its move fails after a.txt's.
        assert!(staging.commit(&["a.txt", "b.txt"]).is_err());
        assert_eq!(
            std::fs::read_to_string(target.join("a.txt")).unwrap(),
            "old"
        );
        assert_eq!(std::fs::read_dir(target).unwrap().count(), 1);
    }

    #[test]
    fn a_staging_directory_never_reuses_a_planted_name() {
        let dir = tempfile::tempdir().unwrap();
        let a = Staging::new(dir.path()).unwrap();
        let b = Staging::new(dir.path()).unwrap();
        assert_ne!(a.dir, b.dir);
        // A file planted at a staged name is not written through.
        let outside = dir.path().join("outside");
        std::fs::write(&outside, "precious").unwrap();
        symlink(&outside, a.path("x")).unwrap();
        assert!(a.write("x", b"new").is_err());
        assert_eq!(std::fs::read_to_string(&outside).unwrap(), "precious");
    }
}
