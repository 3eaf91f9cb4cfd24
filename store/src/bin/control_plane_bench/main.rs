//! `control-plane-bench`: the store's side of the control-plane scale harness
//! (`scripts/bench/control_plane.sh`, which runs PyTorch's `TCPStore` on the same traffic with
//! `scripts/bench/control_plane_tcpstore.py`).
//!
//! ```text
//! control-plane-bench serve --run-id ID
//!     starts a store on 127.0.0.1 (a free port), prints `port P`, serves until its stdin
//!     reaches EOF, then prints `peak_rss_kib K threads_max T rss_start_kib S` (VmHWM, the
//!     most threads seen by a sampler every 20 ms, VmRSS before the store started) and exits;
//!     a `figures` line on stdin prints that line so far and goes on serving.
//! control-plane-bench ranks --addr 127.0.0.1:P --run-id ID --world N --local L
//!                           --first F --count C --threads T [--watch]
//!     simulates ranks F..F+C of an N-rank job with L ranks per host (see `traffic.rs`),
//!     driven by T threads, each host connecting from its own loopback address; prints one
//!     line of JSON: {"ranks","ops","connects","elapsed_s","end_unix","max_op_ms",
//!     "max_wait_ms","max_connect_ms"}. A store error is one line on stderr naming the rank,
//!     the round and the keys, and the exit status is 1. With --watch, the set-up connections
//!     stay open and the detection phase follows (`watch.rs`: every rank's will and watch,
//!     `watching`, then `kill R` on stdin).
//! control-plane-bench launchers --addr 127.0.0.1:P --run-id ID --count M --threads T
//!     simulates M elastic launchers (nodes of `launch --nnodes MIN:MAX`) against the store and
//!     coordinator of a real host `launch` (see `elastic.rs`): `ready`, then commands on stdin
//!     (`go`, `kill`, `stats`, EOF).
//! ```

mod elastic;
mod traffic;
mod watch;

use std::collections::HashMap;
use std::io::{self, BufRead, Write};
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use store::StoreServer;
use traffic::{Job, Rank, Stats, ROUNDS};

const USAGE: &str = "usage: control-plane-bench serve --run-id ID\n       \
    control-plane-bench ranks --addr HOST:PORT --run-id ID --world N --local L --first F \
    --count C --threads T [--watch]\n       \
    control-plane-bench launchers --addr HOST:PORT --run-id ID --count M --threads T";

/// How often the server's thread count is sampled.
const SAMPLE_EVERY: Duration = Duration::from_millis(20);
/// The longest error line printed (a wait on thousands of keys names them all).
const MAX_ERROR_CHARS: usize = 1000;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("serve") => options(&args[1..]).and_then(|o| serve(&o)),
        Some("ranks") => options(&args[1..]).and_then(|o| ranks(&o)),
        Some("launchers") => options(&args[1..]).and_then(|o| elastic::launchers(&o)),
        _ => Err(USAGE.to_string()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("control-plane-bench: {}", clip(&err));
            ExitCode::FAILURE
        }
    }
}

/// Options that take no value (present: an empty value).
const FLAGS: [&str; 1] = ["watch"];

/// `--name value` pairs, and the [`FLAGS`].
fn options(args: &[String]) -> Result<HashMap<String, String>, String> {
    let mut found = HashMap::new();
    let mut rest = args.iter();
    while let Some(name) = rest.next() {
        let key = name
            .strip_prefix("--")
            .ok_or_else(|| format!("unexpected argument {name:?}\n{USAGE}"))?;
        if FLAGS.contains(&key) {
            found.insert(key.to_string(), String::new());
            continue;
        }
        let value = rest
            .next()
            .ok_or_else(|| format!("{name} needs a value\n{USAGE}"))?;
        found.insert(key.to_string(), value.clone());
    }
    Ok(found)
}

fn text<'a>(options: &'a HashMap<String, String>, name: &str) -> Result<&'a str, String> {
    options
        .get(name)
        .map(String::as_str)
        .ok_or_else(|| format!("--{name} is missing\n{USAGE}"))
}

fn number(options: &HashMap<String, String>, name: &str) -> Result<u32, String> {
    let value = text(options, name)?;
    value
        .parse()
        .map_err(|_| format!("--{name} {value:?} is not a whole number"))
}

// ---------------------------------------------------------------------------------------------
// serve

fn serve(options: &HashMap<String, String>) -> Result<(), String> {
    let run_id = text(options, "run-id")?;
    init_logging();
    let rss_start = status_kib("VmRSS").unwrap_or(0);
    let addr = "127.0.0.1:0".parse().map_err(|e| format!("{e}"))?;
    let server = StoreServer::start(addr, run_id).map_err(|e| e.to_string())?;
    let threads_max = Arc::new(AtomicU64::new(0));
    let sampled = Arc::clone(&threads_max);
    thread::Builder::new()
        .name("thread-sampler".into())
        .spawn(move || loop {
            if let Some(threads) = status_value("Threads") {
                sampled.fetch_max(threads, Ordering::Relaxed);
            }
            thread::sleep(SAMPLE_EVERY);
        })
        .map_err(|e| format!("cannot start the sampler thread: {e}"))?;
    let mut out = io::stdout().lock();
    writeln!(out, "port {}", server.local_addr().port())
        .and_then(|()| out.flush())
        .map_err(|e| format!("stdout: {e}"))?;
    let figures = |out: &mut io::StdoutLock| {
        if let Some(threads) = status_value("Threads") {
            threads_max.fetch_max(threads, Ordering::Relaxed);
        }
        let peak = status_kib("VmHWM").unwrap_or(0);
        writeln!(
            out,
            "peak_rss_kib {peak} threads_max {} rss_start_kib {rss_start}",
            threads_max.load(Ordering::Relaxed)
        )
        .and_then(|()| out.flush())
        .map_err(|e| format!("stdout: {e}"))
    };
    // Serves until whoever started us closes our stdin (`figures`: the figures so far).
    for line in io::stdin().lock().lines() {
        if line.map_err(|e| format!("stdin: {e}"))?.trim() == "figures" {
            figures(&mut out)?;
        }
    }
    figures(&mut out)?;
    // The figures are out; the server's own shutdown is not what is measured.
    std::process::exit(0);
}

/// The store's warnings (refused connections, failed accepts) on stderr.
fn init_logging() {
    let _ = tracing_subscriber::fmt()
        .with_writer(io::stderr)
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .try_init();
}

/// A numeric field of /proc/self/status (the first number after `name:`).
fn status_value(name: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status.lines().find_map(|line| {
        let rest = line.strip_prefix(name)?.strip_prefix(':')?;
        rest.split_whitespace().next()?.parse().ok()
    })
}

/// A `kB` field of /proc/self/status.
fn status_kib(name: &str) -> Option<u64> {
    status_value(name)
}

// ---------------------------------------------------------------------------------------------
// ranks

fn ranks(options: &HashMap<String, String>) -> Result<(), String> {
    let job = Arc::new(Job {
        addr: text(options, "addr")?.to_string(),
        run_id: text(options, "run-id")?.to_string(),
        world: number(options, "world")?,
        local: number(options, "local")?,
    });
    let first = number(options, "first")?;
    let count = number(options, "count")?;
    let threads = number(options, "threads")?;
    let watching = options.contains_key("watch");
    if job.world == 0 || job.local == 0 || job.world % job.local != 0 {
        return Err(format!(
            "--world {} must be a positive multiple of --local {}",
            job.world, job.local
        ));
    }
    if job.hosts() > 1 << 16 {
        return Err(format!(
            "{} hosts do not fit in 127.1.0.0/16 (one address each)",
            job.hosts()
        ));
    }
    if u64::from(first) + u64::from(count) > u64::from(job.world) || count == 0 {
        return Err(format!(
            "ranks {first}..{} are not within the {} ranks",
            u64::from(first) + u64::from(count),
            job.world
        ));
    }
    let threads = threads.clamp(1, count);

    // The start line: every rank process is ready (started, arguments read) before any of them
    // begins, so that the clock measures the store, not process start-up.
    println!("ready");
    let _ = std::io::stdout().flush();
    let mut go = String::new();
    std::io::stdin()
        .read_line(&mut go)
        .map_err(|e| format!("waiting for the start line on stdin: {e}"))?;
    let started = Instant::now();
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            // Contiguous shares, as even as can be: thread t drives ranks lo..hi.
            let lo = first + (u64::from(count) * u64::from(t) / u64::from(threads)) as u32;
            let hi = first + (u64::from(count) * u64::from(t + 1) / u64::from(threads)) as u32;
            let job = Arc::clone(&job);
            thread::Builder::new()
                .name(format!("ranks-{lo}"))
                .spawn(move || drive(&job, lo..hi, watching))
        })
        .collect::<Result<_, _>>()
        .map_err(|e| format!("cannot start a thread: {e}"))?;
    let mut stats = Stats::default();
    let mut kept = Vec::new();
    for handle in handles {
        let (done, sims) = handle
            .join()
            .map_err(|_| "a rank thread panicked".to_string())?;
        stats.merge(&done);
        kept.extend(sims);
    }
    let elapsed = started.elapsed();
    let end_unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "{{\"ranks\":{count},\"ops\":{},\"connects\":{},\"elapsed_s\":{:.4},\"end_unix\":{end_unix:.6},\
         \"max_op_ms\":{:.3},\"max_wait_ms\":{:.3},\"max_connect_ms\":{:.3}}}",
        stats.ops,
        stats.connects,
        elapsed.as_secs_f64(),
        ms(stats.max_op),
        ms(stats.max_wait),
        ms(stats.max_connect)
    );
    if watching {
        watch::watch(&job, (first, count), threads, kept)?;
    }
    Ok(())
}

/// Every round for each of `ranks` in turn, then teardown (every connection closed), unless
/// `keep`: then the ranks, their connections open, are returned. The first error ends the
/// process (exit status 1), since the other ranks would wait for this one.
fn drive(job: &Job, ranks: std::ops::Range<u32>, keep: bool) -> (Stats, Vec<Rank>) {
    let mut stats = Stats::default();
    let mut sims: Vec<Rank> = ranks.map(Rank::new).collect();
    for (name, round) in ROUNDS {
        for sim in &mut sims {
            if let Err(err) = round(job, sim, &mut stats) {
                eprintln!(
                    "control-plane-bench: rank {}, round {name}: {}",
                    sim.rank,
                    clip(&err)
                );
                std::process::exit(1);
            }
        }
    }
    if keep {
        return (stats, sims);
    }
    drop(sims);
    (stats, Vec::new())
}

/// `text` cut to [`MAX_ERROR_CHARS`].
fn clip(text: &str) -> String {
    if text.chars().count() <= MAX_ERROR_CHARS {
        return text.to_string();
    }
    let head: String = text.chars().take(MAX_ERROR_CHARS).collect();
    format!("{head}... ({} characters in all)", text.chars().count())
}
