//! The files `fetch` reads rather than downloads (a `--from` zip or model directory, a
//! `--manifest`, a placed file checked against its marker, a finished partial download), each
//! opened once through `common::files::open_input` (non-blocking, refused at once when it is a
//! FIFO, a device, a socket or a directory, or larger than its bound) and then read only
//! through that one handle, from byte 0 each time and never past the length found at open, so
//! that a file swapped in or grown meanwhile is never what gets checked, hashed or copied.
//!
//! Owns: [`Input`] and its readers (the digest, the copy).
//!
//! Must not: write anything but the copy it is asked for, download, or judge what a file
//! holds (its callers check sizes, digests and formats).

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};

use common::files::{self, InputError};
use sha2::{Digest, Sha256};

use crate::error::FetchError;

/// A regular file opened once: its handle, its length when it was opened, its path.
#[derive(Debug)]
pub struct Input {
    file: File,
    len: u64,
    path: PathBuf,
}

impl Input {
    /// Opens `path` (following links) as a regular file of at most `max` bytes.
    pub fn open(path: &Path, max: u64) -> Result<Input, InputError> {
        let (file, len) = files::open_input(path, max)?;
        Ok(Input {
            file,
            len,
            path: path.to_path_buf(),
        })
    }

    /// The length found at open: no reader goes past it.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A reader of the file from byte 0 to the length found at open. Readers are independent
    /// (each reads at its own position through the one handle) and seekable.
    pub fn reader(&self) -> Reader<'_> {
        Reader {
            input: self,
            pos: 0,
        }
    }

    /// All its bytes (a small file).
    pub fn bytes(&self) -> Result<Vec<u8>, FetchError> {
        let mut bytes = Vec::with_capacity(self.len as usize);
        self.reader()
            .read_to_end(&mut bytes)
            .map_err(FetchError::io_at("reading", &self.path))?;
        self.whole(bytes.len() as u64)?;
        Ok(bytes)
    }

    /// The SHA-256 of its bytes, lowercase hex.
    pub fn sha256(&self) -> Result<String, FetchError> {
        let mut hasher = Sha256::new();
        let n = io::copy(&mut self.reader(), &mut hasher)
            .map_err(FetchError::io_at("reading", &self.path))?;
        self.whole(n)?;
        Ok(common::hex(&hasher.finalize()))
    }

    /// Copies its bytes into `out` (at `to`, for messages); fails unless all of them were.
    pub fn copy_to(&self, out: &mut File, to: &Path) -> Result<(), FetchError> {
        let mut reader = self.reader();
        let mut buf = vec![0u8; 1 << 20];
        let mut copied = 0;
        loop {
            let n = match reader.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(FetchError::io("reading", &self.path, e)),
            };
            out.write_all(&buf[..n])
                .map_err(FetchError::io_at("writing", to))?;
            copied += n as u64;
        }
        self.whole(copied)
    }

    /// Fails when fewer than the bytes found at open could be read (it was cut meanwhile).
    fn whole(&self, got: u64) -> Result<(), FetchError> {
        if got == self.len {
            return Ok(());
        }
        let cut = format!(
            "{} bytes when opened, {got} readable: it was cut while being read",
            self.len
        );
        Err(FetchError::io("reading", &self.path, io::Error::other(cut)))
    }
}

/// A position in an [`Input`]: reads at that position (`pread`), never past its length.
pub struct Reader<'a> {
    input: &'a Input,
    pos: u64,
}

impl Read for Reader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.input.len.saturating_sub(self.pos);
        let n = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        if n == 0 {
            return Ok(0);
        }
        let got = self.input.file.read_at(&mut buf[..n], self.pos)?;
        self.pos += got as u64;
        Ok(got)
    }
}

impl Seek for Reader<'_> {
    fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        let target = match to {
            SeekFrom::Start(n) => Some(n),
            SeekFrom::End(d) => self.input.len.checked_add_signed(d),
            SeekFrom::Current(d) => self.pos.checked_add_signed(d),
        };
        let target = target
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "seek before the start"))?;
        self.pos = target;
        Ok(target)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    #[test]
    fn readers_stop_at_the_length_found_at_open_and_see_the_opened_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x");
        fs::write(&path, b"hello").unwrap();
        let input = Input::open(&path, 100).unwrap();
        // Grown, then replaced: the handle still reads the first five bytes of the first file.
        fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
            .write_all(b" world")
            .unwrap();
        fs::write(dir.path().join("y"), b"other").unwrap();
        fs::rename(dir.path().join("y"), &path).unwrap();
        assert_eq!(input.bytes().unwrap(), b"hello");
        assert_eq!(
            input.sha256().unwrap(),
            "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
        );
        let mut r = input.reader();
        r.seek(SeekFrom::End(-2)).unwrap();
        let mut tail = String::new();
        r.read_to_string(&mut tail).unwrap();
        assert_eq!(tail, "lo");
    }

    #[test]
    fn a_file_cut_after_open_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x");
        fs::write(&path, b"hello").unwrap();
        let input = Input::open(&path, 100).unwrap();
        fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(2)
            .unwrap();
        let err = input.sha256().unwrap_err().to_string();
        assert!(err.contains("cut while being read"), "{err}");
        assert!(err.contains(&path.display().to_string()), "{err}");
    }

    #[test]
    fn fifos_and_devices_are_refused_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("f");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let err = Input::open(&fifo, 100).unwrap_err().to_string();
        assert!(err.ends_with("is a FIFO, not a file"), "{err}");
        let err = Input::open(Path::new("/dev/zero"), 100)
            .unwrap_err()
            .to_string();
        assert!(err.ends_with("is a device, not a file"), "{err}");
    }
}
