//! Where a config value came from: the TOML document with its spans (for `file:line:column`),
//! `--set` overrides applied in order, and errors located at the file or the override.

use std::ops::Range;

use toml::de::{DeTable, DeValue};

use super::error::one_line;
use super::*;

/// A parsed TOML document with spans.
pub(super) struct Source<'a> {
    pub(super) origin: &'a str,
    pub(super) text: &'a str,
    pub(super) root: DeTable<'a>,
}

impl<'a> Source<'a> {
    pub(super) fn parse(text: &'a str, origin: &'a str) -> Result<Self, ConfigError> {
        match DeTable::parse(text) {
            Ok(root) => Ok(Source {
                origin,
                text,
                root: root.into_inner(),
            }),
            Err(e) => {
                let at = Source {
                    origin,
                    text,
                    root: DeTable::default(),
                }
                .location(e.span());
                Err(ConfigError::Syntax {
                    at,
                    message: one_line(e.message()),
                })
            }
        }
    }

    /// 1-based line and column (in characters) of a byte offset.
    pub(super) fn position(&self, offset: usize) -> (u32, u32) {
        let mut offset = offset.min(self.text.len());
        while !self.text.is_char_boundary(offset) {
            offset -= 1;
        }
        let before = &self.text[..offset];
        let line = before.matches('\n').count() + 1;
        let line_start = before.rfind('\n').map_or(0, |i| i + 1);
        let column = before[line_start..].chars().count() + 1;
        let clamp = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        (clamp(line), clamp(column))
    }

    /// `file:line:column` of a span's start, or just `file`.
    pub(super) fn location(&self, span: Option<Range<usize>>) -> Location {
        let (line, column) = match span {
            Some(span) => {
                let (l, c) = self.position(span.start);
                (Some(l), Some(c))
            }
            None => (None, None),
        };
        Location::File {
            file: self.origin.to_string(),
            line,
            column,
        }
    }

    /// `file:line` of the key at `path`, or just `file` when the file does not have it.
    pub(super) fn key_location(&self, path: &[String]) -> Location {
        Location::File {
            file: self.origin.to_string(),
            line: key_span(&self.root, path).map(|s| self.position(s.start).0),
            column: None,
        }
    }

    /// Name of the `[section]` header above `offset` (fallback when spans do not resolve).
    pub(super) fn section_above(&self, offset: usize) -> String {
        let end = offset.min(self.text.len());
        let before = self.text.get(..end).unwrap_or(self.text);
        for line in before.lines().rev() {
            let line = line.trim();
            if let Some(rest) = line.strip_prefix('[') {
                let rest = rest.trim_start_matches('[');
                if let Some(close) = rest.find(']') {
                    return rest[..close].trim().to_string();
                }
            }
        }
        String::new()
    }
}

pub(super) fn span_contains(span: &Range<usize>, offset: usize) -> bool {
    span.contains(&offset) || (span.is_empty() && span.start == offset)
}

/// The dotted key path of whatever covers `offset`.
pub(super) fn path_at(table: &DeTable<'_>, offset: usize) -> Option<Vec<String>> {
    for (key, value) in table.iter() {
        let name = key.get_ref().to_string();
        if span_contains(&key.span(), offset) {
            return Some(vec![name]);
        }
        let inner = match value.get_ref() {
            DeValue::Table(t) => path_at(t, offset),
            DeValue::Array(items) => items.iter().find_map(|item| match item.get_ref() {
                DeValue::Table(t) => path_at(t, offset),
                _ => None,
            }),
            _ => None,
        };
        if let Some(mut path) = inner {
            path.insert(0, name);
            return Some(path);
        }
        if span_contains(&value.span(), offset) {
            return Some(vec![name]);
        }
    }
    None
}

/// The span of the key at `path`.
pub(super) fn key_span(table: &DeTable<'_>, path: &[String]) -> Option<Range<usize>> {
    let (first, rest) = path.split_first()?;
    let (key, value) = table.iter().find(|(k, _)| k.get_ref().as_ref() == first)?;
    if rest.is_empty() {
        return Some(key.span());
    }
    match value.get_ref() {
        DeValue::Table(t) => key_span(t, rest),
        _ => None,
    }
}

/// Splits serde's ``unknown field `x`, expected one of `a`, `b` `` into `x` and `[a, b]`.
pub(super) fn parse_unknown_field(message: &str) -> Option<(String, Vec<String>)> {
    let rest = message.strip_prefix("unknown field `")?;
    let (key, rest) = rest.split_once('`')?;
    let expected = match rest.strip_prefix(", expected ") {
        Some(list) => list
            .strip_prefix("one of ")
            .unwrap_or(list)
            .split(", ")
            .flat_map(|s| s.split(" or "))
            .map(|s| s.trim().trim_matches('`').to_string())
            .filter(|s| !s.is_empty())
            .collect(),
        None => Vec::new(),
    };
    Some((key.to_string(), expected))
}

/// A deserialisation error turned into a [`ConfigError`], with the key path it concerns.
pub(super) struct Classified {
    pub(super) error: ConfigError,
    pub(super) path: Option<Vec<String>>,
}

/// Turns a deserialisation error about `src` into a [`ConfigError`]; `locate` picks the location
/// from the key path and span.
pub(super) fn classify(
    e: toml::de::Error,
    src: &Source<'_>,
    locate: impl FnOnce(Option<&[String]>, Option<Range<usize>>) -> Location,
) -> Classified {
    let span = e.span();
    let message = one_line(e.message());
    let found = span.as_ref().and_then(|s| path_at(&src.root, s.start));
    if let Some((key, expected)) = parse_unknown_field(&message) {
        let section = match &found {
            Some(path) if path.last() == Some(&key) => path[..path.len() - 1].join("."),
            _ => span
                .as_ref()
                .map(|s| src.section_above(s.start))
                .unwrap_or_default(),
        };
        let mut path: Vec<String> = if section.is_empty() {
            Vec::new()
        } else {
            section.split('.').map(str::to_string).collect()
        };
        path.push(key.clone());
        let at = locate(Some(&path), span);
        return Classified {
            error: ConfigError::UnknownKey {
                at,
                key,
                section,
                expected,
            },
            path: Some(path),
        };
    }
    let at = locate(found.as_deref(), span);
    Classified {
        error: ConfigError::WrongValue {
            at,
            key: found.as_ref().map(|p| p.join(".")),
            message,
        },
        path: found,
    }
}

/// One `--set key.path=value`.
#[derive(Debug, Clone)]
pub(super) struct Override {
    /// As given.
    pub(super) set: String,
    pub(super) path: Vec<String>,
    /// The text after `=`.
    pub(super) raw_value: String,
    pub(super) value: toml::Value,
    /// The value parsed as a non-string TOML value, so it may be retried as a plain string.
    pub(super) may_be_string: bool,
}

impl Override {
    pub(super) fn parse(set: &str) -> Result<Override, ConfigError> {
        let syntax = || ConfigError::Override {
            set: set.to_string(),
            problem: "expected key.path=value".to_string(),
        };
        let (key, raw) = set.split_once('=').ok_or_else(syntax)?;
        let path: Vec<String> = key
            .trim()
            .split('.')
            .map(|s| s.trim().to_string())
            .collect();
        if path.iter().any(String::is_empty) {
            return Err(syntax());
        }
        let raw_value = raw.trim().to_string();
        let (value, may_be_string) = match raw_value.parse::<toml::Value>() {
            Ok(toml::Value::String(s)) => (toml::Value::String(s), false),
            Ok(v) => (v, true),
            Err(_) => (toml::Value::String(raw_value.clone()), false),
        };
        Ok(Override {
            set: set.to_string(),
            path,
            raw_value,
            value,
            may_be_string,
        })
    }

    pub(super) fn use_raw_string(&mut self) {
        self.value = toml::Value::String(self.raw_value.clone());
        self.may_be_string = false;
    }

    /// Whether this override set `path` or something inside or around it.
    pub(super) fn touches(&self, path: &[String]) -> bool {
        let n = self.path.len().min(path.len());
        self.path[..n] == path[..n]
    }

    pub(super) fn apply(&self, table: &mut toml::Table) -> Result<(), ConfigError> {
        let Some((last, parents)) = self.path.split_last() else {
            return Err(ConfigError::Override {
                set: self.set.clone(),
                problem: "expected key.path=value".to_string(),
            });
        };
        let mut current = table;
        for (depth, segment) in parents.iter().enumerate() {
            let entry = current
                .entry(segment.clone())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            current = match entry {
                toml::Value::Table(t) => t,
                other => {
                    return Err(ConfigError::Override {
                        set: self.set.clone(),
                        problem: format!(
                            "`{}` is {}, not a table",
                            self.path[..=depth].join("."),
                            with_article(other.type_str())
                        ),
                    })
                }
            };
        }
        current.insert(last.clone(), self.value.clone());
        Ok(())
    }
}

pub(super) fn with_article(noun: &str) -> String {
    let article = if noun.starts_with(['a', 'e', 'i', 'o', 'u']) {
        "an"
    } else {
        "a"
    };
    format!("{article} {noun}")
}

/// Why applying overrides failed.
pub(super) struct Failure {
    pub(super) error: Box<ConfigError>,
    /// Index of the override blamed.
    pub(super) blamed: Option<usize>,
    /// Index of an override whose value could be retried as a plain string.
    pub(super) retry_as_string: Option<usize>,
}

pub(super) fn blame(overrides: &[Override], path: Option<&[String]>) -> Option<usize> {
    let path = path?;
    overrides.iter().rposition(|o| o.touches(path))
}

/// Applies `overrides` to the file's table and deserialises the result.
pub(super) fn apply_overrides(
    file: &Source<'_>,
    overrides: &[Override],
) -> Result<Config, Failure> {
    let plain = |error| Failure {
        error: Box::new(error),
        blamed: None,
        retry_as_string: None,
    };
    let mut table: toml::Table = toml::from_str(file.text).map_err(|e| {
        plain(ConfigError::Syntax {
            at: file.location(e.span()),
            message: one_line(e.message()),
        })
    })?;
    for (i, o) in overrides.iter().enumerate() {
        o.apply(&mut table).map_err(|error| Failure {
            error: Box::new(error),
            blamed: Some(i),
            retry_as_string: None,
        })?;
    }
    let serialize_error = |message: String| {
        plain(ConfigError::Serialize {
            message: one_line(&message),
        })
    };
    let merged_text = toml::to_string(&table).map_err(|e| serialize_error(e.to_string()))?;
    let merged =
        Source::parse(&merged_text, file.origin).map_err(|e| serialize_error(e.to_string()))?;
    toml::from_str::<Config>(&merged_text).map_err(|e| {
        let mut blamed = None;
        let classified = classify(e, &merged, |path, _| {
            blamed = blame(overrides, path);
            match (blamed, path) {
                (Some(i), _) => Location::Override {
                    set: overrides[i].set.clone(),
                },
                (None, Some(path)) => file.key_location(path),
                (None, None) => file.location(None),
            }
        });
        let retry_as_string = blamed.filter(|&i| {
            overrides[i].may_be_string && classified.path.as_deref() == Some(&overrides[i].path[..])
        });
        Failure {
            error: Box::new(classified.error),
            blamed,
            retry_as_string,
        }
    })
}

/// Gives a validation error its location: the override that set the key, else the key's line in
/// the file, else the file.
pub(super) fn locate_semantic(
    e: ConfigError,
    file: &Source<'_>,
    overrides: &[Override],
) -> ConfigError {
    let Some(key) = e.semantic_key() else {
        return e;
    };
    let path: Vec<String> = key.split('.').map(str::to_string).collect();
    let at = match blame(overrides, Some(&path)) {
        Some(i) => Location::Override {
            set: overrides[i].set.clone(),
        },
        None => file.key_location(&path),
    };
    e.with_location(at)
}
