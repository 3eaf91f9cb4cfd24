//! `gen-data` end to end: writes ML-1M-format files that the real reader accepts, the same bytes
//! for the same seed, and bad arguments are refused.

mod support;

use std::process::Command;

use support::*;

fn gen(args: &[&str]) -> std::process::Output {
    Command::new(bin("gen-data"))
        .args(args)
        .output()
        .expect("run gen-data")
}

#[test]
fn tiny_data_set_is_written_read_back_and_deterministic() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    for d in [&a, &b] {
        let out = gen(&["--size", "tiny", "--seed", "7", d.to_str().unwrap()]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            stdout.contains("users,") && stdout.contains("train "),
            "{stdout}"
        );
    }
    for file in ["users.dat", "movies.dat", "ratings.dat"] {
        let x = std::fs::read(a.join(file)).unwrap();
        assert!(!x.is_empty(), "{file} is empty");
        assert_eq!(
            x,
            std::fs::read(b.join(file)).unwrap(),
            "{file} differs for the same seed"
        );
    }
    let first = std::fs::read(a.join("ratings.dat")).unwrap();
    let line = first.split(|&c| c == b'\n').next().unwrap();
    assert_eq!(
        line.windows(2).filter(|w| w == b"::").count(),
        3,
        "UserID::MovieID::Rating::Timestamp"
    );
}

#[test]
fn bad_arguments_are_refused() {
    let out = gen(&["--size", "huge", "/tmp/x"]);
    assert_eq!(out.status.code(), Some(2));
    let out = gen(&["--min-rating", "9", "/tmp/x"]);
    assert_eq!(out.status.code(), Some(2));
}
