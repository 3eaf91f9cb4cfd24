//! What each name is downloaded from and what it must match: the built-in manifest (pinned
//! GroupLens digests, Hugging Face repos) or one read from `--manifest FILE` (TOML or JSON).
//!
//! Owns: the manifest schema and its validation, the URLs (`GPTREC_GROUPLENS_URL`,
//! `HF_ENDPOINT`), and the files a data set must contain.
//!
//! Must not: download, or read any file but the manifest it is given.

use std::path::Path;

use common::assets::{self, Asset, AssetKind};
use serde::Deserialize;

use crate::error::UsageError;

/// Where GroupLens keeps the MovieLens zips; `GPTREC_GROUPLENS_URL` replaces it (mirrors).
pub const GROUPLENS_BASE: &str = "https://files.grouplens.org/datasets/movielens";
/// The largest `--manifest` file read (a manifest of every name is under 4 KiB).
const MANIFEST_MAX: u64 = 1 << 20;
/// The Hugging Face hub; `HF_ENDPOINT` replaces it, as `huggingface_hub` does.
pub const HF_DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// The pinned GroupLens zips: (name, bytes, sha256).
///
/// Where these come from (no download was possible here): TensorFlow Datasets'
/// `tensorflow_datasets/url_checksums/movielens.txt` (github.com/tensorflow/datasets), which
/// records `https://files.grouplens.org/datasets/movielens/ml-1m.zip 5917549 a6898adb...` and
/// `.../ml-100k.zip 4924029 50d2a982...`. The same SHA-256s appear in other projects that
/// download these zips (a Rust MovieLens loader, several Python ones; one notes that the ml-1m
/// zip's MD5 matches GroupLens' published `c4d9eecfca2ab87c1945afe126590906`), and one records
/// ml-100k's size as 4_924_029 next to GroupLens' MD5 `0e33842e24a9c977be4e0107933c0723`.
const PINNED_ZIPS: [(&str, u64, &str); 2] = [
    (
        "ml-1m",
        5_917_549,
        "a6898adb50b9ca05aa231689da44c217cb524e7ebd39d264c56e2832f2c54e20",
    ),
    (
        "ml-100k",
        4_924_029,
        "50d2a982c66986937beb9ffb3aa76efe955bf3d5c6b761f4e3a7cd717c6a3229",
    ),
];

/// The Hugging Face repos of the models: (name, repo).
const HUB_REPOS: [(&str, &str); 5] = [
    ("gpt2", "openai-community/gpt2"),
    ("distilgpt2", "distilbert/distilgpt2"),
    ("gpt2-medium", "openai-community/gpt2-medium"),
    ("gpt2-large", "openai-community/gpt2-large"),
    ("gpt2-xl", "openai-community/gpt2-xl"),
];

/// Where one name comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A zip (tried at each URL in turn) that must have exactly this size and SHA-256.
    Zip {
        urls: Vec<String>,
        size: u64,
        sha256: String,
    },
    /// A Hugging Face repo: `config.json` + `model.safetensors` at `revision`. `pin`, when
    /// given, is the (size, sha256) `model.safetensors` must have besides what the hub says.
    Hub {
        repo: String,
        revision: String,
        pin: Option<(u64, String)>,
    },
}

/// One name and its source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub asset: &'static Asset,
    pub source: Source,
}

/// The names `fetch` can get in this run.
#[derive(Debug, Clone)]
pub struct Manifest {
    pub entries: Vec<Entry>,
    /// Where it was read from, for messages ("the built-in manifest" or the file).
    pub origin: String,
}

impl Manifest {
    /// The entry called `name`, if the manifest has it.
    pub fn get(&self, name: &str) -> Option<&Entry> {
        self.entries.iter().find(|e| e.asset.name == name)
    }

    /// The built-in manifest; `grouplens_base` is `GPTREC_GROUPLENS_URL` or [`GROUPLENS_BASE`].
    pub fn builtin(grouplens_base: &str) -> Manifest {
        let base = grouplens_base.trim_end_matches('/');
        let zips = PINNED_ZIPS.iter().map(|(name, size, sha)| {
            let source = Source::Zip {
                urls: vec![format!("{base}/{name}.zip")],
                size: *size,
                sha256: (*sha).to_string(),
            };
            (*name, source)
        });
        let hubs = HUB_REPOS.iter().map(|(name, repo)| {
            let source = Source::Hub {
                repo: (*repo).to_string(),
                revision: "main".into(),
                pin: None,
            };
            (*name, source)
        });
        let entries = zips
            .chain(hubs)
            .filter_map(|(name, source)| {
                Some(Entry {
                    asset: assets::find(name)?,
                    source,
                })
            })
            .collect();
        Manifest {
            entries,
            origin: "the built-in manifest".into(),
        }
    }

    /// The manifest in `path`: JSON when it starts with `{` or `[` (not `[[`), TOML otherwise.
    pub fn from_file(path: &Path) -> Result<Manifest, UsageError> {
        let text = common::files::read_input_text(path, MANIFEST_MAX)
            .map_err(|e| UsageError(format!("cannot read manifest {e}")))?;
        let origin = format!("manifest {}", path.display());
        let mut manifest = parse(&text).map_err(|e| UsageError(format!("{origin}: {e}")))?;
        manifest.origin = origin;
        Ok(manifest)
    }
}

/// The base URL of the GroupLens zips: `GPTREC_GROUPLENS_URL`, else [`GROUPLENS_BASE`].
pub fn grouplens_base() -> String {
    non_empty_env("GPTREC_GROUPLENS_URL").unwrap_or_else(|| GROUPLENS_BASE.into())
}

/// The hub endpoint: `HF_ENDPOINT` without trailing slashes (as `huggingface_hub` reads it),
/// else `https://huggingface.co`. An empty `HF_ENDPOINT` counts as unset.
pub fn hf_endpoint() -> String {
    non_empty_env("HF_ENDPOINT")
        .map(|e| e.trim_end_matches('/').to_string())
        .filter(|e| !e.is_empty())
        .unwrap_or_else(|| HF_DEFAULT_ENDPOINT.into())
}

/// `{endpoint}/{repo}/resolve/{revision}/{file}`, the hub's download URL of one file.
pub fn hub_url(endpoint: &str, repo: &str, revision: &str, file: &str) -> String {
    format!("{endpoint}/{repo}/resolve/{revision}/{file}")
}

/// The files a data set's directory must hold once unpacked.
pub fn required_files(name: &str) -> &'static [&'static str] {
    match name {
        "ml-1m" => &["ratings.dat", "users.dat", "movies.dat"],
        "ml-100k" => &["u.data", "u.item", "u.user"],
        _ => &[],
    }
}

/// Every name `fetch` knows, comma-separated (for error lines).
pub fn known_names() -> String {
    let names: Vec<&str> = assets::ASSETS.iter().map(|a| a.name).collect();
    names.join(", ")
}

fn non_empty_env(key: &str) -> Option<String> {
    std::env::var(key).ok().filter(|v| !v.is_empty())
}

/// One entry as written in a manifest file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEntry {
    name: String,
    url: Option<String>,
    urls: Option<Vec<String>>,
    sha256: Option<String>,
    size: Option<u64>,
    repo: Option<String>,
    revision: Option<String>,
}

/// A manifest file: `[[entry]]` tables (TOML) or `{"entry": [...]}` / `[...]` (JSON).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawManifest {
    #[serde(alias = "entries")]
    entry: Vec<RawEntry>,
}

/// Parses and checks a manifest's text.
pub fn parse(text: &str) -> Result<Manifest, String> {
    let raw = parse_raw(text)?;
    let mut entries: Vec<Entry> = Vec::new();
    for item in raw {
        let entry = check_entry(item)?;
        if entries.iter().any(|e| e.asset.name == entry.asset.name) {
            return Err(format!("{} is listed twice", entry.asset.name));
        }
        entries.push(entry);
    }
    Ok(Manifest {
        entries,
        origin: String::new(),
    })
}

fn parse_raw(text: &str) -> Result<Vec<RawEntry>, String> {
    let start = text.trim_start();
    // `[[entry]]` is TOML; `[{...}]` a JSON list.
    let toml_table = start
        .strip_prefix('[')
        .is_some_and(|r| r.trim_start().starts_with('['));
    match start.chars().next() {
        Some('[') if !toml_table => serde_json::from_str(text).map_err(|e| e.to_string()),
        Some('{') => serde_json::from_str::<RawManifest>(text)
            .map(|m| m.entry)
            .map_err(|e| e.to_string()),
        _ => toml::from_str::<RawManifest>(text)
            .map(|m| m.entry)
            .map_err(|e| e.to_string().trim_end().replace('\n', " ")),
    }
}

fn check_entry(raw: RawEntry) -> Result<Entry, String> {
    let asset = assets::find(&raw.name)
        .ok_or_else(|| format!("unknown name {:?} (known: {})", raw.name, known_names()))?;
    let source = match asset.kind {
        AssetKind::Dataset => zip_source(raw)?,
        AssetKind::Model => hub_source(raw)?,
    };
    Ok(Entry { asset, source })
}

fn zip_source(raw: RawEntry) -> Result<Source, String> {
    let name = &raw.name;
    if raw.repo.is_some() || raw.revision.is_some() {
        return Err(format!(
            "{name} is a data set: give url/urls, not repo/revision"
        ));
    }
    let mut urls: Vec<String> = raw
        .url
        .into_iter()
        .chain(raw.urls.unwrap_or_default())
        .collect();
    urls.dedup();
    if urls.is_empty() {
        return Err(format!("{name} needs url (or urls)"));
    }
    for url in &urls {
        check_url(url)?;
    }
    let size = raw
        .size
        .filter(|s| *s > 0)
        .ok_or(format!("{name} needs size (bytes, > 0)"))?;
    let sha256 = check_sha256(
        name,
        raw.sha256
            .as_deref()
            .ok_or(format!("{name} needs sha256"))?,
    )?;
    Ok(Source::Zip { urls, size, sha256 })
}

fn hub_source(raw: RawEntry) -> Result<Source, String> {
    let name = &raw.name;
    if raw.url.is_some() || raw.urls.is_some() {
        return Err(format!(
            "{name} is a model: give repo (and revision), not url"
        ));
    }
    let repo = raw
        .repo
        .filter(|r| !r.is_empty())
        .ok_or(format!("{name} needs repo"))?;
    let pin = match (raw.size, raw.sha256) {
        (Some(size), Some(sha)) => Some((size, check_sha256(name, &sha)?)),
        (None, None) => None,
        _ => {
            return Err(format!(
                "{name}: give both size and sha256 of model.safetensors, or neither"
            ))
        }
    };
    let revision = raw.revision.unwrap_or_else(|| "main".into());
    Ok(Source::Hub {
        repo,
        revision,
        pin,
    })
}

fn check_url(url: &str) -> Result<(), String> {
    if url.starts_with("http://") || url.starts_with("https://") {
        Ok(())
    } else {
        Err(format!("{url:?} is not an http:// or https:// URL"))
    }
}

/// `sha` as 64 lowercase hex digits, or why not.
fn check_sha256(name: &str, sha: &str) -> Result<String, String> {
    let sha = sha.trim().to_ascii_lowercase();
    if sha.len() == 64 && sha.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok(sha)
    } else {
        Err(format!("{name}: sha256 must be 64 hex digits, not {sha:?}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHA: &str = "a6898adb50b9ca05aa231689da44c217cb524e7ebd39d264c56e2832f2c54e20";

    #[test]
    fn the_builtin_manifest_pins_the_grouplens_zips_and_knows_every_model() {
        let m = Manifest::builtin(GROUPLENS_BASE);
        assert_eq!(m.entries.len(), assets::ASSETS.len());
        let Some(Source::Zip { urls, size, sha256 }) = m.get("ml-1m").map(|e| &e.source) else {
            panic!("ml-1m is a zip");
        };
        assert_eq!(
            urls,
            &["https://files.grouplens.org/datasets/movielens/ml-1m.zip"]
        );
        assert_eq!((*size, sha256.as_str()), (5_917_549, SHA));
        let Some(Source::Hub { repo, .. }) = m.get("distilgpt2").map(|e| &e.source) else {
            panic!("distilgpt2 is a hub model");
        };
        assert_eq!(repo, "distilbert/distilgpt2");
    }

    #[test]
    fn a_mirror_base_replaces_grouplens() {
        let m = Manifest::builtin("http://mirror.example/ml/");
        let Source::Zip { urls, .. } = &m.get("ml-100k").unwrap().source else {
            panic!()
        };
        assert_eq!(urls, &["http://mirror.example/ml/ml-100k.zip"]);
    }

    #[test]
    fn toml_and_json_manifests_read_alike() {
        let toml = format!(
            "[[entry]]\nname = \"ml-1m\"\nurl = \"http://h/a.zip\"\nsize = 3\nsha256 = \"{}\"\n\n\
             [[entry]]\nname = \"gpt2\"\nrepo = \"me/gpt2\"\n",
            SHA.to_uppercase()
        );
        let json = format!(
            r#"{{"entry": [{{"name": "ml-1m", "urls": ["http://h/a.zip"], "size": 3, "sha256": "{SHA}"}},
                           {{"name": "gpt2", "repo": "me/gpt2"}}]}}"#
        );
        let bare = format!(
            r#"[{{"name": "ml-1m", "url": "http://h/a.zip", "size": 3, "sha256": "{SHA}"}},
                {{"name": "gpt2", "repo": "me/gpt2", "revision": "main"}}]"#
        );
        let a = parse(&toml).unwrap().entries;
        assert_eq!(a, parse(&json).unwrap().entries);
        assert_eq!(a, parse(&bare).unwrap().entries);
        assert_eq!(
            a[0].source,
            Source::Zip {
                urls: vec!["http://h/a.zip".into()],
                size: 3,
                sha256: SHA.into()
            }
        );
    }

    #[test]
    fn bad_entries_are_refused_with_a_reason() {
        let cases = [
            (
                r#"[{"name": "ml-2m", "url": "http://h", "size": 1, "sha256": "x"}]"#,
                "unknown name",
            ),
            (
                r#"[{"name": "ml-1m", "size": 1, "sha256": "x"}]"#,
                "needs url",
            ),
            (
                r#"[{"name": "ml-1m", "url": "ftp://h", "size": 1, "sha256": "x"}]"#,
                "not an http",
            ),
            (
                r#"[{"name": "ml-1m", "url": "http://h", "sha256": "x"}]"#,
                "needs size",
            ),
            (
                r#"[{"name": "ml-1m", "url": "http://h", "size": 1, "sha256": "abc"}]"#,
                "64 hex",
            ),
            (r#"[{"name": "ml-1m", "repo": "a/b"}]"#, "is a data set"),
            (r#"[{"name": "gpt2", "url": "http://h"}]"#, "is a model"),
            (
                r#"[{"name": "gpt2", "repo": "a/b", "size": 3}]"#,
                "both size and sha256",
            ),
            (
                r#"[{"name": "gpt2", "repo": "a/b", "colour": 3}]"#,
                "unknown field",
            ),
            (
                r#"[{"name": "gpt2", "repo": "a/b"}, {"name": "gpt2", "repo": "c/d"}]"#,
                "twice",
            ),
            ("entry = 3", "invalid type"),
        ];
        for (text, why) in cases {
            let err = parse(text).unwrap_err();
            assert!(err.contains(why), "{text}: {err}");
        }
    }

    #[test]
    fn hub_urls_follow_the_resolve_layout() {
        assert_eq!(
            hub_url(
                "https://huggingface.co",
                "openai-community/gpt2",
                "main",
                "config.json"
            ),
            "https://huggingface.co/openai-community/gpt2/resolve/main/config.json"
        );
    }
}
