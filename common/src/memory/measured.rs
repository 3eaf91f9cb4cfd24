//! The data shape a run measured, remembered for later estimates of the same data: `launch`
//! (which reads no data, and so starts from [`DataShape::assumed`]) then gives the estimate the
//! workers give. Records live in `<run.output_dir>/data/shapes/<key>.json`, one per key.
//!
//! Owns: the key (what decides a data set's shape: its files, the keys that filter and split it,
//! how text is cut) and the record's file. Must not: read the data (the worker measures it), or
//! decide anything from the shape (the estimate does).

use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::DataShape;
use crate::config::{Config, ModelKind};
use crate::data_layout::{data_dir, DataFormat};

/// What the shape of `config`'s data depends on, as one digest; `None` when its data files are
/// not there yet (synthetic data before its first run, a missing `data.dir`).
fn key(config: &Config) -> Option<String> {
    let dir = data_dir(config);
    let format = DataFormat::detect(&dir)?;
    let mut hasher = Sha256::new();
    for name in format.files() {
        // The file as the file system knows it: any rewrite changes its size, time or inode.
        let meta = std::fs::metadata(dir.join(name)).ok()?;
        hasher.update(format!(
            "{name} {} {} {} {};",
            meta.len(),
            meta.ino(),
            meta.mtime(),
            meta.mtime_nsec()
        ));
    }
    let data = &config.data;
    let text = config.model.kind == ModelKind::Gpt2rec;
    hasher.update(format!(
        "min_rating {} cold_items {} cold_users {} split_seed {} text {text} max_text_tokens {}",
        data.min_rating,
        data.cold_items,
        data.cold_users,
        data.split_seed_or(config.run.seed),
        config.model.max_text_tokens,
    ));
    let digest = hasher.finalize();
    Some(digest[..8].iter().map(|b| format!("{b:02x}")).collect())
}

fn record_path(config: &Config, key: &str) -> PathBuf {
    config
        .run
        .output_dir
        .join("data")
        .join("shapes")
        .join(format!("{key}.json"))
}

impl DataShape {
    /// The shape an earlier run measured on exactly this data, if one did.
    pub fn measured_earlier(config: &Config) -> Option<DataShape> {
        let key = key(config)?;
        let text = std::fs::read_to_string(record_path(config, &key)).ok()?;
        let mut shape: DataShape = serde_json::from_str(&text).ok()?;
        shape.source = format!("{}, by an earlier run", shape.source);
        Some(shape)
    }

    /// What `launch` estimates with: [`DataShape::measured_earlier`], else the assumed shape.
    pub fn best_known(config: &Config) -> DataShape {
        Self::measured_earlier(config).unwrap_or_else(|| Self::assumed(config))
    }

    /// Remembers this shape, measured on `config`'s data, for later estimates (written whole:
    /// a temporary file renamed into place).
    pub fn remember(&self, config: &Config) -> io::Result<()> {
        let Some(key) = key(config) else {
            return Ok(());
        };
        let path = record_path(config, &key);
        let dir = path.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir)?;
        let tmp = dir.join(format!(".{key}.{}.tmp", std::process::id()));
        std::fs::write(&tmp, serde_json::to_vec(self).map_err(io::Error::other)?)?;
        std::fs::rename(&tmp, &path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> DataShape {
        DataShape {
            users: 7,
            items: 5,
            interactions: 30,
            user_tokens: 9,
            item_tokens: 11,
            source: "measured on d".into(),
        }
    }

    /// A shape is found again for the same data and settings, and not once the files or a key
    /// that changes the shape do.
    #[test]
    fn a_measured_shape_is_found_for_the_same_data_only() {
        let out = tempfile::tempdir().unwrap();
        let mut c = Config::default();
        c.run.output_dir = out.path().to_path_buf();
        assert_eq!(DataShape::measured_earlier(&c), None, "no data yet");
        shape().remember(&c).unwrap();
        assert!(
            !out.path().join("data/shapes").exists(),
            "nothing to key it by yet"
        );
        let dir = data_dir(&c);
        std::fs::create_dir_all(&dir).unwrap();
        for name in DataFormat::Ml1m.files() {
            std::fs::write(dir.join(name), "x").unwrap();
        }
        shape().remember(&c).unwrap();
        let found = DataShape::measured_earlier(&c).unwrap();
        assert_eq!((found.users, found.item_tokens), (7, 11));
        assert_eq!(found.source, "measured on d, by an earlier run");
        assert_eq!(DataShape::best_known(&c), found);
        let mut other = c.clone();
        other.data.min_rating = 4;
        assert_eq!(DataShape::measured_earlier(&other), None);
        assert_eq!(DataShape::best_known(&other), DataShape::assumed(&other));
        std::fs::write(dir.join("ratings.dat"), "xy").unwrap();
        assert_eq!(DataShape::measured_earlier(&c), None, "the data changed");
    }
}
