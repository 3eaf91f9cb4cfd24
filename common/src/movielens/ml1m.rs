//! Reading MovieLens-1M's three files: `users.dat`, `movies.dat` (ISO-8859-1) and `ratings.dat`,
//! `::`-separated; every bad line is an error naming the file, the line and what is wrong.

use std::collections::HashSet;
use std::path::Path;

use super::*;

/// Largest data file read (ML-1M's `ratings.dat` is 24 MB): a bigger one is refused, not
/// read into memory.
pub(super) const MAX_DATA_FILE: u64 = 4 << 30;

/// Reads a whole data file. A FIFO, a device or a directory is refused without blocking on it,
/// as is one over [`MAX_DATA_FILE`] (`common::files`).
pub(super) fn read_file(path: &Path) -> Result<Vec<u8>, DataError> {
    use crate::files::InputError;
    crate::files::read_input(path, MAX_DATA_FILE).map_err(|e| match e {
        InputError::Missing { path } => DataError::MissingFile { path },
        InputError::NotAFile { path, what } => DataError::NotAFile { path, what },
        InputError::TooLarge { path, size, max } => DataError::TooLarge { path, size, max },
        InputError::Io { path, error } => DataError::Read {
            path,
            source: error,
        },
    })
}

/// Iterates over `(1-based line number, line bytes)`, skipping empty lines and stripping a
/// trailing `\r`.
pub(super) fn lines(bytes: &[u8]) -> impl Iterator<Item = (usize, &[u8])> {
    bytes
        .split(|&b| b == b'\n')
        .enumerate()
        .map(|(i, l)| (i + 1, l.strip_suffix(b"\r").unwrap_or(l)))
        .filter(|(_, l)| !l.is_empty())
}

/// Splits `line` on `::` into `out`; returns the number of fields found (may exceed `N`, in
/// which case only the first `N` are stored).
fn split_fields<'a, const N: usize>(line: &'a [u8], out: &mut [&'a [u8]; N]) -> usize {
    let mut n = 0;
    let mut start = 0;
    let mut i = 0;
    while i + 1 < line.len() {
        if line[i] == b':' && line[i + 1] == b':' {
            if n < N {
                out[n] = &line[start..i];
            }
            n += 1;
            i += 2;
            start = i;
        } else {
            i += 1;
        }
    }
    if n < N {
        out[n] = &line[start..];
    }
    n + 1
}

pub(super) fn parse_uint(field: &[u8]) -> Option<u64> {
    if field.is_empty() || field.len() > 19 {
        return None;
    }
    let mut v: u64 = 0;
    for &b in field {
        if !b.is_ascii_digit() {
            return None;
        }
        v = v * 10 + u64::from(b - b'0');
    }
    Some(v)
}

/// Latin-1 decoding: each byte is the char U+00XX.
pub(super) fn latin1(bytes: &[u8]) -> String {
    bytes.iter().map(|&b| b as char).collect()
}

pub(super) struct Ctx<'p> {
    pub(super) path: &'p Path,
}

impl Ctx<'_> {
    pub(super) fn err(&self, line: usize, msg: impl Into<String>) -> DataError {
        DataError::Parse {
            path: self.path.to_path_buf(),
            line,
            msg: msg.into(),
        }
    }

    fn fields<'a, const N: usize>(
        &self,
        line_no: usize,
        line: &'a [u8],
    ) -> Result<[&'a [u8]; N], DataError> {
        let mut out: [&[u8]; N] = [&[]; N];
        let n = split_fields(line, &mut out);
        if n != N {
            return Err(self.err(
                line_no,
                format!("expected {N} '::'-separated fields, found {n}"),
            ));
        }
        Ok(out)
    }

    pub(super) fn num(
        &self,
        line_no: usize,
        what: &str,
        field: &[u8],
        max: u64,
    ) -> Result<u64, DataError> {
        match parse_uint(field) {
            Some(v) if v <= max => Ok(v),
            Some(v) => Err(self.err(line_no, format!("{what} {v} out of range (max {max})"))),
            None => Err(self.err(
                line_no,
                format!("{what} is not a number: {:?}", latin1(field)),
            )),
        }
    }
}

fn parse_users(path: &Path, bytes: &[u8]) -> Result<Vec<User>, DataError> {
    let cx = Ctx { path };
    let mut users = Vec::with_capacity(bytes.len() / 20 + 1);
    let mut seen = HashSet::new();
    for (no, line) in lines(bytes) {
        let [id, gender, age, occ, zip] = cx.fields::<5>(no, line)?;
        let id = cx.num(no, "user id", id, u64::from(u32::MAX))? as u32;
        if !seen.insert(id) {
            return Err(cx.err(no, format!("duplicate user id {id}")));
        }
        let gender = match gender {
            b"M" => Gender::M,
            b"F" => Gender::F,
            other => {
                return Err(cx.err(
                    no,
                    format!("gender must be M or F, got {:?}", latin1(other)),
                ))
            }
        };
        let age = cx.num(no, "age code", age, 255)? as u8;
        if !AGE_CODES.contains(&age) {
            return Err(cx.err(no, format!("age code {age} is not one of {AGE_CODES:?}")));
        }
        let occupation = cx.num(no, "occupation", occ, 20)? as u8;
        if zip.is_empty() {
            return Err(cx.err(no, "empty zip code"));
        }
        users.push(User {
            id,
            gender,
            age: Age::Group(age),
            occupation: Occupation::Code(occupation),
            zip: latin1(zip),
        });
    }
    Ok(users)
}

/// Year from a title ending in `(dddd)`.
pub(super) fn title_year(title: &[u8]) -> Option<u16> {
    let t = title.trim_ascii_end();
    if t.len() < 6 || t[t.len() - 1] != b')' || t[t.len() - 6] != b'(' {
        return None;
    }
    let digits = &t[t.len() - 5..t.len() - 1];
    parse_uint(digits).map(|y| y as u16)
}

fn parse_movies(path: &Path, bytes: &[u8]) -> Result<Vec<Movie>, DataError> {
    let cx = Ctx { path };
    let mut movies = Vec::with_capacity(bytes.len() / 40 + 1);
    let mut seen = HashSet::new();
    for (no, line) in lines(bytes) {
        let [id, title, genres] = cx.fields::<3>(no, line)?;
        let id = cx.num(no, "movie id", id, u64::from(u32::MAX))? as u32;
        if !seen.insert(id) {
            return Err(cx.err(no, format!("duplicate movie id {id}")));
        }
        if title.is_empty() {
            return Err(cx.err(no, "empty title"));
        }
        let mut gs = Vec::new();
        for g in genres.split(|&b| b == b'|') {
            match GENRES.iter().find(|k| k.as_bytes() == g) {
                Some(k) => gs.push((*k).to_string()),
                None => return Err(cx.err(no, format!("unknown genre {:?}", latin1(g)))),
            }
        }
        movies.push(Movie {
            id,
            title: latin1(title),
            year: title_year(title),
            genres: gs,
        });
    }
    Ok(movies)
}

fn parse_ratings(
    path: &Path,
    bytes: &[u8],
    users: &IdSet,
    movies: &IdSet,
) -> Result<Vec<Rating>, DataError> {
    let cx = Ctx { path };
    let mut ratings = Vec::with_capacity(bytes.len() / 22 + 1);
    for (no, line) in lines(bytes) {
        if let Some((user, movie, rating, timestamp)) = fast_rating(line) {
            if (1..=5).contains(&rating) && users.contains(user) && movies.contains(movie) {
                ratings.push(Rating {
                    user,
                    movie,
                    rating,
                    timestamp,
                });
                continue;
            }
        }
        // Slow path: re-parse field by field to report exactly what is wrong.
        let fields = cx.fields::<4>(no, line)?;
        ratings.push(cx.rating(no, fields, users, movies)?);
    }
    Ok(ratings)
}

impl Ctx<'_> {
    /// A rating from its four fields (user, movie, stars, timestamp), each checked: numbers,
    /// stars in 1..=5, a known user and movie.
    pub(super) fn rating(
        &self,
        no: usize,
        [u, m, r, t]: [&[u8]; 4],
        users: &IdSet,
        movies: &IdSet,
    ) -> Result<Rating, DataError> {
        let user = self.num(no, "user id", u, u64::from(u32::MAX))? as u32;
        let movie = self.num(no, "movie id", m, u64::from(u32::MAX))? as u32;
        let rating = self.num(no, "rating", r, 255)? as u8;
        if !(1..=5).contains(&rating) {
            return Err(self.err(no, format!("rating {rating} not in 1..=5")));
        }
        let timestamp = self.num(no, "timestamp", t, u64::MAX)?;
        if !users.contains(user) {
            return Err(self.err(no, format!("rating for unknown user {user}")));
        }
        if !movies.contains(movie) {
            return Err(self.err(no, format!("rating for unknown movie {movie}")));
        }
        Ok(Rating {
            user,
            movie,
            rating,
            timestamp,
        })
    }
}

/// Membership test for ids: a bitmap when ids are small (ML-1M), a sorted list otherwise.
pub(super) enum IdSet {
    Bitmap(Vec<bool>),
    Sorted(Vec<u32>),
}

impl IdSet {
    pub(super) fn new(ids: impl Iterator<Item = u32>) -> IdSet {
        let mut v: Vec<u32> = ids.collect();
        let max = v.iter().copied().max().unwrap_or(0) as usize;
        if max <= 1 << 24 {
            let mut bits = vec![false; max + 1];
            for id in v {
                bits[id as usize] = true;
            }
            IdSet::Bitmap(bits)
        } else {
            v.sort_unstable();
            IdSet::Sorted(v)
        }
    }

    #[inline]
    pub(super) fn contains(&self, id: u32) -> bool {
        match self {
            IdSet::Bitmap(b) => b.get(id as usize).copied().unwrap_or(false),
            IdSet::Sorted(v) => v.binary_search(&id).is_ok(),
        }
    }
}

/// Single-pass parse of a well-formed `u::m::r::t` line; `None` on anything unusual.
#[inline]
fn fast_rating(line: &[u8]) -> Option<(u32, u32, u8, u64)> {
    let mut pos = 0;
    let mut vals = [0u64; 4];
    for (k, v) in vals.iter_mut().enumerate() {
        let start = pos;
        let mut x: u64 = 0;
        while pos < line.len() && line[pos].is_ascii_digit() {
            x = x
                .checked_mul(10)?
                .checked_add(u64::from(line[pos] - b'0'))?;
            pos += 1;
        }
        if pos == start {
            return None;
        }
        *v = x;
        if k < 3 {
            if line.get(pos..pos + 2) != Some(b"::".as_slice()) {
                return None;
            }
            pos += 2;
        }
    }
    if pos != line.len() || vals[0] > u64::from(u32::MAX) || vals[1] > u64::from(u32::MAX) {
        return None;
    }
    Some((
        vals[0] as u32,
        vals[1] as u32,
        u8::try_from(vals[2]).ok()?,
        vals[3],
    ))
}

/// A ratings parser: the file's path and bytes, the known users and movies.
pub(super) type ParseRatings = fn(&Path, &[u8], &IdSet, &IdSet) -> Result<Vec<Rating>, DataError>;

/// The three parsers of one layout.
pub(super) struct Parsers {
    pub(super) users: fn(&Path, &[u8]) -> Result<Vec<User>, DataError>,
    pub(super) movies: fn(&Path, &[u8]) -> Result<Vec<Movie>, DataError>,
    pub(super) ratings: ParseRatings,
}

/// Reads and validates the files of `format` from `dir`: users and movies first, then the
/// ratings, each of which must name a known user and movie.
pub(super) fn read_layout(
    dir: &Path,
    format: DataFormat,
    parse: Parsers,
) -> Result<RawData, DataError> {
    let [rp, up, mp] = format.files().map(|f| dir.join(f));
    let users = (parse.users)(&up, &read_file(&up)?)?;
    let movies = (parse.movies)(&mp, &read_file(&mp)?)?;
    let user_ok = IdSet::new(users.iter().map(|u| u.id));
    let movie_ok = IdSet::new(movies.iter().map(|m| m.id));
    let bytes = read_file(&rp)?;
    let ratings = (parse.ratings)(&rp, &bytes, &user_ok, &movie_ok)?;
    let duplicates = super::duplicate_pairs(&rp, &bytes, &ratings);
    Ok(RawData {
        users,
        movies,
        ratings,
        duplicates,
    })
}

/// Reads and validates `users.dat`, `movies.dat` and `ratings.dat` from `dir`.
pub fn read_ml1m(dir: &Path) -> Result<RawData, DataError> {
    let parse = Parsers {
        users: parse_users,
        movies: parse_movies,
        ratings: parse_ratings,
    };
    read_layout(dir, DataFormat::Ml1m, parse)
}
