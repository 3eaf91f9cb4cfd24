//! The `.complete` marker a placement ends with, and checking a placed directory against it:
//! the marker records every placed file's path (relative to the directory), size and SHA-256,
//! and a directory counts as complete only while its files are there with those sizes (every
//! use) or those digests (`--verify`). A file that is missing, not a file, or of another size
//! or digest is named in one line, and the directory is then treated as not complete.
//!
//! Owns: the marker's format (kept readable by earlier versions' markers through serde
//! defaults), reading it, and the check of a directory's files against it.
//!
//! Must not: write or remove anything (placing and replacing is `place`'s), download, or
//! decide what a directory must hold (its callers record the files they placed).

use std::fs;
use std::io;
use std::path::{Component, Path, PathBuf};

use common::files::{self, InputError};
use serde::{Deserialize, Serialize};

use crate::input::Input;

/// The marker's file name inside a placed directory.
pub const MARKER: &str = ".complete";
/// The largest marker read (one line of about 150 bytes a file; a data set has a few dozen).
const MARKER_MAX: u64 = 16 << 20;

/// What the marker records.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Marker {
    pub name: String,
    /// Where it came from (a URL or `--from PATH`).
    pub source: String,
    /// What was checked on the way in: a data set's zip (`ml-1m.zip`), a model's two files.
    pub files: Vec<MarkedFile>,
    /// Every file placed in the directory (`file` relative to it), checked on every use.
    ///
    /// Markers written before this field existed have none (serde's default) and are accepted
    /// as they are: they cover only what `files` says was checked on the way in (for a data
    /// set the zip, whose unpacked files they do not list), so their directories' files are
    /// not checked, and `--verify` says so.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub placed: Vec<MarkedFile>,
}

/// One checked file: a download (`ml-1m.zip`) or a placed file (`model.safetensors`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MarkedFile {
    pub file: String,
    pub size: u64,
    pub sha256: String,
}

/// How closely a placement's files are compared with its marker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Depth {
    /// Presence, type and size: cheap, on every use.
    Sizes,
    /// Also every file's SHA-256 (`--verify`): reads every byte.
    Digests,
}

/// What a final directory holds, by its marker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    /// No marker, or one that cannot be read: not placed by `fetch`, or not finished.
    Unmarked,
    /// Its marker, and every file it lists is as recorded.
    Complete(Marker),
    /// Its marker, but a file it lists is not as recorded: one line naming it and what differs.
    Differs(Marker, String),
}

/// The marker of `dir`, if there is one that can be read (opened as an input: a FIFO or a
/// device planted there is refused, not waited on).
pub fn read(dir: &Path) -> Option<Marker> {
    let bytes = files::read_input(&dir.join(MARKER), MARKER_MAX).ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// `dir` checked against its marker to `depth`.
pub fn state(dir: &Path, depth: Depth) -> State {
    match read(dir) {
        None => State::Unmarked,
        Some(marker) => judge(dir, marker, depth),
    }
}

/// The verdict on `dir` given its `marker`: complete, or the first file that differs (and how
/// many more do).
pub fn judge(dir: &Path, marker: Marker, depth: Depth) -> State {
    let differing: Vec<String> = marker
        .placed
        .iter()
        .filter_map(|f| differs(dir, f, depth))
        .collect();
    match differing.split_first() {
        None => State::Complete(marker),
        Some((first, rest)) => {
            let more = match rest.len() {
                0 => String::new(),
                1 => " (and 1 more file differs)".to_string(),
                n => format!(" (and {n} more files differ)"),
            };
            State::Differs(marker, format!("{first}{more}"))
        }
    }
}

/// How the placed file `f` in `dir` differs from its record, if it does.
fn differs(dir: &Path, f: &MarkedFile, depth: Depth) -> Option<String> {
    let Some(rel) = inside(&f.file) else {
        return Some(format!(
            "{}: lists {:?}, not a path inside {}",
            dir.join(MARKER).display(),
            f.file,
            dir.display()
        ));
    };
    let path = dir.join(rel);
    let found = match depth {
        Depth::Sizes => by_size(&path),
        Depth::Digests => by_digest(&path, f.size),
    };
    let shown = path.display();
    match found {
        Found::Missing => Some(format!(
            "{shown}: missing, though its {MARKER} marker lists it"
        )),
        Found::Unusable(why) => Some(why),
        Found::File { size, .. } if size != f.size => Some(format!(
            "{shown}: {size} bytes, its {MARKER} marker records {}",
            f.size
        )),
        Found::File {
            sha256: Some(got), ..
        } if got != f.sha256 => Some(format!(
            "{shown}: sha256 {got}, its {MARKER} marker records {}",
            f.sha256
        )),
        Found::File { .. } => None,
    }
}

/// What is at a placed file's path.
enum Found {
    Missing,
    /// Not a regular file, or unreadable: one line naming the path.
    Unusable(String),
    /// A file: its size, and its SHA-256 when it was hashed.
    File {
        size: u64,
        sha256: Option<String>,
    },
}

/// The type and size of what is at `path`.
fn by_size(path: &Path) -> Found {
    match fs::metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Found::Missing,
        Err(e) => Found::Unusable(format!("{}: {e}", path.display())),
        Ok(m) if !m.is_file() => Found::Unusable(format!(
            "{}: is {}, not a file",
            path.display(),
            files::file_type_name(&m.file_type())
        )),
        Ok(m) => Found::File {
            size: m.len(),
            sha256: None,
        },
    }
}

/// What is at `path`, opened as an input, and its SHA-256 when it has the `recorded` size.
fn by_digest(path: &Path, recorded: u64) -> Found {
    let input = match Input::open(path, u64::MAX) {
        Err(InputError::Missing { .. }) => return Found::Missing,
        Err(e) => return Found::Unusable(e.to_string()),
        Ok(input) => input,
    };
    if input.len() != recorded {
        return Found::File {
            size: input.len(),
            sha256: None,
        };
    }
    match input.sha256() {
        Ok(sha256) => Found::File {
            size: input.len(),
            sha256: Some(sha256),
        },
        Err(e) => Found::Unusable(e.to_string()),
    }
}

/// `file` as a relative path that stays inside the directory (no `..`, not absolute, not
/// empty), or `None`.
fn inside(file: &str) -> Option<PathBuf> {
    let path = Path::new(file);
    let plain = path.components().all(|c| matches!(c, Component::Normal(_)));
    (plain && !file.is_empty()).then(|| path.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::{Digest, Sha256};

    fn record(file: &str, bytes: &[u8]) -> MarkedFile {
        MarkedFile {
            file: file.into(),
            size: bytes.len() as u64,
            sha256: common::hex(&Sha256::digest(bytes)),
        }
    }

    /// A directory with `a` and `sub/b`, and a marker that lists them.
    fn placed() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir(dir.path().join("sub")).unwrap();
        fs::write(dir.path().join("a"), b"abc").unwrap();
        fs::write(dir.path().join("sub/b"), b"de").unwrap();
        let marker = Marker {
            name: "ml-1m".into(),
            source: "x".into(),
            files: vec![],
            placed: vec![record("a", b"abc"), record("sub/b", b"de")],
        };
        fs::write(
            dir.path().join(MARKER),
            serde_json::to_vec(&marker).unwrap(),
        )
        .unwrap();
        dir
    }

    fn detail(state: State) -> String {
        match state {
            State::Differs(_, detail) => detail,
            other => panic!("not a difference: {other:?}"),
        }
    }

    #[test]
    fn a_placement_as_recorded_is_complete_to_either_depth() {
        let dir = placed();
        assert!(matches!(
            state(dir.path(), Depth::Sizes),
            State::Complete(_)
        ));
        assert!(matches!(
            state(dir.path(), Depth::Digests),
            State::Complete(_)
        ));
    }

    #[test]
    fn sizes_catch_a_missing_or_resized_file_and_digests_a_changed_one() {
        let dir = placed();
        fs::write(dir.path().join("a"), b"abd").unwrap();
        assert!(matches!(
            state(dir.path(), Depth::Sizes),
            State::Complete(_)
        ));
        let got = detail(state(dir.path(), Depth::Digests));
        assert!(got.contains("/a: sha256 "), "{got}");
        assert!(
            got.contains("its .complete marker records ba7816bf"),
            "{got}"
        );
        fs::remove_file(dir.path().join("sub/b")).unwrap();
        fs::write(dir.path().join("a"), b"abcd").unwrap();
        let got = detail(state(dir.path(), Depth::Sizes));
        assert!(
            got.ends_with("/a: 4 bytes, its .complete marker records 3 (and 1 more file differs)"),
            "{got}"
        );
        fs::write(dir.path().join("a"), b"abc").unwrap();
        let got = detail(state(dir.path(), Depth::Sizes));
        assert!(
            got.ends_with("/sub/b: missing, though its .complete marker lists it"),
            "{got}"
        );
        fs::create_dir(dir.path().join("sub/b")).unwrap();
        let got = detail(state(dir.path(), Depth::Sizes));
        assert!(got.ends_with("/sub/b: is a directory, not a file"), "{got}");
    }

    #[test]
    fn markers_of_earlier_versions_are_accepted_and_garbled_ones_are_not() {
        let dir = tempfile::tempdir().unwrap();
        let old = r#"{"name":"ml-1m","source":"x","files":[{"file":"ml-1m.zip","size":3,"sha256":"ab"}]}"#;
        fs::write(dir.path().join(MARKER), old).unwrap();
        match state(dir.path(), Depth::Digests) {
            State::Complete(m) => assert!(m.placed.is_empty() && m.files.len() == 1),
            other => panic!("{other:?}"),
        }
        fs::write(dir.path().join(MARKER), b"{").unwrap();
        assert_eq!(state(dir.path(), Depth::Sizes), State::Unmarked);
    }

    #[test]
    fn a_listed_path_outside_the_directory_is_a_difference() {
        let dir = tempfile::tempdir().unwrap();
        let marker = Marker {
            name: "ml-1m".into(),
            source: "x".into(),
            files: vec![],
            placed: vec![record("../x", b"")],
        };
        fs::write(
            dir.path().join(MARKER),
            serde_json::to_vec(&marker).unwrap(),
        )
        .unwrap();
        let got = detail(state(dir.path(), Depth::Sizes));
        assert!(got.contains("lists \"../x\", not a path inside"), "{got}");
    }
}
