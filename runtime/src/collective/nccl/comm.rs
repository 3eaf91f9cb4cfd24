//! One NCCL communicator's life, as NCCL's fault-tolerance model wants it: created
//! non-blocking (`blocking = 0`), so no NCCL call holds the calling thread; every operation then
//! polled (`ncclCommGetAsyncError`, and the stream for completion) up to a deadline; aborted at
//! most once, by its single owner, when an operation fails or misses its deadline; torn down
//! (finalize, destroy) with a deadline, aborting when it passes. There is no watchdog thread:
//! nothing else can touch the communicator, so no lock is needed to keep the abort single —
//! `&mut self` is the lock. (The real abort runs on a helper thread with a time limit while the
//! owner waits for it: `ncclCommAbort` joins NCCL's threads and can itself hang.)
//!
//! The NCCL and CUDA calls sit behind [`NcclApi`] so that tests stand in a fake; this module knows
//! nothing about tensors (the backend in `super` does).

use std::time::{Duration, Instant};

use cudarc::nccl::sys::ncclResult_t as Status;

/// One collective to launch, with device pointers already resolved.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Call {
    AllReduce {
        buf: *mut std::ffi::c_void,
        count: usize,
        dtype: cudarc::nccl::sys::ncclDataType_t,
        op: cudarc::nccl::sys::ncclRedOp_t,
    },
    Broadcast {
        buf: *mut std::ffi::c_void,
        bytes: usize,
        root: i32,
    },
    AllGather {
        send: *const std::ffi::c_void,
        recv: *mut std::ffi::c_void,
        bytes: usize,
    },
}

/// The NCCL (and CUDA stream) calls one communicator needs.
pub(crate) trait NcclApi {
    /// Enqueues `call` (non-blocking: `ncclInProgress` means "not yet enqueued, poll").
    fn launch(&mut self, call: &Call) -> Status;
    /// `ncclCommGetAsyncError`: `ncclInProgress` while an init, launch or finalize is pending.
    fn async_state(&mut self) -> Status;
    /// Whether the enqueued work has finished on the stream; on failure CUDA's code and text.
    fn stream_done(&mut self) -> Result<bool, (i32, String)>;
    /// `ncclCommFinalize` (non-blocking: poll [`NcclApi::async_state`] afterwards).
    fn finalize(&mut self) -> Status;
    /// `ncclCommDestroy`, after a finalize that completed.
    fn destroy(&mut self);
    /// `ncclCommAbort`: frees the communicator whatever it is doing. Called at most once.
    fn abort(&mut self);
    /// NCCL's own text for the last error (names the cause: a duplicate GPU, a small /dev/shm).
    fn last_error(&self) -> String;
}

/// Why an operation on the communicator failed. The communicator is aborted before this is
/// returned (except for [`CommFailure::Aborted`], which says it already was).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum CommFailure {
    /// The deadline passed with the operation still pending.
    Timeout,
    /// NCCL returned or reported an error: the code's name and NCCL's last-error text.
    Nccl { code: Status, text: String },
    /// The CUDA stream reported an error while the operation ran.
    Cuda { code: i32, text: String },
    /// An earlier failure aborted the communicator; it must not be used again.
    Aborted,
}

impl std::fmt::Display for CommFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let with_text = |f: &mut std::fmt::Formatter<'_>, head: String, text: &str| {
            if text.trim().is_empty() {
                write!(f, "{head}")
            } else {
                write!(f, "{head}: {}", text.trim())
            }
        };
        match self {
            CommFailure::Timeout => write!(f, "timed out"),
            CommFailure::Nccl { code, text } => with_text(f, format!("NCCL error {code:?}"), text),
            CommFailure::Cuda { code, text } => {
                with_text(f, format!("CUDA error {code} while waiting for NCCL"), text)
            }
            CommFailure::Aborted => {
                write!(
                    f,
                    "the NCCL communicator was aborted after an earlier failure"
                )
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Life {
    Live,
    Aborted,
    Closed,
}

/// Polling that answers fast when the operation is fast: yields for the first millisecond (a
/// small all-reduce finishes in microseconds), then sleeps `sleep` between looks.
struct Backoff {
    spin_until: Instant,
    sleep: Duration,
}

impl Backoff {
    fn new(sleep: Duration) -> Backoff {
        Backoff {
            spin_until: Instant::now() + Duration::from_millis(1),
            sleep,
        }
    }

    fn pause(&mut self) {
        if Instant::now() < self.spin_until {
            std::thread::yield_now();
        } else {
            std::thread::sleep(self.sleep);
        }
    }
}

/// Teardown gets this long before the communicator is aborted instead.
pub(crate) const TEARDOWN: Duration = Duration::from_secs(10);

/// A communicator and where it is in its life. Dropping it tears it down (see [`TEARDOWN`]).
pub(crate) struct Communicator<A: NcclApi> {
    api: A,
    life: Life,
}

impl<A: NcclApi> Communicator<A> {
    /// Waits until a communicator created non-blocking is ready, up to `deadline`.
    pub(crate) fn init(api: A, deadline: Instant) -> Result<Communicator<A>, CommFailure> {
        let mut comm = Communicator {
            api,
            life: Life::Live,
        };
        comm.settle(deadline)?;
        Ok(comm)
    }

    /// Whether the communicator can still be used.
    pub(crate) fn is_live(&self) -> bool {
        self.life == Life::Live
    }

    /// Launches `call` and waits for it to finish on the stream, up to `deadline`.
    pub(crate) fn run(&mut self, call: &Call, deadline: Instant) -> Result<(), CommFailure> {
        if !self.is_live() {
            return Err(CommFailure::Aborted);
        }
        match self.api.launch(call) {
            Status::ncclSuccess => {}
            Status::ncclInProgress => self.settle(deadline)?,
            code => return Err(self.fail_nccl(code)),
        }
        let mut wait = Backoff::new(Duration::from_micros(50));
        loop {
            match self.api.stream_done() {
                // One last look: an error NCCL raised while the kernels finished still counts.
                Ok(true) => {
                    return match self.api.async_state() {
                        Status::ncclSuccess | Status::ncclInProgress => Ok(()),
                        code => Err(self.fail_nccl(code)),
                    }
                }
                Ok(false) => {}
                Err((code, text)) => {
                    self.abort_once();
                    return Err(CommFailure::Cuda { code, text });
                }
            }
            match self.api.async_state() {
                Status::ncclSuccess | Status::ncclInProgress => {}
                code => return Err(self.fail_nccl(code)),
            }
            if Instant::now() >= deadline {
                self.abort_once();
                return Err(CommFailure::Timeout);
            }
            wait.pause();
        }
    }

    /// Polls the asynchronous state until it leaves `ncclInProgress`.
    fn settle(&mut self, deadline: Instant) -> Result<(), CommFailure> {
        let mut wait = Backoff::new(Duration::from_micros(200));
        loop {
            match self.api.async_state() {
                Status::ncclSuccess => return Ok(()),
                Status::ncclInProgress => {}
                code => return Err(self.fail_nccl(code)),
            }
            if Instant::now() >= deadline {
                self.abort_once();
                return Err(CommFailure::Timeout);
            }
            wait.pause();
        }
    }

    /// NCCL's text is read before the abort (which may clear what it describes).
    fn fail_nccl(&mut self, code: Status) -> CommFailure {
        let text = self.api.last_error();
        self.abort_once();
        CommFailure::Nccl { code, text }
    }

    fn abort_once(&mut self) {
        if self.life == Life::Live {
            self.life = Life::Aborted;
            self.api.abort();
        }
    }

    /// Finalizes and destroys the communicator; aborts it when that fails or outlives
    /// `deadline` (work still pending because a peer is gone must not hold the process).
    pub(crate) fn close(&mut self, deadline: Instant) {
        if self.life != Life::Live {
            return;
        }
        let finalized = match self.api.finalize() {
            Status::ncclSuccess => true,
            Status::ncclInProgress => self.settle(deadline).is_ok(),
            _ => false,
        };
        if finalized {
            self.life = Life::Closed;
            self.api.destroy();
        } else {
            self.abort_once();
        }
    }
}

impl<A: NcclApi> Drop for Communicator<A> {
    fn drop(&mut self) {
        self.close(Instant::now() + TEARDOWN);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// What the fake was asked to do, shared with the test after the communicator is gone.
    #[derive(Debug, Default)]
    struct Log {
        launches: usize,
        aborts: usize,
        finalizes: usize,
        destroys: usize,
        /// Any call after the abort: undefined behaviour on a real communicator.
        used_after_abort: usize,
    }

    /// A communicator whose init, launches and stream behave as scripted.
    struct Fake {
        log: Arc<Mutex<Log>>,
        /// async_state answers: ncclInProgress this many times, then `settled`.
        pending: usize,
        settled: Status,
        launch: Status,
        /// The stream finishes after this many polls (`None`: never, a peer is gone).
        stream_after: Option<usize>,
        stream_error: Option<i32>,
        finalize: Status,
    }

    impl Fake {
        fn new(log: &Arc<Mutex<Log>>) -> Fake {
            Fake {
                log: Arc::clone(log),
                pending: 2,
                settled: Status::ncclSuccess,
                launch: Status::ncclSuccess,
                stream_after: Some(3),
                stream_error: None,
                finalize: Status::ncclSuccess,
            }
        }

        fn touch(&self) {
            let mut log = self.log.lock().unwrap();
            if log.aborts > 0 {
                log.used_after_abort += 1;
            }
        }
    }

    impl NcclApi for Fake {
        fn launch(&mut self, _call: &Call) -> Status {
            self.touch();
            self.log.lock().unwrap().launches += 1;
            self.launch
        }
        fn async_state(&mut self) -> Status {
            self.touch();
            if self.pending > 0 {
                self.pending -= 1;
                return Status::ncclInProgress;
            }
            self.settled
        }
        fn stream_done(&mut self) -> Result<bool, (i32, String)> {
            self.touch();
            if let Some(code) = self.stream_error {
                return Err((code, "an illegal memory access was encountered".into()));
            }
            match &mut self.stream_after {
                None => Ok(false),
                Some(0) => Ok(true),
                Some(n) => {
                    *n -= 1;
                    Ok(false)
                }
            }
        }
        fn finalize(&mut self) -> Status {
            self.touch();
            self.log.lock().unwrap().finalizes += 1;
            self.finalize
        }
        fn destroy(&mut self) {
            self.touch();
            self.log.lock().unwrap().destroys += 1;
        }
        fn abort(&mut self) {
            self.touch();
            self.log.lock().unwrap().aborts += 1;
        }
        fn last_error(&self) -> String {
            "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 0".into()
        }
    }

    const CALL: Call = Call::Broadcast {
        buf: std::ptr::null_mut(),
        bytes: 4,
        root: 0,
    };

    fn soon() -> Instant {
        Instant::now() + Duration::from_millis(100)
    }

    #[test]
    fn a_healthy_communicator_runs_and_is_finalized_then_destroyed() {
        let log = Arc::new(Mutex::new(Log::default()));
        let mut fake = Fake::new(&log);
        fake.launch = Status::ncclInProgress;
        let mut comm = Communicator::init(fake, soon()).unwrap();
        comm.run(&CALL, soon()).unwrap();
        drop(comm);
        let log = log.lock().unwrap();
        assert_eq!(
            (log.launches, log.aborts, log.finalizes, log.destroys),
            (1, 0, 1, 1)
        );
    }

    #[test]
    fn a_timeout_aborts_exactly_once_and_the_wreck_is_never_touched_again() {
        let log = Arc::new(Mutex::new(Log::default()));
        let mut fake = Fake::new(&log);
        fake.stream_after = None; // the peer never sends
        let mut comm = Communicator::init(fake, soon()).unwrap();
        let started = Instant::now();
        assert_eq!(comm.run(&CALL, soon()), Err(CommFailure::Timeout));
        assert!(started.elapsed() < Duration::from_secs(2), "{started:?}");
        // A second operation (e.g. the trainer's next step) is refused without touching NCCL.
        assert_eq!(comm.run(&CALL, soon()), Err(CommFailure::Aborted));
        assert!(!comm.is_live());
        drop(comm);
        let log = log.lock().unwrap();
        assert_eq!(log.aborts, 1, "{log:?}");
        assert_eq!((log.finalizes, log.destroys), (0, 0), "{log:?}");
        assert_eq!(log.used_after_abort, 0, "{log:?}");
    }

    #[test]
    fn an_init_that_never_completes_times_out_with_one_abort() {
        let log = Arc::new(Mutex::new(Log::default()));
        let mut fake = Fake::new(&log);
        fake.pending = usize::MAX; // a rank never joins
        assert_eq!(
            Communicator::init(fake, soon()).err(),
            Some(CommFailure::Timeout)
        );
        let log = log.lock().unwrap();
        assert_eq!((log.aborts, log.destroys, log.used_after_abort), (1, 0, 0));
    }

    #[test]
    fn nccl_errors_carry_nccls_own_text_and_abort_once() {
        let log = Arc::new(Mutex::new(Log::default()));
        let mut fake = Fake::new(&log);
        fake.settled = Status::ncclInvalidUsage;
        let failure = Communicator::init(fake, soon()).err().unwrap();
        let text = failure.to_string();
        assert!(text.contains("ncclInvalidUsage"), "{text}");
        assert!(text.contains("Duplicate GPU detected"), "{text}");
        assert_eq!(log.lock().unwrap().aborts, 1);

        assert_call_fails_with(
            Status::ncclSystemError,
            |fake| fake.launch = Status::ncclSystemError,
            |_| {},
        );
    }

    #[test]
    fn an_error_raised_as_the_kernels_finish_still_fails_the_operation() {
        assert_call_fails_with(
            Status::ncclRemoteError,
            |fake| fake.pending = 0,
            |api| api.settled = Status::ncclRemoteError,
        );
    }

    /// One call on a communicator whose fake `before` prepared (before init) and `after`
    /// changed (after init) fails with NCCL's `code`, and the communicator is aborted once.
    fn assert_call_fails_with(
        code: Status,
        before: impl FnOnce(&mut Fake),
        after: impl FnOnce(&mut Fake),
    ) {
        let log = Arc::new(Mutex::new(Log::default()));
        let mut fake = Fake::new(&log);
        before(&mut fake);
        let mut comm = Communicator::init(fake, soon()).unwrap();
        after(&mut comm.api);
        let failure = comm.run(&CALL, soon()).unwrap_err();
        assert!(
            matches!(failure, CommFailure::Nccl { code: got, .. } if got == code),
            "{failure}"
        );
        drop(comm);
        assert_eq!(log.lock().unwrap().aborts, 1);
    }

    #[test]
    fn a_stream_error_aborts_once() {
        let log = Arc::new(Mutex::new(Log::default()));
        let mut fake = Fake::new(&log);
        fake.stream_error = Some(700);
        let mut comm = Communicator::init(fake, soon()).unwrap();
        let failure = comm.run(&CALL, soon()).unwrap_err();
        assert!(failure.to_string().contains("CUDA error 700"), "{failure}");
        assert!(
            failure.to_string().contains("illegal memory access"),
            "{failure}"
        );
        drop(comm);
        let log = log.lock().unwrap();
        assert_eq!((log.aborts, log.destroys, log.used_after_abort), (1, 0, 0));
    }

    #[test]
    fn a_teardown_that_hangs_is_aborted_at_its_deadline() {
        let log = Arc::new(Mutex::new(Log::default()));
        let fake = Fake::new(&log);
        let mut comm = Communicator::init(fake, soon()).unwrap();
        // Pending work that never finishes: finalize stays in progress.
        comm.api.finalize = Status::ncclInProgress;
        comm.api.pending = usize::MAX;
        let started = Instant::now();
        comm.close(soon());
        assert!(started.elapsed() < Duration::from_secs(2));
        drop(comm); // already closed by abort: nothing more
        let log = log.lock().unwrap();
        assert_eq!((log.finalizes, log.aborts, log.destroys), (1, 1, 0));
        assert_eq!(log.used_after_abort, 0);
    }
}
