//! accelerate's values as Python writes them: what PyYAML (YAML 1.1, accelerate's config
//! loader) makes of a config file's scalars, and Python's `str` of them, which is what
//! `accelerate launch` puts in its variables. Owns those conversions; must not know which
//! setting a value belongs to (the DeepSpeed and FSDP readers do).

use yaml_rust2::Yaml;

/// A config value as PyYAML (YAML 1.1: accelerate's loader) types it where YAML 1.2
/// (yaml_rust2's) differs: `yes`, `no`, `on` and `off` (lower, title or upper case) are
/// booleans. (A quoted `"yes"` stays text to PyYAML; yaml_rust2 does not tell them apart.)
pub(super) fn as_pyyaml(value: Yaml) -> Yaml {
    match value {
        Yaml::String(text) => match text.as_str() {
            "yes" | "Yes" | "YES" | "on" | "On" | "ON" => Yaml::Boolean(true),
            "no" | "No" | "NO" | "off" | "Off" | "OFF" => Yaml::Boolean(false),
            _ => Yaml::String(text),
        },
        Yaml::Hash(map) => Yaml::Hash(map.into_iter().map(|(k, v)| (k, as_pyyaml(v))).collect()),
        Yaml::Array(items) => Yaml::Array(items.into_iter().map(as_pyyaml).collect()),
        other => other,
    }
}

/// A float as Python's `str` writes it, as accelerate passes it on: the shortest digits that
/// read back the same, `1.0` rather than `1`, and an exponent of two digits or more outside
/// 1e-4 to 1e16 (`1e-05`, `1e+16`). (Where two shortest forms tie, Python rounds to even and
/// Rust up: only for values above 1e10 with a fraction, never a clipping norm.)
pub(super) fn python_float(x: f64) -> String {
    if !x.is_finite() {
        return match (x.is_nan(), x > 0.0) {
            (true, _) => "nan",
            (false, true) => "inf",
            (false, false) => "-inf",
        }
        .into();
    }
    let scientific = format!("{x:e}");
    let Some((digits, exponent)) = scientific.split_once('e') else {
        return scientific;
    };
    let exponent: i32 = exponent.parse().unwrap_or(0);
    if (-4..16).contains(&exponent) {
        let text = x.to_string();
        return match text.contains('.') {
            true => text,
            false => format!("{text}.0"),
        };
    }
    let sign = if exponent < 0 { '-' } else { '+' };
    format!("{digits}e{sign}{:02}", exponent.unsigned_abs())
}

/// A config file's scalar as Python's `str` writes what PyYAML (YAML 1.1) reads: integers as
/// written, reals that YAML 1.1 calls floats (a dot, a signed exponent) as floats, any other
/// text as text (`1e-5` has no dot: a string to PyYAML).
pub(super) fn python_str(value: &Yaml) -> String {
    match value {
        Yaml::Integer(n) => n.to_string(),
        Yaml::Real(text) => match (is_yaml11_float(text), text.replace('_', "").parse::<f64>()) {
            (true, Ok(x)) => python_float(x),
            _ => text.clone(),
        },
        Yaml::Boolean(b) => if *b { "True" } else { "False" }.into(),
        Yaml::String(text) => text.clone(),
        other => format!("{other:?}"),
    }
}

/// YAML 1.1's float (PyYAML's resolver): digits, a dot, digits, and an optional exponent with
/// its sign (`1.0`, `.5`, `-2.5e-3`; not `1e-5` nor `1.0e5`).
fn is_yaml11_float(text: &str) -> bool {
    let (mantissa, exponent) = match text.find(['e', 'E']) {
        Some(i) => (&text[..i], Some(&text[i + 1..])),
        None => (text, None),
    };
    let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit() || b == b'_');
    let exponent_ok = exponent.is_none_or(|e| {
        e.len() > 1 && e.starts_with(['+', '-']) && e[1..].bytes().all(|b| b.is_ascii_digit())
    });
    let unsigned = mantissa.strip_prefix(['+', '-']).unwrap_or(mantissa);
    let Some((whole, fraction)) = unsigned.split_once('.') else {
        return false;
    };
    let mantissa_ok = match whole.bytes().next() {
        // `.5` is a float to YAML 1.1 only without a sign.
        None => {
            fraction.starts_with(|c: char| c.is_ascii_digit()) && unsigned.len() == mantissa.len()
        }
        Some(first) => first.is_ascii_digit(),
    };
    exponent_ok && mantissa_ok && digits(whole) && digits(fraction)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_are_written_as_python_writes_them() {
        assert_eq!(python_float(1.0), "1.0");
        assert_eq!(python_float(0.5), "0.5");
        assert_eq!(python_float(1e-4), "0.0001");
        assert_eq!(python_float(1e-5), "1e-05");
        assert_eq!(python_float(1.5e-7), "1.5e-07");
        assert_eq!(python_float(1e15), "1000000000000000.0");
        assert_eq!(python_float(1e16), "1e+16");
        assert_eq!(python_float(-2.5e300), "-2.5e+300");
        assert_eq!(python_float(0.0), "0.0");
        assert_eq!(python_float(f64::INFINITY), "inf");
    }

    #[test]
    fn file_values_are_written_as_python_writes_what_pyyaml_reads() {
        let read = |text: &str| {
            let doc = yaml_rust2::YamlLoader::load_from_str(&format!("v: {text}")).unwrap();
            python_str(&doc[0]["v"])
        };
        // PyYAML: `1` an int, `1.0` and `1.0e-5` floats, `1e-5` and `1.0e5` strings.
        assert_eq!(read("1"), "1");
        assert_eq!(read("1.0"), "1.0");
        assert_eq!(read("0.50"), "0.5");
        assert_eq!(read(".5"), "0.5");
        assert_eq!(read("1.0e-5"), "1e-05");
        assert_eq!(read("1e-5"), "1e-5");
        assert_eq!(read("1.0e5"), "1.0e5");
        assert_eq!(read("\"2.0\""), "2.0");
        for not_float in ["+.5", "._5", "1.0e", "a.b", "1e-5", "1.0e5"] {
            assert!(!is_yaml11_float(not_float), "{not_float}");
        }
    }
}
