//! TensorBoard's event files, written without TensorBoard: `tensorboard --logdir runs` shows a
//! run's scalars. The format is small and documented (TensorFlow's `TFRecord` framing around
//! `tensorflow.Event` protocol buffers, `tensorboard/compat/proto/event.proto`): each record is
//! its length (u64, little-endian), the masked CRC-32C of that length, the bytes, and their
//! masked CRC-32C; the first event carries `file_version = "brain.Event:2"`, each later one a
//! wall time, a step and a `Summary` (field 5) of `(tag, simple_value)` pairs, or a resume's
//! `SessionLog` (field 7) START.
//!
//! Owns the encoding and the file; must not decide what is logged (the trainer's).

use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// One event file, appended to as scalars come.
#[derive(Debug)]
pub struct EventWriter {
    file: File,
    path: PathBuf,
}

impl EventWriter {
    /// A new event file in `dir` (made if missing), named as TensorFlow names them
    /// (`events.out.tfevents.<seconds>.<host>.<pid>`), headed by its version event. TensorBoard
    /// reads a directory's files in name order, so the seconds are past every earlier file's
    /// (two starts within one second would otherwise sort by their pids).
    pub fn create(dir: &Path) -> std::io::Result<EventWriter> {
        std::fs::create_dir_all(dir)?;
        let now = wall_time();
        let host = nix_hostname();
        let latest = std::fs::read_dir(dir)?
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                let rest = name.strip_prefix("events.out.tfevents.")?;
                rest.split('.').next()?.parse::<u64>().ok()
            })
            .max();
        let seconds = latest.map_or(now as u64, |l| (now as u64).max(l + 1));
        let name = format!(
            "events.out.tfevents.{seconds}.{host}.{}",
            std::process::id()
        );
        let path = dir.join(name);
        let file = OpenOptions::new()
            .create_new(true)
            .append(true)
            .open(&path)?;
        let mut writer = EventWriter { file, path };
        let mut event = Vec::new();
        put_double(&mut event, 1, now);
        put_bytes(&mut event, 3, b"brain.Event:2");
        writer.write_record(&event)?;
        Ok(writer)
    }

    /// Says that the run starts again at `step` (a resume): TensorBoard then drops the points at
    /// `step` and after that earlier files hold (a `SessionLog` START, as TensorFlow writes it),
    /// so the steps written again are not shown twice.
    pub fn restart_at(&mut self, step: u64) -> std::io::Result<()> {
        let mut session_log = Vec::new();
        put_varint_field(&mut session_log, 1, 1); // status: START
        let mut event = Vec::new();
        put_double(&mut event, 1, wall_time());
        put_varint_field(&mut event, 2, step);
        put_bytes(&mut event, 7, &session_log);
        self.write_record(&event)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// One event at `step` with every `(tag, value)` of `scalars` (written as f32, as
    /// TensorBoard's `simple_value` holds them).
    pub fn scalars(&mut self, step: u64, scalars: &[(String, f64)]) -> std::io::Result<()> {
        if scalars.is_empty() {
            return Ok(());
        }
        let mut summary = Vec::new();
        for (tag, value) in scalars {
            let mut v = Vec::new();
            put_bytes(&mut v, 1, tag.as_bytes());
            put_float(&mut v, 2, *value as f32);
            put_bytes(&mut summary, 1, &v);
        }
        let mut event = Vec::new();
        put_double(&mut event, 1, wall_time());
        put_varint_field(&mut event, 2, step);
        put_bytes(&mut event, 5, &summary);
        self.write_record(&event)
    }

    /// The record framing, in one write (a kill leaves a whole record or a cut last one, which
    /// TensorBoard's reader skips).
    fn write_record(&mut self, data: &[u8]) -> std::io::Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        let mut record = Vec::with_capacity(data.len() + 16);
        record.extend_from_slice(&len);
        record.extend_from_slice(&masked_crc(&len).to_le_bytes());
        record.extend_from_slice(data);
        record.extend_from_slice(&masked_crc(data).to_le_bytes());
        self.file.write_all(&record)
    }
}

fn wall_time() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// This host's name for the file name (`localhost` when it cannot be read or is odd).
fn nix_hostname() -> String {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let name = name.trim();
    let plain = !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_".contains(c));
    if plain {
        name.to_string()
    } else {
        "localhost".to_string()
    }
}

/// TFRecord's masked CRC-32C.
fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// Protocol buffers' field key: number and wire type.
fn put_key(out: &mut Vec<u8>, field: u64, wire: u64) {
    put_varint(out, (field << 3) | wire);
}

fn put_varint_field(out: &mut Vec<u8>, field: u64, value: u64) {
    put_key(out, field, 0);
    put_varint(out, value);
}

fn put_double(out: &mut Vec<u8>, field: u64, value: f64) {
    put_key(out, field, 1);
    out.extend_from_slice(&value.to_le_bytes());
}

fn put_float(out: &mut Vec<u8>, field: u64, value: f32) {
    put_key(out, field, 5);
    out.extend_from_slice(&value.to_le_bytes());
}

fn put_bytes(out: &mut Vec<u8>, field: u64, bytes: &[u8]) {
    put_key(out, field, 2);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc_and_varints_are_the_formats() {
        // CRC-32C's check value, and TFRecord's mask of it.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        let mut v = Vec::new();
        put_varint(&mut v, 300);
        assert_eq!(v, [0xac, 0x02]);
    }

    #[test]
    fn records_frame_their_events() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path()).unwrap();
        w.scalars(7, &[("train/loss".into(), 0.5)]).unwrap();
        w.scalars(8, &[]).unwrap();
        let bytes = std::fs::read(w.path()).unwrap();
        let mut at = 0;
        let mut records = 0;
        while at < bytes.len() {
            let len = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize;
            let len_crc = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap());
            assert_eq!(len_crc, masked_crc(&bytes[at..at + 8]));
            let data = &bytes[at + 12..at + 12 + len];
            let crc = u32::from_le_bytes(bytes[at + 12 + len..at + 16 + len].try_into().unwrap());
            assert_eq!(crc, masked_crc(data));
            at += 16 + len;
            records += 1;
        }
        assert_eq!(records, 2, "the version event and one of scalars");
        let name = w.path().file_name().unwrap().to_str().unwrap().to_string();
        assert!(name.starts_with("events.out.tfevents."), "{name}");
        // A second file, in the same second, sorts after the first (TensorBoard's read order).
        let again = EventWriter::create(dir.path()).unwrap();
        let second = again
            .path()
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .to_string();
        assert!(second > name, "{second} <= {name}");
    }
}
