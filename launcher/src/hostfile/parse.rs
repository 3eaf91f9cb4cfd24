//! DeepSpeed's hostfile (`worker-0 slots=4` per line, `#` comments, blank lines) and its
//! `--include` / `--exclude` filters (`host1:0,2@host2`: `@` separates hosts, `:` lists slots;
//! a host without slots means all of them). Pure text in, hosts and slots out.

use std::path::Path;

/// A bad hostfile or filter: one line naming the file and line, or the flag.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct HostfileError(pub String);

/// One host of the hostfile and the slots (GPU indices, or CPU worker numbers) it offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Host {
    pub name: String,
    pub slots: Vec<u32>,
}

/// At most this many slots on one host (as `--num-processes`).
const MAX_SLOTS: u32 = 1024;

/// Reads and parses the hostfile at `path`.
pub fn read(path: &Path) -> Result<Vec<Host>, HostfileError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| HostfileError(format!("--hostfile {}: {e}", path.display())))?;
    parse(&text, &path.display().to_string())
}

/// Parses hostfile `text` (`shown` names it in errors): hosts in file order, slots `0..N`.
pub fn parse(text: &str, shown: &str) -> Result<Vec<Host>, HostfileError> {
    let mut hosts: Vec<Host> = Vec::new();
    for (n, raw) in text.lines().enumerate() {
        let line = raw.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let at = |why: String| HostfileError(format!("{shown}:{}: {why}: {raw:?}", n + 1));
        let mut words = line.split_whitespace();
        let (Some(name), Some(slots), None) = (words.next(), words.next(), words.next()) else {
            return Err(at("expected `HOST slots=N`".into()));
        };
        let count = slots
            .strip_prefix("slots=")
            .and_then(|s| s.parse::<u32>().ok())
            .filter(|s| (1..=MAX_SLOTS).contains(s))
            .ok_or_else(|| at(format!("expected slots=N with N in 1..={MAX_SLOTS}")))?;
        if !valid_host(name) {
            return Err(at(format!("{name:?} is not a host name or address")));
        }
        if hosts.iter().any(|h| h.name == name) {
            return Err(at(format!("host {name} is listed twice")));
        }
        hosts.push(Host {
            name: name.to_string(),
            slots: (0..count).collect(),
        });
    }
    if hosts.is_empty() {
        return Err(HostfileError(format!(
            "{shown}: no hosts (expected `HOST slots=N` lines)"
        )));
    }
    Ok(hosts)
}

/// A host name, an IPv4/IPv6 address or `user@host` would be fine for ssh; we take names and
/// addresses only (no option-looking or shell-special words reach ssh's command line).
fn valid_host(name: &str) -> bool {
    !name.starts_with('-')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | ':'))
}

/// An item of `--include` / `--exclude`: the host and its slot list, if any. An IPv6 address
/// is named bare (`fd00::2`, the whole host) or in brackets (`[fd00::2]:0,1`), as in a URL.
fn host_and_slots(item: &str) -> (&str, Option<&str>) {
    let item = item.trim();
    if let Some((addr, after)) = item.strip_prefix('[').and_then(|r| r.split_once(']')) {
        return (addr, after.strip_prefix(':'));
    }
    if item.parse::<std::net::Ipv6Addr>().is_ok() {
        return (item, None);
    }
    match item.split_once(':') {
        Some((name, list)) => (name, Some(list)),
        None => (item, None),
    }
}

/// `host1:0,2@host2` as (host, slots) pairs; empty slots mean the whole host.
fn parse_filter(spec: &str, flag: &str) -> Result<Vec<(String, Vec<u32>)>, HostfileError> {
    let bad = |why: String| HostfileError(format!("{flag} {spec:?}: {why}"));
    let mut out: Vec<(String, Vec<u32>)> = Vec::new();
    for item in spec.split('@') {
        let (name, slots) = match host_and_slots(item) {
            (name, Some(list)) => {
                let slots = list
                    .split(',')
                    .map(|s| s.trim().parse::<u32>())
                    .collect::<Result<Vec<u32>, _>>()
                    .map_err(|_| bad(format!("expected HOST[:SLOT,...], got {item:?}")))?;
                (name.trim(), slots)
            }
            (name, None) => (name, Vec::new()),
        };
        if name.is_empty() {
            return Err(bad(
                "a host name is empty (hosts are separated by `@`)".into()
            ));
        }
        match out.iter_mut().find(|(n, _)| n == name) {
            Some((_, have)) if have.is_empty() || slots.is_empty() => have.clear(),
            Some((_, have)) => have.extend(slots),
            None => out.push((name.to_string(), slots)),
        }
    }
    Ok(out)
}

/// The hosts and slots left after `--include` (only these) or `--exclude` (all but these), in
/// hostfile order; hosts left without slots are dropped. Names and slots must exist.
pub fn filter(
    hosts: &[Host],
    include: Option<&str>,
    exclude: Option<&str>,
) -> Result<Vec<Host>, HostfileError> {
    let (spec, flag, keep) = match (include, exclude) {
        (Some(_), Some(_)) => {
            return Err(HostfileError(
                "--include and --exclude cannot be used together".into(),
            ))
        }
        (Some(s), None) => (s, "--include", true),
        (None, Some(s)) => (s, "--exclude", false),
        (None, None) => return Ok(hosts.to_vec()),
    };
    let listed = parse_filter(spec, flag)?;
    for (name, slots) in &listed {
        let Some(host) = hosts.iter().find(|h| &h.name == name) else {
            return Err(HostfileError(format!(
                "{flag}: host {name} is not in the hostfile"
            )));
        };
        if let Some(s) = slots.iter().find(|s| !host.slots.contains(s)) {
            return Err(HostfileError(format!(
                "{flag}: host {name} has no slot {s} (it has {} slots)",
                host.slots.len()
            )));
        }
    }
    let mut out = Vec::new();
    for host in hosts {
        let spec = listed.iter().find(|(n, _)| *n == host.name).map(|(_, s)| s);
        let slots: Vec<u32> = host
            .slots
            .iter()
            .copied()
            .filter(|s| match (spec, keep) {
                (None, keep) => !keep,
                (Some(listed), true) => listed.is_empty() || listed.contains(s),
                (Some(listed), false) => !listed.is_empty() && !listed.contains(s),
            })
            .collect();
        if !slots.is_empty() {
            out.push(Host {
                name: host.name.clone(),
                slots,
            });
        }
    }
    if out.is_empty() {
        return Err(HostfileError(format!("{flag} {spec:?} leaves no host")));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(text: &str) -> Vec<Host> {
        parse(text, "hf").unwrap()
    }

    fn names(hosts: &[Host]) -> Vec<(String, Vec<u32>)> {
        hosts
            .iter()
            .map(|h| (h.name.clone(), h.slots.clone()))
            .collect()
    }

    #[test]
    fn parses_deepspeed_hostfiles() {
        let h = hosts("# cluster\nworker-0 slots=4\n\n  worker-1   slots=2  # two GPUs\n");
        assert_eq!(
            names(&h),
            vec![
                ("worker-0".to_string(), vec![0, 1, 2, 3]),
                ("worker-1".to_string(), vec![0, 1])
            ]
        );
    }

    #[test]
    fn a_bad_line_names_the_file_and_line() {
        for (text, why) in [
            ("a slots=1\nb slots=x\n", "hf:2: expected slots=N"),
            ("a slots=1\nb\n", "hf:2: expected `HOST slots=N`"),
            ("a slots=0\n", "hf:1: expected slots=N"),
            ("a slots=1 extra\n", "hf:1: expected `HOST slots=N`"),
            ("a slots=1\na slots=2\n", "hf:2: host a is listed twice"),
            (
                "-oProxy=x slots=1\n",
                "hf:1: \"-oProxy=x\" is not a host name",
            ),
            ("# nothing\n\n", "hf: no hosts"),
        ] {
            let e = parse(text, "hf").unwrap_err().to_string();
            assert!(e.starts_with(why), "{e}");
            assert!(!e.contains('\n'), "{e}");
        }
    }

    #[test]
    fn include_and_exclude_as_deepspeed_spells_them() {
        let h = hosts("h0 slots=4\nh1 slots=4\nh2 slots=2\n");
        let inc = filter(&h, Some("h1:0,2@h0"), None).unwrap();
        assert_eq!(
            names(&inc),
            vec![("h0".into(), vec![0, 1, 2, 3]), ("h1".into(), vec![0, 2])]
        );
        let exc = filter(&h, None, Some("h0:1@h2")).unwrap();
        assert_eq!(
            names(&exc),
            vec![
                ("h0".into(), vec![0, 2, 3]),
                ("h1".into(), vec![0, 1, 2, 3])
            ]
        );
        assert_eq!(filter(&h, None, None).unwrap(), h);
    }

    #[test]
    fn ipv6_hosts_are_named_bare_or_in_brackets() {
        let h = hosts("fd00::1 slots=2\nfd00::2 slots=2\n::1 slots=1\n");
        let inc = filter(&h, Some("fd00::2@::1"), None).unwrap();
        assert_eq!(
            names(&inc),
            vec![("fd00::2".into(), vec![0, 1]), ("::1".into(), vec![0])]
        );
        let exc = filter(&h, None, Some("[fd00::1]:1@[::1]")).unwrap();
        assert_eq!(
            names(&exc),
            vec![("fd00::1".into(), vec![0]), ("fd00::2".into(), vec![0, 1])]
        );
        let e = filter(&h, Some("[fd00::9]"), None).unwrap_err().to_string();
        assert!(
            e.starts_with("--include: host fd00::9 is not in the hostfile"),
            "{e}"
        );
    }

    #[test]
    fn bad_filters_are_one_line_naming_the_flag() {
        let h = hosts("h0 slots=2\nh1 slots=2\n");
        for (inc, exc, why) in [
            (
                Some("h9"),
                None,
                "--include: host h9 is not in the hostfile",
            ),
            (None, Some("h0:5"), "--exclude: host h0 has no slot 5"),
            (
                Some("h0:a"),
                None,
                "--include \"h0:a\": expected HOST[:SLOT,...]",
            ),
            (Some("h0@"), None, "--include \"h0@\": a host name is empty"),
            (None, Some("h0@h1"), "--exclude \"h0@h1\" leaves no host"),
            (Some("h0"), Some("h1"), "--include and --exclude cannot"),
        ] {
            let e = filter(&h, inc, exc).unwrap_err().to_string();
            assert!(e.starts_with(why), "{e}");
        }
    }
}
