//! The flight recorder's record: what a rank keeps of its last collectives, shared by the ranks
//! that write it and `launch`, which reads it after a failure.
//!
//! Each rank keeps its last operations in a ring of fixed-size slots inside a file it maps,
//! `<run dir>/flight/rank-N.ring`: the record outlives the process, so it can be read while the
//! rank is stopped and after it was killed, when it could write nothing itself. The file is a
//! header of [`HEADER_WORDS`] and `capacity` slots of [`SLOT_WORDS`] little-endian u64 words;
//! operation `seq` (1, 2, ... counted per communicator, the same on every rank) lives in slot
//! `(seq - 1) % capacity`. A slot's sequence number is written last when an operation begins (0
//! while the slot is rewritten) and its outcome last when it ends, so a half-written slot never
//! reads as a whole one. `rank-N.json` is the same record as JSON ([`Dump`]).
//!
//! Owns: the layout, its encoding and decoding, the JSON, and `GPTREC_FLIGHT_ENTRIES`. Must not:
//! map memory (the runtime's recorder does), decide what a failure means (`launch`'s summary
//! does), or panic on what it reads (anything may be on disk).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The directory of the records inside a run directory.
pub const DIR: &str = "flight";
/// The variable that sets how many operations each rank keeps (0 turns the recorder off).
pub const ENTRIES_VAR: &str = "GPTREC_FLIGHT_ENTRIES";
/// Operations kept when [`ENTRIES_VAR`] is unset.
pub const DEFAULT_ENTRIES: u32 = 256;
/// The most a ring may hold (4 MiB of slots).
pub const MAX_ENTRIES: u32 = 65_536;
/// Words in the header, then in each slot.
pub const HEADER_WORDS: usize = 32;
pub const SLOT_WORDS: usize = 8;
/// The JSON's `format`.
pub const JSON_FORMAT: &str = "gptrec-flight/1";

const MAGIC: u64 = u64::from_le_bytes(*b"gptrflt1");
const VERSION: u64 = 1;
/// Header words holding the run's fingerprint (32 bytes), then the backend's name (64 bytes).
const RUN_AT: usize = 8;
const BACKEND_AT: usize = 12;
const TEXT_END: usize = 20;

/// Slot words written apart from the others: the sequence number (published last when an
/// operation begins), kind/dtype/outcome/tensors (written last when it ends), the end time.
pub const SLOT_SEQ: usize = 0;
pub const SLOT_META: usize = 1;
pub const SLOT_END: usize = 6;

/// A record that cannot be read or written: one line naming the file.
#[derive(Debug, thiserror::Error)]
pub enum FlightError {
    #[error(transparent)]
    Input(#[from] crate::files::InputError),
    #[error(transparent)]
    Output(#[from] crate::files::OutputError),
    #[error("{}: not a flight record: {why}", .path.display())]
    NotARecord { path: PathBuf, why: String },
    #[error("{}: {source}", .path.display())]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{ENTRIES_VAR}={text}: expected a whole number of operations from 0 (no recorder) to {MAX_ENTRIES}")]
    Entries { text: String },
}

/// Which collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    AllReduce = 1,
    Broadcast = 2,
    AllGather = 3,
    Barrier = 4,
    HostShared = 5,
    ReduceScatter = 6,
    AllGatherShards = 7,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::AllReduce => "all_reduce",
            Kind::Broadcast => "broadcast",
            Kind::AllGather => "all_gather",
            Kind::Barrier => "barrier",
            Kind::HostShared => "host_shared",
            Kind::ReduceScatter => "reduce_scatter",
            Kind::AllGatherShards => "all_gather_shards",
        }
    }

    fn from_code(code: u8) -> Option<Kind> {
        Some(match code {
            1 => Kind::AllReduce,
            2 => Kind::Broadcast,
            3 => Kind::AllGather,
            4 => Kind::Barrier,
            5 => Kind::HostShared,
            6 => Kind::ReduceScatter,
            7 => Kind::AllGatherShards,
            _ => return None,
        })
    }
}

/// The element type of an operation's tensors (`mixed` when they differ, `none` without any).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Dtype {
    None = 0,
    F32 = 1,
    Bf16 = 2,
    F16 = 3,
    F64 = 4,
    I64 = 5,
    I32 = 6,
    U8 = 7,
    Other = 8,
    Mixed = 9,
}

impl Dtype {
    pub fn as_str(self) -> &'static str {
        match self {
            Dtype::None => "none",
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
            Dtype::F64 => "f64",
            Dtype::I64 => "i64",
            Dtype::I32 => "i32",
            Dtype::U8 => "u8",
            Dtype::Other => "other",
            Dtype::Mixed => "mixed",
        }
    }

    fn from_code(code: u8) -> Dtype {
        [
            Dtype::None,
            Dtype::F32,
            Dtype::Bf16,
            Dtype::F16,
            Dtype::F64,
            Dtype::I64,
            Dtype::I32,
            Dtype::U8,
            Dtype::Other,
            Dtype::Mixed,
        ]
        .get(usize::from(code))
        .copied()
        .unwrap_or(Dtype::Other)
    }
}

/// How an operation ended, or that it had not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Running = 0,
    Ok = 1,
    Timeout = 2,
    /// The connection to a peer failed (or its process exited).
    PeerFailed = 3,
    /// The ranks called different operations.
    Mismatch = 4,
    Failed = 5,
}

impl Outcome {
    fn from_code(code: u8) -> Outcome {
        match code {
            0 => Outcome::Running,
            1 => Outcome::Ok,
            2 => Outcome::Timeout,
            3 => Outcome::PeerFailed,
            4 => Outcome::Mismatch,
            _ => Outcome::Failed,
        }
    }
}

/// One operation of one rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub seq: u64,
    pub kind: Kind,
    pub tensors: u32,
    pub elements: u64,
    pub bytes: u64,
    pub dtype: Dtype,
    /// The caller's step (`OpContext::step`).
    pub step: u64,
    /// A broadcast's source rank.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root: Option<u32>,
    pub timeout_ms: u32,
    pub start_unix_ns: u64,
    /// None while it runs.
    pub end_unix_ns: Option<u64>,
    pub outcome: Outcome,
}

/// The word holding kind, dtype, outcome and the number of tensors.
pub fn meta_word(kind: Kind, dtype: Dtype, outcome: Outcome, tensors: u32) -> u64 {
    (kind as u64) | (dtype as u64) << 8 | (outcome as u64) << 16 | u64::from(tensors) << 32
}

impl Entry {
    /// The slot's words.
    pub fn words(&self) -> [u64; SLOT_WORDS] {
        let root = self.root.unwrap_or(u32::MAX);
        [
            self.seq,
            meta_word(self.kind, self.dtype, self.outcome, self.tensors),
            self.elements,
            self.bytes,
            self.step,
            self.start_unix_ns,
            self.end_unix_ns.unwrap_or(0),
            u64::from(self.timeout_ms) | u64::from(root) << 32,
        ]
    }

    /// The operation in a slot; None for an empty or half-written one.
    pub fn from_words(w: &[u64]) -> Option<Entry> {
        let &[seq, meta, elements, bytes, step, start, end, timing] = w else {
            return None;
        };
        let kind = Kind::from_code(meta as u8)?;
        let outcome = Outcome::from_code((meta >> 16) as u8);
        let root = (timing >> 32) as u32;
        (seq != 0).then_some(Entry {
            seq,
            kind,
            tensors: (meta >> 32) as u32,
            elements,
            bytes,
            dtype: Dtype::from_code((meta >> 8) as u8),
            step,
            root: (root != u32::MAX).then_some(root),
            timeout_ms: timing as u32,
            start_unix_ns: start,
            end_unix_ns: (outcome != Outcome::Running && end != 0).then_some(end),
            outcome,
        })
    }
}

/// Who wrote a ring, for which run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Header {
    pub rank: u32,
    pub world: u32,
    pub capacity: u32,
    pub pid: u32,
    /// `TORCHELASTIC_RESTART_COUNT` of the group that wrote it.
    pub restart: u32,
    pub opened_unix_ns: u64,
    /// The run id's fingerprint (`store::run_fingerprint`).
    pub run: String,
    /// The communicator's name (`tcp (shared memory)`, `nccl`).
    pub backend: String,
}

impl Header {
    /// The header's words.
    pub fn words(&self) -> [u64; HEADER_WORDS] {
        let mut w = [0u64; HEADER_WORDS];
        w[..8].copy_from_slice(&[
            MAGIC,
            VERSION,
            u64::from(self.capacity),
            u64::from(self.rank),
            u64::from(self.world),
            u64::from(self.pid),
            u64::from(self.restart),
            self.opened_unix_ns,
        ]);
        put_text(&mut w[RUN_AT..BACKEND_AT], &self.run);
        put_text(&mut w[BACKEND_AT..TEXT_END], &self.backend);
        w
    }

    fn from_words(w: &[u64]) -> Result<Header, String> {
        if w.len() < HEADER_WORDS || w[0] != MAGIC {
            return Err("no flight-record header".into());
        }
        if w[1] != VERSION {
            return Err(format!("format version {}, expected {VERSION}", w[1]));
        }
        let small =
            |i: usize| u32::try_from(w[i]).map_err(|_| format!("header word {i} out of range"));
        Ok(Header {
            capacity: small(2)?,
            rank: small(3)?,
            world: small(4)?,
            pid: small(5)?,
            restart: small(6)?,
            opened_unix_ns: w[7],
            run: text_of(&w[RUN_AT..BACKEND_AT]),
            backend: text_of(&w[BACKEND_AT..TEXT_END]),
        })
    }
}

/// Bytes of `text` (cut to fit) into `words`, zero-padded.
fn put_text(words: &mut [u64], text: &str) {
    let mut bytes = vec![0u8; words.len() * 8];
    let n = text.len().min(bytes.len());
    bytes[..n].copy_from_slice(&text.as_bytes()[..n]);
    for (w, chunk) in words.iter_mut().zip(bytes.chunks_exact(8)) {
        let mut b = [0u8; 8];
        b.copy_from_slice(chunk);
        *w = u64::from_le_bytes(b);
    }
}

fn text_of(words: &[u64]) -> String {
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    let end = bytes.iter().position(|b| *b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

/// A ring's file length in bytes.
pub fn ring_bytes(capacity: u32) -> usize {
    (HEADER_WORDS + capacity as usize * SLOT_WORDS) * 8
}

/// The word at which the slot of operation `seq` (>= 1) begins.
pub fn slot_at(seq: u64, capacity: u32) -> usize {
    HEADER_WORDS + ((seq - 1) % u64::from(capacity.max(1))) as usize * SLOT_WORDS
}

/// One rank's ring, read back: its header and its operations, oldest first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recording {
    pub header: Header,
    pub entries: Vec<Entry>,
}

impl Recording {
    /// Decodes a ring's words; slots that are empty, half-written or not where their sequence
    /// number belongs are left out.
    pub fn decode(words: &[u64]) -> Result<Recording, String> {
        let header = Header::from_words(words)?;
        let capacity = header.capacity;
        if capacity == 0 || capacity > MAX_ENTRIES || words.len() < ring_bytes(capacity) / 8 {
            return Err(format!(
                "{} words hold no ring of {capacity} operations",
                words.len()
            ));
        }
        let slots = &words[HEADER_WORDS..ring_bytes(capacity) / 8];
        let mut entries: Vec<Entry> = slots
            .chunks_exact(SLOT_WORDS)
            .enumerate()
            .filter_map(|(i, w)| Entry::from_words(w).map(|e| (i, e)))
            .filter(|(i, e)| slot_at(e.seq, capacity) == HEADER_WORDS + i * SLOT_WORDS)
            .map(|(_, e)| e)
            .collect();
        entries.sort_by_key(|e| e.seq);
        Ok(Recording { header, entries })
    }

    /// Reads the ring at `path`.
    pub fn read(path: &Path) -> Result<Recording, FlightError> {
        let bytes = crate::files::read_input(path, ring_bytes(MAX_ENTRIES) as u64)?;
        let words: Vec<u64> = bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
            .collect();
        Recording::decode(&words).map_err(|why| FlightError::NotARecord {
            path: path.to_path_buf(),
            why,
        })
    }
}

/// `rank-N.ring` and `rank-N.json` in the records' directory.
pub fn ring_path(dir: &Path, rank: u32) -> PathBuf {
    dir.join(format!("rank-{rank}.ring"))
}

pub fn json_name(rank: u32) -> String {
    format!("rank-{rank}.json")
}

/// `rank-N.json`: a ring in words.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Dump {
    pub format: String,
    #[serde(flatten)]
    pub header: Header,
    /// `rank` when the rank wrote it after one of its collectives failed, `launch` when `launch`
    /// read the ring after the group failed.
    pub written_by: String,
    pub written_unix_ns: u64,
    /// The error of the collective that failed, when the rank wrote it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Oldest first.
    pub entries: Vec<Entry>,
}

impl Dump {
    pub fn new(recording: &Recording, written_by: &str, error: Option<String>, now: u64) -> Dump {
        Dump {
            format: JSON_FORMAT.to_string(),
            header: recording.header.clone(),
            written_by: written_by.to_string(),
            written_unix_ns: now,
            error,
            entries: recording.entries.clone(),
        }
    }

    /// Writes it whole (a staged file renamed into place) as `dir/rank-N.json`.
    pub fn write(&self, dir: &Path) -> Result<PathBuf, FlightError> {
        let name = json_name(self.header.rank);
        let text = serde_json::to_string_pretty(self).map_err(|source| FlightError::Json {
            path: dir.join(&name),
            source,
        })?;
        let staging = crate::files::Staging::new(dir)?;
        staging.write(&name, text.as_bytes())?;
        staging.commit(&[&name])?;
        Ok(dir.join(name))
    }

    pub fn read(path: &Path) -> Result<Dump, FlightError> {
        let text = crate::files::read_input_text(path, 64 << 20)?;
        serde_json::from_str(&text).map_err(|source| FlightError::Json {
            path: path.to_path_buf(),
            source,
        })
    }
}

/// How many operations each rank keeps: [`ENTRIES_VAR`]'s value, [`DEFAULT_ENTRIES`] when it is
/// unset or empty.
pub fn entries_from(value: Option<&str>) -> Result<u32, FlightError> {
    let text = value.unwrap_or("").trim();
    if text.is_empty() {
        return Ok(DEFAULT_ENTRIES);
    }
    text.parse::<u32>()
        .ok()
        .filter(|n| *n <= MAX_ENTRIES)
        .ok_or_else(|| FlightError::Entries {
            text: text.to_string(),
        })
}

/// Nanoseconds since the Unix epoch, now (0 for a clock before 1970).
pub fn unix_ns_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(seq: u64, outcome: Outcome) -> Entry {
        Entry {
            seq,
            kind: Kind::AllReduce,
            tensors: 3,
            elements: 1000,
            bytes: 4000,
            dtype: Dtype::F32,
            step: 7,
            root: None,
            timeout_ms: 2000,
            start_unix_ns: 1_000 + seq,
            end_unix_ns: (outcome != Outcome::Running).then_some(2_000 + seq),
            outcome,
        }
    }

    fn header(capacity: u32) -> Header {
        Header {
            rank: 2,
            world: 3,
            capacity,
            pid: 4242,
            restart: 1,
            opened_unix_ns: 99,
            run: "sha256:0123456789ab".into(),
            backend: "tcp (shared memory in each host, ring between hosts)".into(),
        }
    }

    /// A ring of `capacity` slots after operations `1..=last` (the last one still running).
    fn ring(capacity: u32, last: u64) -> Vec<u64> {
        let mut words = vec![0u64; ring_bytes(capacity) / 8];
        words[..HEADER_WORDS].copy_from_slice(&header(capacity).words());
        for seq in 1..=last {
            let outcome = if seq == last {
                Outcome::Running
            } else {
                Outcome::Ok
            };
            let at = slot_at(seq, capacity);
            words[at..at + SLOT_WORDS].copy_from_slice(&entry(seq, outcome).words());
        }
        words
    }

    #[test]
    fn a_ring_reads_back_oldest_first_with_what_was_overwritten_gone() {
        let rec = Recording::decode(&ring(4, 6)).unwrap();
        assert_eq!(rec.header, header(4));
        let seqs: Vec<u64> = rec.entries.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, [3, 4, 5, 6]);
        assert_eq!(rec.entries[3], entry(6, Outcome::Running));
        assert_eq!(rec.entries[3].end_unix_ns, None);
        assert_eq!(rec.entries[0], entry(3, Outcome::Ok));
    }

    #[test]
    fn a_slot_being_rewritten_and_garbage_are_left_out_never_a_panic() {
        let mut words = ring(4, 2);
        words[slot_at(2, 4) + SLOT_SEQ] = 0; // a begin that was cut short
        let rec = Recording::decode(&words).unwrap();
        assert_eq!(rec.entries.len(), 1);
        // An operation in a slot that is not its own is not believed.
        let at = slot_at(2, 4);
        words[at..at + SLOT_WORDS].copy_from_slice(&entry(9, Outcome::Ok).words());
        assert_eq!(Recording::decode(&words).unwrap().entries.len(), 1);
        assert!(Recording::decode(&words[..HEADER_WORDS + 3]).is_err());
        assert!(Recording::decode(&[7u64; 64]).is_err());
        let mut other = ring(4, 1);
        other[1] = 9;
        assert!(Recording::decode(&other).unwrap_err().contains("version 9"));
    }

    #[test]
    fn the_json_round_trips_and_is_written_whole() {
        let dir = tempfile::tempdir().unwrap();
        let rec = Recording::decode(&ring(8, 3)).unwrap();
        let dump = Dump::new(&rec, "rank", Some("all_reduce timed out".into()), 5);
        let path = dump.write(dir.path()).unwrap();
        assert_eq!(path, dir.path().join("rank-2.json"));
        let back = Dump::read(&path).unwrap();
        assert_eq!(back, dump);
        let text = std::fs::read_to_string(&path).unwrap();
        for needle in [
            "\"format\": \"gptrec-flight/1\"",
            "\"kind\": \"all_reduce\"",
            "\"outcome\": \"running\"",
            "\"end_unix_ns\": null",
        ] {
            assert!(text.contains(needle), "{needle} in {text}");
        }
        // Only the file: no staging directory is left.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn entries_come_from_the_variable() {
        assert_eq!(entries_from(None).unwrap(), DEFAULT_ENTRIES);
        assert_eq!(entries_from(Some(" ")).unwrap(), DEFAULT_ENTRIES);
        assert_eq!(entries_from(Some("0")).unwrap(), 0);
        assert_eq!(entries_from(Some("1000")).unwrap(), 1000);
        for bad in ["-1", "lots", "65537", "2.5"] {
            let text = entries_from(Some(bad)).unwrap_err().to_string();
            assert!(
                text.starts_with(&format!("GPTREC_FLIGHT_ENTRIES={bad}: ")),
                "{text}"
            );
        }
    }

    #[test]
    fn texts_too_long_are_cut_not_spilled() {
        let mut h = header(4);
        h.backend = "x".repeat(100);
        let words = h.words();
        assert_eq!(Header::from_words(&words).unwrap().backend, "x".repeat(64));
    }
}
