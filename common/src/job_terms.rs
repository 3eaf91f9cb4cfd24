//! The terms of a job: everything every node of one job must agree on, as `key -> value`
//! text, so that a node started with another config, other data or another worker build is
//! told apart by name before it joins (see the launcher's elastic rendezvous and the runtime's
//! start-up agreement) instead of training a different model beside the others.
//!
//! This module owns which config keys are per node (paths that may differ between hosts
//! while naming the same content), how the content behind them is fingerprinted, and how two
//! nodes' terms are compared and described. It must not decide what happens to a node that
//! disagrees (the caller refuses it) and does no I/O but reading the files it fingerprints.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::Path;

use sha2::{Digest, Sha256};

use crate::config::Config;
use crate::data_layout::DataFormat;

/// Config keys that may differ between nodes: paths on each node's own disk. The content
/// behind `data.dir` and `model.gpt2_weights` is compared instead (`data.files`,
/// `model.weights_file`).
pub const PER_NODE_KEYS: [&str; 3] = ["run.output_dir", "data.dir", "model.gpt2_weights"];

/// Files up to this size are hashed whole; larger ones (GPT-2 weights) by their size, first
/// and last MiB, so that a join stays fast.
const WHOLE_FILE_LIMIT: u64 = 256 << 20;
const SAMPLE: u64 = 1 << 20;

/// What must agree, key by key (sorted, so two equal terms have one digest).
pub type Terms = BTreeMap<String, String>;

/// The terms of a job that trains `config`: every config key but [`PER_NODE_KEYS`], plus
/// fingerprints of the data files and the weights file the config names.
pub fn of_config(config: &Config) -> Terms {
    let mut terms = Terms::new();
    if let Ok(value) = serde_json::to_value(config) {
        flatten("", &value, &mut terms);
    }
    for key in PER_NODE_KEYS {
        terms.remove(key);
    }
    if let Some(dir) = &config.data.dir {
        terms.insert("data.files".into(), data_fingerprint(dir));
    }
    if let Some(weights) = &config.model.gpt2_weights {
        let file = if weights.is_dir() {
            weights.join("model.safetensors")
        } else {
            weights.clone()
        };
        terms.insert("model.weights_file".into(), fingerprint_or_error(&file));
    }
    terms
}

/// One hex digest of the whole terms (what a node sends first; the full terms only on a
/// mismatch).
pub fn digest(terms: &Terms) -> String {
    let mut hasher = Sha256::new();
    for (key, value) in terms {
        hasher.update((key.len() as u64).to_le_bytes());
        hasher.update(key.as_bytes());
        hasher.update((value.len() as u64).to_le_bytes());
        hasher.update(value.as_bytes());
    }
    crate::hex(&hasher.finalize()[..16])
}

/// The keys whose values differ between `ours` and `theirs` (a key only one side has counts,
/// its missing value shown as `(unset)`), as `key: OURS <ours label> vs THEIRS <their label>`
/// (e.g. labels `("here", "in the job")`), at most `limit` of them and then how many more.
pub fn describe_difference(
    ours: &Terms,
    theirs: &Terms,
    limit: usize,
    (our_label, their_label): (&str, &str),
) -> String {
    let unset = "(unset)".to_string();
    let mut keys: Vec<&String> = ours.keys().chain(theirs.keys()).collect();
    keys.sort();
    keys.dedup();
    let differing: Vec<String> = keys
        .into_iter()
        .filter(|k| ours.get(*k) != theirs.get(*k))
        .map(|k| {
            format!(
                "{k}: {} {our_label} vs {} {their_label}",
                ours.get(k).unwrap_or(&unset),
                theirs.get(k).unwrap_or(&unset)
            )
        })
        .collect();
    let mut line = differing
        .iter()
        .take(limit)
        .cloned()
        .collect::<Vec<_>>()
        .join("; ");
    if differing.len() > limit {
        line.push_str(&format!("; and {} more", differing.len() - limit));
    }
    line
}

/// Flattens a JSON value into dotted keys (arrays and scalars as their JSON text).
fn flatten(prefix: &str, value: &serde_json::Value, out: &mut Terms) {
    match value {
        serde_json::Value::Object(map) => {
            for (k, v) in map {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flatten(&key, v, out);
            }
        }
        serde_json::Value::String(s) => {
            out.insert(prefix.to_string(), s.clone());
        }
        other => {
            out.insert(prefix.to_string(), other.to_string());
        }
    }
}

/// The data set's layout and the fingerprint of each of its files, in one value.
fn data_fingerprint(dir: &Path) -> String {
    let Some(format) = DataFormat::detect(dir) else {
        return "no data set found".into();
    };
    let parts: Vec<String> = format
        .files()
        .iter()
        .map(|name| format!("{name}={}", fingerprint_or_error(&dir.join(name))))
        .collect();
    format!("{} {}", format.name(), parts.join(","))
}

fn fingerprint_or_error(path: &Path) -> String {
    file_fingerprint(path).unwrap_or_else(|e| format!("unreadable ({})", e.kind()))
}

/// A short digest of a file's content: the whole file up to [`WHOLE_FILE_LIMIT`], else its
/// size, first and last MiB.
pub fn file_fingerprint(path: &Path) -> io::Result<String> {
    let (mut file, len) = crate::files::open_input(path, u64::MAX).map_err(io::Error::other)?;
    let mut hasher = Sha256::new();
    hasher.update(len.to_le_bytes());
    if len <= WHOLE_FILE_LIMIT {
        io::copy(
            &mut (&mut file).take(WHOLE_FILE_LIMIT),
            &mut HashWriter(&mut hasher),
        )?;
    } else {
        sample(&mut file, 0, &mut hasher)?;
        sample(&mut file, len - SAMPLE, &mut hasher)?;
    }
    Ok(format!("{len}:{}", crate::hex(&hasher.finalize()[..8])))
}

fn sample(file: &mut File, at: u64, hasher: &mut Sha256) -> io::Result<()> {
    file.seek(SeekFrom::Start(at))?;
    io::copy(&mut file.take(SAMPLE), &mut HashWriter(hasher))?;
    Ok(())
}

struct HashWriter<'a>(&'a mut Sha256);

impl io::Write for HashWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The build of a program: its ELF build id where it has one, else a fingerprint of the file
/// (a script, or a binary linked without one).
pub fn program_fingerprint(path: &Path) -> String {
    match elf_build_id(path) {
        Some(id) => format!("build-id {id}"),
        None => fingerprint_or_error(path),
    }
}

fn elf_build_id(path: &Path) -> Option<String> {
    use object::Object;
    let file = File::open(path).ok()?;
    let cache = object::ReadCache::new(file);
    let elf = object::File::parse(&cache).ok()?;
    let id = elf.build_id().ok()??;
    Some(crate::hex(id))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(toml: &str) -> Config {
        let text = format!("{toml}\n[batch]\nglobal = 8\nmicro = 8\n");
        Config::parse(&text, "t.toml", &[]).unwrap()
    }

    #[test]
    fn equal_configs_agree_and_a_changed_key_is_named_with_both_values() {
        let a = of_config(&config("[train]\nlr = 0.001\n"));
        let b = of_config(&config("[train]\nlr = 0.002\n"));
        assert_eq!(
            digest(&a),
            digest(&of_config(&config("[train]\nlr = 0.001\n")))
        );
        assert_ne!(digest(&a), digest(&b));
        let line = describe_difference(&b, &a, 8, ("here", "in the job"));
        assert_eq!(line, "train.lr: 0.002 here vs 0.001 in the job");
    }

    #[test]
    fn per_node_paths_do_not_count_but_their_content_does() {
        let dir = tempfile::tempdir().unwrap();
        let (one, two) = (dir.path().join("one"), dir.path().join("two"));
        for d in [&one, &two] {
            std::fs::create_dir_all(d).unwrap();
            for f in ["u.data", "u.user", "u.item"] {
                std::fs::write(d.join(f), "1\t2\t3\t4\n").unwrap();
            }
        }
        let at = |d: &Path, out: &str| {
            of_config(&config(&format!(
                "[run]\noutput_dir = \"{out}\"\n[data]\ndir = \"{}\"\n",
                d.display()
            )))
        };
        assert_eq!(at(&one, "runs"), at(&two, "elsewhere"));
        std::fs::write(two.join("u.data"), "1\t2\t5\t4\n").unwrap();
        let line = describe_difference(&at(&two, "runs"), &at(&one, "runs"), 8, ("a", "b"));
        assert!(
            line.starts_with("data.files: MovieLens-100k u.data="),
            "{line}"
        );
    }

    #[test]
    fn the_description_is_bounded() {
        let a: Terms = (0..20)
            .map(|i| (format!("k{i:02}"), "a".to_string()))
            .collect();
        let b: Terms = (0..20)
            .map(|i| (format!("k{i:02}"), "b".to_string()))
            .collect();
        let line = describe_difference(&a, &b, 3, ("here", "in the job"));
        assert!(line.ends_with("; and 17 more"), "{line}");
        assert_eq!(line.matches(" here vs ").count(), 3);
    }

    #[test]
    fn programs_are_told_apart_by_build() {
        let exe = std::env::current_exe().unwrap();
        let ours = program_fingerprint(&exe);
        assert!(
            ours.starts_with("build-id ") || ours.contains(':'),
            "{ours}"
        );
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("train.py");
        std::fs::write(&script, "print(1)\n").unwrap();
        let before = program_fingerprint(&script);
        std::fs::write(&script, "print(2)\n").unwrap();
        assert_ne!(before, program_fingerprint(&script));
        assert!(program_fingerprint(&dir.path().join("missing")).starts_with("unreadable"));
    }
}
