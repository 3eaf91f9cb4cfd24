//! The MovieLens files as GroupLens ships them, read and validated: MovieLens-1M's `users.dat`,
//! `movies.dat` (ISO-8859-1) and `ratings.dat` (`::`-separated), and MovieLens-100k's `u.user`,
//! `u.item` and `u.data`, into the same records; every bad line is an error naming the file, the
//! line and what is wrong. Pure Rust, so that `launch` can check a data set's content before any
//! worker starts (its pre-flight and `--dry-run`) with the very reader the workers use.
//!
//! Must not: turn ratings into training data (the recommender's `data` module splits and
//! samples), know models or ranks, or read anything but the three files of a layout (each
//! through [`crate::files`], bounded, never blocking on a FIFO).

mod duplicates;
mod ml100k;
mod ml1m;

use std::path::{Path, PathBuf};

use thiserror::Error;

pub use crate::data_layout::DataFormat;
pub use duplicates::{duplicate_pairs, DuplicatePairs};
pub use ml100k::read_ml100k;
pub use ml1m::read_ml1m;

/// The layout of `dir`, or an error that names both layouts' files (and the command that
/// fetches it, for a known data set).
pub fn detect_format(dir: &Path) -> Result<DataFormat, DataError> {
    DataFormat::detect(dir).ok_or_else(|| DataError::NoDataSet {
        dir: dir.to_path_buf(),
        hint: crate::assets::fetch_hint(dir, crate::assets::AssetKind::Dataset),
    })
}

/// Reads the data set in `dir`, whichever of the two layouts it has.
pub fn read_movielens(dir: &Path) -> Result<(RawData, DataFormat), DataError> {
    let format = detect_format(dir)?;
    let raw = match format {
        DataFormat::Ml1m => read_ml1m(dir)?,
        DataFormat::Ml100k => read_ml100k(dir)?,
    };
    Ok((raw, format))
}

/// A data set with nothing to learn from is refused naming the file and the cause (rather than
/// as "0 training samples" later).
pub fn check_positives(raw: &RawData, min_rating: u8, ratings: &Path) -> Result<(), DataError> {
    if raw.ratings.is_empty() {
        return Err(DataError::Unusable {
            path: ratings.to_path_buf(),
            msg: "holds no ratings".into(),
        });
    }
    if !raw.ratings.iter().any(|r| r.rating >= min_rating) {
        let best = raw.ratings.iter().map(|r| r.rating).max().unwrap_or(0);
        return Err(DataError::Unusable {
            path: ratings.to_path_buf(),
            msg: format!(
                "none of its {} ratings is at or above data.min_rating = {min_rating} (the highest is {best}); lower data.min_rating",
                raw.ratings.len()
            ),
        });
    }
    Ok(())
}

/// The 18 ML-1M genres, in the order listed in the dataset's README.
pub const GENRES: [&str; 18] = [
    "Action",
    "Adventure",
    "Animation",
    "Children's",
    "Comedy",
    "Crime",
    "Documentary",
    "Drama",
    "Fantasy",
    "Film-Noir",
    "Horror",
    "Musical",
    "Mystery",
    "Romance",
    "Sci-Fi",
    "Thriller",
    "War",
    "Western",
];

/// Valid age codes of `users.dat`, in increasing order.
pub const AGE_CODES: [u8; 7] = [1, 18, 25, 35, 45, 50, 56];

/// Errors reading or writing ML-1M files.
#[derive(Debug, Error)]
pub enum DataError {
    #[error("data: missing file {}", path.display())]
    MissingFile { path: PathBuf },
    #[error("data: {} is {what}, not a data file", path.display())]
    NotAFile { path: PathBuf, what: &'static str },
    #[error("data: {} is {size} bytes, more than the {max} a data file may have", path.display())]
    TooLarge { path: PathBuf, size: u64, max: u64 },
    #[error(
        "data: {} holds neither MovieLens-1M's ratings.dat, users.dat, movies.dat nor MovieLens-100k's u.data, u.user, u.item{}",
        dir.display(),
        hint.as_deref().map(|h| format!(" (run `{h}` to download it)")).unwrap_or_default()
    )]
    NoDataSet { dir: PathBuf, hint: Option<String> },
    #[error("data: cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("data: cannot write {}: {source}", path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A file that parses but holds nothing to learn from.
    #[error("data: {}: {msg}", path.display())]
    Unusable { path: PathBuf, msg: String },
    #[error("data: {}:{line}: {msg}", path.display())]
    Parse {
        path: PathBuf,
        line: usize,
        msg: String,
    },
}

/// Gender field of `users.dat`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Gender {
    M,
    F,
}

/// A user's age as the data set gives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Age {
    /// ML-1M's age code (1, 18, 25, 35, 45, 50 or 56); see [`age_group_name`].
    Group(u8),
    /// Years (ML-100k).
    Years(u8),
}

/// A user's occupation as the data set gives it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Occupation {
    /// ML-1M's occupation code 0..=20; see [`occupation_name`].
    Code(u8),
    /// A name in words (ML-100k's `u.occupation`, e.g. `technician`).
    Named(String),
}

/// One user (a row of ML-1M's `users.dat` or ML-100k's `u.user`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    pub id: u32,
    pub gender: Gender,
    pub age: Age,
    pub occupation: Occupation,
    /// Kept verbatim (ZIP+4 and odd codes are valid).
    pub zip: String,
}

/// One movie (a row of ML-1M's `movies.dat` or ML-100k's `u.item`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Movie {
    pub id: u32,
    /// Title as in the file (latin-1 decoded), including the trailing `(year)`.
    pub title: String,
    /// Year from the trailing `(1995)` of the title, when present.
    pub year: Option<u16>,
    pub genres: Vec<String>,
}

/// One rating (a row of ML-1M's `ratings.dat` or ML-100k's `u.data`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rating {
    pub user: u32,
    pub movie: u32,
    pub rating: u8,
    pub timestamp: u64,
}

/// The three ML-1M files, parsed and validated, rows in file order.
#[derive(Debug, Clone, Default)]
pub struct RawData {
    pub users: Vec<User>,
    pub movies: Vec<Movie>,
    pub ratings: Vec<Rating>,
    /// The user-item pairs rated more than once, when there are any (said, not refused).
    pub duplicates: Option<DuplicatePairs>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_with_nothing_to_learn_is_refused_naming_the_file_and_cause() {
        let dir = Path::new("/data/ml-1m");
        let rating = |rating| Rating {
            user: 1,
            movie: 1,
            rating,
            timestamp: 0,
        };
        let mut raw = RawData::default();
        let text = check_positives(&raw, 3, &dir.join("ratings.dat"))
            .unwrap_err()
            .to_string();
        assert!(
            text.contains("/data/ml-1m/ratings.dat: holds no ratings"),
            "{text}"
        );
        raw.ratings = vec![rating(1), rating(2)];
        let text = check_positives(&raw, 3, &dir.join("ratings.dat"))
            .unwrap_err()
            .to_string();
        assert!(
            text.contains(
                "none of its 2 ratings is at or above data.min_rating = 3 (the highest is 2)"
            ),
            "{text}"
        );
        assert!(check_positives(&raw, 2, &dir.join("ratings.dat")).is_ok());
    }
}
