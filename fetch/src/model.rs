//! The checks a GPT-2 model directory's files must pass beyond their digests: `config.json`
//! is JSON with `"model_type": "gpt2"`, and `model.safetensors` is whole (its header parses and
//! its tensors end exactly at the end of the file).
//!
//! Must not: download, write anything, or open files (callers hand it what they opened).

use std::io::Read;

/// The largest `config.json` accepted (GPT-2's is under 1 KiB).
pub const CONFIG_MAX: u64 = 1 << 20;
/// The largest `model.safetensors` accepted from `--from DIR` (gpt2-xl's is 6.4 GB).
pub const WEIGHTS_MAX: u64 = 64 << 30;
/// The largest safetensors header accepted.
const HEADER_MAX: u64 = 100 << 20;

/// Checks a `config.json`'s bytes: a JSON object whose `model_type` is `"gpt2"`.
pub fn check_config(bytes: &[u8]) -> Result<(), String> {
    let value: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| format!("not JSON: {e}"))?;
    match value.get("model_type").and_then(|v| v.as_str()) {
        Some("gpt2") => Ok(()),
        Some(other) => Err(format!("model_type is {other:?}, not \"gpt2\"")),
        None => Err("has no model_type (not a Hugging Face model config)".into()),
    }
}

/// Checks that a safetensors file of `len` bytes, read from its start by `file`, is complete:
/// an 8-byte little-endian header length, a JSON header, and tensors whose largest end offset
/// is the end of the file.
pub fn check_safetensors(mut file: impl Read, len: u64) -> Result<(), String> {
    let mut head = [0u8; 8];
    file.read_exact(&mut head)
        .map_err(|_| "shorter than a safetensors header".to_string())?;
    let header_len = u64::from_le_bytes(head);
    if header_len > HEADER_MAX || 8 + header_len > len {
        return Err(format!(
            "header length {header_len} does not fit a file of {len} bytes"
        ));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header).map_err(|e| e.to_string())?;
    let data_end = tensors_end(&header)?;
    let expected = 8 + header_len + data_end;
    if expected != len {
        return Err(format!(
            "its tensors end at byte {expected} but the file has {len} (incomplete or padded)"
        ));
    }
    Ok(())
}

/// The largest `data_offsets` end in a safetensors JSON header.
fn tensors_end(header: &[u8]) -> Result<u64, String> {
    let value: serde_json::Value =
        serde_json::from_slice(header).map_err(|e| format!("header is not JSON: {e}"))?;
    let tensors = value.as_object().ok_or("header is not a JSON object")?;
    let mut end = 0;
    for (name, info) in tensors.iter().filter(|(k, _)| k.as_str() != "__metadata__") {
        let offsets = info.get("data_offsets").and_then(|o| o.as_array());
        let stop = offsets
            .filter(|o| o.len() == 2)
            .and_then(|o| o[1].as_u64())
            .ok_or_else(|| format!("tensor {name} has no data_offsets"))?;
        end = end.max(stop);
    }
    Ok(end)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A safetensors file with one f32 tensor of `n` values.
    fn safetensors(n: usize) -> Vec<u8> {
        let header = format!(
            r#"{{"__metadata__":{{"format":"pt"}},"w":{{"dtype":"F32","shape":[{n}],"data_offsets":[0,{}]}}}}"#,
            n * 4
        );
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend(std::iter::repeat_n(0u8, n * 4));
        bytes
    }

    #[test]
    fn gpt2_configs_pass_and_others_do_not() {
        assert!(check_config(br#"{"model_type": "gpt2", "n_layer": 12}"#).is_ok());
        assert!(check_config(br#"{"model_type": "llama"}"#)
            .unwrap_err()
            .contains("llama"));
        assert!(check_config(br#"{"n_layer": 12}"#)
            .unwrap_err()
            .contains("no model_type"));
        assert!(check_config(b"<html>").unwrap_err().contains("not JSON"));
    }

    #[test]
    fn whole_safetensors_pass_and_cut_ones_do_not() {
        let check = |bytes: &[u8]| check_safetensors(bytes, bytes.len() as u64);
        let bytes = safetensors(10);
        check(&bytes).unwrap();
        assert!(check(&bytes[..bytes.len() - 1])
            .unwrap_err()
            .contains("incomplete"));
        assert!(check(b"\xff\xff\xff\xff\xff\xff\xff\x7f{}")
            .unwrap_err()
            .contains("does not fit"));
        assert!(check(b"abc").is_err());
    }
}
