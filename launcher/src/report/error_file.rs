//! torchrun's error files: what a script's `@record`
//! (`torch.distributed.elastic.multiprocessing.errors.record`) writes into
//! `TORCHELASTIC_ERROR_FILE` when it dies of an exception, read back so that the failure summary
//! names the exception as torchrun's root cause does. Reads them; must not write them or decide
//! which rank is the root cause.

use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, UNIX_EPOCH};

/// The files a worker may have written are small; a larger one is not read.
const MAX_BYTES: u64 = 4 << 20;

/// An error a rank recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recorded {
    /// `ValueError: boom`.
    pub message: String,
    /// The innermost frame of the traceback, `File "train.py", line 12, in step` and its code.
    pub frame: Vec<String>,
    /// When it was recorded (seconds since the epoch), if the file says.
    pub timestamp: Option<u64>,
}

impl Recorded {
    /// The summary's lines for it, indented as the summary's.
    pub fn lines(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "  error (recorded by the rank in its error file):");
        let _ = writeln!(out, "    | {}", self.message);
        for line in &self.frame {
            let _ = writeln!(out, "    | {line}");
        }
        // A time past year 9999 (a file's nonsense) is left out rather than shown.
        let time = (self.timestamp)
            .filter(|&at| at < 253_402_300_800)
            .and_then(|at| UNIX_EPOCH.checked_add(Duration::from_secs(at)));
        if let Some(time) = time {
            let _ = writeln!(out, "    | at {}", humantime::format_rfc3339_seconds(time));
        }
        out
    }
}

/// The error recorded in `path`, if the rank wrote one there in torchrun's format (both its
/// forms: `{"message": {"message", "extraInfo": {"py_callstack", "timestamp"}}}` and
/// `{"message": "...", "timestamp": N}`). Nothing for a missing, empty, oversized or foreign file.
pub fn read(path: &Path) -> Option<Recorded> {
    use std::io::Read as _;
    let mut text = String::new();
    let file = std::fs::File::open(path).ok()?;
    file.take(MAX_BYTES).read_to_string(&mut text).ok()?;
    parse(&text)
}

fn parse(text: &str) -> Option<Recorded> {
    let data: serde_json::Value = serde_json::from_str(text).ok()?;
    let message = data.get("message")?;
    let (message, callstack, timestamp) = match message {
        serde_json::Value::String(m) => (m.clone(), None, data.get("timestamp")),
        serde_json::Value::Object(m) => {
            let extra = m.get("extraInfo");
            (
                m.get("message")?.as_str()?.to_string(),
                extra.and_then(|e| e.get("py_callstack")?.as_str()),
                extra.and_then(|e| e.get("timestamp")),
            )
        }
        _ => return None,
    };
    let timestamp = timestamp.and_then(|t| match t {
        serde_json::Value::String(s) => s.trim().parse().ok(),
        other => other.as_u64(),
    });
    Some(Recorded {
        message,
        frame: callstack.map(innermost_frame).unwrap_or_default(),
        timestamp,
    })
}

/// The last `File "...", line N, in F` line of a Python traceback and the code line under it.
fn innermost_frame(callstack: &str) -> Vec<String> {
    let lines: Vec<&str> = callstack.lines().collect();
    let Some(at) = lines
        .iter()
        .rposition(|l| l.trim_start().starts_with("File \""))
    else {
        return Vec::new();
    };
    let mut frame = vec![lines[at].trim().to_string()];
    // The code line is indented; the exception's own line (no code to show) is not.
    let code = (lines.get(at + 1))
        .filter(|l| l.starts_with(' '))
        .map(|l| l.trim())
        .filter(|l| !l.is_empty() && !l.starts_with('^') && !l.starts_with('~'));
    frame.extend(code.map(str::to_string));
    frame
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What torch 2.11's `ErrorHandler.record_exception` writes.
    const RECORDED: &str = r#"{"message": {"message": "ValueError: bad batch 3", "extraInfo": {"py_callstack": "Traceback (most recent call last):\n  File \"/x/torch/distributed/elastic/multiprocessing/errors/__init__.py\", line 362, in wrapper\n    return f(*args, **kwargs)\n           ^^^^^^^^^^^^^^^^^^\n  File \"/tmp/train.py\", line 9, in main\n    raise ValueError(f\"bad batch {i}\")\nValueError: bad batch 3\n", "timestamp": "1795996800"}}}"#;

    #[test]
    fn torchs_record_is_read_with_its_frame_and_time() {
        let r = parse(RECORDED).unwrap();
        assert_eq!(r.message, "ValueError: bad batch 3");
        assert_eq!(
            r.frame,
            vec![
                "File \"/tmp/train.py\", line 9, in main".to_string(),
                "raise ValueError(f\"bad batch {i}\")".to_string()
            ]
        );
        assert_eq!(r.timestamp, Some(1_795_996_800));
        let lines = r.lines();
        assert!(lines.contains("    | ValueError: bad batch 3\n"), "{lines}");
        assert!(lines.contains("    | at 2026-11-30T00:00:00Z\n"), "{lines}");
    }

    #[test]
    fn the_newer_flat_form_and_foreign_files() {
        let huge = parse(r#"{"message": "E: x", "timestamp": "18446744073709551615"}"#).unwrap();
        assert!(!huge.lines().contains("| at "), "{}", huge.lines());
        let r = parse(r#"{"message": "RuntimeError: x", "timestamp": 5}"#).unwrap();
        assert_eq!(
            (r.message.as_str(), r.timestamp),
            ("RuntimeError: x", Some(5))
        );
        assert!(r.frame.is_empty());
        for foreign in ["", "not json", "{}", r#"{"message": 3}"#, "[1]"] {
            assert_eq!(parse(foreign), None, "{foreign}");
        }
        assert_eq!(read(Path::new("/nonexistent/error.json")), None);
    }
}
