//! Slurm's hostlist syntax (`n[0-3,7]`, `gpu-a[01-04],gpu-b7`, `rack[1-2]-n[1-2]`), as
//! `scontrol show hostnames` expands it. It owns only the syntax: which host is the master is the
//! job shape's decision.
//!
//! Rules (Slurm's `hostlist.c`): entries are separated by commas outside brackets; a bracket
//! group holds comma-separated numbers or `lo-hi` ranges; a range keeps the zero padding of its
//! lower bound (`[08-11]` is `08 09 10 11`); several groups in one entry expand as a product, the
//! last group varying fastest.

/// A hostlist that does not parse, with the reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bad hostlist {list:?}: {reason}")]
pub struct HostlistError {
    pub list: String,
    pub reason: String,
}

/// More hosts than this is a malformed list (`n[0-999999999]`), not a job.
pub const MAX_HOSTS: usize = 1 << 20;

/// `host:port`, bracketing a bare IPv6 address.
pub fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Every host of `list`, in Slurm's order.
pub fn expand(list: &str) -> Result<Vec<String>, HostlistError> {
    let err = |reason: String| HostlistError {
        list: list.to_string(),
        reason,
    };
    if list.trim().is_empty() {
        return Err(err("it is empty".into()));
    }
    let mut hosts = Vec::new();
    for entry in split_outside_brackets(list).map_err(&err)? {
        let entry = entry.trim();
        if entry.is_empty() {
            return Err(err("it has an empty entry (two commas in a row?)".into()));
        }
        expand_entry(entry, &mut hosts).map_err(&err)?;
    }
    Ok(hosts)
}

/// The first host of `list` (the job's first node, where rank 0 runs).
pub fn first_host(list: &str) -> Result<String, HostlistError> {
    // Expanding the whole list also validates it; lists are short enough for that to be cheap.
    let hosts = expand(list)?;
    Ok(hosts.into_iter().next().unwrap_or_default())
}

/// Splits at commas that are not inside brackets; checks that brackets balance and never nest.
fn split_outside_brackets(list: &str) -> Result<Vec<&str>, String> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0u32, 0usize);
    for (i, c) in list.char_indices() {
        match c {
            '[' if depth > 0 => return Err(format!("nested '[' at column {}", i + 1)),
            '[' => depth = 1,
            ']' if depth == 0 => return Err(format!("']' without '[' at column {}", i + 1)),
            ']' => depth = 0,
            ',' if depth == 0 => {
                parts.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth > 0 {
        return Err("'[' is never closed".into());
    }
    parts.push(&list[start..]);
    Ok(parts)
}

/// One entry, e.g. `rack[1-2]-n[01-02]`: literal pieces and bracket groups, expanded as a product.
fn expand_entry(entry: &str, hosts: &mut Vec<String>) -> Result<(), String> {
    let mut prefixes = vec![String::new()];
    let mut rest = entry;
    while let Some(open) = rest.find('[') {
        let close = open + rest[open..].find(']').ok_or("'[' is never closed")?;
        let literal = &rest[..open];
        check_literal(literal)?;
        let values = expand_group(&rest[open + 1..close])?;
        let total = prefixes.len().saturating_mul(values.len());
        if hosts.len().saturating_add(total) > MAX_HOSTS {
            return Err(format!("it expands to more than {MAX_HOSTS} hosts"));
        }
        prefixes = prefixes
            .iter()
            .flat_map(|p| values.iter().map(move |v| format!("{p}{literal}{v}")))
            .collect();
        rest = &rest[close + 1..];
    }
    check_literal(rest)?;
    hosts.extend(prefixes.into_iter().map(|p| p + rest));
    Ok(())
}

fn check_literal(text: &str) -> Result<(), String> {
    match text.chars().find(|c| c.is_whitespace() || *c == ']') {
        Some(c) => Err(format!("unexpected {c:?} in a host name")),
        None => Ok(()),
    }
}

/// The inside of one bracket group: `0-3,7`, `01-04`.
fn expand_group(group: &str) -> Result<Vec<String>, String> {
    if group.trim().is_empty() {
        return Err("empty brackets '[]'".into());
    }
    let mut values = Vec::new();
    for item in group.split(',') {
        let item = item.trim();
        let (lo, hi) = item.split_once('-').unwrap_or((item, item));
        let lo_n = parse_index(lo, item)?;
        let hi_n = parse_index(hi, item)?;
        if hi_n < lo_n {
            return Err(format!("range {item:?} runs backwards"));
        }
        if (hi_n - lo_n) as usize >= MAX_HOSTS || values.len() > MAX_HOSTS {
            return Err(format!("it expands to more than {MAX_HOSTS} hosts"));
        }
        // Slurm pads to the width of the lower bound as written (`[08-11]`, `[098-100]`).
        let width = if lo.len() > 1 && lo.starts_with('0') {
            lo.len()
        } else {
            0
        };
        values.extend((lo_n..=hi_n).map(|n| format!("{n:0width$}")));
    }
    Ok(values)
}

fn parse_index(text: &str, item: &str) -> Result<u64, String> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!(
            "{item:?} in brackets is not a number or a range lo-hi"
        ));
    }
    text.parse()
        .map_err(|_| format!("{text:?} in brackets is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(list: &str) -> Vec<String> {
        expand(list).unwrap_or_else(|e| panic!("{list}: {e}"))
    }

    #[test]
    fn plain_names_and_lists() {
        assert_eq!(hosts("node7"), ["node7"]);
        assert_eq!(hosts("a,b,c"), ["a", "b", "c"]);
        assert_eq!(hosts("gpu-01.cluster.org"), ["gpu-01.cluster.org"]);
    }

    #[test]
    fn ranges_and_single_values() {
        assert_eq!(hosts("n[0-3,7]"), ["n0", "n1", "n2", "n3", "n7"]);
        assert_eq!(hosts("n[5]"), ["n5"]);
        assert_eq!(hosts("n[0-1]"), ["n0", "n1"]);
        assert_eq!(hosts("n[9-11]"), ["n9", "n10", "n11"]);
    }

    #[test]
    fn zero_padding_is_kept() {
        assert_eq!(
            hosts("gpu-a[01-04],gpu-b7"),
            ["gpu-a01", "gpu-a02", "gpu-a03", "gpu-a04", "gpu-b7"]
        );
        assert_eq!(hosts("n[08-11]"), ["n08", "n09", "n10", "n11"]);
        assert_eq!(hosts("n[098-100]"), ["n098", "n099", "n100"]);
        assert_eq!(hosts("n[0]"), ["n0"]);
        assert_eq!(hosts("n[001,010]"), ["n001", "n010"]);
    }

    #[test]
    fn several_groups_expand_as_a_product_and_suffixes_stay() {
        assert_eq!(
            hosts("rack[1-2]-n[1-2]"),
            ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]
        );
        assert_eq!(hosts("n[1-2].ib"), ["n1.ib", "n2.ib"]);
        assert_eq!(
            hosts("a[1-2],b[3-4]-ib,c"),
            ["a1", "a2", "b3-ib", "b4-ib", "c"]
        );
        assert_eq!(first_host("gpu-a[01-04],gpu-b7").unwrap(), "gpu-a01");
        assert_eq!(first_host("z9,a1").unwrap(), "z9");
    }

    #[test]
    fn bad_syntax_is_an_error_with_a_reason() {
        for (list, needle) in [
            ("", "empty"),
            ("n[0-3", "never closed"),
            ("n0-3]", "without '['"),
            ("n[[0-3]]", "nested"),
            ("n[]", "empty brackets"),
            ("n[3-1]", "backwards"),
            ("n[a-b]", "not a number"),
            ("n[1-]", "not a number"),
            ("n[1,,2]", "not a number"),
            ("a,,b", "empty entry"),
            ("a b", "unexpected"),
            ("n[0-99999999999]", "more than"),
            ("n[0-999][0-999][0-999]", "more than"),
            ("n[99999999999999999999999]", "too large"),
        ] {
            let err = expand(list).expect_err(list).to_string();
            assert!(err.contains(needle), "{list:?}: {err}");
            assert!(err.contains("bad hostlist"), "{err}");
        }
    }
}
