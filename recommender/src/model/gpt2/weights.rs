//! Loading a Hugging Face GPT-2 `model.safetensors` into the variables of a built model.
//!
//! Owns: the file's header (parsed here, so that only the header is read before the checks),
//! name mapping (`transformer.` prefix, ignored buffers) and shape checks, and reading each
//! tensor straight into its variable. Peak memory is the model plus at most one tensor: the file
//! is never held whole, and no second model is built to receive it.
//!
//! Also owns [`check_weights`]: the same header checked against a config's shapes before any
//! model is built, so that a config that disagrees with its weights allocates nothing.
//!
//! Must not: change a variable unless every GPT-2 variable is in the file with its shape;
//! transpose anything (HF's Conv1D weights are stored [in, out], as ours are); block on a FIFO
//! (the file is opened through `common::files`).

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use serde::Deserialize;
use tch::{nn, Device, Kind, Tensor};

use super::{Config, Gpt2Error};

/// Largest weights file opened (GPT-2 XL's is 6.4 GB; the largest model a `config.json` may
/// describe is 2^33 parameters).
const MAX_WEIGHTS_FILE: u64 = 1 << 40;

/// The GPT-2 tensors a model of `config` has, by Hugging Face name (without `transformer.`),
/// with their shapes: the variables [`super::Gpt2::new`] creates.
pub fn expected_shapes(config: &Config) -> Vec<(String, Vec<i64>)> {
    let (d, v, p) = (config.n_embd, config.vocab_size, config.n_positions);
    let mut shapes = vec![
        ("wte.weight".to_string(), vec![v, d]),
        ("wpe.weight".to_string(), vec![p, d]),
    ];
    let block: [(&str, Vec<i64>); 12] = [
        ("ln_1.weight", vec![d]),
        ("ln_1.bias", vec![d]),
        ("attn.c_attn.weight", vec![d, 3 * d]),
        ("attn.c_attn.bias", vec![3 * d]),
        ("attn.c_proj.weight", vec![d, d]),
        ("attn.c_proj.bias", vec![d]),
        ("ln_2.weight", vec![d]),
        ("ln_2.bias", vec![d]),
        ("mlp.c_fc.weight", vec![d, 4 * d]),
        ("mlp.c_fc.bias", vec![4 * d]),
        ("mlp.c_proj.weight", vec![4 * d, d]),
        ("mlp.c_proj.bias", vec![d]),
    ];
    for i in 0..config.n_layer {
        shapes.extend(
            block
                .iter()
                .map(|(name, shape)| (format!("h.{i}.{name}"), shape.clone())),
        );
    }
    shapes.push(("ln_f.weight".to_string(), vec![d]));
    shapes.push(("ln_f.bias".to_string(), vec![d]));
    shapes
}

/// Checks the safetensors file at `path` (its header only) against a model of `config`: every
/// GPT-2 tensor present with its shape (the first that differs is named with both shapes).
/// Nothing is allocated but the header, so a config that disagrees with its weights is
/// refused before a model is built from it.
pub fn check_weights(path: &Path, config: &Config) -> Result<(), Gpt2Error> {
    let (mut file, _) = common::files::open_input(path, MAX_WEIGHTS_FILE)?;
    let header = read_header(&mut file)?;
    let found: BTreeMap<&str, &Vec<i64>> = header
        .iter()
        .map(|(name, entry)| {
            let name = name.strip_prefix("transformer.").unwrap_or(name);
            (name, &entry.shape)
        })
        .collect();
    let mut missing = Vec::new();
    for (name, expected) in expected_shapes(config) {
        match found.get(name.as_str()) {
            None => missing.push(name),
            Some(shape) if **shape != expected => {
                return Err(Gpt2Error::Shape {
                    name,
                    expected,
                    found: (*shape).clone(),
                })
            }
            Some(_) => {}
        }
    }
    if missing.is_empty() {
        return Ok(());
    }
    // One line, however many blocks the config says.
    if missing.len() > MISSING_NAMED {
        let more = missing.len() - MISSING_NAMED;
        missing.truncate(MISSING_NAMED);
        missing.push(format!("and {more} more"));
    }
    Err(Gpt2Error::Missing(missing))
}

/// Missing tensors named in a message at most.
const MISSING_NAMED: usize = 8;

/// What `load_hf_safetensors` did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoadReport {
    /// Variables copied from the file.
    pub loaded: usize,
    /// File tensors ignored on purpose (`lm_head.weight`, `attn.bias`/`attn.masked_bias`
    /// buffers), file names as written.
    pub ignored: Vec<String>,
    /// File tensors matching no variable (file names as written).
    pub unexpected: Vec<String>,
    /// Store variables outside GPT-2's names (e.g. a head), left untouched.
    pub skipped: Vec<String>,
}

fn is_gpt2_name(name: &str) -> bool {
    ["wte.", "wpe.", "h.", "ln_f."]
        .iter()
        .any(|p| name.starts_with(p))
}

fn is_ignored(name: &str) -> bool {
    name == "lm_head.weight" || name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias")
}

/// Loads a Hugging Face GPT-2 safetensors file (`model.safetensors` of `GPT2Model` or
/// `GPT2LMHeadModel`: names with or without the `transformer.` prefix) into the GPT-2
/// variables of `vs` built under `prefix` (the store's root when `None`). Every GPT-2 variable
/// must be in the file with its exact shape; nothing is copied unless all are. Values are
/// converted to each variable's kind and device.
pub fn load_hf_safetensors(
    vs: &nn::VarStore,
    prefix: Option<&str>,
    path: &Path,
) -> Result<LoadReport, Gpt2Error> {
    let (mut file, _) = common::files::open_input(path, MAX_WEIGHTS_FILE)?;
    let header = read_header(&mut file)?;
    let mut report = LoadReport::default();
    let mut by_name: BTreeMap<String, (&String, &Stored)> = BTreeMap::new();
    for (name, entry) in &header {
        let stripped = name.strip_prefix("transformer.").unwrap_or(name);
        if is_ignored(stripped) {
            report.ignored.push(name.clone());
        } else {
            by_name.insert(stripped.to_string(), (name, entry));
        }
    }

    let mut targets: Vec<(String, Tensor)> = Vec::new();
    let mut missing = Vec::new();
    for (full, var) in vs.variables() {
        let name = match prefix {
            Some(p) => match full.strip_prefix(p).and_then(|n| n.strip_prefix('.')) {
                Some(n) => n.to_string(),
                None => {
                    report.skipped.push(full);
                    continue;
                }
            },
            None => full,
        };
        if !is_gpt2_name(&name) {
            report.skipped.push(name);
            continue;
        }
        match by_name.get(&name) {
            None => missing.push(name),
            Some((_, entry)) if entry.shape != var.size() => {
                return Err(Gpt2Error::Shape {
                    name,
                    expected: var.size(),
                    found: entry.shape.clone(),
                })
            }
            Some(_) => targets.push((name, var)),
        }
    }
    if !missing.is_empty() {
        missing.sort();
        return Err(Gpt2Error::Missing(missing));
    }
    report.skipped.sort();
    let used: BTreeSet<&String> = targets.iter().map(|(n, _)| n).collect();
    report.unexpected = by_name
        .iter()
        .filter(|(n, _)| !used.contains(n))
        .map(|(_, (file_name, _))| (*file_name).clone())
        .collect();
    for (name, var) in &targets {
        by_name[name].1.read_into(&mut file, var)?;
    }
    report.loaded = targets.len();
    Ok(report)
}

/// One tensor of the header: `{"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}`,
/// offsets relative to the end of the header.
#[derive(Debug, Deserialize)]
struct Entry {
    dtype: String,
    shape: Vec<i64>,
    data_offsets: (u64, u64),
}

/// An entry once checked: its kind, shape and bytes (absolute offsets in the file).
struct Stored {
    kind: Kind,
    shape: Vec<i64>,
    bytes: std::ops::Range<u64>,
}

/// Headers larger than this are refused (safetensors' own limit).
const MAX_HEADER: u64 = 100_000_000;

/// Reads and checks the header: every entry's dtype is known and its bytes lie in the file
/// and match its shape.
fn read_header(file: &mut File) -> Result<BTreeMap<String, Stored>, Gpt2Error> {
    let len = file.metadata()?.len();
    let mut n = [0u8; 8];
    file.read_exact(&mut n)
        .map_err(|_| Gpt2Error::Format(format!("{len} bytes, too short for a header")))?;
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER || 8 + n > len {
        return Err(Gpt2Error::Format(format!(
            "header length {n} does not fit the file's {len} bytes"
        )));
    }
    let mut text = vec![0u8; n as usize];
    file.read_exact(&mut text)?;
    let mut raw: BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(&text).map_err(|e| Gpt2Error::Format(format!("header: {e}")))?;
    raw.remove("__metadata__");
    let data_start = 8 + n;
    let mut entries = BTreeMap::new();
    for (name, value) in raw {
        let entry: Entry = serde_json::from_value(value)
            .map_err(|e| Gpt2Error::Format(format!("header entry {name}: {e}")))?;
        let (begin, end) = entry.data_offsets;
        let kind = kind_of(&entry.dtype)
            .ok_or_else(|| Gpt2Error::Format(format!("{name}: dtype {}", entry.dtype)))?;
        let numel = entry.shape.iter().try_fold(1u64, |acc, &d| {
            u64::try_from(d).ok().and_then(|d| acc.checked_mul(d))
        });
        let bytes = numel.and_then(|n| n.checked_mul(kind.elt_size_in_bytes() as u64));
        if begin > end || data_start + end > len || bytes != Some(end - begin) {
            return Err(Gpt2Error::Format(format!(
                    "{name}: bytes {begin}..{end} do not hold a {} tensor of shape {:?} in a file of {len} bytes",
                    entry.dtype, entry.shape
                )));
        }
        entries.insert(
            name,
            Stored {
                kind,
                shape: entry.shape,
                bytes: data_start + begin..data_start + end,
            },
        );
    }
    Ok(entries)
}

impl Stored {
    /// Reads the entry's bytes into `var`: straight into its memory when it is a contiguous CPU
    /// tensor of the file's kind, otherwise through one tensor of the file's kind.
    fn read_into(&self, file: &mut File, var: &Tensor) -> Result<(), Gpt2Error> {
        let kind = self.kind;
        file.seek(SeekFrom::Start(self.bytes.start))?;
        let direct = var.device() == Device::Cpu && var.kind() == kind && var.is_contiguous();
        let target = if direct {
            var.shallow_clone()
        } else {
            Tensor::f_empty(self.shape.as_slice(), (kind, Device::Cpu))?
        };
        let len = (self.bytes.end - self.bytes.start) as usize;
        if len > 0 {
            // SAFETY: `target` is a contiguous CPU tensor of `len` bytes (the header check
            // matched shape and dtype to the byte range, and the shape to the variable's), and
            // nothing reads it while it is filled. safetensors is little-endian, as the hosts
            // libtorch runs on are.
            let bytes =
                unsafe { std::slice::from_raw_parts_mut(target.data_ptr() as *mut u8, len) };
            file.read_exact(bytes)?;
        }
        if !direct {
            tch::no_grad(|| var.shallow_clone().f_copy_(&target))?;
        }
        Ok(())
    }
}

/// The libtorch kind of a safetensors dtype (the ones GPT-2 checkpoints use).
fn kind_of(dtype: &str) -> Option<Kind> {
    Some(match dtype {
        "F64" => Kind::Double,
        "F32" => Kind::Float,
        "F16" => Kind::Half,
        "BF16" => Kind::BFloat16,
        _ => return None,
    })
}
