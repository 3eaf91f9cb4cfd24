//! Downloading one file into its partial file (`<cache>/.partial/<name>/<file>.part`) and
//! checking it: resume with `Range: bytes=N-` (a 206 appends, a 200 starts over, a 416 or a
//! partial file longer than expected starts over cleanly), retries of cut, stalled or too slow
//! transfers (each held to its `http::Pace`), mirrors in turn, then the size and SHA-256 check
//! (a mismatch deletes the file). Also small files read whole (a model's `config.json`).
//!
//! Must not: unpack, place anything in the cache's final directories, or know about assets.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::Path;

use crate::error::FetchError;
use crate::http::{Client, ContentRange, Pace, Reply};
use crate::input::Input;
use crate::progress::Progress;

/// One file to download and what it must be.
pub struct Want<'a> {
    /// The file's name, for messages (`ml-1m.zip`).
    pub label: &'a str,
    /// Where to get it, tried in turn.
    pub urls: &'a [String],
    pub size: u64,
    /// Lowercase hex SHA-256.
    pub sha256: &'a str,
}

/// How downloads behave.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    pub quiet: bool,
    /// How many times a cut or stalled transfer is resumed within one run.
    pub retries: u32,
}

/// What a partial file of `have` bytes means when `size` are expected.
#[derive(Debug, PartialEq, Eq)]
pub enum Start {
    /// Nothing there: download from byte 0.
    Fresh,
    /// Ask for the rest from this byte.
    Resume(u64),
    /// All bytes are there: only check them.
    Complete,
    /// More than expected: not this file; delete it and start over.
    TooBig,
}

pub fn plan_start(have: u64, size: u64) -> Start {
    match have {
        0 => Start::Fresh,
        h if h < size => Start::Resume(h),
        h if h == size => Start::Complete,
        _ => Start::TooBig,
    }
}

/// What to do with the server's answer to a GET from `offset`.
#[derive(Debug, PartialEq, Eq)]
pub enum Answer {
    /// The body continues the partial file at `offset`.
    Append,
    /// The body is the whole file (a 200): truncate and write from 0.
    StartOver,
    /// The range was refused or misplaced (416, a 206 elsewhere): delete and ask again.
    Discard,
    /// The server's file has another size than expected (its size).
    WrongSize(u64),
}

pub fn judge(
    offset: u64,
    size: u64,
    status: u16,
    range: Option<ContentRange>,
    length: Option<u64>,
) -> Answer {
    match status {
        416 => Answer::Discard,
        206 => match range {
            Some(r) if r.total.is_some_and(|t| t != size) => {
                Answer::WrongSize(r.total.unwrap_or(0))
            }
            Some(r) if r.start == offset && r.end < size => Answer::Append,
            _ => Answer::Discard,
        },
        _ => match length {
            Some(len) if len != size => Answer::WrongSize(len),
            _ => Answer::StartOver,
        },
    }
}

/// Downloads `want` into `part` (resuming what is there) and checks it. On success `part`
/// holds exactly the wanted bytes, synced to disk.
pub fn download(
    client: &Client,
    want: &Want,
    part: &Path,
    opts: Options,
) -> Result<(), FetchError> {
    if let Some(dir) = part.parent() {
        fs::create_dir_all(dir).map_err(FetchError::io_at("creating", dir))?;
    }
    match_sidecar(want, part)?;
    let have = file_len(part)?;
    let mut progress = Progress::new(want.label, Some(want.size), have.min(want.size), opts.quiet);
    let result = from_mirrors(client, want, part, opts, &mut progress);
    match result {
        Ok(()) => progress.finish(),
        Err(e) => {
            progress.abandon();
            return Err(e);
        }
    }
    verify(want, part)
}

/// Tries each URL in turn (the next one after an error that retrying would not cure).
fn from_mirrors(
    client: &Client,
    want: &Want,
    part: &Path,
    opts: Options,
    progress: &mut Progress,
) -> Result<(), FetchError> {
    let mut last = None;
    for (i, url) in want.urls.iter().enumerate() {
        match with_retries(client, want, url, part, opts, progress) {
            Ok(()) => return Ok(()),
            Err(e) if i + 1 < want.urls.len() && !matches!(e, FetchError::Io { .. }) => {
                progress.note(&format!("{e}; trying the next URL"));
                last = Some(e);
            }
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| FetchError::Hub(format!("no URL to download {} from", want.label))))
}

fn with_retries(
    client: &Client,
    want: &Want,
    url: &str,
    part: &Path,
    opts: Options,
    progress: &mut Progress,
) -> Result<(), FetchError> {
    let mut tries = 0;
    loop {
        match transfer(client, want, url, part, progress) {
            Err(e) if e.is_transient() && tries < opts.retries => {
                tries += 1;
                progress.note(&format!(
                    "{e}; resuming (retry {tries} of {})",
                    opts.retries
                ));
            }
            Err(e) if e.is_transient() => {
                let got = file_len(part).unwrap_or(0);
                return Err(FetchError::Transfer {
                    url: url.to_string(),
                    detail: format!(
                        "{}; {got} of {} bytes kept, rerun to resume",
                        transfer_detail(&e),
                        want.size
                    ),
                });
            }
            other => return other,
        }
    }
}

fn transfer_detail(e: &FetchError) -> String {
    match e {
        FetchError::Transfer { detail, .. } => detail.clone(),
        other => other.to_string(),
    }
}

/// One request: from where the partial file ends to the end (or nothing, when complete).
fn transfer(
    client: &Client,
    want: &Want,
    url: &str,
    part: &Path,
    progress: &mut Progress,
) -> Result<(), FetchError> {
    let mut have = file_len(part)?;
    match plan_start(have, want.size) {
        Start::Complete => return Ok(()),
        Start::TooBig => {
            remove(part)?;
            progress.restart();
            have = 0;
        }
        Start::Fresh | Start::Resume(_) => {}
    }
    let reply = client.get(url, have)?;
    match judge(
        have,
        want.size,
        reply.status,
        reply.content_range,
        reply.content_length,
    ) {
        Answer::Append => write_body(client, reply, part, have, want.size, progress),
        Answer::StartOver => {
            progress.restart();
            write_body(client, reply, part, 0, want.size, progress)
        }
        Answer::Discard if have > 0 => {
            remove(part)?;
            progress.restart();
            transfer(client, want, url, part, progress)
        }
        Answer::Discard => Err(FetchError::Status {
            url: reply.url,
            status: format!("{} to a request without a range", reply.status),
        }),
        Answer::WrongSize(got) => Err(FetchError::Size {
            file: want.label.to_string(),
            expected: want.size,
            got,
            then: format!(" at {}", reply.url),
        }),
    }
}

/// Writes the body into `part` from byte `from` (truncating there), never past `size`, within
/// the time the client's [`Pace`] allows for the `size - from` bytes.
fn write_body(
    client: &Client,
    reply: Reply,
    part: &Path,
    from: u64,
    size: u64,
    progress: &mut Progress,
) -> Result<(), FetchError> {
    let mut file = open_at(part, from)?;
    let pace = client.pace(size.saturating_sub(from));
    let mut body = reply.body.into_reader();
    let mut written = from;
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = match body.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(client.read_error(&reply.url, &e)),
        };
        if written + n as u64 > size {
            remove(part)?;
            return Err(too_long(part, size, written + n as u64));
        }
        file.write_all(&buf[..n])
            .map_err(FetchError::io_at("writing", part))?;
        written += n as u64;
        progress.add(n as u64);
        if written < size {
            pace.check(&reply.url, written - from)?;
        }
    }
    file.sync_all()
        .map_err(FetchError::io_at("syncing", part))?;
    if written < size {
        return Err(client.read_error(&reply.url, &io::ErrorKind::UnexpectedEof.into()));
    }
    Ok(())
}

fn too_long(part: &Path, size: u64, got: u64) -> FetchError {
    FetchError::Size {
        file: file_name(part),
        expected: size,
        got,
        then: "; the server sent more, the download was deleted".into(),
    }
}

/// `part` opened for writing at byte `from`, cut there.
fn open_at(part: &Path, from: u64) -> Result<File, FetchError> {
    let file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(part)
        .map_err(FetchError::io_at("opening", part))?;
    file.set_len(from)
        .map_err(FetchError::io_at("truncating", part))?;
    Ok(file)
}

/// What [`verify`] says after deleting a download that failed its check.
const DELETED: &str = "; the download was deleted, rerun to start over";

/// The largest partial download read back (far above any asset).
const PART_MAX: u64 = u64::MAX;

/// Checks that `part` has the wanted size and SHA-256; deletes it when not.
pub fn verify(want: &Want, part: &Path) -> Result<(), FetchError> {
    let result = Input::open(part, PART_MAX)
        .map_err(FetchError::from)
        .and_then(|input| check(want, &input, DELETED));
    if matches!(
        result,
        Err(FetchError::Size { .. } | FetchError::Checksum { .. })
    ) {
        remove(part)?;
        remove(&sidecar(part))?;
    }
    result
}

/// Checks that `input` has the wanted size and SHA-256; `then` ends the error line.
pub fn check(want: &Want, input: &Input, then: &str) -> Result<(), FetchError> {
    if input.len() != want.size {
        return Err(FetchError::Size {
            file: want.label.to_string(),
            expected: want.size,
            got: input.len(),
            then: then.to_string(),
        });
    }
    let got = input.sha256()?;
    if got != want.sha256 {
        return Err(FetchError::Checksum {
            file: want.label.to_string(),
            expected: want.sha256.to_string(),
            got,
            then: then.to_string(),
        });
    }
    Ok(())
}

/// `<part>.want`: the size and SHA-256 the partial file was downloaded for.
fn sidecar(part: &Path) -> std::path::PathBuf {
    let mut name = part.as_os_str().to_owned();
    name.push(".want");
    name.into()
}

/// Deletes a partial file that was downloaded for other bytes (a new revision, another
/// manifest), then records what this one is for.
fn match_sidecar(want: &Want, part: &Path) -> Result<(), FetchError> {
    let side = sidecar(part);
    let wanted = format!("{} {}\n", want.size, want.sha256);
    let recorded = common::files::read_input_text(&side, 1024).ok();
    if recorded.as_deref() == Some(wanted.as_str()) {
        return Ok(());
    }
    remove(part)?;
    fs::write(&side, wanted).map_err(FetchError::io_at("writing", &side))
}

/// Removes a partial file and its record, once what it held is placed.
pub fn discard(part: &Path) {
    let _ = fs::remove_file(part);
    let _ = fs::remove_file(sidecar(part));
    if let Some(dir) = part.parent() {
        let _ = fs::remove_dir(dir);
    }
}

/// A small file (at most `max` bytes) read whole from `url`; its `Content-Length`, when
/// given, must match what arrived. It is allowed the time of its `Content-Length` (else of
/// `max` bytes) at the floor rate, as every transfer is ([`Pace`]).
pub fn small_file(
    client: &Client,
    url: &str,
    label: &str,
    max: u64,
) -> Result<Vec<u8>, FetchError> {
    let reply = client.get(url, 0)?;
    if reply.status != 200 {
        return Err(FetchError::Status {
            url: reply.url,
            status: reply.status.to_string(),
        });
    }
    let expected = reply.content_length.unwrap_or(max).min(max);
    let pace = client.pace(expected);
    let mut body = reply.body.into_reader().take(max + 1);
    let bytes = read_paced(client, &mut body, &reply.url, pace, expected)?;
    let got = bytes.len() as u64;
    if got > max {
        return Err(FetchError::BadContent {
            file: label.to_string(),
            detail: format!("larger than {max} bytes at {}", reply.url),
        });
    }
    match reply.content_length {
        Some(len) if len != got => Err(FetchError::Size {
            file: label.to_string(),
            expected: len,
            got,
            then: format!(" (Content-Length of {})", reply.url),
        }),
        _ => Ok(bytes),
    }
}

/// All of `body`, read within `pace` while fewer than the `expected` bytes are there.
fn read_paced(
    client: &Client,
    body: &mut impl Read,
    url: &str,
    pace: Pace,
    expected: u64,
) -> Result<Vec<u8>, FetchError> {
    let mut bytes = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match body.read(&mut buf) {
            Ok(0) => return Ok(bytes),
            Ok(n) => bytes.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(client.read_error(url, &e)),
        }
        if (bytes.len() as u64) < expected {
            pace.check(url, bytes.len() as u64)?;
        }
    }
}

/// The length of `path`, 0 when it does not exist.
fn file_len(path: &Path) -> Result<u64, FetchError> {
    match fs::metadata(path) {
        Ok(m) => Ok(m.len()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(0),
        Err(e) => Err(FetchError::io("reading", path, e)),
    }
}

/// Removes `path` if it is there.
pub fn remove(path: &Path) -> Result<(), FetchError> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(FetchError::io("removing", path, e)),
        _ => Ok(()),
    }
}

fn file_name(path: &Path) -> String {
    path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use common::hex;
    use sha2::{Digest, Sha256};

    fn range(start: u64, end: u64, total: Option<u64>) -> Option<ContentRange> {
        Some(ContentRange { start, end, total })
    }

    #[test]
    fn a_partial_file_resumes_restarts_or_is_complete() {
        assert_eq!(plan_start(0, 10), Start::Fresh);
        assert_eq!(plan_start(4, 10), Start::Resume(4));
        assert_eq!(plan_start(10, 10), Start::Complete);
        assert_eq!(plan_start(11, 10), Start::TooBig);
    }

    #[test]
    fn answers_append_start_over_or_discard() {
        // A 206 at the right place appends.
        assert_eq!(
            judge(4, 10, 206, range(4, 9, Some(10)), Some(6)),
            Answer::Append
        );
        assert_eq!(judge(4, 10, 206, range(4, 9, None), None), Answer::Append);
        // A 200 is the whole file: start over.
        assert_eq!(judge(4, 10, 200, None, Some(10)), Answer::StartOver);
        assert_eq!(judge(0, 10, 200, None, None), Answer::StartOver);
        // A refused or misplaced range: delete and ask again.
        assert_eq!(judge(4, 10, 416, None, None), Answer::Discard);
        assert_eq!(
            judge(4, 10, 206, range(0, 9, Some(10)), None),
            Answer::Discard
        );
        assert_eq!(judge(4, 10, 206, None, None), Answer::Discard);
        // The server's file is another one.
        assert_eq!(judge(0, 10, 200, None, Some(11)), Answer::WrongSize(11));
        assert_eq!(
            judge(4, 10, 206, range(4, 11, Some(12)), None),
            Answer::WrongSize(12)
        );
    }

    #[test]
    fn a_wrong_file_is_deleted_by_the_check() {
        let dir = tempfile::tempdir().unwrap();
        let part = dir.path().join("a.part");
        fs::write(&part, b"abc").unwrap();
        let sha = hex(&Sha256::digest(b"abc"));
        let urls = [];
        let want = |sha256, size| Want {
            label: "a",
            urls: &urls,
            size,
            sha256,
        };
        verify(&want(&sha, 3), &part).unwrap();
        let other = hex(&Sha256::digest(b"abd"));
        let err = verify(&want(&other, 3), &part).unwrap_err().to_string();
        assert!(
            err.contains(&format!("expected sha256 {other}, got {sha}")),
            "{err}"
        );
        assert!(!part.exists());
        fs::write(&part, b"abcd").unwrap();
        let err = verify(&want(&sha, 3), &part).unwrap_err().to_string();
        assert!(err.contains("expected 3 bytes, got 4"), "{err}");
        assert!(!part.exists());
    }
}
