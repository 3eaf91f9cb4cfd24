//! Unpacking a data set's zip into a (staging) directory, safely: a single top folder
//! (GroupLens' `ml-1m/`) is dropped so the files land directly in the directory; entries with
//! `..`, absolute paths or drive letters, symlinks, duplicates (two central directory records of
//! one path, counted from the records themselves: the zip crate keeps only the last), too many
//! entries or too many bytes in all (zip bombs) are refused; every file is synced, and hashed
//! as it is written (for the marker).
//!
//! Must not: download, or write anywhere but the directory it is given (which it expects to
//! be new and empty).

use std::collections::HashSet;
use std::fs::{self, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::FetchError;
use crate::input::Input;

/// Limits against zip bombs.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Bytes of all files together, unpacked.
    pub total_bytes: u64,
    pub entries: usize,
}

/// Far above MovieLens (ml-1m unpacks to about 24 MB, ml-100k to about 16 MB).
pub const LIMITS: Limits = Limits {
    total_bytes: 1 << 30,
    entries: 10_000,
};

const S_IFMT: u32 = 0o170_000;
const S_IFLNK: u32 = 0o120_000;

/// One file written: its path relative to the destination, its size and SHA-256 (of the bytes
/// written, hashed as they were).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unpacked {
    pub path: PathBuf,
    pub size: u64,
    pub sha256: String,
}

/// Unpacks the zip `zip` (opened once, read no further than its length at open) into `dest`
/// (an empty directory); returns the files written. `label` names the zip in messages.
pub fn unpack(
    zip: &Input,
    dest: &Path,
    label: &str,
    limits: Limits,
) -> Result<Vec<Unpacked>, FetchError> {
    let bad = |detail: String| FetchError::BadContent {
        file: label.to_string(),
        detail,
    };
    let mut archive =
        zip::ZipArchive::new(zip.reader()).map_err(|e| bad(format!("not a readable zip: {e}")))?;
    let names = entry_names(&mut archive, &mut zip.reader(), limits).map_err(bad)?;
    let top = common_top(&names);
    let mut written = Vec::new();
    let mut budget = limits.total_bytes;
    for (i, name) in names.iter().enumerate() {
        let Some(rel) = target(name, top.as_deref()).map_err(bad)? else {
            continue;
        };
        let mut entry = archive
            .by_index(i)
            .map_err(|e| bad(format!("{name}: {e}")))?;
        if entry.is_dir() {
            let dir = dest.join(&rel);
            fs::create_dir_all(&dir).map_err(FetchError::io_at("creating", &dir))?;
            continue;
        }
        let out = dest.join(&rel);
        let (size, sha256) = write_entry(&mut entry, &out, budget).map_err(|e| match e {
            Extract::TooBig => bad(format!(
                "unpacks to more than {} bytes (refused)",
                limits.total_bytes
            )),
            Extract::Zip(detail) => bad(format!("{name}: {detail}")),
            Extract::Io(what, e) => FetchError::io(what, &out, e),
        })?;
        budget -= size;
        written.push(Unpacked {
            path: rel,
            size,
            sha256,
        });
    }
    sync_dirs(dest, &written)?;
    Ok(written)
}

/// Every entry's name, after refusing duplicates (read from `raw`, the same zip), symlinks,
/// too many entries or too many bytes declared.
fn entry_names<R: Read + Seek>(
    archive: &mut zip::ZipArchive<R>,
    raw: &mut (impl Read + Seek),
    limits: Limits,
) -> Result<Vec<String>, String> {
    if archive.len() > limits.entries {
        return Err(format!(
            "has {} entries, more than {} (refused)",
            archive.len(),
            limits.entries
        ));
    }
    let records = record_names(raw, archive.central_directory_start(), limits.entries)
        .map_err(|e| format!("its central directory cannot be read: {e}"))?;
    refuse_duplicates(&records, archive.len())?;
    let mut names = Vec::with_capacity(archive.len());
    let mut declared: u64 = 0;
    for i in 0..archive.len() {
        let entry = archive.by_index_raw(i).map_err(|e| e.to_string())?;
        if entry.unix_mode().is_some_and(|m| m & S_IFMT == S_IFLNK) {
            return Err(format!("{}: a symlink (refused)", entry.name()));
        }
        declared = declared.saturating_add(entry.size());
        if declared > limits.total_bytes {
            return Err(format!(
                "unpacks to more than {} bytes (refused)",
                limits.total_bytes
            ));
        }
        names.push(entry.name().to_string());
    }
    Ok(names)
}

/// The signature of a central directory record.
const CENTRAL_RECORD: [u8; 4] = *b"PK\x01\x02";

/// The name of every record of the central directory that starts at `start`, in order, at
/// most `max + 1` of them. The zip crate keeps one entry per name (the last), so a duplicate
/// is seen only here.
fn record_names(raw: &mut (impl Read + Seek), start: u64, max: usize) -> io::Result<Vec<String>> {
    raw.seek(SeekFrom::Start(start))?;
    let mut names = Vec::new();
    while names.len() <= max {
        let mut sig = [0u8; 4];
        if raw.read_exact(&mut sig).is_err() || sig != CENTRAL_RECORD {
            break;
        }
        // The rest of the fixed part: name, extra field and comment lengths at 24, 26 and 28.
        let mut fixed = [0u8; 42];
        raw.read_exact(&mut fixed)?;
        let len_at = |i: usize| u16::from_le_bytes([fixed[i], fixed[i + 1]]);
        let mut name = vec![0u8; usize::from(len_at(24))];
        raw.read_exact(&mut name)?;
        raw.seek(SeekFrom::Current(
            i64::from(len_at(26)) + i64::from(len_at(28)),
        ))?;
        names.push(String::from_utf8_lossy(&name).into_owned());
    }
    Ok(names)
}

/// Refuses two records of one path (`a/b`, `a//b` and `a/./b` are one), naming the second;
/// and, should names that differ as bytes decode alike, more records than the `kept` entries.
fn refuse_duplicates(records: &[String], kept: usize) -> Result<(), String> {
    let mut seen = HashSet::new();
    for name in records {
        let parts: Vec<&str> = name
            .split('/')
            .filter(|p| !p.is_empty() && *p != ".")
            .collect();
        if !seen.insert(parts.join("/")) {
            return Err(format!("{name}: a duplicate entry (refused)"));
        }
    }
    if records.len() != kept {
        return Err(format!(
            "has {} records for {kept} entry names: duplicate entries (refused)",
            records.len()
        ));
    }
    Ok(())
}

/// The one folder every entry is in (`ml-1m`), if there is one.
pub fn common_top(names: &[String]) -> Option<String> {
    let first = names.first()?.split('/').next()?;
    let all_inside = names.iter().all(|n| match n.split_once('/') {
        Some((top, _)) => top == first,
        None => false,
    });
    (all_inside && !first.is_empty()).then(|| first.to_string())
}

/// Where entry `name` goes, relative to the destination, without the `top` folder: `None` for
/// the top folder itself; an error for an unsafe path.
pub fn target(name: &str, top: Option<&str>) -> Result<Option<PathBuf>, String> {
    let unsafe_path = || format!("{name:?}: an unsafe path (refused)");
    if name.starts_with('/')
        || name.starts_with('\\')
        || name.contains('\\')
        || name.contains(':')
        || name.contains('\0')
    {
        return Err(unsafe_path());
    }
    let mut parts: Vec<&str> = name
        .split('/')
        .filter(|p| !p.is_empty() && *p != ".")
        .collect();
    if parts.contains(&"..") {
        return Err(unsafe_path());
    }
    if let Some(top) = top {
        if parts.first() == Some(&top) {
            parts.remove(0);
        }
    }
    Ok((!parts.is_empty()).then(|| parts.iter().collect()))
}

enum Extract {
    TooBig,
    Zip(String),
    Io(&'static str, io::Error),
}

/// Writes one entry to `out` (a new file), at most `budget` bytes; returns its size and the
/// SHA-256 of what was written.
fn write_entry(entry: &mut impl Read, out: &Path, budget: u64) -> Result<(u64, String), Extract> {
    if let Some(dir) = out.parent() {
        fs::create_dir_all(dir).map_err(|e| Extract::Io("creating", e))?;
    }
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(out)
        .map_err(|e| Extract::Io("creating", e))?;
    let mut limited = entry.take(budget + 1);
    let mut buf = vec![0u8; 1 << 16];
    let mut n: u64 = 0;
    let mut hasher = Sha256::new();
    loop {
        let got = match limited.read(&mut buf) {
            Ok(0) => break,
            Ok(got) => got,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(Extract::Zip(e.to_string())),
        };
        n += got as u64;
        if n > budget {
            return Err(Extract::TooBig);
        }
        file.write_all(&buf[..got])
            .map_err(|e| Extract::Io("writing", e))?;
        hasher.update(&buf[..got]);
    }
    file.sync_all().map_err(|e| Extract::Io("syncing", e))?;
    Ok((n, common::hex(&hasher.finalize())))
}

/// Syncs `dest` and every directory a file was written in.
fn sync_dirs(dest: &Path, files: &[Unpacked]) -> Result<(), FetchError> {
    let mut dirs: Vec<PathBuf> = files
        .iter()
        .filter_map(|f| f.path.parent().map(|p| dest.join(p)))
        .collect();
    dirs.push(dest.to_path_buf());
    dirs.sort();
    dirs.dedup();
    for dir in dirs {
        crate::place::sync_dir(&dir)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;
    use zip::write::SimpleFileOptions;

    #[test]
    fn unsafe_paths_are_refused() {
        for name in [
            "../x",
            "a/../../x",
            "/etc/passwd",
            "\\x",
            "a\\..\\b",
            "C:/x",
            "a/\0b",
        ] {
            assert!(target(name, None).is_err(), "{name}");
        }
    }

    #[test]
    fn the_top_folder_is_dropped() {
        let t = |n| target(n, Some("ml-1m")).unwrap();
        assert_eq!(t("ml-1m/"), None);
        assert_eq!(t("ml-1m/ratings.dat"), Some(PathBuf::from("ratings.dat")));
        assert_eq!(t("ml-1m/./sub/x"), Some(PathBuf::from("sub/x")));
        assert_eq!(target("x.dat", None).unwrap(), Some(PathBuf::from("x.dat")));
    }

    #[test]
    fn a_common_top_folder_is_found_only_when_all_share_it() {
        let v = |names: &[&str]| names.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            common_top(&v(&["ml-1m/", "ml-1m/a", "ml-1m/b"])),
            Some("ml-1m".into())
        );
        assert_eq!(common_top(&v(&["ml-1m/a", "other/b"])), None);
        assert_eq!(common_top(&v(&["a", "b"])), None);
        assert_eq!(common_top(&v(&[])), None);
    }

    fn zip_of(entries: &[(&str, &[u8])], symlink: Option<&str>) -> Vec<u8> {
        let mut w = zip::ZipWriter::new(Cursor::new(Vec::new()));
        let opts = SimpleFileOptions::default();
        for (name, data) in entries {
            w.start_file(*name, opts).unwrap();
            w.write_all(data).unwrap();
        }
        if let Some(link) = symlink {
            w.add_symlink(link, "/etc/passwd", opts).unwrap();
        }
        w.finish().unwrap().into_inner()
    }

    fn unpack_bytes(
        bytes: &[u8],
        limits: Limits,
    ) -> (tempfile::TempDir, Result<Vec<Unpacked>, FetchError>) {
        let dir = tempfile::tempdir().unwrap();
        let zip_path = dir.path().join("a.zip");
        fs::write(&zip_path, bytes).unwrap();
        let dest = dir.path().join("out");
        fs::create_dir(&dest).unwrap();
        let zip = Input::open(&zip_path, u64::MAX).unwrap();
        let result = unpack(&zip, &dest, "a.zip", limits);
        (dir, result)
    }

    #[test]
    fn grouplens_layout_unpacks_flat() {
        let bytes = zip_of(
            &[
                ("ml-1m/ratings.dat", b"1::2::3::4\n"),
                ("ml-1m/README", b"hi"),
            ],
            None,
        );
        let (dir, result) = unpack_bytes(&bytes, LIMITS);
        let files = result.unwrap();
        let paths: Vec<&Path> = files.iter().map(|f| f.path.as_path()).collect();
        assert_eq!(paths, [Path::new("ratings.dat"), Path::new("README")]);
        assert_eq!(files[1].size, 2);
        assert_eq!(
            files[1].sha256,
            "8f434346648f6b96df89dda901c5176b10a6d83961dd3c1ac88b59b2dc327aa4"
        );
        assert_eq!(
            fs::read(dir.path().join("out/ratings.dat")).unwrap(),
            b"1::2::3::4\n"
        );
    }

    #[test]
    fn symlinks_traversal_and_bombs_are_refused() {
        let link = zip_of(&[("d/a", b"x")], Some("d/link"));
        let err = unpack_bytes(&link, LIMITS).1.unwrap_err().to_string();
        assert!(err.contains("symlink"), "{err}");
        let evil = zip_of(&[("d/../../evil", b"x")], None);
        let err = unpack_bytes(&evil, LIMITS).1.unwrap_err().to_string();
        assert!(err.contains("unsafe path"), "{err}");
        let big = zip_of(&[("d/a", &[0u8; 5000])], None);
        let small = Limits {
            total_bytes: 4096,
            entries: 10,
        };
        let err = unpack_bytes(&big, small).1.unwrap_err().to_string();
        assert!(err.contains("more than 4096 bytes"), "{err}");
        let many = zip_of(&[("d/a", b"1"), ("d/b", b"2"), ("d/c", b"3")], None);
        let few = Limits {
            total_bytes: 4096,
            entries: 2,
        };
        let err = unpack_bytes(&many, few).1.unwrap_err().to_string();
        assert!(err.contains("3 entries"), "{err}");
        let err = unpack_bytes(b"not a zip", LIMITS)
            .1
            .unwrap_err()
            .to_string();
        assert!(err.contains("not a readable zip"), "{err}");
    }

    /// `from` replaced by `to` (of the same length) wherever it occurs in `bytes`.
    fn patched(bytes: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
        let mut out = bytes.to_vec();
        let mut i = 0;
        while i + from.len() <= out.len() {
            if &out[i..i + from.len()] == from {
                out[i..i + from.len()].copy_from_slice(to);
            }
            i += 1;
        }
        out
    }

    #[test]
    fn duplicate_entries_are_refused_naming_the_entry() {
        // The zip writer refuses a duplicate name: write two, then rename the second (its local
        // header and its central directory record) to the first's name.
        let two = zip_of(&[("d/a", b"first"), ("d/b", b"later")], None);
        let dup = patched(&two, b"d/b", b"d/a");
        let err = unpack_bytes(&dup, LIMITS).1.unwrap_err().to_string();
        assert_eq!(err, "a.zip: d/a: a duplicate entry (refused)");
        // The same path spelt another way is the same entry.
        let two = zip_of(&[("d/a", b"first"), ("d//a", b"later")], None);
        let err = unpack_bytes(&two, LIMITS).1.unwrap_err().to_string();
        assert_eq!(err, "a.zip: d//a: a duplicate entry (refused)");
    }
}
