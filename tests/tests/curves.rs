//! A run's pictures end to end: `launch` trains a tiny run and its summary says where the curves
//! are; `plot-curves` redraws them from `metrics.jsonl` alone, also for a run whose log was cut
//! by a kill, and names the file when there is nothing to draw; values near the ends of f64
//! are drawn, never a hang; a FIFO log is refused at once; nothing outside the run is written
//! through a link.

mod support;

use std::time::Duration;

use support::*;

/// `plot-curves RUN_DIR` with a time limit (a hang is killed and fails the test).
fn plot_curves_within(run: &std::path::Path, limit: Duration) -> Output {
    let child = std::process::Command::new(bin("plot-curves"))
        .arg(run)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start plot-curves");
    wait_output(child, limit)
}

fn plot_curves(args: &[&std::path::Path]) -> std::process::Output {
    std::process::Command::new(bin("plot-curves"))
        .args(args)
        .output()
        .expect("start plot-curves")
}

#[test]
fn a_run_ends_with_its_curves_and_plot_curves_redraws_them() {
    let dir = tempfile::tempdir().unwrap();
    let sets = tiny_bpr_sets(dir.path());
    let mut args = vec!["--num-processes", "2", "--master-port", "0"];
    args.extend(sets.iter().map(String::as_str));
    args.extend(["--set", "train.epochs=2", "configs/default.toml"]);
    let out = launch(&args, Duration::from_secs(180));
    out.assert_code(0);
    let run = dir.path().join("default");
    let curves = run.join("curves");
    let line = format!("curves: {}/{{loss.svg,lr.svg,valid.svg}}", curves.display());
    assert!(out.stdout.contains(&line), "{}", out.stdout);
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    assert!(
        metrics.starts_with(r#"{"hit@10""#)
            && metrics
                .lines()
                .next()
                .unwrap()
                .contains(r#""kind":"baseline""#)
    );
    for name in ["loss.svg", "lr.svg", "valid.svg"] {
        let svg = std::fs::read_to_string(curves.join(name)).unwrap();
        assert!(svg.starts_with("<svg"), "{name}");
    }
    let valid = std::fs::read_to_string(curves.join("valid.svg")).unwrap();
    // The popularity baseline is drawn in red dashes.
    assert!(
        valid.contains("ndcg@10") && valid.contains(r##"stroke="#FF0000""##),
        "no baseline line"
    );

    // Deleted pictures and a log cut mid-line by a kill: redrawn from what is whole.
    std::fs::remove_dir_all(&curves).unwrap();
    std::fs::write(
        run.join("metrics.jsonl"),
        format!("{metrics}{{\"kind\":\"st"),
    )
    .unwrap();
    let redraw = plot_curves(&[&run]);
    let stdout = String::from_utf8_lossy(&redraw.stdout);
    assert_eq!(redraw.status.code(), Some(0), "{redraw:?}");
    assert_eq!(stdout.lines().count(), 3, "{stdout}");
    assert!(curves.join("valid.svg").is_file());

    // Nothing to draw: the file is named, exit 2.
    let empty = dir.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let failed = plot_curves(&[&empty]);
    let stderr = String::from_utf8_lossy(&failed.stderr);
    assert_eq!(failed.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.starts_with(&format!(
            "plot-curves: error: {}/metrics.jsonl: ",
            empty.display()
        )),
        "{stderr}"
    );
}

/// A loss of ±1e308 used to spin at 100% CPU forever (an axis of infinite width).
#[test]
fn values_near_the_ends_of_f64_are_drawn_quickly() {
    let dir = tempfile::tempdir().unwrap();
    let log = [
        r#"{"kind":"step","epoch":1,"step":1,"loss":1e308,"lr":0.001}"#,
        r#"{"kind":"step","epoch":1,"step":2,"loss":-1e308,"lr":-1.7976931348623157e308}"#,
        r#"{"kind":"step","epoch":1,"step":3,"loss":"NaN","lr":null}"#,
        r#"{"kind":"step","epoch":1,"step":4,"loss":1e999,"lr":0.001}"#,
        r#"{"kind":"step","epoch":1,"step":5,"loss":5e-324,"lr":0.001}"#,
        r#"{"kind":"eval","split":"valid","epoch":1,"ndcg@10":1e308,"recall@10":-1e308}"#,
    ]
    .join("\n");
    std::fs::write(dir.path().join("metrics.jsonl"), log).unwrap();
    let out = plot_curves_within(dir.path(), Duration::from_secs(60));
    out.assert_code(0);
    out.assert_ended_within(10);
    let loss = std::fs::read_to_string(dir.path().join("curves/loss.svg")).unwrap();
    assert!(
        loss.contains("drawn at it"),
        "no note of the clamped values"
    );
}

#[test]
fn a_log_that_is_a_fifo_or_a_directory_is_one_line_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("metrics.jsonl");
    nix::unistd::mkfifo(&log, nix::sys::stat::Mode::S_IRWXU).unwrap();
    for what in ["a FIFO", "a directory"] {
        let out = plot_curves_within(dir.path(), Duration::from_secs(30));
        out.assert_code(2);
        out.assert_stderr(format!("metrics.jsonl: is {what}, not a file"));
        assert_eq!(out.stderr.trim_end().lines().count(), 1, "{}", out.stderr);
        out.assert_ended_within(10);
        // Then the same name as a directory.
        let _ = std::fs::remove_file(&log);
        let _ = std::fs::create_dir(&log);
    }
    assert!(!dir.path().join("curves").exists());
}

/// Links planted at the pictures' names point outside the run: the pictures replace the
/// links, and the files outside stay as they were; a `curves` that is a link is refused.
#[test]
fn nothing_outside_the_run_is_written_through_a_link() {
    use std::os::unix::fs::symlink;
    let dir = tempfile::tempdir().unwrap();
    let (run, outside) = (dir.path().join("run"), dir.path().join("outside"));
    std::fs::create_dir_all(run.join("curves")).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(
        run.join("metrics.jsonl"),
        r#"{"kind":"step","epoch":1,"step":1,"loss":0.5,"lr":0.001}"#,
    )
    .unwrap();
    for name in ["loss.svg", "lr.svg"] {
        std::fs::write(outside.join(name), "precious").unwrap();
        symlink(outside.join(name), run.join("curves").join(name)).unwrap();
    }
    let out = plot_curves_within(&run, Duration::from_secs(60));
    out.assert_code(0);
    for name in ["loss.svg", "lr.svg"] {
        assert_eq!(
            std::fs::read_to_string(outside.join(name)).unwrap(),
            "precious"
        );
        let picture = run.join("curves").join(name);
        assert!(!picture.symlink_metadata().unwrap().is_symlink());
        assert!(std::fs::read_to_string(picture)
            .unwrap()
            .starts_with("<svg"));
    }
    assert_eq!(std::fs::read_dir(run.join("curves")).unwrap().count(), 2);

    std::fs::remove_dir_all(run.join("curves")).unwrap();
    symlink(&outside, run.join("curves")).unwrap();
    let out = plot_curves_within(&run, Duration::from_secs(60));
    out.assert_code(2);
    out.assert_stderr("curves: is a symbolic link, not a directory; nothing was written");
    assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 2);
}
