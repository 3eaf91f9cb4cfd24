//! The two MovieLens layouts a data directory may have, told apart by the files present: the
//! names the launcher's pre-flight checks and the worker's readers agree on.
//!
//! Must not: read or parse the files (the recommender's readers do).

use std::path::{Path, PathBuf};

use crate::config::Config;

/// Version of the synthetic generator's output (`recommender::data::synthetic`): bumped
/// whenever the same seed would give other files, so cached copies (named with it) are never
/// stale.
pub const SYNTHETIC_VERSION: u32 = 2;

/// The directory `config`'s data is read from: `data.dir`, or [`synthetic_dir`].
pub fn data_dir(config: &Config) -> PathBuf {
    match &config.data.dir {
        Some(dir) => dir.clone(),
        None => synthetic_dir(config),
    }
}

/// Where the synthetic data of `config` is generated:
/// `<output_dir>/data/synthetic-<size>-seed<seed>-v<generator version>/`.
pub fn synthetic_dir(config: &Config) -> PathBuf {
    let size = format!("{:?}", config.data.synthetic).to_lowercase();
    config.run.output_dir.join("data").join(format!(
        "synthetic-{size}-seed{}-v{SYNTHETIC_VERSION}",
        config.run.seed
    ))
}

/// A data directory's layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataFormat {
    /// MovieLens-1M: `ratings.dat`, `users.dat`, `movies.dat` (`::`-separated).
    Ml1m,
    /// MovieLens-100k as GroupLens ships it: `u.data`, `u.user`, `u.item`.
    Ml100k,
}

impl DataFormat {
    /// The layout of `dir`: ML-1M when `ratings.dat` is there, ML-100k when `u.data` is.
    pub fn detect(dir: &Path) -> Option<DataFormat> {
        [DataFormat::Ml1m, DataFormat::Ml100k]
            .into_iter()
            .find(|f| dir.join(f.files()[0]).symlink_metadata().is_ok())
    }

    /// The files of this layout: ratings, users, items.
    pub fn files(self) -> [&'static str; 3] {
        match self {
            DataFormat::Ml1m => ["ratings.dat", "users.dat", "movies.dat"],
            DataFormat::Ml100k => ["u.data", "u.user", "u.item"],
        }
    }

    /// The data set's name, e.g. for messages.
    pub fn name(self) -> &'static str {
        match self {
            DataFormat::Ml1m => "MovieLens-1M",
            DataFormat::Ml100k => "MovieLens-100k",
        }
    }

    /// Whether users come with their age in years and an occupation name (ML-100k), rather
    /// than ML-1M's codes.
    pub fn ages_in_years(self) -> bool {
        self == DataFormat::Ml100k
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ratings_file_tells_the_layout() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(DataFormat::detect(d.path()), None);
        std::fs::write(d.path().join("u.data"), "").unwrap();
        assert_eq!(DataFormat::detect(d.path()), Some(DataFormat::Ml100k));
        std::fs::write(d.path().join("ratings.dat"), "").unwrap();
        assert_eq!(DataFormat::detect(d.path()), Some(DataFormat::Ml1m));
    }
}
