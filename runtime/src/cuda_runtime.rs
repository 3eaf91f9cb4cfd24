//! The few CUDA runtime calls the worker makes itself (libtorch makes all the others): select a
//! device, ask a stream whether its work is done, ask the device how much memory is free, turn
//! an error code into CUDA's text. They come from the libcudart that libtorch already loaded,
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
}

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
        // SAFETY: querying the legacy default stream (null).
        match unsafe { (self.stream_query)(std::ptr::null_mut()) } {
            0 => Ok(true),
            CUDA_ERROR_NOT_READY => Ok(false),
            code => Err((code, self.error_text(code))),
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
