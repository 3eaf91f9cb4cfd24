//! The elastic part of a job's shape (`--nnodes MIN:MAX`, torchrun's spelling): the node range,
//! the rendezvous endpoint and its timeouts, each with its [`Source`]. Parsing only: the
//! rendezvous itself is the launcher's.

use std::time::Duration;

use super::{parse_host, parse_port, Count, CountError, Flags, Pet, ShapeError, Source, Sourced};

/// torchrun's default port of the c10d rendezvous endpoint.
pub const DEFAULT_RDZV_PORT: u16 = 29400;
/// How long the first rendezvous waits for `MIN` nodes (torchrun's `join_timeout`).
pub const DEFAULT_JOIN_TIMEOUT: Duration = Duration::from_secs(900);
/// Once `MIN` nodes are there, how long to wait for more (torchrun's `last_call_timeout`).
pub const DEFAULT_LAST_CALL: Duration = Duration::from_secs(30);

/// A node count as written: `N` or `MIN:MAX`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeRange {
    pub min: u32,
    pub max: u32,
}

impl NodeRange {
    /// The count when the range is fixed (`4`, `4:4`).
    pub fn fixed(self) -> Option<u32> {
        (self.min == self.max).then_some(self.min)
    }
}

/// Parses `N` or `MIN:MAX` (1 <= MIN <= MAX <= [`super::MAX_NODES`]).
pub fn parse_node_range(text: &str) -> Result<NodeRange, String> {
    let text = text.trim();
    let count = |part: &str| match Count::Nodes.parse(part) {
        Ok(0) => Err("must be at least 1".to_string()),
        Ok(n) => Ok(n),
        Err(CountError::TooMany(why)) => Err(why),
        Err(CountError::NotANumber) => Err(format!(
            "expected a positive number or MIN:MAX (e.g. 2:4), got {text:?}"
        )),
    };
    let (min, max) = match text.split_once(':') {
        Some((lo, hi)) => (count(lo)?, count(hi)?),
        None => {
            let n = count(text)?;
            (n, n)
        }
    };
    if min > max {
        return Err(format!(
            "the minimum {min} is above the maximum {max} in {text:?}"
        ));
    }
    Ok(NodeRange { min, max })
}

/// An elastic job: between `min` and `max` nodes meet at `endpoint`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Elastic {
    pub min: u32,
    pub max: u32,
    /// Where `MIN:MAX` came from.
    pub range_source: Source,
    /// Host and port of the rendezvous store: the launcher on that host binds it and hosts the
    /// store; the others connect.
    pub endpoint: Sourced<(String, u16)>,
    /// How long a rendezvous waits for `MIN` nodes before the job gives up.
    pub join_timeout: Sourced<Duration>,
    /// Once `MIN` nodes are there, how long the first rendezvous waits for more.
    pub last_call: Sourced<Duration>,
}

/// `--rdzv-conf` as torchrun takes it: `key=value,key=value`. Known keys: `join_timeout` (also
/// torchrun's `timeout`) and `last_call_timeout` (seconds); `--rdzv-timeout` is `join_timeout`.
pub fn parse_rdzv_conf(text: &str) -> Result<Vec<(String, Duration)>, String> {
    let mut out = Vec::new();
    for item in text.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let (key, value) = item
            .split_once('=')
            .ok_or_else(|| format!("expected key=value, got {item:?}"))?;
        let key = match key.trim() {
            "timeout" | "join_timeout" => "join_timeout",
            "last_call_timeout" => "last_call_timeout",
            other => {
                return Err(format!(
                    "unknown key {other:?} (expected join_timeout, timeout or last_call_timeout)"
                ))
            }
        };
        out.push((key.to_string(), parse_secs(value)?));
    }
    Ok(out)
}

/// Seconds, `0 < s <= 1 day`.
pub fn parse_secs(text: &str) -> Result<Duration, String> {
    let secs: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("expected seconds (e.g. 30 or 0.5), got {text:?}"))?;
    if !(secs.is_finite() && secs > 0.0 && secs <= 86_400.0) {
        return Err(format!(
            "must be above 0 and at most 86400 seconds, got {text:?}"
        ));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// `HOST[:PORT]` (port default [`DEFAULT_RDZV_PORT`]).
pub fn parse_endpoint(text: &str) -> Result<(String, u16), String> {
    let text = text.trim();
    let (host, port) = match text.rsplit_once(':') {
        Some((h, p)) if !h.ends_with(':') && !p.contains(']') => (h, Some(p)),
        _ => (text, None),
    };
    let host = parse_host(host.trim_start_matches('[').trim_end_matches(']'))?;
    let port = match port {
        Some(p) => parse_port(p)?,
        None => DEFAULT_RDZV_PORT,
    };
    if port == 0 {
        return Err("the port must be fixed (every node connects to it), not 0".into());
    }
    Ok((host, port))
}

/// The elastic shape when the node count is a range with `MIN < MAX`; `master` is the resolved
/// master address and port, the endpoint when none is given.
pub(super) fn resolve(
    flags: &Flags,
    pet: &Pet<'_>,
    range: Sourced<NodeRange>,
    master: (&Sourced<String>, &Sourced<u16>),
    by_rendezvous: bool,
) -> Result<Option<Elastic>, ShapeError> {
    if range.value.fixed().is_some() && !by_rendezvous {
        return Ok(None);
    }
    let endpoint = if let Some(text) = &flags.rdzv_endpoint {
        let ep = parse_endpoint(text)
            .map_err(|e| ShapeError(format!("--rdzv-endpoint {text:?}: {e}")))?;
        Sourced::new(ep, Source::Flag("--rdzv-endpoint"))
    } else if let Some(ep) = pet.get("RDZV_ENDPOINT", parse_endpoint)? {
        ep
    } else {
        let (addr, port) = master;
        if port.value == 0 {
            return Err(ShapeError(
                "an elastic job needs a fixed rendezvous port: give --rdzv-endpoint HOST:PORT"
                    .into(),
            ));
        }
        Sourced::new(
            (addr.value.clone(), port.value),
            Source::Default("the master address and port"),
        )
    };
    let conf = |key: &str| {
        flags
            .rdzv_conf
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| *v)
    };
    let join_timeout = if let Some(t) = flags.rdzv_timeout {
        Sourced::new(t, Source::Flag("--rdzv-timeout"))
    } else if let Some(t) = conf("join_timeout") {
        Sourced::new(t, Source::Flag("--rdzv-conf"))
    } else if let Some(t) = pet.get("RDZV_TIMEOUT", parse_secs)? {
        t
    } else {
        Sourced::new(DEFAULT_JOIN_TIMEOUT, Source::Default(""))
    };
    let last_call = match conf("last_call_timeout") {
        Some(t) => Sourced::new(t, Source::Flag("--rdzv-conf")),
        None => Sourced::new(DEFAULT_LAST_CALL, Source::Default("")),
    };
    Ok(Some(Elastic {
        min: range.value.min,
        max: range.value.max,
        range_source: range.source,
        endpoint,
        join_timeout,
        last_call,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_ranges_parse_and_bad_ones_say_why() {
        assert_eq!(parse_node_range("3"), Ok(NodeRange { min: 3, max: 3 }));
        assert_eq!(parse_node_range(" 2:4 "), Ok(NodeRange { min: 2, max: 4 }));
        assert_eq!(parse_node_range("2:4").unwrap().fixed(), None);
        assert_eq!(parse_node_range("4:4").unwrap().fixed(), Some(4));
        assert!(parse_node_range("4:2")
            .unwrap_err()
            .contains("above the maximum"));
        assert!(parse_node_range("0:2").unwrap_err().contains("at least 1"));
        assert!(parse_node_range("a:2").unwrap_err().contains("MIN:MAX"));
        assert!(parse_node_range("").is_err());
    }

    #[test]
    fn endpoints_and_conf_parse() {
        assert_eq!(parse_endpoint("node1:1234"), Ok(("node1".into(), 1234)));
        assert_eq!(
            parse_endpoint("node1"),
            Ok(("node1".into(), DEFAULT_RDZV_PORT))
        );
        assert_eq!(parse_endpoint("[::1]:5"), Ok(("::1".into(), 5)));
        assert!(parse_endpoint("node1:0").unwrap_err().contains("fixed"));
        assert!(parse_endpoint("node1:x").is_err());
        let conf = parse_rdzv_conf("join_timeout=60, last_call_timeout=0.5").unwrap();
        assert_eq!(
            conf,
            vec![
                ("join_timeout".to_string(), Duration::from_secs(60)),
                ("last_call_timeout".to_string(), Duration::from_millis(500)),
            ]
        );
        assert!(parse_rdzv_conf("read_timeout=5")
            .unwrap_err()
            .contains("unknown key"));
        assert!(parse_rdzv_conf("join_timeout")
            .unwrap_err()
            .contains("key=value"));
        assert!(parse_rdzv_conf("join_timeout=-1").is_err());
    }
}
