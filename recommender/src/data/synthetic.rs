//! The synthetic generator: deterministic MovieLens-1M-format files (Tiny/Small/Full) with
//! popularity, genre and demographic structure, so that models have something to learn.

use std::fmt::Write as _;
use std::fs;
use std::path::Path;

use common::config::SyntheticSize;

use super::*;

fn spec(size: SyntheticSize) -> common::memory::SyntheticSpec {
    size.spec()
}

const TITLE_ADJ: [&str; 24] = [
    "Last",
    "Dark",
    "Silent",
    "Lost",
    "Golden",
    "Broken",
    "Hidden",
    "Wild",
    "Crimson",
    "Endless",
    "Frozen",
    "Little",
    "Big",
    "Secret",
    "Burning",
    "Forgotten",
    "Blue",
    "Midnight",
    "Iron",
    "Strange",
    "Sweet",
    "Final",
    "Long",
    "Quiet",
];
const TITLE_NOUN: [&str; 24] = [
    "Road", "River", "Summer", "Night", "City", "Heart", "Kingdom", "Game", "Island", "Dream",
    "Star", "Garden", "Storm", "Mountain", "Letter", "House", "Promise", "Shadow", "Voyage",
    "Harvest", "Circus", "Mirror", "Empire", "Station",
];
/// Latin-1 encoded words (single bytes >= 0x80).
const LATIN1_WORDS: [&[u8]; 8] = [
    b"Mis\xe9rables",
    b"\xdcber Alles",
    b"Caf\xe9 Society",
    b"No\xebl",
    b"Se\xf1or Loco",
    b"Am\xe9lie's Garden",
    b"Gar\xe7on",
    b"M\xfcnchen",
];
const GENRE_BASE_WEIGHT: [f64; 18] = [
    5.0, 3.0, 1.0, 1.5, 9.0, 2.5, 1.0, 12.0, 0.8, 0.4, 2.5, 1.0, 1.0, 3.5, 2.0, 4.0, 1.0, 0.5,
];

/// Version of the generator's output: bump it (it lives in `common`, where the launcher reads
/// it too) whenever the same seed would give other files, so cached copies are never stale.
pub use common::data_layout::SYNTHETIC_VERSION as GENERATOR_VERSION;

/// How much a user's choice of movies follows popularity, the demographic genre preference
/// (which the metadata text reveals) and a hidden taste (which only the interactions reveal),
/// in log-weight units. Chosen so that, as on the real ML-1M, personalised models clearly beat
/// the popularity baseline.
const POP_WEIGHT: f64 = 0.6;
const GENRE_WEIGHT: f64 = 3.0;
const TASTE_WEIGHT: f64 = 1.0;
/// Dimensions of the hidden user taste / movie style.
const TASTE_DIM: usize = 8;

fn pick_weighted(state: &mut u64, w: &[f64]) -> usize {
    let total: f64 = w.iter().sum();
    let mut x = unit(state) * total;
    for (i, &wi) in w.iter().enumerate() {
        if x < wi {
            return i;
        }
        x -= wi;
    }
    w.len() - 1
}

/// Demographic genre shift: a fixed (seed-independent) structure, so a model reading user text
/// can learn it. Genre indices follow [`GENRES`].
fn demographic_pref(gender: Gender, age_idx: usize, occ: u8, g: usize) -> f64 {
    let mut p = 0.0;
    // Gender.
    let male: [usize; 5] = [0, 14, 15, 16, 17]; // Action, Sci-Fi, Thriller, War, Western
    let female: [usize; 4] = [13, 11, 7, 3]; // Romance, Musical, Drama, Children's
    match gender {
        Gender::M if male.contains(&g) => p += 0.5,
        Gender::F if female.contains(&g) => p += 0.5,
        _ => {}
    }
    // Age: young like Animation/Children's/Comedy/Horror/Action; older Drama/Film-Noir/War/Western.
    let young = (3.0 - age_idx as f64) / 3.0; // +1 .. -1
    match g {
        2 | 3 => p += 0.6 * young,
        4 | 10 | 0 => p += 0.3 * young,
        7 | 9 | 16 | 17 | 6 => p -= 0.4 * young,
        _ => {}
    }
    // Occupation: a fixed pseudo-random shift per (occupation, genre), plus a few obvious ones.
    let mut s = 0x5eed_0000 ^ (u64::from(occ) << 8) ^ g as u64;
    p += 0.5 * (unit(&mut s) - 0.5);
    match (occ, g) {
        (12 | 15 | 17, 14) => p += 0.7, // programmers/scientists/engineers: Sci-Fi
        (10, 2 | 3) => p += 0.7,        // K-12 students: Animation/Children's
        (2 | 20, 7 | 6) => p += 0.5,    // artists/writers: Drama/Documentary
        (13, 16 | 17 | 9) => p += 0.6,  // retired: War/Western/Film-Noir
        (4, 4 | 10) => p += 0.4,        // college students: Comedy/Horror
        _ => {}
    }
    p
}

/// Writes `users.dat`, `movies.dat` (latin-1) and `ratings.dat` in ML-1M format into `dir`
/// (created if missing). Deterministic for `(size, seed)`: the same bytes on the same platform
/// (floating-point `ln`/`exp`/`cos` come from the platform's libm). One generator draws
/// everything, in this order: movie ids, movies, users, hidden styles, popularity, ratings.
pub fn generate_ml1m(dir: &Path, size: SyntheticSize, seed: u64) -> Result<(), DataError> {
    let sp = spec(size);
    let mut rng = mix_seed(seed, 0x4d4c_314d);
    let movies = movies(&movie_ids(sp.movies, &mut rng), &mut rng);
    let users = users(sp.users, &mut rng);
    // Hidden per-movie style (not in any text): what only the interactions reveal.
    let styles: Vec<[f64; TASTE_DIM]> = (0..sp.movies).map(|_| taste(&mut rng)).collect();
    let log_pop = popularity(sp.movies, &mut rng);
    let ratings = ratings(&sp, &movies, &users, &styles, &log_pop, &mut rng);
    fs::create_dir_all(dir).map_err(|source| DataError::Write {
        path: dir.to_path_buf(),
        source,
    })?;
    for (name, buf) in [
        ("users.dat", &users.buf),
        ("movies.dat", &movies.buf),
        ("ratings.dat", &ratings),
    ] {
        let path = dir.join(name);
        fs::write(&path, buf).map_err(|source| DataError::Write { path, source })?;
    }
    Ok(())
}

/// Movie ids: 1..=max_id with (max_id - movies) gaps (3952 for Full).
fn movie_ids(n: usize, rng: &mut u64) -> Vec<u32> {
    let max_id = n + n / 56;
    let mut ids: Vec<u32> = (1..=max_id as u32).collect();
    shuffle(&mut ids, rng);
    ids.truncate(n);
    ids.sort_unstable();
    ids
}

/// `movies.dat` and what the ratings need to know of each movie.
struct Movies {
    buf: Vec<u8>,
    ids: Vec<u32>,
    genres: Vec<Vec<usize>>,
    quality: Vec<f64>,
}

/// Titles (a few with latin-1 words and an HTML entity, as the real file has), years and
/// genres, and a hidden quality per movie.
fn movies(ids: &[u32], rng: &mut u64) -> Movies {
    let n = ids.len();
    let mut buf: Vec<u8> = Vec::with_capacity(n * 48);
    let mut genres: Vec<Vec<usize>> = Vec::with_capacity(n);
    let mut quality = Vec::with_capacity(n);
    let amp_idx = n / 3;
    for (i, &id) in ids.iter().enumerate() {
        let year = 2000 - (unit(rng).powi(3) * 81.0) as u32;
        let n_g = 1 + pick_weighted(rng, &[0.45, 0.35, 0.2]);
        let mut gs: Vec<usize> = Vec::with_capacity(n_g);
        while gs.len() < n_g {
            let g = pick_weighted(rng, &GENRE_BASE_WEIGHT);
            if !gs.contains(&g) {
                gs.push(g);
            }
        }
        gs.sort_unstable();
        quality.push(0.6 * normal(rng));
        let adj = TITLE_ADJ[below(rng, TITLE_ADJ.len() as u64) as usize];
        let noun = TITLE_NOUN[below(rng, TITLE_NOUN.len() as u64) as usize];
        let _ = write!(LineBuf(&mut buf), "{id}::");
        if i == amp_idx {
            buf.extend_from_slice(b"And Then There Were None&#8230; ");
        } else if i % 29 == 7 {
            let w = LATIN1_WORDS[(i / 29) % LATIN1_WORDS.len()];
            buf.extend_from_slice(w);
            buf.push(b' ');
        }
        let the = if below(rng, 5) == 0 { ", The" } else { "" };
        let _ = write!(LineBuf(&mut buf), "{adj} {noun}{the} ({year})::");
        for (k, &g) in gs.iter().enumerate() {
            if k > 0 {
                buf.push(b'|');
            }
            buf.extend_from_slice(GENRES[g].as_bytes());
        }
        buf.push(b'\n');
        genres.push(gs);
    }
    Movies {
        buf,
        ids: ids.to_vec(),
        genres,
        quality,
    }
}

/// `users.dat` and each user's genre preferences and hidden taste.
struct Users {
    buf: Vec<u8>,
    prefs: Vec<[f64; 18]>,
    tastes: Vec<[f64; TASTE_DIM]>,
}

/// Demographics in ML-1M's proportions (zip codes in its three shapes), genre preferences
/// that follow them, and a hidden taste vector.
fn users(n: usize, rng: &mut u64) -> Users {
    let mut buf: Vec<u8> = Vec::with_capacity(n * 24);
    let age_w = [0.04, 0.18, 0.35, 0.20, 0.09, 0.08, 0.06];
    let occ_w = [
        11.0, 8.0, 4.0, 3.0, 12.0, 2.0, 4.0, 11.0, 0.3, 1.5, 3.0, 2.0, 6.0, 2.0, 5.0, 2.5, 4.0,
        8.0, 1.0, 1.2, 5.0,
    ];
    let mut prefs: Vec<[f64; 18]> = Vec::with_capacity(n);
    let mut tastes: Vec<[f64; TASTE_DIM]> = Vec::with_capacity(n);
    for uid in 1..=n as u32 {
        let gender = if unit(rng) < 0.72 {
            Gender::M
        } else {
            Gender::F
        };
        let age_idx = pick_weighted(rng, &age_w);
        let occ = pick_weighted(rng, &occ_w) as u8;
        let zip5 = below(rng, 100_000);
        let r = unit(rng);
        let zip = if r < 0.003 {
            format!("{:07}", below(rng, 10_000_000))
        } else if r < 0.08 {
            format!("{zip5:05}-{:04}", below(rng, 10_000))
        } else {
            format!("{zip5:05}")
        };
        let g = if gender == Gender::M { 'M' } else { 'F' };
        let age = AGE_CODES[age_idx];
        let _ = writeln!(LineBuf(&mut buf), "{uid}::{g}::{age}::{occ}::{zip}");
        let mut p = [0.0; 18];
        for (gi, pg) in p.iter_mut().enumerate() {
            *pg = demographic_pref(gender, age_idx, occ, gi) + 0.35 * normal(rng);
        }
        prefs.push(p);
        tastes.push(taste(rng));
    }
    Users { buf, prefs, tastes }
}

/// A standard-normal vector of `TASTE_DIM` values.
fn taste(rng: &mut u64) -> [f64; TASTE_DIM] {
    let mut v = [0.0; TASTE_DIM];
    for x in v.iter_mut() {
        *x = normal(rng);
    }
    v
}

/// Popularity: Zipf-like over a random rank order (log scale).
fn popularity(n: usize, rng: &mut u64) -> Vec<f64> {
    let mut rank: Vec<usize> = (0..n).collect();
    shuffle(&mut rank, rng);
    let mut log_pop = vec![0.0f64; n];
    for (r, &m) in rank.iter().enumerate() {
        log_pop[m] = -0.9 * ((r + 1) as f64).ln();
    }
    log_pop
}

/// `ratings.dat`: each user rates a number of movies drawn by popularity, genre preference and
/// hidden taste; the stars follow preference and quality.
fn ratings(
    sp: &common::memory::SyntheticSpec,
    movies: &Movies,
    users: &Users,
    styles: &[[f64; TASTE_DIM]],
    log_pop: &[f64],
    rng: &mut u64,
) -> Vec<u8> {
    let mut buf: Vec<u8> = Vec::with_capacity((sp.users as f64 * sp.mean_ratings) as usize * 24);
    let cap = (sp.movies * 7 / 10).max(20);
    let mut keys: Vec<(f64, u32)> = Vec::with_capacity(sp.movies);
    let mut chosen: Vec<u32> = Vec::new();
    for (ui, p) in users.prefs.iter().enumerate() {
        let uid = ui + 1;
        let extra = -(sp.mean_ratings - 20.0) * (1.0 - unit(rng)).ln();
        let k = (20 + extra as usize).min(cap).min(sp.movies);
        // Efraimidis–Spirakis weighted sampling without replacement: key = ln(u) / w,
        // computed in log space as ln(-ln u) - ln w (smaller is better).
        keys.clear();
        let taste = &users.tastes[ui];
        for (m, gs) in movies.genres.iter().enumerate() {
            let aff = gs.iter().map(|&g| p[g]).sum::<f64>() / gs.len() as f64;
            let hidden = taste
                .iter()
                .zip(&styles[m])
                .map(|(a, b)| a * b)
                .sum::<f64>()
                / (TASTE_DIM as f64).sqrt();
            let log_w = POP_WEIGHT * log_pop[m] + GENRE_WEIGHT * aff + TASTE_WEIGHT * hidden;
            let u = 1.0 - unit(rng);
            keys.push(((-u.ln()).ln() - log_w, m as u32));
        }
        keys.select_nth_unstable_by(k - 1, |a, b| a.0.total_cmp(&b.0));
        chosen.clear();
        chosen.extend(keys[..k].iter().map(|&(_, m)| m));
        chosen.sort_unstable();
        let mut ts = 956_703_932 + below(rng, 80_000_000);
        for &m in &chosen {
            let gs = &movies.genres[m as usize];
            let aff = gs.iter().map(|&g| p[g]).sum::<f64>() / gs.len() as f64;
            let score = 3.6 + 1.2 * aff + movies.quality[m as usize] + 0.8 * normal(rng);
            let stars = score.round().clamp(1.0, 5.0) as u8;
            ts += below(rng, 5_000);
            let _ = writeln!(
                LineBuf(&mut buf),
                "{uid}::{}::{stars}::{ts}",
                movies.ids[m as usize]
            );
        }
    }
    buf
}

/// `fmt::Write` adapter appending ASCII/UTF-8 text to a byte buffer.
struct LineBuf<'a>(&'a mut Vec<u8>);

impl std::fmt::Write for LineBuf<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.0.extend_from_slice(s.as_bytes());
        Ok(())
    }
}
