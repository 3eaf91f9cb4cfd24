//! The named downloads (`ml-1m`, `ml-100k`, `gpt2`, ...) and where the cache keeps them.
//!
//! Owns: the cache root (`GPTREC_CACHE`, else `$XDG_CACHE_HOME/gptrec`, else
//! `$HOME/.cache/gptrec`, as `scripts/setup.sh` uses), the list of names `fetch` knows, the
//! directory each one is placed in, and the resolution of a config's `data.dir` /
//! `model.gpt2_weights` written as such a name into that directory.
//!
//! Must not: download, read or write anything (the `fetch` binary does), or depend on more than
//! the environment variables above.

use std::path::{Path, PathBuf};

/// What a named download is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AssetKind {
    /// A MovieLens data set: a directory of its files.
    Dataset,
    /// A Hugging Face GPT-2 model directory (`config.json` + `model.safetensors`).
    Model,
}

/// One name `fetch` knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Asset {
    pub name: &'static str,
    pub kind: AssetKind,
    /// What it is, in a few words (for `fetch --list`).
    pub about: &'static str,
}

/// Every name `fetch` knows, data sets first.
pub const ASSETS: [Asset; 7] = [
    Asset {
        name: "ml-1m",
        kind: AssetKind::Dataset,
        about: "MovieLens-1M (GroupLens): 6,040 users, 3,706 movies, 1,000,209 ratings",
    },
    Asset {
        name: "ml-100k",
        kind: AssetKind::Dataset,
        about: "MovieLens-100k (GroupLens): 943 users, 1,682 movies, 100,000 ratings",
    },
    Asset {
        name: "gpt2",
        kind: AssetKind::Model,
        about: "GPT-2 124M (Hugging Face openai-community/gpt2)",
    },
    Asset {
        name: "distilgpt2",
        kind: AssetKind::Model,
        about: "DistilGPT-2 82M (Hugging Face distilbert/distilgpt2)",
    },
    Asset {
        name: "gpt2-medium",
        kind: AssetKind::Model,
        about: "GPT-2 355M (Hugging Face openai-community/gpt2-medium)",
    },
    Asset {
        name: "gpt2-large",
        kind: AssetKind::Model,
        about: "GPT-2 774M (Hugging Face openai-community/gpt2-large)",
    },
    Asset {
        name: "gpt2-xl",
        kind: AssetKind::Model,
        about: "GPT-2 1.5B (Hugging Face openai-community/gpt2-xl)",
    },
];

/// The asset called `name`, if `fetch` knows it.
pub fn find(name: &str) -> Option<&'static Asset> {
    ASSETS.iter().find(|a| a.name == name)
}

/// The cache root: `GPTREC_CACHE`, else `$XDG_CACHE_HOME/gptrec`, else `$HOME/.cache/gptrec`,
/// else `.cache/gptrec` under the working directory (no home at all).
pub fn cache_root() -> PathBuf {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    if let Some(dir) = var("GPTREC_CACHE") {
        return PathBuf::from(dir);
    }
    if let Some(xdg) = var("XDG_CACHE_HOME") {
        return PathBuf::from(xdg).join("gptrec");
    }
    match var("HOME") {
        Some(home) => PathBuf::from(home).join(".cache").join("gptrec"),
        None => PathBuf::from(".cache").join("gptrec"),
    }
}

/// Where `asset` lives once fetched: `<cache>/data/<name>` or `<cache>/models/<name>`.
pub fn asset_dir(asset: &Asset) -> PathBuf {
    let sub = match asset.kind {
        AssetKind::Dataset => "data",
        AssetKind::Model => "models",
    };
    cache_root().join(sub).join(asset.name)
}

/// The command that fetches `asset`, as a user types it.
pub fn fetch_command(asset: &Asset) -> String {
    format!("fetch {}", asset.name)
}

/// A config path written as a bare name `fetch` knows (`"ml-1m"`, `"gpt2"`) of the wanted kind:
/// the asset. A path with a separator (`./ml-1m`, `data/ml-1m`) is always a path.
pub fn named(path: &Path, kind: AssetKind) -> Option<&'static Asset> {
    let name = path.to_str()?;
    find(name).filter(|a| a.kind == kind)
}

/// `path` as the run uses it: a bare asset name of `kind` becomes its cache directory; anything
/// else is returned unchanged.
pub fn resolve(path: &Path, kind: AssetKind) -> PathBuf {
    match named(path, kind) {
        Some(asset) => asset_dir(asset),
        None => path.to_path_buf(),
    }
}

/// The command that would provide `path` (a bare asset name, a path ending in a known
/// asset's cache directory or in a directory called like it), for error lines: `fetch ml-1m`.
pub fn fetch_hint(path: &Path, kind: AssetKind) -> Option<String> {
    if let Some(a) = named(path, kind) {
        return Some(fetch_command(a));
    }
    path.components()
        .rev()
        .filter_map(|c| c.as_os_str().to_str())
        .take(2)
        .find_map(|n| find(n).filter(|a| a.kind == kind))
        .map(fetch_command)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_names_resolve_into_the_cache_and_paths_stay_paths() {
        let root = cache_root();
        assert_eq!(
            resolve(Path::new("ml-1m"), AssetKind::Dataset),
            root.join("data").join("ml-1m")
        );
        assert_eq!(
            resolve(Path::new("gpt2"), AssetKind::Model),
            root.join("models").join("gpt2")
        );
        for p in ["./ml-1m", "data/ml-1m", "/x/ml-1m", "ml-2m"] {
            assert_eq!(resolve(Path::new(p), AssetKind::Dataset), Path::new(p));
        }
        // A data set's name is no model, and the other way round.
        assert_eq!(
            resolve(Path::new("gpt2"), AssetKind::Dataset),
            Path::new("gpt2")
        );
        assert_eq!(
            resolve(Path::new("ml-1m"), AssetKind::Model),
            Path::new("ml-1m")
        );
    }

    #[test]
    fn hints_name_the_fetch_command() {
        let hint = |p: &str, k| fetch_hint(Path::new(p), k);
        assert_eq!(
            hint("ml-1m", AssetKind::Dataset).as_deref(),
            Some("fetch ml-1m")
        );
        assert_eq!(
            hint("data/ml-100k", AssetKind::Dataset).as_deref(),
            Some("fetch ml-100k")
        );
        assert_eq!(
            hint("w/gpt2/model.safetensors", AssetKind::Model).as_deref(),
            Some("fetch gpt2")
        );
        assert_eq!(hint("data/mine", AssetKind::Dataset), None);
    }

    #[test]
    fn every_name_is_unique() {
        for (i, a) in ASSETS.iter().enumerate() {
            assert!(
                ASSETS[i + 1..].iter().all(|b| b.name != a.name),
                "{}",
                a.name
            );
        }
    }
}
