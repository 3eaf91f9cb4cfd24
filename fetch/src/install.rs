//! Getting one named asset into the cache, from the network or from `--from`: skip it when
//! complete (its marker there and its files as the marker records them; one that differs is
//! named and placed again), take the name's lock, download and check (zip: pinned size and
//! SHA-256; model: the hub's `X-Linked-Size`/`X-Linked-Etag`, `config.json` is GPT-2's), unpack
//! or gather into a staging directory, place it with a marker listing every placed file, and
//! turn failures into their one line (disk full, offline with the way to fetch by hand).
//!
//! Must not: parse the command line, print errors or exit (the binary's edge does).

use std::fs;
use std::path::{Path, PathBuf};

use common::assets::{Asset, AssetKind};
use common::files::InputError;

use crate::download::{self, Options, Want};
use crate::error::FetchError;
use crate::http::{Client, Head};
use crate::input::Input;
use crate::manifest::{self, Entry, Source};
use crate::marker::{self, Depth, MarkedFile, Marker, State};
use crate::model;
use crate::place::{self, Staging};
use crate::unpack;

/// The cache, how to download, and how closely a placement is checked against its marker.
pub struct Ctx {
    pub root: PathBuf,
    pub client: Client,
    pub opts: Options,
    pub depth: Depth,
}

/// What became of a name.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// It was complete already, in this directory.
    Already(PathBuf),
    /// It was placed in this directory now.
    Placed(PathBuf),
}

/// `<root>/data/<name>` or `<root>/models/<name>` (as `common::assets::asset_dir` lays out
/// the default cache root).
pub fn final_dir(root: &Path, asset: &Asset) -> PathBuf {
    let sub = match asset.kind {
        AssetKind::Dataset => "data",
        AssetKind::Model => "models",
    };
    root.join(sub).join(asset.name)
}

/// The largest zip accepted from `--from` (the MovieLens zips are under 6 MB).
const ZIP_MAX: u64 = 4 << 30;

/// `<root>/.partial`: partial downloads and locks.
fn partial_root(root: &Path) -> PathBuf {
    root.join(".partial")
}

/// Downloads `entry` into the cache unless it is complete there.
pub fn fetch(ctx: &Ctx, entry: &Entry) -> Result<Outcome, FetchError> {
    let hint = offline_hint(entry);
    guarded(ctx, entry, || match &entry.source {
        Source::Zip { urls, size, sha256 } => fetch_zip(ctx, entry.asset, urls, *size, sha256),
        Source::Hub {
            repo,
            revision,
            pin,
        } => fetch_model(ctx, entry.asset, repo, revision, pin.as_ref()),
    })
    .map_err(|e| e.with_offline_hint(&hint))
}

/// Installs `entry` from a file downloaded by hand (a zip; for a model, a directory holding
/// `config.json` and `model.safetensors`), with the same checks and no network.
pub fn install_from(ctx: &Ctx, entry: &Entry, from: &Path) -> Result<Outcome, FetchError> {
    guarded(ctx, entry, || match &entry.source {
        Source::Zip { size, sha256, .. } => zip_from(ctx, entry.asset, from, *size, sha256),
        Source::Hub { pin, .. } => model_from(ctx, entry.asset, from, pin.as_ref()),
    })
}

/// Runs `work` under the name's lock unless the asset is complete (its marker there and its
/// files as the marker records them, to `ctx.depth`); a placement whose files differ is named
/// and placed again. A full disk names the directory that was not placed.
fn guarded(
    ctx: &Ctx,
    entry: &Entry,
    work: impl FnOnce() -> Result<(), FetchError>,
) -> Result<Outcome, FetchError> {
    let name = entry.asset.name;
    let dir = final_dir(&ctx.root, entry.asset);
    let first = marker::state(&dir, ctx.depth);
    match &first {
        State::Complete(m) => return Ok(already(ctx, name, m, dir)),
        State::Differs(_, detail) => eprintln!("fetch: {detail}; {name} is placed again"),
        State::Unmarked if placed_by_hand(&dir, name) => {
            // Never replaced: it may be all the user has (scripts/data/ml100k.sh writes one
            // offline).
            eprintln!(
                "fetch: {} holds {name}'s files, placed by hand (no fetch marker, so not checked against the pinned digest); kept as it is",
                dir.display(),
            );
            return Ok(Outcome::Already(dir));
        }
        State::Unmarked => {}
    }
    let result = place::lock(&partial_root(&ctx.root), name).and_then(|_lock| {
        if let State::Complete(m) = recheck(&dir, first, ctx.depth) {
            return Ok(already(ctx, name, &m, dir.clone()));
        }
        work().map(|()| Outcome::Placed(dir.clone()))
    });
    result.map_err(|e| e.placing(&dir))
}

/// The state of `dir` once the lock is held: `before` again unless its marker changed
/// meanwhile (another `fetch` placed it while this one waited), so nothing is hashed twice.
fn recheck(dir: &Path, before: State, depth: Depth) -> State {
    let seen = match &before {
        State::Unmarked => None,
        State::Complete(m) | State::Differs(m, _) => Some(m),
    };
    match marker::read(dir) {
        now if now.as_ref() == seen => before,
        None => State::Unmarked,
        Some(now) => marker::judge(dir, now, depth),
    }
}

/// A complete placement: under `--verify`, says what was checked.
fn already(ctx: &Ctx, name: &str, m: &Marker, dir: PathBuf) -> Outcome {
    if ctx.depth == Depth::Digests {
        match m.placed.len() {
            0 => eprintln!(
                "fetch: {name}: its {} marker, from an earlier fetch, lists no files: nothing verified",
                marker::MARKER
            ),
            n => eprintln!(
                "fetch: {name}: {n} files match the SHA-256 in its {} marker",
                marker::MARKER
            ),
        }
    }
    Outcome::Already(dir)
}

/// A data set's directory without fetch's marker that holds every file the data set needs (as
/// `scripts/data/ml100k.sh` writes them): placed by hand, and kept.
pub fn placed_by_hand(dir: &Path, name: &str) -> bool {
    let files = crate::manifest::required_files(name);
    !files.is_empty() && marker::read(dir).is_none() && files.iter().all(|f| dir.join(f).is_file())
}

/// How to get `entry` by hand when this machine is offline.
fn offline_hint(entry: &Entry) -> String {
    let name = entry.asset.name;
    match &entry.source {
        Source::Zip { urls, .. } => format!(
            "download {} on another machine and run: fetch --from FILE {name}",
            urls.first().map_or("the zip", String::as_str)
        ),
        Source::Hub { repo, revision, .. } => {
            let url = |f| manifest::hub_url(&manifest::hf_endpoint(), repo, revision, f);
            format!(
                "download {} and {} into one directory on another machine and run: fetch --from DIR {name}",
                url("config.json"),
                url("model.safetensors")
            )
        }
    }
}

fn say(ctx: &Ctx, line: &str) {
    if !ctx.opts.quiet {
        eprintln!("fetch: {line}");
    }
}

fn fetch_zip(
    ctx: &Ctx,
    asset: &Asset,
    urls: &[String],
    size: u64,
    sha256: &str,
) -> Result<(), FetchError> {
    let label = format!("{}.zip", asset.name);
    let part = partial_root(&ctx.root)
        .join(asset.name)
        .join(format!("{label}.part"));
    say(
        ctx,
        &format!(
            "downloading {} from {}",
            asset.name,
            urls.first().map_or("", String::as_str)
        ),
    );
    let want = Want {
        label: &label,
        urls,
        size,
        sha256,
    };
    download::download(&ctx.client, &want, &part, ctx.opts)?;
    let zip = Input::open(&part, u64::MAX)?;
    let marked = MarkedFile {
        file: label.clone(),
        size,
        sha256: sha256.to_string(),
    };
    place_zip(
        ctx,
        asset,
        &zip,
        marked,
        urls.first().cloned().unwrap_or_default(),
    )?;
    download::discard(&part);
    Ok(())
}

fn zip_from(
    ctx: &Ctx,
    asset: &Asset,
    from: &Path,
    size: u64,
    sha256: &str,
) -> Result<(), FetchError> {
    let label = format!("{}.zip", asset.name);
    let want = Want {
        label: &label,
        urls: &[],
        size,
        sha256,
    };
    let then = format!(" ({} is not the published {label})", from.display());
    let zip = Input::open(from, ZIP_MAX)?;
    download::check(&want, &zip, &then)?;
    let marked = MarkedFile {
        file: label.clone(),
        size,
        sha256: sha256.to_string(),
    };
    place_zip(
        ctx,
        asset,
        &zip,
        marked,
        format!("--from {}", from.display()),
    )
}

/// Unpacks a checked zip into staging, checks the data set's files are there, places it.
fn place_zip(
    ctx: &Ctx,
    asset: &Asset,
    zip: &Input,
    marked: MarkedFile,
    source: String,
) -> Result<(), FetchError> {
    let staging = Staging::new(&final_dir(&ctx.root, asset))?;
    let unpacked = unpack::unpack(zip, &staging.dir, &marked.file, unpack::LIMITS)?;
    let missing: Vec<&str> = manifest::required_files(asset.name)
        .iter()
        .copied()
        .filter(|f| !staging.dir.join(f).is_file())
        .collect();
    if !missing.is_empty() {
        return Err(FetchError::BadContent {
            file: marked.file,
            detail: format!("has no {} (not {})", missing.join(", "), asset.name),
        });
    }
    let placed = unpacked
        .into_iter()
        .map(|f| MarkedFile {
            file: f.path.to_string_lossy().into_owned(),
            size: f.size,
            sha256: f.sha256,
        })
        .collect();
    let marker = Marker {
        name: asset.name.to_string(),
        source,
        files: vec![marked],
        placed,
    };
    staging.commit(&marker)
}

fn fetch_model(
    ctx: &Ctx,
    asset: &Asset,
    repo: &str,
    revision: &str,
    pin: Option<&(u64, String)>,
) -> Result<(), FetchError> {
    let endpoint = manifest::hf_endpoint();
    let config_url = manifest::hub_url(&endpoint, repo, revision, "config.json");
    let weights_url = manifest::hub_url(&endpoint, repo, revision, "model.safetensors");
    say(
        ctx,
        &format!("downloading {} from {endpoint}/{repo}", asset.name),
    );
    let config = download::small_file(&ctx.client, &config_url, "config.json", model::CONFIG_MAX)?;
    model::check_config(&config).map_err(|detail| bad("config.json", detail))?;
    let head = ctx.client.head(&weights_url)?;
    let (size, sha256) = hub_digest(&head, pin, &weights_url)?;
    let part = partial_root(&ctx.root)
        .join(asset.name)
        .join("model.safetensors.part");
    let urls = [head.download_url.clone()];
    let want = Want {
        label: "model.safetensors",
        urls: &urls,
        size,
        sha256: &sha256,
    };
    download::download(&ctx.client, &want, &part, ctx.opts)?;
    let weights = Input::open(&part, u64::MAX)?;
    model::check_safetensors(weights.reader(), weights.len())
        .map_err(|detail| bad("model.safetensors", detail))?;
    place_model(ctx, asset, &config, &weights, (size, sha256), weights_url)?;
    download::discard(&part);
    Ok(())
}

/// The size and SHA-256 `model.safetensors` must have: the hub's `X-Linked-*` headers, which
/// must agree with a pin when the manifest has one.
fn hub_digest(
    head: &Head,
    pin: Option<&(u64, String)>,
    url: &str,
) -> Result<(u64, String), FetchError> {
    let linked = head
        .linked_etag
        .as_ref()
        .filter(|e| is_sha256(e))
        .zip(head.linked_size)
        .map(|(sha, size)| (size, sha.clone()));
    match (linked, pin) {
        (Some(hub), Some(pin)) if &hub != pin => Err(FetchError::Hub(format!(
            "{url}: the hub's file ({} bytes, sha256 {}) is not the pinned one ({} bytes, sha256 {})",
            hub.0, hub.1, pin.0, pin.1
        ))),
        (Some(hub), _) => Ok(hub),
        (None, Some(pin)) => Ok(pin.clone()),
        (None, None) => Err(FetchError::Hub(format!(
            "{url}: the answer has no X-Linked-Etag (sha256) and X-Linked-Size, so model.safetensors cannot be checked; pin its size and sha256 in a --manifest"
        ))),
    }
}

fn is_sha256(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

fn bad(file: &str, detail: String) -> FetchError {
    FetchError::BadContent {
        file: file.to_string(),
        detail,
    }
}

/// Gathers `config.json` and the checked weights (linked, else copied) into staging and places
/// them; the partial file stays until the placement succeeded.
fn place_model(
    ctx: &Ctx,
    asset: &Asset,
    config: &[u8],
    weights: &Input,
    digest: (u64, String),
    source: String,
) -> Result<(), FetchError> {
    let staging = Staging::new(&final_dir(&ctx.root, asset))?;
    place::write_synced(&staging.dir.join("config.json"), config)?;
    let target = staging.dir.join("model.safetensors");
    if fs::hard_link(weights.path(), &target).is_err() {
        place::copy_synced(weights, &target)?;
    }
    let marker = model_marker(asset, config, digest, source);
    staging.commit(&marker)
}

fn model_marker(asset: &Asset, config: &[u8], digest: (u64, String), source: String) -> Marker {
    use sha2::{Digest, Sha256};
    let config_file = MarkedFile {
        file: "config.json".into(),
        size: config.len() as u64,
        sha256: common::hex(&Sha256::digest(config)),
    };
    let weights_file = MarkedFile {
        file: "model.safetensors".into(),
        size: digest.0,
        sha256: digest.1,
    };
    let files = vec![config_file, weights_file];
    Marker {
        name: asset.name.to_string(),
        source,
        placed: files.clone(),
        files,
    }
}

/// A model from a directory holding `config.json` and `model.safetensors`: the config is
/// GPT-2's, the weights are whole (and match the pin, when there is one); copied into place.
/// Each file is opened once, and the weights' header check, digest and copy read that handle.
fn model_from(
    ctx: &Ctx,
    asset: &Asset,
    from: &Path,
    pin: Option<&(u64, String)>,
) -> Result<(), FetchError> {
    let config_file = open_in(from, "config.json", model::CONFIG_MAX)?;
    let config = config_file.bytes()?;
    model::check_config(&config).map_err(|d| bad(&config_file.path().display().to_string(), d))?;
    let weights = open_in(from, "model.safetensors", model::WEIGHTS_MAX)?;
    model::check_safetensors(weights.reader(), weights.len())
        .map_err(|d| bad(&weights.path().display().to_string(), d))?;
    let digest = weights_digest(&weights, pin)?;
    let staging = Staging::new(&final_dir(&ctx.root, asset))?;
    place::write_synced(&staging.dir.join("config.json"), &config)?;
    place::copy_synced(&weights, &staging.dir.join("model.safetensors"))?;
    staging.commit(&model_marker(
        asset,
        &config,
        digest,
        format!("--from {}", from.display()),
    ))
}

/// `dir/file` opened by [`Input::open`]; a missing one is named as what the directory lacks.
fn open_in(dir: &Path, file: &str, max: u64) -> Result<Input, FetchError> {
    match Input::open(&dir.join(file), max) {
        Err(InputError::Missing { .. }) => Err(bad(
            &dir.display().to_string(),
            format!("no {file} there: a GPT-2 model directory holds config.json and model.safetensors (as the hub has them)"),
        )),
        other => Ok(other?),
    }
}

/// The size and SHA-256 of `--from`'s weights: checked against the pin when there is one.
fn weights_digest(
    weights: &Input,
    pin: Option<&(u64, String)>,
) -> Result<(u64, String), FetchError> {
    match pin {
        Some((size, sha256)) => {
            let want = Want {
                label: "model.safetensors",
                urls: &[],
                size: *size,
                sha256,
            };
            let then = format!(" ({})", weights.path().display());
            download::check(&want, weights, &then)?;
            Ok((*size, sha256.clone()))
        }
        None => Ok((weights.len(), weights.sha256()?)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use common::assets;

    #[test]
    fn final_dirs_match_common_asset_dirs_under_the_default_root() {
        for asset in assets::ASSETS.iter() {
            assert_eq!(
                final_dir(&assets::cache_root(), asset),
                assets::asset_dir(asset)
            );
        }
    }

    fn head(etag: Option<&str>, size: Option<u64>) -> Head {
        Head {
            download_url: "u".into(),
            linked_etag: etag.map(str::to_string),
            linked_size: size,
            etag: None,
        }
    }

    #[test]
    fn the_hub_digest_comes_from_x_linked_headers_and_must_match_a_pin() {
        let sha = "a".repeat(64);
        let got = hub_digest(&head(Some(&sha), Some(5)), None, "u").unwrap();
        assert_eq!(got, (5, sha.clone()));
        let pin = (5, sha.clone());
        assert_eq!(hub_digest(&head(None, None), Some(&pin), "u").unwrap(), pin);
        let other = (6, sha.clone());
        let err = hub_digest(&head(Some(&sha), Some(5)), Some(&other), "u").unwrap_err();
        assert!(err.to_string().contains("not the pinned one"), "{err}");
        let err = hub_digest(&head(Some("e1"), Some(5)), None, "u").unwrap_err();
        assert!(err.to_string().contains("no X-Linked-Etag"), "{err}");
    }
}
