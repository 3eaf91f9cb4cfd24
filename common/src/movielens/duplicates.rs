//! One user-item pair rated more than once (two files concatenated, a log with repeats): found
//! when the ratings are read, so the reader can say so with the lines and the rule applied,
//! instead of merging them silently. The rule itself (a pair counts once, as a positive when
//! any of its ratings reaches `data.min_rating`) is the recommender's split; this module only
//! finds and describes. Must not: drop or change a rating.

use std::path::{Path, PathBuf};

use super::ml1m::lines;
use super::Rating;

/// The pairs of a ratings file rated more than once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DuplicatePairs {
    /// The ratings file.
    pub path: PathBuf,
    /// Pairs rated more than once.
    pub pairs: usize,
    /// The first such pair in file order: user, movie, and each of its (line, stars).
    pub first: (u32, u32, Vec<(usize, u8)>),
}

impl DuplicatePairs {
    /// The warning a run prints, with the rule applied at `min_rating`.
    pub fn warning(&self, min_rating: u8) -> String {
        let (user, movie, seen) = &self.first;
        let at: Vec<String> = seen
            .iter()
            .map(|(line, stars)| format!("line {line}: {stars}"))
            .collect();
        format!(
            "{}: {} user-item pair(s) rated more than once (the first: user {user}, movie {movie}, {}); each pair counts once, as a positive when any of its ratings is at or above data.min_rating = {min_rating}",
            self.path.display(),
            self.pairs,
            at.join(", ")
        )
    }
}

/// The pairs of `ratings` (read in order from the non-empty lines of `bytes`, the file at
/// `path`) rated more than once; `None` when every pair is rated once.
pub fn duplicate_pairs(path: &Path, bytes: &[u8], ratings: &[Rating]) -> Option<DuplicatePairs> {
    let key = |r: &Rating| (u64::from(r.user) << 32) | u64::from(r.movie);
    let mut order: Vec<(u64, u32)> = (0..ratings.len() as u32)
        .map(|i| (key(&ratings[i as usize]), i))
        .collect();
    order.sort_unstable();
    let mut pairs = 0;
    let mut first: Option<u64> = None;
    let mut first_index = u32::MAX;
    for run in order
        .chunk_by(|a, b| a.0 == b.0)
        .filter(|run| run.len() > 1)
    {
        pairs += 1;
        if run[0].1 < first_index {
            (first, first_index) = (Some(run[0].0), run[0].1);
        }
    }
    let first = first?;
    // Their lines: the k-th rating is the k-th non-empty line.
    let seen = lines(bytes)
        .zip(ratings)
        .filter(|(_, r)| key(r) == first)
        .map(|((line, _), r)| (line, r.rating))
        .collect();
    Some(DuplicatePairs {
        path: path.to_path_buf(),
        pairs,
        first: ((first >> 32) as u32, first as u32, seen),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rating(user: u32, movie: u32, rating: u8) -> Rating {
        Rating {
            user,
            movie,
            rating,
            timestamp: 0,
        }
    }

    #[test]
    fn pairs_rated_twice_are_found_with_their_lines() {
        let bytes = b"1::10::5::0\n\n2::10::3::0\n1::10::1::0\n2::11::4::0\n2::11::4::0\n";
        let ratings = [
            rating(1, 10, 5),
            rating(2, 10, 3),
            rating(1, 10, 1),
            rating(2, 11, 4),
            rating(2, 11, 4),
        ];
        let found = duplicate_pairs(Path::new("r.dat"), bytes, &ratings).unwrap();
        assert_eq!(found.pairs, 2);
        assert_eq!(found.first, (1, 10, vec![(1, 5), (4, 1)]));
        assert_eq!(
            found.warning(4),
            "r.dat: 2 user-item pair(s) rated more than once (the first: user 1, movie 10, line 1: 5, line 4: 1); each pair counts once, as a positive when any of its ratings is at or above data.min_rating = 4"
        );
        assert!(duplicate_pairs(Path::new("r.dat"), bytes, &ratings[..2]).is_none());
    }
}
