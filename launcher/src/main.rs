//! `launch`: starts one worker per GPU (or CPU slot) with torchrun's environment and supervises
//! them as one group. Split as torchrun's elastic agent is, but smaller: `plan` (what to start),
//! `supervisor` (keep them alive, notice failure, tear down, restart), `report` and `output`
//! (what the user reads). It never links libtorch, so it starts in milliseconds.
//!
//! The hidden `--orphan-guard` first argument runs this binary as the job's orphan guard
//! instead (see [`watchdog`]).

mod accelerate;
mod adopted;
mod cgroup;
mod child;
mod cli;
mod console;
mod console_line;
mod cpus;
mod elastic;
mod event;
mod gpu;
mod hostfile;
mod logs;
mod output;
mod plan;
mod port;
mod preflight;
mod process;
mod progress;
mod rendezvous;
mod report;
mod round;
mod secret;
mod shm_sweep;
mod supervisor;
mod watchdog;

use std::fmt;
use std::io::Write as _;

use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use tracing::{info, warn, Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

use crate::cli::Cli;
use crate::plan::{Plan, PlanError};
use crate::watchdog::{Watchdog, GUARD_ARG, SWEEP_ARG};

/// Exit code for bad input (command line, config, environment), as clap uses for usage errors.
const EXIT_BAD_INPUT: i32 = 2;

fn main() {
    // One malloc arena for all threads: `launch` allocates little, and an arena of its own
    // costs each new thread 64 MiB of address space mapped and trimmed.
    // SAFETY: a malloc setting, made before any other thread exists.
    unsafe { libc::mallopt(libc::M_ARENA_MAX, 1) };
    let mut args = std::env::args_os().skip(1);
    match args.next() {
        Some(a) if a == GUARD_ARG => watchdog::guard_main(args.next().map(Into::into)),
        Some(a) if a == SWEEP_ARG => watchdog::sweep_main(args.next().map(Into::into)),
        _ => {}
    }
    run()
}

fn run() -> ! {
    let mut cli = cli::parse();
    init_logging();
    match accelerate::apply(&mut cli, &common::job_shape::process_env()) {
        Ok(applied) => {
            for notice in &applied.notices {
                info!("{notice}");
            }
            cli.accelerate_env = applied.env;
        }
        Err(e) => {
            eprintln!("launch: error: {e}");
            std::process::exit(EXIT_BAD_INPUT);
        }
    }
    std::process::exit(launch(&cli));
}

fn launch(cli: &Cli) -> i32 {
    // An inherited SIG_IGN for SIGCHLD would make the kernel reap workers (or, with a hostfile,
    // the ssh clients) behind our back.
    // SAFETY: restoring a default disposition is always sound (no handler is installed).
    unsafe {
        let _ = nix::sys::signal::signal(
            nix::sys::signal::Signal::SIGCHLD,
            nix::sys::signal::SigHandler::SigDfl,
        );
    }
    if cli.hostfile.is_some() {
        return hostfile::main(cli);
    }
    if cli.dry_run {
        return dry_run(cli);
    }
    // The orphan guard first: it watches every worker from its start (and is started before
    // the launcher becomes a subreaper, so that it is not re-parented to it).
    let watchdog = match Watchdog::start() {
        Ok(w) => w,
        Err(e) => {
            eprintln!("launch: error: cannot start the orphan guard process: {e}");
            return 1;
        }
    };
    // Workers' orphaned children are re-parented to us, not to init: we can find and reap them.
    if let Err(e) = nix::sys::prctl::set_child_subreaper(true) {
        warn!("cannot become a child subreaper ({e}): orphaned children of workers go to init");
    }
    hostfile::stop_on_stdin_eof();
    let mut plan = match Plan::from_cli(cli).and_then(|p| preflight_of(&p).map(|_| p)) {
        Ok(plan) => plan,
        Err(e) => {
            watchdog.disarm();
            return bad_input(&e);
        }
    };
    if let Err(e) = plan.resolve_port().and_then(|()| plan.prepare_logs()) {
        watchdog.disarm();
        return bad_input(&e);
    }
    if let Some(layout) = plan.layout.as_ref().filter(|l| l.streams) {
        info!(
            "logs: {}/attempt_N/<local rank>/{{stdout,stderr}}.log",
            layout.run_dir().display()
        );
    }
    for notice in &plan.notices {
        info!("{notice}");
    }
    if let Some(warning) = &plan.secret_warning {
        tracing::warn!("{warning}");
    }
    if let Some((threads, cores)) = plan.omp_threads {
        if plan.nproc > 1 {
            info!(
                "OMP_NUM_THREADS not set: using {threads} per worker ({cores} cores / {} processes)",
                plan.nproc
            );
        }
    }
    if let Some(wc) = &plan.config {
        info!("{}: {}", wc.source.display(), wc.batch.derivation());
    }
    // Only where the devices were looked up (`--num-processes auto`): a start stays fast.
    if let Some(check) = plan.gpus.is_some().then(|| plan.memory_check()).flatten() {
        for w in &check.warnings {
            warn!("{w}");
        }
        if let (Some(refusal), false) = (&check.refusal, cli.force) {
            watchdog.disarm();
            eprintln!("launch: error: {refusal}");
            return 2;
        }
    }

    let events = crossbeam_channel::unbounded();
    let mut signals = match signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP]) {
        Ok(s) => s,
        Err(e) => {
            watchdog.disarm();
            eprintln!("launch: error: cannot install signal handlers: {e}");
            return 1;
        }
    };
    let tx = events.0.clone();
    let spawned = std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            for sig in signals.forever() {
                if tx.send(supervisor::Event::Signal(sig)).is_err() {
                    break;
                }
            }
        });
    if let Err(e) = spawned {
        watchdog.disarm();
        eprintln!("launch: error: cannot start the signal thread: {e}");
        return 1;
    }
    if plan.shape.elastic.is_some() {
        elastic::run(&plan, watchdog, events)
    } else {
        supervisor::run(&plan, watchdog, events)
    }
}

/// `--dry-run`: the plan on stdout, started nothing. It is shown even when a file it needs is
/// missing; the exit code (2, with the pre-flight's line) says that it would not start.
fn dry_run(cli: &Cli) -> i32 {
    match Plan::from_cli(cli) {
        Ok(plan) => {
            // `launch --dry-run ... | head` must not panic on the closed pipe.
            let _ = std::io::stdout()
                .lock()
                .write_all(plan.describe().as_bytes());
            match preflight_of(&plan) {
                Ok(notes) => {
                    for note in notes {
                        warn!("{note}");
                    }
                    0
                }
                Err(e) => bad_input(&e),
            }
        }
        Err(e) => bad_input(&e),
    }
}

/// The pre-flight of the plan's config (data, weights, output directory), when it runs one;
/// its notes (the workers say them again when they read the data).
fn preflight_of(plan: &Plan) -> Result<Vec<String>, PlanError> {
    match &plan.config {
        Some(t) => preflight::check(&t.config).map_err(|e| PlanError::Usage(e.to_string())),
        None => Ok(Vec::new()),
    }
}

fn bad_input(e: &PlanError) -> i32 {
    let _ = writeln!(std::io::stderr().lock(), "launch: error: {e}");
    EXIT_BAD_INPUT
}

/// Launcher messages: `launch: message` / `launch: warning: message`, on stderr, so they stand
/// apart from the workers' `[rank N]` lines. `RUST_LOG` filters them.
fn init_logging() {
    // Field names are styled (ANSI escapes) only on a terminal, never into a log file or a pipe.
    let builder = tracing_subscriber::fmt()
        .with_writer(progress::ConsoleWriter::default)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .event_format(LaunchFormat);
    // Without `RUST_LOG` (or with a bad one) a plain level: cheaper to set up than a filter.
    match tracing_subscriber::EnvFilter::try_from_default_env() {
        Ok(filter) => builder.with_env_filter(filter).init(),
        Err(_) => builder.with_max_level(Level::INFO).init(),
    }
}

struct LaunchFormat;

impl<S, N> FormatEvent<S, N> for LaunchFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let level = match *event.metadata().level() {
            Level::ERROR => "error: ",
            Level::WARN => "warning: ",
            _ => "",
        };
        write!(writer, "launch: {level}")?;
        ctx.field_format().format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
}
