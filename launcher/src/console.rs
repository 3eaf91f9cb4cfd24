//! Which workers' output reaches the console: `--local-ranks-filter` (only these local ranks),
//! `--redirects` (these streams to the log files only) and `--tee` (to the console and the log
//! files), spelled as torchrun spells them; and, for a rank that is hidden, what it said while
//! it was, so that it can be shown again when it fails.
//!
//! Owns: the policy and the hidden lines. Must not: write to the console or the log files (the
//! output module does), or decide when a hidden rank is shown again (the supervisor does).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Lines a hidden rank keeps for when it is shown again.
pub const HIDDEN_LINES: usize = 20;

/// Which console stream a line belongs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

/// torchrun's stream selector: `0` none, `1` stdout, `2` stderr, `3` both; for every local rank
/// or per local rank (`0:3,1:2`; ranks not named: none).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Streams {
    all: u8,
    per_rank: Vec<(u32, u8)>,
}

impl Streams {
    /// Whether `stream` of `local_rank` is selected.
    pub fn selects(&self, local_rank: u32, stream: Stream) -> bool {
        let bits = match self.per_rank.iter().find(|(r, _)| *r == local_rank) {
            Some((_, bits)) => *bits,
            None => self.all,
        };
        let bit = match stream {
            Stream::Stdout => 1,
            Stream::Stderr => 2,
        };
        bits & bit != 0
    }
}

/// `--tee` / `--redirects` as torchrun writes them.
pub fn parse_streams(text: &str) -> Result<Streams, String> {
    let bits = |t: &str| {
        match t.trim() {
        "0" => Ok(0u8),
        "1" => Ok(1),
        "2" => Ok(2),
        "3" => Ok(3),
        _ => Err(format!(
            "expected 0 (none), 1 (stdout), 2 (stderr) or 3 (both), or LOCAL_RANK:N,... (e.g. 0:3,1:2), got {text:?}"
        )),
    }
    };
    if !text.contains(':') {
        return Ok(Streams {
            all: bits(text)?,
            per_rank: Vec::new(),
        });
    }
    let mut per_rank = Vec::new();
    for item in text.split(',') {
        let (rank, b) = item
            .split_once(':')
            .ok_or_else(|| format!("expected LOCAL_RANK:N in {text:?}, got {item:?}"))?;
        let rank: u32 = rank
            .trim()
            .parse()
            .map_err(|_| format!("expected a local rank before ':' in {text:?}, got {rank:?}"))?;
        per_rank.push((rank, bits(b)?));
    }
    Ok(Streams { all: 0, per_rank })
}

/// `--local-ranks-filter`'s local ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalRanks(pub Vec<u32>);

/// `--local-ranks-filter`: local ranks separated by commas.
pub fn parse_ranks(text: &str) -> Result<LocalRanks, String> {
    text.split(',')
        .map(|r| {
            r.trim().parse::<u32>().map_err(|_| {
                format!("expected local ranks separated by commas (e.g. 0,3), got {text:?}")
            })
        })
        .collect::<Result<_, _>>()
        .map(LocalRanks)
}

/// What reaches the console, for every worker of this node.
#[derive(Debug, Clone, Default)]
pub struct Policy {
    /// `--local-ranks-filter`: only these local ranks (`None`: all).
    pub shown_ranks: Option<Vec<u32>>,
    /// `--redirects`: these streams go to the log files only.
    pub redirects: Streams,
}

impl Policy {
    /// Whether `local_rank` is shown at start (a hidden one is shown again when it fails).
    pub fn shows(&self, local_rank: u32) -> bool {
        self.shown_ranks
            .as_ref()
            .is_none_or(|ranks| ranks.contains(&local_rank))
    }

    /// The console route of one worker's `stream`: `None` when it goes to its log file only.
    pub fn route(&self, local_rank: u32, stream: Stream, muting: &Muting) -> Option<Muting> {
        (!self.redirects.selects(local_rank, stream)).then(|| muting.clone())
    }
}

/// Whether one worker's lines reach the console now, and the last ones it wrote while they did
/// not (both streams, in order).
#[derive(Debug, Clone)]
pub struct Muting {
    shown: Arc<AtomicBool>,
    hidden: Arc<Mutex<VecDeque<(Stream, String)>>>,
    /// The worker's streams not read to their end yet.
    open: Arc<AtomicUsize>,
}

impl Muting {
    /// For a worker with two streams (stdout, stderr), shown or not.
    pub fn new(shown: bool) -> Muting {
        Muting {
            shown: Arc::new(AtomicBool::new(shown)),
            hidden: Arc::default(),
            open: Arc::new(AtomicUsize::new(2)),
        }
    }

    /// One of the worker's streams was read to its end.
    pub fn stream_closed(&self) {
        let _ = (self.open).fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
    }

    /// Waits until both streams were read to their end, at most `limit` (a child of the worker
    /// may hold them open): what a worker wrote before it exited is then all held.
    pub fn wait_drained(&self, limit: Duration) {
        let until = Instant::now() + limit;
        while self.open.load(Ordering::SeqCst) > 0 && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    pub fn is_shown(&self) -> bool {
        self.shown.load(Ordering::SeqCst)
    }

    /// Keeps `line` (of `stream`) among the last [`HIDDEN_LINES`] a hidden worker wrote.
    pub fn hold(&self, stream: Stream, line: String) {
        let mut hidden = self.hidden.lock().unwrap_or_else(|p| p.into_inner());
        if hidden.len() == HIDDEN_LINES {
            hidden.pop_front();
        }
        hidden.push_back((stream, line));
    }

    /// Shows the worker from now on; the lines it wrote while hidden, oldest first (empty when
    /// it was shown already).
    pub fn show(&self) -> Vec<(Stream, String)> {
        if self.shown.swap(true, Ordering::SeqCst) {
            return Vec::new();
        }
        let mut hidden = self.hidden.lock().unwrap_or_else(|p| p.into_inner());
        hidden.drain(..).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torchrun_stream_selectors_parse() {
        let both = parse_streams("3").unwrap();
        assert!(both.selects(5, Stream::Stdout) && both.selects(5, Stream::Stderr));
        let per = parse_streams("0:1, 1:2").unwrap();
        assert!(per.selects(0, Stream::Stdout) && !per.selects(0, Stream::Stderr));
        assert!(per.selects(1, Stream::Stderr) && !per.selects(1, Stream::Stdout));
        assert!(!per.selects(2, Stream::Stdout), "ranks not named: none");
        assert!(!parse_streams("0").unwrap().selects(0, Stream::Stderr));
        for bad in ["4", "x", "0:5", "a:1", "0:1,2"] {
            assert!(parse_streams(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_ranks("0, 3").unwrap(), LocalRanks(vec![0, 3]));
        assert!(parse_ranks("0,x").is_err());
    }

    /// A hidden worker keeps its last lines, gives them up once when shown, and is shown after.
    #[test]
    fn a_hidden_worker_gives_its_last_lines_when_shown() {
        let m = Muting::new(false);
        for i in 0..HIDDEN_LINES + 5 {
            m.hold(Stream::Stdout, format!("line {i}"));
        }
        m.hold(Stream::Stderr, "the error".into());
        let lines = m.show();
        assert_eq!(lines.len(), HIDDEN_LINES);
        assert_eq!(lines[0].1, "line 6");
        assert_eq!(
            lines.last().cloned(),
            Some((Stream::Stderr, "the error".into()))
        );
        assert!(m.is_shown() && m.show().is_empty());
        let policy = Policy {
            shown_ranks: Some(vec![0, 3]),
            redirects: parse_streams("1:2").unwrap(),
        };
        assert!(policy.shows(3) && !policy.shows(1));
        assert!(policy.route(1, Stream::Stderr, &m).is_none());
        assert!(policy.route(1, Stream::Stdout, &m).is_some());
    }
}
