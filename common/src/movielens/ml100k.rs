//! Reading MovieLens-100k as GroupLens ships it: `u.user` (`id|age|gender|occupation|zip`),
//! `u.item` (`id|title|release date|video release date|IMDb URL|` then 19 genre flags, latin-1)
//! and `u.data` (`user<TAB>item<TAB>rating<TAB>timestamp`). Every bad line is an error naming
//! the file, the line and what is wrong; the records are the same as ML-1M's reader gives.

use std::collections::HashSet;
use std::path::Path;

use super::ml1m::{latin1, lines, read_layout, title_year, Ctx, IdSet, Parsers};
use super::*;

/// The genre of `u.item`'s flag `k` (0..19): `unknown`, then ML-1M's 18 in their order.
fn genre_of_flag(k: usize) -> &'static str {
    match k {
        0 => "unknown",
        k => GENRES[k - 1],
    }
}

/// Splits `line` on `sep` into exactly `N` fields, or says how many there were.
fn fields<'a, const N: usize>(
    cx: &Ctx,
    no: usize,
    line: &'a [u8],
    sep: u8,
) -> Result<[&'a [u8]; N], DataError> {
    let mut out: [&[u8]; N] = [&[]; N];
    let mut n = 0;
    for part in line.split(|&b| b == sep) {
        if n < N {
            out[n] = part;
        }
        n += 1;
    }
    if n != N {
        let name = if sep == b'\t' { "tab" } else { "'|'" };
        return Err(cx.err(
            no,
            format!("expected {N} {name}-separated fields, found {n}"),
        ));
    }
    Ok(out)
}

fn parse_users(path: &Path, bytes: &[u8]) -> Result<Vec<User>, DataError> {
    let cx = Ctx { path };
    let mut users = Vec::new();
    let mut seen = HashSet::new();
    for (no, line) in lines(bytes) {
        let [id, age, gender, occupation, zip] = fields::<5>(&cx, no, line, b'|')?;
        let id = cx.num(no, "user id", id, u64::from(u32::MAX))? as u32;
        if !seen.insert(id) {
            return Err(cx.err(no, format!("duplicate user id {id}")));
        }
        let age = cx.num(no, "age", age, 120)? as u8;
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
        let occupation = latin1(occupation).trim().to_string();
        if occupation.is_empty() {
            return Err(cx.err(no, "empty occupation"));
        }
        users.push(User {
            id,
            gender,
            age: Age::Years(age),
            occupation: Occupation::Named(occupation),
            zip: latin1(zip),
        });
    }
    Ok(users)
}

/// Year of a `u.item` release date `01-Jan-1995`.
fn release_year(date: &[u8]) -> Option<u16> {
    let year = date.rsplit(|&b| b == b'-').next()?;
    (year.len() == 4)
        .then(|| super::ml1m::parse_uint(year))
        .flatten()
        .map(|y| y as u16)
}

fn parse_items(path: &Path, bytes: &[u8]) -> Result<Vec<Movie>, DataError> {
    let cx = Ctx { path };
    let mut movies = Vec::new();
    let mut seen = HashSet::new();
    for (no, line) in lines(bytes) {
        let f = fields::<24>(&cx, no, line, b'|')?;
        let id = cx.num(no, "movie id", f[0], u64::from(u32::MAX))? as u32;
        if !seen.insert(id) {
            return Err(cx.err(no, format!("duplicate movie id {id}")));
        }
        let title = f[1];
        if title.is_empty() {
            return Err(cx.err(no, "empty title"));
        }
        let mut genres = Vec::new();
        for (k, flag) in f[5..].iter().enumerate() {
            let name = genre_of_flag(k);
            match *flag {
                b"1" => genres.push(name.to_string()),
                b"0" => {}
                other => {
                    return Err(cx.err(
                        no,
                        format!("genre flag {name} must be 0 or 1, got {:?}", latin1(other)),
                    ))
                }
            }
        }
        movies.push(Movie {
            id,
            title: latin1(title),
            year: title_year(title).or_else(|| release_year(f[2])),
            genres,
        });
    }
    Ok(movies)
}

/// `u.data`'s lines (tab-separated) through the checks `ratings.dat`'s reader shares
/// (`Ctx::rating`); ML-1M's reader adds a fast path for its million lines, which 100,000 do
/// not need, so the two loops stay apart.
fn parse_ratings(
    path: &Path,
    bytes: &[u8],
    users: &IdSet,
    movies: &IdSet,
) -> Result<Vec<Rating>, DataError> {
    let cx = Ctx { path };
    let mut ratings = Vec::with_capacity(bytes.len() / 20 + 1);
    for (no, line) in lines(bytes) {
        let fields = fields::<4>(&cx, no, line, b'\t')?;
        ratings.push(cx.rating(no, fields, users, movies)?);
    }
    Ok(ratings)
}

/// Reads and validates `u.user`, `u.item` and `u.data` from `dir`.
pub fn read_ml100k(dir: &Path) -> Result<RawData, DataError> {
    let parse = Parsers {
        users: parse_users,
        movies: parse_items,
        ratings: parse_ratings,
    };
    read_layout(dir, DataFormat::Ml100k, parse)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    const USERS: &[u8] = b"1|24|M|technician|85711\n2|53|F|other|94043\n3|23|M|writer|T8H1N\n";
    const ITEMS: &[u8] = b"1|Toy Story (1995)|01-Jan-1995||http://us.imdb.com/M/title-exact?Toy%20Story%20(1995)|0|0|0|1|1|1|0|0|0|0|0|0|0|0|0|0|0|0|0\n\
267|unknown||||1|0|0|0|0|0|0|0|0|0|0|0|0|0|0|0|0|0|0\n\
543|Mis\xe9rables, Les (1995)|01-Jan-1995||http://x|0|0|0|0|0|0|0|0|1|0|0|0|1|0|0|0|0|0|0\n";
    const DATA: &[u8] = b"1\t1\t5\t874965758\n2\t543\t3\t876893171\n3\t267\t1\t878542960\n";

    fn write(users: &[u8], items: &[u8], data: &[u8]) -> tempfile::TempDir {
        let d = tempfile::tempdir().expect("tempdir");
        fs::write(d.path().join("u.user"), users).expect("write");
        fs::write(d.path().join("u.item"), items).expect("write");
        fs::write(d.path().join("u.data"), data).expect("write");
        d
    }

    #[test]
    fn parses_grouplens_layout() {
        let d = write(USERS, ITEMS, DATA);
        let raw = read_ml100k(d.path()).expect("parse");
        assert_eq!(raw.users.len(), 3);
        assert_eq!(raw.users[0].age, Age::Years(24));
        assert_eq!(
            raw.users[2].occupation,
            Occupation::Named("writer".to_string())
        );
        assert_eq!(raw.users[2].zip, "T8H1N");
        assert_eq!(raw.movies.len(), 3);
        assert_eq!(
            raw.movies[0].genres,
            vec!["Animation", "Children's", "Comedy"]
        );
        assert_eq!(raw.movies[0].year, Some(1995));
        assert_eq!(raw.movies[1].title, "unknown");
        assert_eq!(raw.movies[1].genres, vec!["unknown"]);
        assert_eq!(raw.movies[1].year, None);
        assert_eq!(raw.movies[2].title, "Misérables, Les (1995)");
        assert_eq!(raw.ratings.len(), 3);
        assert_eq!(
            raw.ratings[1],
            Rating {
                user: 2,
                movie: 543,
                rating: 3,
                timestamp: 876893171
            }
        );
    }

    #[test]
    fn malformed_lines_name_file_line_and_cause() {
        // (u.user, u.item, u.data, the place named, the cause named)
        type Case<'a> = (&'a [u8], &'a [u8], &'a [u8], &'a str, &'a str);
        let cases: [Case; 6] = [
            (b"1|24|M|x\n", ITEMS, DATA, "u.user:1:", "5 '|'-separated"),
            (
                b"1|240|M|x|1\n",
                ITEMS,
                DATA,
                "u.user:1:",
                "age 240 out of range",
            ),
            (
                USERS,
                b"1|T|||u|0|2\n",
                DATA,
                "u.item:1:",
                "24 '|'-separated",
            ),
            (USERS, ITEMS, b"1\t1\t5\n", "u.data:1:", "4 tab-separated"),
            (
                USERS,
                ITEMS,
                b"1\t1\t5\t1\n9\t1\t5\t1\n",
                "u.data:2:",
                "unknown user 9",
            ),
            (USERS, ITEMS, b"1\t1\t0\t1\n", "u.data:1:", "rating 0"),
        ];
        for (users, items, data, place, cause) in cases {
            let d = write(users, items, data);
            let e = read_ml100k(d.path()).expect_err(place).to_string();
            assert!(e.contains(place) && e.contains(cause), "{e}");
        }
        let mut bad_flag = ITEMS[..ITEMS.iter().position(|&b| b == b'\n').unwrap()].to_vec();
        let last = bad_flag.len() - 1;
        bad_flag[last] = b'7';
        let d = write(USERS, &bad_flag, b"");
        let e = read_ml100k(d.path()).unwrap_err().to_string();
        assert!(e.contains("genre flag Western must be 0 or 1"), "{e}");
    }
}
