//! MovieLens data for the recommender: implicit-feedback splitting, negative sampling and a
//! synthetic generator that writes files in ML-1M's format. The files themselves are read by
//! `common::movielens` (re-exported here), which `launch` shares for its pre-flight.
//!
//! Owns: turning ratings into implicit feedback with a dense id remap and a seeded per-user
//! 8:1:1 train/valid/test split; uniform negative sampling outside a user's train set; the texts
//! of users and movies; and a deterministic synthetic ML-1M-format generator
//! (Tiny/Small/Full).
//!
//! Must not: know the model, tokenizers, ranks or libtorch, touch the network, or use a random
//! source other than the local SplitMix64 (so splits are bit-identical on every rank and
//! machine). Input errors are returned as [`DataError`] (file, line, what was wrong), never
//! panics.

mod split;
mod synthetic;

pub use common::movielens::{
    check_positives, detect_format, duplicate_pairs, read_ml100k, read_ml1m, read_movielens, Age,
    DataError, DataFormat, DuplicatePairs, Gender, Movie, Occupation, Rating, RawData, User,
    AGE_CODES, GENRES,
};
pub use split::{build_dataset, ColdShares, Dataset};
pub use synthetic::{generate_ml1m, GENERATOR_VERSION};

const OCCUPATIONS: [&str; 21] = [
    "other/not specified",
    "academic/educator",
    "artist",
    "clerical/admin",
    "college/grad student",
    "customer service",
    "doctor/health care",
    "executive/managerial",
    "farmer",
    "homemaker",
    "K-12 student",
    "lawyer",
    "programmer",
    "retired",
    "sales/marketing",
    "scientist",
    "self-employed",
    "technician/engineer",
    "tradesman/craftsman",
    "unemployed",
    "writer",
];

/// Human-readable age group for an ML-1M age code (`"unknown"` for an invalid code).
pub fn age_group_name(code: u8) -> &'static str {
    match code {
        1 => "Under 18",
        18 => "18-24",
        25 => "25-34",
        35 => "35-44",
        45 => "45-49",
        50 => "50-55",
        56 => "56+",
        _ => "unknown",
    }
}

/// Human-readable occupation for an ML-1M occupation code 0..=20 (`"unknown"` otherwise).
pub fn occupation_name(code: u8) -> &'static str {
    OCCUPATIONS.get(code as usize).copied().unwrap_or("unknown")
}

/// The metadata text of a movie, as GPT-2 reads it, e.g.
/// `Movie: Toy Story (1995). Genres: Animation, Children's, Comedy.` (the title carries the year).
pub fn item_text(movie: &Movie) -> String {
    format!(
        "Movie: {}. Genres: {}.",
        movie.title.trim(),
        movie.genres.join(", ")
    )
}

/// The metadata text of a user in words, e.g.
/// `User: female, aged 25-34, works as programmer.` (ML-1M's codes) or
/// `User: male, aged 24, works as technician.` (ML-100k's years and names).
pub fn user_text(user: &User) -> String {
    let gender = match user.gender {
        Gender::M => "male",
        Gender::F => "female",
    };
    let age = match user.age {
        Age::Group(code) => age_group_name(code).to_string(),
        Age::Years(years) => years.to_string(),
    };
    let occupation = match &user.occupation {
        Occupation::Code(code) => occupation_name(*code),
        Occupation::Named(name) => name.as_str(),
    };
    format!("User: {gender}, aged {age}, works as {occupation}.")
}

/// The occupation a [`user_text`] names (`programmer` of `User: ..., works as programmer.`).
pub fn occupation_of_text(text: &str) -> Option<&str> {
    text.rsplit_once(", works as ")?.1.strip_suffix('.')
}

// ---------------------------------------------------------------------------------------------
// PRNG
// ---------------------------------------------------------------------------------------------

use runtime::rng::splitmix64;

/// Uniform-ish integer in `0..n` (multiply-shift; bias < n / 2^64). `n` must be > 0.
fn below(state: &mut u64, n: u64) -> u64 {
    ((u128::from(splitmix64(state)) * u128::from(n)) >> 64) as u64
}

/// Uniform f64 in [0, 1).
fn unit(state: &mut u64) -> f64 {
    (splitmix64(state) >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Standard normal (Box–Muller).
fn normal(state: &mut u64) -> f64 {
    let u1 = 1.0 - unit(state); // (0, 1]
    let u2 = unit(state);
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

fn mix_seed(a: u64, b: u64) -> u64 {
    let mut s = a ^ b.wrapping_mul(0xD1B5_4A32_D192_ED03);
    splitmix64(&mut s)
}

fn shuffle<T>(v: &mut [T], state: &mut u64) {
    for i in (1..v.len()).rev() {
        let j = below(state, i as u64 + 1) as usize;
        v.swap(i, j);
    }
}

// ---------------------------------------------------------------------------------------------
// Negative sampling
// ---------------------------------------------------------------------------------------------

/// Draws an item uniformly from `0..n_items` minus `train_items_sorted`, advancing `rng_state`
/// (SplitMix64). Precondition: `train_items_sorted` is sorted, deduplicated, every id
/// `< n_items`. Returns `None` when the user has every item in train (or `n_items == 0`).
///
/// Rejection sampling with binary search; after 32 rejections (a user owning most items) it
/// falls back to an exact draw of the k-th free item, so it always terminates quickly.
pub fn sample_negative(
    train_items_sorted: &[u32],
    n_items: u32,
    rng_state: &mut u64,
) -> Option<u32> {
    let owned = train_items_sorted.len() as u64;
    let n = u64::from(n_items);
    if owned >= n {
        return None;
    }
    for _ in 0..32 {
        let c = below(rng_state, n) as u32;
        if train_items_sorted.binary_search(&c).is_err() {
            return Some(c);
        }
    }
    // Exact: the k-th item (0-based) not in the set.
    let mut k = below(rng_state, n - owned) as u32;
    for &t in train_items_sorted {
        if t <= k {
            k += 1;
        } else {
            break;
        }
    }
    Some(k)
}

#[cfg(test)]
mod tests {
    use super::*;
    use common::config::SyntheticSize;
    use proptest::prelude::*;
    use std::fs;

    const USERS: &[u8] = b"1::F::1::10::48067\n2::M::56::16::98107-2117\n3::M::25::15::5849574\n";
    const MOVIES: &[u8] = b"1::Toy Story (1995)::Animation|Children's|Comedy\n\
2::Mis\xe9rables, Les (1995)::Drama|Musical\n\
3::Good, The Bad and The Ugly, The&#8230; (1966)::Action|Western\n\
4::No Year Here::Film-Noir\n";
    const RATINGS: &[u8] =
        b"1::1::5::978300760\n1::2::3::978302109\n2::3::4::978301968\n3::1::1::978300275\n";

    fn write_set(users: &[u8], movies: &[u8], ratings: &[u8]) -> tempfile::TempDir {
        let d = tempfile::tempdir().expect("tempdir");
        fs::write(d.path().join("users.dat"), users).expect("write");
        fs::write(d.path().join("movies.dat"), movies).expect("write");
        fs::write(d.path().join("ratings.dat"), ratings).expect("write");
        d
    }

    fn err_of(users: &[u8], movies: &[u8], ratings: &[u8]) -> String {
        let d = write_set(users, movies, ratings);
        match read_ml1m(d.path()) {
            Ok(_) => panic!("expected an error"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn parses_hand_written_files() {
        let d = write_set(USERS, MOVIES, RATINGS);
        let raw = read_ml1m(d.path()).expect("parse");
        assert_eq!(raw.users.len(), 3);
        assert_eq!(raw.users[0].gender, Gender::F);
        assert_eq!(raw.users[0].age, Age::Group(1));
        assert_eq!(raw.users[1].zip, "98107-2117");
        assert_eq!(raw.users[2].zip, "5849574");
        assert_eq!(raw.movies.len(), 4);
        assert_eq!(raw.movies[0].year, Some(1995));
        assert_eq!(
            raw.movies[0].genres,
            vec!["Animation", "Children's", "Comedy"]
        );
        assert_eq!(raw.movies[1].title, "Misérables, Les (1995)");
        assert!(raw.movies[2].title.contains("&#8230;"));
        assert_eq!(raw.movies[2].year, Some(1966));
        assert_eq!(raw.movies[3].year, None);
        assert_eq!(raw.ratings.len(), 4);
        assert_eq!(
            raw.ratings[2],
            Rating {
                user: 2,
                movie: 3,
                rating: 4,
                timestamp: 978301968
            }
        );
    }

    #[test]
    fn crlf_and_trailing_blank_lines_are_accepted() {
        let d = write_set(
            b"1::F::1::10::48067\r\n\n",
            b"1::A (1995)::Drama\r\n",
            b"1::1::5::1\r\n",
        );
        let raw = read_ml1m(d.path()).expect("parse");
        assert_eq!(raw.users[0].zip, "48067");
        assert_eq!(raw.movies[0].genres, vec!["Drama"]);
        assert_eq!(raw.ratings.len(), 1);
    }

    /// Every malformed line is named by file and line, with what is wrong in it.
    #[test]
    fn malformed_lines_name_file_line_and_cause() {
        // (case, users.dat, movies.dat, ratings.dat, the place named, the cause named)
        type Case<'a> = (&'a str, &'a [u8], &'a [u8], &'a [u8], &'a str, &'a str);
        let cases: [Case; 9] = [
            (
                "field count",
                b"1::F::1::10::48067\n2::M::56::16\n",
                MOVIES,
                RATINGS,
                "users.dat:2:",
                "fields",
            ),
            (
                "non-numeric id",
                USERS,
                MOVIES,
                b"1::1::5::978300760\n1::x2::3::978302109\n",
                "ratings.dat:2:",
                "movie id is not a number",
            ),
            (
                "gender",
                b"1::F::1::10::48067\n2::X::56::16::98107\n",
                MOVIES,
                RATINGS,
                "users.dat:2:",
                "gender",
            ),
            (
                "age",
                b"1::F::2::10::48067\n",
                MOVIES,
                b"",
                "users.dat:1:",
                "age code",
            ),
            (
                "occupation",
                b"1::F::1::21::48067\n",
                MOVIES,
                b"",
                "users.dat:1:",
                "occupation",
            ),
            (
                "genre",
                USERS,
                b"1::Toy Story (1995)::Animation\n2::X (1990)::Drama|Cartoon\n",
                b"",
                "movies.dat:2:",
                "Cartoon",
            ),
            (
                "rating 6",
                USERS,
                MOVIES,
                b"1::1::5::1\n1::2::3::2\n2::3::6::3\n",
                "ratings.dat:3:",
                "rating 6",
            ),
            (
                "unknown movie",
                USERS,
                MOVIES,
                b"1::1::5::1\n1::99::3::2\n",
                "ratings.dat:2:",
                "unknown movie 99",
            ),
            (
                "unknown user",
                USERS,
                MOVIES,
                b"1::1::5::1\n7::1::3::2\n",
                "ratings.dat:2:",
                "unknown user 7",
            ),
        ];
        for (case, users, movies, ratings, place, cause) in cases {
            let e = err_of(users, movies, ratings);
            assert!(e.contains(place) && e.contains(cause), "{case}: {e}");
        }
    }

    #[test]
    fn missing_file_is_named() {
        let d = tempfile::tempdir().expect("tempdir");
        fs::write(d.path().join("users.dat"), USERS).expect("write");
        fs::write(d.path().join("movies.dat"), MOVIES).expect("write");
        let e = read_ml1m(d.path())
            .expect_err("missing ratings")
            .to_string();
        assert!(
            e.contains("missing file") && e.contains("ratings.dat"),
            "{e}"
        );
    }

    #[test]
    fn metadata_texts_read_as_words() {
        let movie = Movie {
            id: 1,
            title: "Toy Story (1995)".into(),
            year: Some(1995),
            genres: vec!["Animation".into(), "Children's".into(), "Comedy".into()],
        };
        assert_eq!(
            item_text(&movie),
            "Movie: Toy Story (1995). Genres: Animation, Children's, Comedy."
        );
        let user = User {
            id: 1,
            gender: Gender::F,
            age: Age::Group(25),
            occupation: Occupation::Code(12),
            zip: "12345-6789".into(),
        };
        assert_eq!(
            user_text(&user),
            "User: female, aged 25-34, works as programmer."
        );
        let user = User {
            age: Age::Years(24),
            occupation: Occupation::Named("technician".into()),
            gender: Gender::M,
            ..user
        };
        assert_eq!(
            user_text(&user),
            "User: male, aged 24, works as technician."
        );
    }

    #[test]
    fn name_helpers() {
        assert_eq!(age_group_name(1), "Under 18");
        assert_eq!(age_group_name(56), "56+");
        assert_eq!(age_group_name(7), "unknown");
        assert_eq!(occupation_name(12), "programmer");
        assert_eq!(occupation_name(20), "writer");
        assert_eq!(occupation_name(21), "unknown");
    }

    /// User `u` rates movies `1..=n`, all with 4 stars; user 100 rates movie 1 with 1 star.
    fn raw_with_counts(counts: &[(u32, u32)]) -> RawData {
        let max_m = counts.iter().map(|c| c.1).max().unwrap_or(1);
        let mut raw = RawData::default();
        for m in 1..=max_m + 1 {
            raw.movies.push(Movie {
                id: m,
                title: format!("M{m}"),
                year: None,
                genres: vec!["Drama".into()],
            });
        }
        for &(u, n) in counts {
            for m in 1..=n {
                raw.ratings.push(Rating {
                    user: u,
                    movie: m,
                    rating: 4,
                    timestamp: 0,
                });
            }
        }
        raw.ratings.push(Rating {
            user: 100,
            movie: max_m + 1,
            rating: 1,
            timestamp: 0,
        });
        raw
    }

    #[test]
    fn split_proportions_are_exact() {
        let raw = raw_with_counts(&[(5, 20), (3, 25)]);
        let ds = build_dataset(&raw, 3, 42, ColdShares::default());
        // User 100 and its movie are filtered out (rating 1 < 3); dense order is by original id.
        assert_eq!(ds.user_ids, vec![3, 5]);
        assert_eq!(ds.n_users, 2);
        assert_eq!(ds.n_items, 25);
        assert_eq!(ds.item_ids, (1..=25).collect::<Vec<u32>>());
        let sizes = |d: usize| (ds.train[d].len(), ds.valid[d].len(), ds.test[d].len());
        assert_eq!(sizes(1), (16, 2, 2));
        assert_eq!(sizes(0), (21, 2, 2));
    }

    #[test]
    fn split_parts_are_disjoint_sorted_and_complete() {
        let raw = raw_with_counts(&[(1, 37), (2, 20), (4, 3)]);
        let ds = build_dataset(&raw, 1, 7, ColdShares::default());
        for d in 0..ds.n_users as usize {
            let mut all: Vec<u32> = ds.train[d]
                .iter()
                .chain(&ds.valid[d])
                .chain(&ds.test[d])
                .copied()
                .collect();
            for part in [&ds.train[d], &ds.valid[d], &ds.test[d]] {
                assert!(part.windows(2).all(|w| w[0] < w[1]));
            }
            let n = all.len();
            all.sort_unstable();
            all.dedup();
            assert_eq!(all.len(), n, "an item appears in two parts");
        }
        // 3 items: floor(0.3) = 0 valid/test.
        assert_eq!(ds.train[2].len(), 3);
    }

    #[test]
    fn split_is_deterministic_and_seed_dependent() {
        let raw = raw_with_counts(&[(1, 60), (2, 40), (9, 33)]);
        let a = build_dataset(&raw, 3, 1, ColdShares::default());
        let b = build_dataset(&raw, 3, 1, ColdShares::default());
        let c = build_dataset(&raw, 3, 2, ColdShares::default());
        assert_eq!(a, b);
        assert_ne!(a.test, c.test);
    }

    #[test]
    fn negative_none_when_user_has_everything() {
        let mut s = 1;
        assert_eq!(sample_negative(&[0, 1, 2], 3, &mut s), None);
        assert_eq!(sample_negative(&[], 0, &mut s), None);
        // Only item 2 is free: the exact fallback must find it.
        for _ in 0..20 {
            assert_eq!(sample_negative(&[0, 1, 3, 4], 5, &mut s), Some(2));
        }
    }

    proptest! {
        #[test]
        fn negative_never_in_train(
            n_items in 1u32..300,
            items in proptest::collection::vec(0u32..300, 0..300),
            seed in any::<u64>(),
        ) {
            let mut train: Vec<u32> = items.into_iter().filter(|&i| i < n_items).collect();
            train.sort_unstable();
            train.dedup();
            let mut s = seed;
            for _ in 0..20 {
                match sample_negative(&train, n_items, &mut s) {
                    Some(x) => {
                        prop_assert!(x < n_items);
                        prop_assert!(train.binary_search(&x).is_err());
                    }
                    None => prop_assert_eq!(train.len() as u32, n_items),
                }
            }
        }
    }

    #[test]
    fn synthetic_tiny_round_trips() {
        let d = tempfile::tempdir().expect("tempdir");
        generate_ml1m(d.path(), SyntheticSize::Tiny, 3).expect("generate");
        let raw = read_ml1m(d.path()).expect("parse");
        assert_eq!(raw.users.len(), 200);
        assert_eq!(raw.movies.len(), 150);
        assert!(raw.movies.iter().all(|m| m.year.is_some()));
        assert!(raw.movies.iter().all(|m| (1..=3).contains(&m.genres.len())));
        assert!(raw.movies.iter().any(|m| m.title.contains("&#8230;")));
        assert!(raw.movies.iter().any(|m| m.title.contains('é')));
        let bytes = fs::read(d.path().join("movies.dat")).expect("read");
        assert!(
            std::str::from_utf8(&bytes).is_err(),
            "movies.dat must be latin-1"
        );
        assert!(raw.users.iter().any(|u| u.zip.contains('-')));
        let n = raw.ratings.len();
        assert!((4_000..10_000).contains(&n), "{n} ratings");
        let mut per_user = vec![0usize; 201];
        for r in &raw.ratings {
            per_user[r.user as usize] += 1;
        }
        assert!(per_user[1..].iter().all(|&c| c >= 20));
        // All five star levels occur and the split works on it.
        for s in 1..=5u8 {
            assert!(
                raw.ratings.iter().any(|r| r.rating == s),
                "no {s}-star rating"
            );
        }
        let ds = build_dataset(&raw, 3, 0, ColdShares::default());
        assert!(ds.n_users > 150 && ds.n_items > 100);
    }

    #[test]
    fn synthetic_is_deterministic() {
        let a = tempfile::tempdir().expect("tempdir");
        let b = tempfile::tempdir().expect("tempdir");
        let c = tempfile::tempdir().expect("tempdir");
        generate_ml1m(a.path(), SyntheticSize::Tiny, 11).expect("generate");
        generate_ml1m(b.path(), SyntheticSize::Tiny, 11).expect("generate");
        generate_ml1m(c.path(), SyntheticSize::Tiny, 12).expect("generate");
        for f in ["users.dat", "movies.dat", "ratings.dat"] {
            let x = fs::read(a.path().join(f)).expect("read");
            let y = fs::read(b.path().join(f)).expect("read");
            let z = fs::read(c.path().join(f)).expect("read");
            assert_eq!(x, y, "{f} differs for the same seed");
            assert_ne!(x, z, "{f} identical for different seeds");
        }
    }

    #[test]
    #[ignore = "generates ~24 MB; run with --ignored to time read_ml1m on Full"]
    fn synthetic_full_parse_timing() {
        let d = tempfile::tempdir().expect("tempdir");
        let t0 = std::time::Instant::now();
        generate_ml1m(d.path(), SyntheticSize::Full, 1).expect("generate");
        let gen = t0.elapsed();
        let t1 = std::time::Instant::now();
        let raw = read_ml1m(d.path()).expect("parse");
        let parse = t1.elapsed();
        println!(
            "Full: {} users, {} movies, {} ratings; generate {:?}, read_ml1m {:?}",
            raw.users.len(),
            raw.movies.len(),
            raw.ratings.len(),
            gen,
            parse
        );
        assert_eq!(raw.users.len(), 6040);
        assert_eq!(raw.movies.len(), 3883);
        assert!(raw.movies.iter().all(|m| (1..=3952).contains(&m.id)));
        assert!((800_000..1_200_000).contains(&raw.ratings.len()));
        let t2 = std::time::Instant::now();
        let ds = build_dataset(&raw, 3, 0, ColdShares::default());
        println!(
            "build_dataset {:?}: {} users, {} items",
            t2.elapsed(),
            ds.n_users,
            ds.n_items
        );
    }
}
