//! The few CUDA runtime calls the worker makes itself (libtorch makes all the others): select a
//! device, make a stream of its own and order it after the compute stream with an event, ask a
//! stream whether its work is done, ask the device how much memory is free, turn an error code
//! into CUDA's text. They come from the libcudart that libtorch already loaded,
//! looked up at run time, so CPU-only machines build and run without CUDA.

use std::ffi::{c_char, c_void};

use libloading::os::unix::{Library, Symbol};

/// cudart's "not ready" status for `cudaStreamQuery`.
pub const CUDA_ERROR_NOT_READY: i32 = 600;

/// The functions, resolved in this process.
pub struct CudaRuntime {
    set_device: Symbol<unsafe extern "C" fn(i32) -> i32>,
    stream_query: Symbol<unsafe extern "C" fn(*mut c_void) -> i32>,
    mem_get_info: Symbol<unsafe extern "C" fn(*mut usize, *mut usize) -> i32>,
    error_string: Symbol<unsafe extern "C" fn(i32) -> *const c_char>,
    stream_create: Symbol<unsafe extern "C" fn(*mut *mut c_void, u32) -> i32>,
    stream_destroy: Symbol<unsafe extern "C" fn(*mut c_void) -> i32>,
    stream_wait_event: Symbol<unsafe extern "C" fn(*mut c_void, *mut c_void, u32) -> i32>,
    event_create: Symbol<unsafe extern "C" fn(*mut *mut c_void, u32) -> i32>,
    event_destroy: Symbol<unsafe extern "C" fn(*mut c_void) -> i32>,
    event_record: Symbol<unsafe extern "C" fn(*mut c_void, *mut c_void) -> i32>,
}

/// `cudaStreamNonBlocking`: a stream that does not wait for the legacy default stream (where
/// libtorch computes) unless told to.
const STREAM_NON_BLOCKING: u32 = 1;
/// `cudaEventDisableTiming`: an event only for ordering.
const EVENT_DISABLE_TIMING: u32 = 2;

/// A CUDA stream of the device current when it was made (a raw handle; see
/// [`CudaRuntime::destroy_stream`]).
#[derive(Debug, Clone, Copy)]
pub struct Stream(pub *mut c_void);

/// A CUDA event, for ordering one stream after another.
#[derive(Debug, Clone, Copy)]
pub struct Event(*mut c_void);

/// The function `name` of `lib`; the error says the CUDA runtime lacks it.
///
/// # Safety
/// `T` must be the function's real signature.
unsafe fn symbol<T>(lib: &Library, name: &str) -> Result<Symbol<T>, String> {
    let mut c_name = name.as_bytes().to_vec();
    c_name.push(0);
    lib.get(c_name.as_slice())
        .map_err(|e| format!("the CUDA runtime ({name}) is not available in this process: {e}"))
}

impl CudaRuntime {
    /// Resolves the functions; the error names the one missing (no CUDA runtime loaded).
    pub fn load() -> Result<CudaRuntime, String> {
        let this = Library::this();
        // SAFETY: the signatures are those of the CUDA runtime API.
        unsafe {
            Ok(CudaRuntime {
                set_device: symbol(&this, "cudaSetDevice")?,
                stream_query: symbol(&this, "cudaStreamQuery")?,
                mem_get_info: symbol(&this, "cudaMemGetInfo")?,
                error_string: symbol(&this, "cudaGetErrorString")?,
                stream_create: symbol(&this, "cudaStreamCreateWithFlags")?,
                stream_destroy: symbol(&this, "cudaStreamDestroy")?,
                stream_wait_event: symbol(&this, "cudaStreamWaitEvent")?,
                event_create: symbol(&this, "cudaEventCreateWithFlags")?,
                event_destroy: symbol(&this, "cudaEventDestroy")?,
                event_record: symbol(&this, "cudaEventRecord")?,
            })
        }
    }

    /// Makes `device` the calling thread's current device.
    pub fn set_device(&self, device: usize) -> Result<(), String> {
        // SAFETY: plain runtime call.
        match unsafe { (self.set_device)(device as i32) } {
            0 => Ok(()),
            code => Err(format!(
                "cudaSetDevice({device}) failed with CUDA error {code} ({})",
                self.error_text(code)
            )),
        }
    }

    /// Whether the work queued on the legacy default stream is done; CUDA's code and text on
    /// failure.
    pub fn default_stream_done(&self) -> Result<bool, (i32, String)> {
        self.stream_done(Stream(std::ptr::null_mut()))
    }

    /// Whether the work queued on `stream` is done; CUDA's code and text on failure.
    pub fn stream_done(&self, stream: Stream) -> Result<bool, (i32, String)> {
        // SAFETY: querying a live stream (or the legacy default one, null).
        match unsafe { (self.stream_query)(stream.0) } {
            0 => Ok(true),
            CUDA_ERROR_NOT_READY => Ok(false),
            code => Err((code, self.error_text(code))),
        }
    }

    /// A new non-blocking stream and an ordering event on the current device.
    pub fn new_stream(&self) -> Result<(Stream, Event), String> {
        let (mut stream, mut event) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: valid out-pointers; flags are CUDA's.
        let code = unsafe { (self.stream_create)(&mut stream, STREAM_NON_BLOCKING) };
        if code != 0 {
            return Err(format!(
                "cudaStreamCreateWithFlags: CUDA error {code} ({})",
                self.error_text(code)
            ));
        }
        // SAFETY: as above.
        let code = unsafe { (self.event_create)(&mut event, EVENT_DISABLE_TIMING) };
        if code != 0 {
            // SAFETY: the stream just made, unused.
            unsafe { (self.stream_destroy)(stream) };
            return Err(format!(
                "cudaEventCreateWithFlags: CUDA error {code} ({})",
                self.error_text(code)
            ));
        }
        Ok((Stream(stream), Event(event)))
    }

    /// Makes `stream`'s later work wait for everything queued so far on the legacy default
    /// stream (libtorch's computation), through `event`, without the host waiting.
    pub fn order_after_default(&self, stream: Stream, event: Event) -> Result<(), (i32, String)> {
        // SAFETY: a live event and streams of the current device.
        let code = unsafe { (self.event_record)(event.0, std::ptr::null_mut()) };
        if code != 0 {
            return Err((code, self.error_text(code)));
        }
        // SAFETY: as above.
        match unsafe { (self.stream_wait_event)(stream.0, event.0, 0) } {
            0 => Ok(()),
            code => Err((code, self.error_text(code))),
        }
    }

    /// Releases a stream and event made by [`CudaRuntime::new_stream`], once nothing uses them.
    pub fn destroy_stream(&self, stream: Stream, event: Event) {
        // SAFETY: handles from `new_stream`, destroyed once by their owner.
        unsafe {
            (self.event_destroy)(event.0);
            (self.stream_destroy)(stream.0);
        }
    }

    /// (free, total) bytes of `device`, as CUDA sees it (a MIG instance's own memory, too).
    pub fn memory(&self, device: usize) -> Result<(u64, u64), String> {
        self.set_device(device)?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-pointers.
        match unsafe { (self.mem_get_info)(&mut free, &mut total) } {
            0 => Ok((free as u64, total as u64)),
            code => Err(format!(
                "cudaMemGetInfo on cuda:{device} failed with CUDA error {code} ({})",
                self.error_text(code)
            )),
        }
    }

    /// CUDA's text for an error code.
    pub fn error_text(&self, code: i32) -> String {
        // SAFETY: cudaGetErrorString returns a static string for any code.
        let ptr = unsafe { (self.error_string)(code) };
        if ptr.is_null() {
            return String::new();
        }
        // SAFETY: a NUL-terminated static string.
        unsafe { std::ffi::CStr::from_ptr(ptr) }
            .to_string_lossy()
            .into_owned()
    }
}
