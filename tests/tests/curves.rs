//! A run's pictures end to end: `launch` trains a tiny run and its summary says where the curves
//! are; `plot-curves` redraws them from `metrics.jsonl` alone, also for a run whose log was cut
//! by a kill, and names the file when there is nothing to draw.

mod support;

use std::time::Duration;

use support::*;

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
