//! Pre-flight: every file and directory a config's run needs (the data set's files, GPT-2's
//! weights, the output directory) is checked before any worker starts, and by `--dry-run`, so
//! that a missing or unusable one is one line naming the path and how to get it, not a failure
//! of every worker after start-up. The data set is read with the workers' own reader
//! (`common::movielens`), so a bad line (`ratings.dat:LINE`) is found here too, with exit 2.
//!
//! Must not: parse the weights (the worker does), write or create anything, or block: a FIFO
//! is opened non-blocking and refused.

use std::io;
use std::path::{Path, PathBuf};

use common::assets::{fetch_hint, AssetKind};
use common::config::Config;
use common::data_layout::DataFormat;

/// Largest data or weights file the worker will be asked to read (GPT-2 XL's weights are
/// 6.4 GB; ML-1M's ratings 24 MB).
const MAX_INPUT_BYTES: u64 = 64 << 30;

/// A needed path that is missing or unusable: one line.
#[derive(Debug, thiserror::Error)]
#[error("{key}: {}{}: {problem}{}", path.display(), line.map(|l| format!(":{l}")).unwrap_or_default(), hint.as_deref().map(|h| format!("; {h}")).unwrap_or_default())]
pub struct PreflightError {
    /// The config key that named the path.
    pub key: &'static str,
    pub path: PathBuf,
    /// The line of the file at fault, for a data file's content.
    pub line: Option<usize>,
    pub problem: String,
    /// What to do about it (`run `fetch ml-1m` to download it`).
    pub hint: Option<String>,
}

/// Checks everything `config` needs on this node; what is worth saying about the data that does
/// not stop the run (pairs rated twice).
pub fn check(config: &Config) -> Result<Vec<String>, PreflightError> {
    let format = match &config.data.dir {
        Some(dir) => Some((dir, check_data_dir(dir)?)),
        None => None,
    };
    if let Some(weights) = &config.model.gpt2_weights {
        if config.model.kind == common::config::ModelKind::Gpt2rec {
            check_weights(weights)?;
        }
    }
    check_output_dir(&config.run.output_dir, &config.run.name)?;
    // The data's content last: every missing download is named before a second is read.
    let mut notes = Vec::new();
    if let Some((dir, format)) = format {
        notes.extend(check_data_content(dir, format, config.data.min_rating)?);
    }
    Ok(notes)
}

/// Reads the data set as the workers will: a bad line, an unknown id, nothing at or above
/// `min_rating`, each refused here in the worker's words.
fn check_data_content(
    dir: &Path,
    format: DataFormat,
    min_rating: u8,
) -> Result<Option<String>, PreflightError> {
    use common::movielens::{self, DataError};
    let fail = |e: DataError| {
        let (path, line) = match &e {
            DataError::Parse { path, line, .. } => (path.clone(), Some(*line)),
            DataError::Unusable { path, .. }
            | DataError::MissingFile { path }
            | DataError::NotAFile { path, .. }
            | DataError::TooLarge { path, .. }
            | DataError::Read { path, .. }
            | DataError::Write { path, .. } => (path.clone(), None),
            DataError::NoDataSet { dir, .. } => (dir.clone(), None),
        };
        let problem = match e {
            DataError::Parse { msg, .. } | DataError::Unusable { msg, .. } => msg,
            other => other.to_string(),
        };
        PreflightError {
            key: "data.dir",
            path,
            line,
            problem,
            hint: None,
        }
    };
    let (raw, _) = movielens::read_movielens(dir).map_err(fail)?;
    movielens::check_positives(&raw, min_rating, &dir.join(format.files()[0])).map_err(fail)?;
    Ok(raw.duplicates.map(|d| d.warning(min_rating)))
}

fn fetch_line(path: &Path, kind: AssetKind) -> Option<String> {
    fetch_hint(path, kind).map(|cmd| format!("run `{cmd}` to download it"))
}

fn check_data_dir(dir: &Path) -> Result<DataFormat, PreflightError> {
    let fail = |problem: String| PreflightError {
        key: "data.dir",
        path: dir.to_path_buf(),
        line: None,
        problem,
        hint: fetch_line(dir, AssetKind::Dataset).or_else(|| {
            Some(
                "point data.dir at a MovieLens directory, or leave it out for synthetic data"
                    .into(),
            )
        }),
    };
    match std::fs::metadata(dir) {
        Err(e) => return Err(fail(io_problem(&e, "no such directory"))),
        Ok(m) if !m.is_dir() => return Err(fail("not a directory".into())),
        Ok(_) => {}
    }
    let format = DataFormat::detect(dir).ok_or_else(|| {
        fail("holds neither MovieLens-1M's ratings.dat, users.dat, movies.dat nor MovieLens-100k's u.data, u.user, u.item".into())
    })?;
    for name in format.files() {
        let path = dir.join(name);
        check_file(&path).map_err(|problem| PreflightError {
            key: "data.dir",
            path: path.clone(),
            line: None,
            problem: format!("{problem} ({} needs it)", format.name()),
            hint: fetch_line(dir, AssetKind::Dataset),
        })?;
    }
    Ok(format)
}

fn check_weights(weights: &Path) -> Result<(), PreflightError> {
    let fail = |path: &Path, problem: String| PreflightError {
        key: "model.gpt2_weights",
        path: path.to_path_buf(),
        line: None,
        problem,
        hint: fetch_line(weights, AssetKind::Model),
    };
    let files: Vec<PathBuf> = match std::fs::metadata(weights) {
        Err(e) => return Err(fail(weights, io_problem(&e, "no such file or directory"))),
        Ok(m) if m.is_dir() => ["config.json", "model.safetensors"]
            .iter()
            .map(|f| weights.join(f))
            .collect(),
        Ok(_) => vec![weights.to_path_buf()],
    };
    for path in files {
        check_file(&path).map_err(|problem| fail(&path, problem))?;
    }
    Ok(())
}

/// A file a worker will read: there, readable, a regular file (opened without blocking, by
/// `common::files`), not empty, not enormous.
fn check_file(path: &Path) -> Result<(), String> {
    use common::files::InputError;
    let (_, len) = common::files::open_input(path, MAX_INPUT_BYTES).map_err(|e| match e {
        InputError::Missing { .. } => "no such file".to_string(),
        InputError::NotAFile { what, .. } => format!("is {what}, not a file"),
        InputError::TooLarge { size, max, .. } => {
            format!("is {size} bytes, more than the {max} allowed")
        }
        InputError::Io { error, .. } => io_problem(&error, "no such file"),
    })?;
    if len == 0 {
        return Err("is empty".into());
    }
    Ok(())
}

/// The output directory must be a directory we can write in, or creatable under one; the run's
/// own directory, when there, a directory.
fn check_output_dir(output_dir: &Path, run_name: &str) -> Result<(), PreflightError> {
    let fail = |path: &Path, problem: String| PreflightError {
        key: "run.output_dir",
        path: path.to_path_buf(),
        line: None,
        problem,
        hint: None,
    };
    let run_dir = output_dir.join(run_name);
    if let Ok(m) = std::fs::metadata(&run_dir) {
        if !m.is_dir() {
            return Err(fail(
                &run_dir,
                "the run's directory is not a directory".into(),
            ));
        }
    }
    // The nearest existing ancestor is where the run's directories will be created.
    let mut probe = output_dir.to_path_buf();
    loop {
        match std::fs::metadata(&probe) {
            Ok(m) if m.is_dir() => break,
            Ok(_) => return Err(fail(&probe, "not a directory".into())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(fail(&probe, io_problem(&e, ""))),
        }
        match probe.parent() {
            Some(p) if !p.as_os_str().is_empty() => probe = p.to_path_buf(),
            _ => {
                probe = PathBuf::from(".");
                break;
            }
        }
    }
    let writable = nix::unistd::access(
        &probe,
        nix::unistd::AccessFlags::W_OK | nix::unistd::AccessFlags::X_OK,
    );
    if let Err(e) = writable {
        let problem = format!("cannot write there ({})", e.desc());
        return Err(fail(&probe, problem));
    }
    Ok(())
}

/// An I/O error as a short phrase, without repeating what the OS says twice.
fn io_problem(e: &io::Error, not_found: &str) -> String {
    match e.kind() {
        io::ErrorKind::NotFound => not_found.to_string(),
        io::ErrorKind::PermissionDenied => "permission denied".to_string(),
        _ => match e.raw_os_error() {
            Some(code) => nix::errno::Errno::from_raw(code).desc().to_lowercase(),
            None => e.to_string(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(text: &str) -> Config {
        Config::parse(&format!("{text}[batch]\nglobal = 8\n"), "x.toml", &[]).expect("config")
    }

    #[test]
    fn a_missing_named_data_set_says_how_to_fetch_it() {
        let cache = tempfile::tempdir().unwrap();
        let out = tempfile::tempdir().unwrap();
        let dir = cache.path().join("data").join("ml-1m");
        let c = config(&format!(
            "[run]\noutput_dir = {:?}\n[data]\ndir = {:?}\n",
            out.path(),
            dir
        ));
        let e = check(&c).unwrap_err().to_string();
        assert!(e.starts_with("data.dir: "), "{e}");
        assert!(
            e.contains("no such directory") && e.contains("run `fetch ml-1m`"),
            "{e}"
        );
    }

    #[test]
    fn data_files_are_checked_by_layout() {
        let d = tempfile::tempdir().unwrap();
        let out = tempfile::tempdir().unwrap();
        let c = config(&format!(
            "[run]\noutput_dir = {:?}\n[data]\ndir = {:?}\n",
            out.path(),
            d.path()
        ));
        let e = check(&c).unwrap_err().to_string();
        assert!(e.contains("holds neither"), "{e}");
        for f in ["u.data", "u.user"] {
            std::fs::write(d.path().join(f), "1").unwrap();
        }
        let e = check(&c).unwrap_err().to_string();
        assert!(
            e.contains("u.item: no such file (MovieLens-100k needs it)"),
            "{e}"
        );
        std::fs::write(d.path().join("u.item"), "").unwrap();
        let e = check(&c).unwrap_err().to_string();
        assert!(e.contains("u.item: is empty"), "{e}");
        std::fs::remove_file(d.path().join("u.item")).unwrap();
        nix::unistd::mkfifo(&d.path().join("u.item"), nix::sys::stat::Mode::S_IRWXU).unwrap();
        let e = check(&c).unwrap_err().to_string();
        assert!(e.contains("u.item: is a FIFO, not a file"), "{e}");
        std::fs::remove_file(d.path().join("u.item")).unwrap();
        std::fs::write(d.path().join("u.item"), "1").unwrap();
        // There and readable; what they hold is read next.
        let e = check(&c).unwrap_err().to_string();
        assert!(
            e.contains("u.user:1: expected 5 '|'-separated fields"),
            "{e}"
        );
    }

    /// A small ML-1M data set in `dir` whose ratings file is `ratings`.
    fn ml1m(dir: &Path, ratings: &[u8]) {
        std::fs::write(
            dir.join("users.dat"),
            "1::F::1::10::48067\n2::M::56::16::70072\n",
        )
        .unwrap();
        std::fs::write(
            dir.join("movies.dat"),
            "1::Toy Story (1995)::Animation|Children's|Comedy\n2::Jumanji (1995)::Adventure\n",
        )
        .unwrap();
        std::fs::write(dir.join("ratings.dat"), ratings).unwrap();
    }

    #[test]
    fn bad_ratings_are_found_before_any_worker_starts_naming_the_line() {
        // Each was found only by the workers, after they started (exit 1).
        let d = tempfile::tempdir().unwrap();
        let c = config(&format!(
            "[run]\noutput_dir = {:?}\n[data]\ndir = {:?}\n",
            d.path(),
            d.path()
        ));
        let good = "1::1::5::978300760\n2::2::3::978300761\n";
        ml1m(d.path(), good.as_bytes());
        assert_eq!(check(&c).unwrap(), Vec::<String>::new());
        let ratings = d.path().join("ratings.dat").display().to_string();
        for (bytes, said) in [
            (
                format!("{good}1::2::6::978300762\n"),
                ":3: rating 6 not in 1..=5",
            ),
            (format!("{good}1::x::4::978300762\n"), ":3: "),
            (
                format!("{good}1::9::4::978300762\n"),
                ":3: rating for unknown movie 9",
            ),
            (format!("\u{feff}{good}"), ":1: "),
            (
                String::from("1::1::2::978300760\n"),
                ": none of its 1 ratings is at or above data.min_rating = 3",
            ),
        ] {
            ml1m(d.path(), bytes.as_bytes());
            let e = check(&c).unwrap_err().to_string();
            assert!(e.starts_with(&format!("data.dir: {ratings}{said}")), "{e}");
            assert!(!e.contains('\n'), "{e}");
        }
        // The same pair rated twice is said, not refused.
        ml1m(d.path(), format!("{good}1::1::1::978300762\n").as_bytes());
        let notes = check(&c).unwrap();
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(
            notes[0].contains("1 user-item pair(s) rated more than once (the first: user 1, movie 1, line 1: 5, line 3: 1); each pair counts once, as a positive when any of its ratings is at or above data.min_rating = 3"),
            "{notes:?}"
        );
    }

    #[test]
    fn weights_and_output_dir() {
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("file");
        std::fs::write(&out, "x").unwrap();
        let c = config(&format!("[run]\noutput_dir = {:?}\n", out.join("deeper")));
        let e = check(&c).unwrap_err().to_string();
        assert!(
            e.starts_with("run.output_dir: ") && e.contains("not a directory"),
            "{e}"
        );
        let weights = d.path().join("gpt2").join("model.safetensors");
        let c = config(&format!(
            "[run]\noutput_dir = {:?}\n[model]\ngpt2_weights = {:?}\n",
            d.path(),
            weights
        ));
        let e = check(&c).unwrap_err().to_string();
        assert!(
            e.starts_with("model.gpt2_weights: ") && e.contains("run `fetch gpt2`"),
            "{e}"
        );
    }
}
