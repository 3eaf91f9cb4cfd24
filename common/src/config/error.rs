//! Config errors: one line each, naming where the problem is (`file:line:column`, or the
//! `--set` override that brought the value).

use std::fmt;
use std::io;

use crate::batch::BatchError;

/// Where a config problem is. Displays as `file`, `file:line`, `file:line:column` or
/// `--set key=value`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Location {
    /// Not known (for example [`Config::validate`] on a config built in code).
    #[default]
    Unknown,
    /// In (or, without a line, missing from) the config file.
    File {
        /// The file as named by the caller.
        file: String,
        /// 1-based line.
        line: Option<u32>,
        /// 1-based column in characters (only with a line).
        column: Option<u32>,
    },
    /// A `--set` override, exactly as given.
    Override {
        /// The override text after `--set `.
        set: String,
    },
}

impl Location {
    /// `"<location>: "`, or nothing when unknown.
    pub(super) fn prefix(&self) -> String {
        match self {
            Location::Unknown => String::new(),
            other => format!("{other}: "),
        }
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Unknown => Ok(()),
            Location::File { file, line, column } => {
                write!(f, "{file}")?;
                if let Some(line) = line {
                    write!(f, ":{line}")?;
                    if let Some(column) = column {
                        write!(f, ":{column}")?;
                    }
                }
                Ok(())
            }
            Location::Override { set } => write!(f, "--set {set}"),
        }
    }
}

/// Everything that can be wrong with a config. Every message is one line.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The path as given.
        path: String,
        /// The I/O error.
        source: io::Error,
    },
    /// The file is not valid TOML.
    #[error("{}invalid TOML: {message}", .at.prefix())]
    Syntax {
        /// Where.
        at: Location,
        /// The parser's short message.
        message: String,
    },
    /// A key the schema does not know.
    #[error("{}unknown key `{key}` {} ({})", .at.prefix(), section_text(.section), expected_text(.expected))]
    UnknownKey {
        /// Where.
        at: Location,
        /// The unknown key.
        key: String,
        /// Dotted path of the enclosing table; empty for the top level.
        section: String,
        /// The keys allowed there.
        expected: Vec<String>,
    },
    /// A value of the wrong type, or not one of an enum's names.
    #[error("{}{}{message}", .at.prefix(), key_text(.key))]
    WrongValue {
        /// Where.
        at: Location,
        /// Dotted key (`model.kind`), when known.
        key: Option<String>,
        /// What serde says, e.g. ``unknown variant `gpt3`, expected one of ...``.
        message: String,
    },
    /// A value that deserialised but breaks a rule of [`Config::validate`].
    #[error("{}`{key}` {problem}", .at.prefix())]
    Invalid {
        /// Where.
        at: Location,
        /// Dotted key, e.g. `train.lr`.
        key: String,
        /// The rule and the value, e.g. `must be > 0 (got -1)`.
        problem: String,
    },
    /// `[batch]` breaks a rule that needs no world size.
    #[error("{}{source}", .at.prefix())]
    Batch {
        /// Where.
        at: Location,
        /// The batch problem.
        source: Box<BatchError>,
    },
    /// A `--set` argument that cannot be applied.
    #[error("--set {set}: {problem}")]
    Override {
        /// The override text after `--set `.
        set: String,
        /// What is wrong with it.
        problem: String,
    },
    /// The config could not be written as TOML.
    #[error("cannot write the config as TOML: {message}")]
    Serialize {
        /// The serialiser's message.
        message: String,
    },
}

pub(super) fn section_text(section: &str) -> String {
    if section.is_empty() {
        "at the top level".to_string()
    } else {
        format!("in [{section}]")
    }
}

pub(super) fn expected_text(expected: &[String]) -> String {
    if expected.is_empty() {
        "this table takes no keys".to_string()
    } else {
        format!("expected one of: {}", expected.join(", "))
    }
}

pub(super) fn key_text(key: &Option<String>) -> String {
    match key {
        Some(key) if !key.is_empty() => format!("`{key}`: "),
        _ => String::new(),
    }
}

/// Collapses any line breaks so every message stays on one line.
pub(super) fn one_line(message: &str) -> String {
    message
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

impl ConfigError {
    /// The location this error points at, for errors that carry one.
    pub fn location(&self) -> Option<&Location> {
        match self {
            ConfigError::Syntax { at, .. }
            | ConfigError::UnknownKey { at, .. }
            | ConfigError::WrongValue { at, .. }
            | ConfigError::Invalid { at, .. }
            | ConfigError::Batch { at, .. } => Some(at),
            _ => None,
        }
    }

    pub(super) fn invalid(key: &str, problem: impl Into<String>) -> Self {
        ConfigError::Invalid {
            at: Location::Unknown,
            key: key.to_string(),
            problem: problem.into(),
        }
    }

    /// Dotted key of a validation error (`train.lr`, `batch`).
    pub(super) fn semantic_key(&self) -> Option<String> {
        match self {
            ConfigError::Invalid { key, .. } => Some(key.clone()),
            ConfigError::Batch { source, .. } => Some(source.key_path()),
            _ => None,
        }
    }

    pub(super) fn with_location(mut self, new: Location) -> Self {
        match &mut self {
            ConfigError::Syntax { at, .. }
            | ConfigError::UnknownKey { at, .. }
            | ConfigError::WrongValue { at, .. }
            | ConfigError::Invalid { at, .. }
            | ConfigError::Batch { at, .. } => *at = new,
            _ => {}
        }
        self
    }
}
