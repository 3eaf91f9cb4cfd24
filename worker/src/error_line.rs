//! The line a binary prints for an error: its chain of context and causes, each said once.
//!
//! Owns: joining an `anyhow` chain with ": ", leaving out a cause whose text the message before
//! it already contains (many error types print their source and also return it from
//! `source()`, which `{:#}` would say twice: `cannot read x: No such file or directory (os
//! error 2): No such file or directory (os error 2)`). Must not: print, or choose exit codes.

/// The chain of `error`, each cause once, in full (a libtorch message keeps its later lines).
pub fn chain_text(error: &anyhow::Error) -> String {
    join(error.chain().map(|cause| cause.to_string()))
}

/// [`chain_text`] on one line: each cause cut to its first line (libtorch appends a C++
/// backtrace to its messages).
pub fn one_line(error: &anyhow::Error) -> String {
    join(error.chain().map(|cause| {
        let text = cause.to_string();
        text.lines()
            .map(str::trim)
            .find(|l| !l.is_empty())
            .unwrap_or_default()
            .to_string()
    }))
}

fn join(causes: impl Iterator<Item = String>) -> String {
    let mut line = String::new();
    let mut said = String::new();
    for text in causes {
        if text.is_empty() || said.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
        said = text;
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context as _;

    #[derive(Debug, thiserror::Error)]
    #[error("cannot read {path}: {source}")]
    struct Read {
        path: String,
        source: std::io::Error,
    }

    #[test]
    fn a_cause_already_in_its_message_is_said_once() {
        let io = std::fs::read("/nonexistent/x").unwrap_err();
        let read = Read {
            path: "/nonexistent/x".into(),
            source: io,
        };
        let e = Err::<(), _>(read).context("loading x").unwrap_err();
        assert_eq!(format!("{e:#}").matches("os error 2").count(), 2);
        let line = one_line(&e);
        assert_eq!(line.matches("os error 2").count(), 1, "{line}");
        assert!(
            line.starts_with("loading x: cannot read /nonexistent/x: No such file"),
            "{line}"
        );
        assert_eq!(chain_text(&e), line);
    }

    #[test]
    fn causes_that_add_something_are_kept_and_later_lines_cut() {
        let e = anyhow::anyhow!("inner\nat frame 1\nat frame 2").context("outer");
        assert_eq!(one_line(&e), "outer: inner");
        assert_eq!(chain_text(&e), "outer: inner\nat frame 1\nat frame 2");
    }
}
