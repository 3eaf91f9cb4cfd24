//! Mixed precision (`train.bf16`) on CUDA and on the CPU: bf16 autocast entered through a guard that restores libtorch's
//! autocast state however the scope ends. `tch::autocast` restores it only on a normal return:
//! a panic inside (a caught out-of-memory, as the `micro = "auto"` probe catches) would leave
//! autocast on, its nesting above 0 and its cache of bf16 weight copies alive, so later forwards
//! would use stale bf16 weights while the optimizer updates the f32 ones. Everything here is
//! libtorch's per-thread state; the functions work without a GPU.

// libtorch's own setter for the autocast type (tch only switches autocast on, and CUDA's
// default type is f16, which needs loss scaling; bf16 does not). `DeviceType` and `ScalarType`
// are `int8_t` enums in C++.
extern "C" {
    #[link_name = "_ZN2at8autocast18set_autocast_dtypeEN3c1010DeviceTypeENS1_10ScalarTypeE"]
    fn at_autocast_set_dtype(device_type: i8, scalar_type: i8);
    #[link_name = "_ZN2at8autocast18get_autocast_dtypeEN3c1010DeviceTypeE"]
    fn at_autocast_get_dtype(device_type: i8) -> i8;
    // The per-device forms: torch-sys's `at_autocast_is_enabled` and `_set_enabled` call the
    // deprecated device-less ones, which print a warning on every call.
    #[link_name = "_ZN2at8autocast19is_autocast_enabledEN3c1010DeviceTypeE"]
    fn at_is_autocast_enabled(device_type: i8) -> bool;
    #[link_name = "_ZN2at8autocast20set_autocast_enabledEN3c1010DeviceTypeEb"]
    fn at_set_autocast_enabled(device_type: i8, enabled: bool);
}

/// c10's `DeviceType::CPU`, `DeviceType::CUDA` and `ScalarType::BFloat16`.
const DEVICE_TYPE_CPU: i8 = 0;
const DEVICE_TYPE_CUDA: i8 = 1;
const SCALAR_TYPE_BFLOAT16: i8 = 15;

/// Makes autocast on `device`'s type compute in bf16 for this process (the CPU's default
/// already, set all the same so that nothing else in the process can have changed it).
pub fn use_bf16_autocast_on(device: tch::Device) {
    let device_type = device_type(device);
    // SAFETY: plain setters of libtorch's global autocast state, with valid enum values.
    unsafe { at_autocast_set_dtype(device_type, SCALAR_TYPE_BFLOAT16) }
}

/// Whether this machine's CPU computes bf16 natively (x86's AVX512-BF16 or AMX-BF16, Arm's
/// BF16), as `/proc/cpuinfo` lists its features: where it does not, oneDNN emulates bf16 and
/// CPU autocast is usually slower than f32. `false` where the file cannot be read.
pub fn cpu_has_native_bf16() -> bool {
    std::fs::read_to_string("/proc/cpuinfo").is_ok_and(|info| lists_native_bf16(&info))
}

/// [`cpu_has_native_bf16`] on the text of `/proc/cpuinfo` (its first `flags` or `Features` line).
fn lists_native_bf16(cpuinfo: &str) -> bool {
    cpuinfo
        .lines()
        .find(|l| l.starts_with("flags") || l.starts_with("Features"))
        .and_then(|l| l.split_once(':'))
        .is_some_and(|(_, features)| {
            features
                .split_whitespace()
                .any(|f| matches!(f, "avx512_bf16" | "amx_bf16" | "bf16"))
        })
}

/// c10's device type of `device` (autocast knows the CPU and CUDA).
fn device_type(device: tch::Device) -> i8 {
    if device.is_cuda() {
        DEVICE_TYPE_CUDA
    } else {
        DEVICE_TYPE_CPU
    }
}

/// Whether autocast on `device`'s type computes in bf16 (see [`use_bf16_autocast_on`]).
pub fn bf16_autocast_is_set(device: tch::Device) -> bool {
    // SAFETY: a plain getter of libtorch's global autocast state.
    unsafe { at_autocast_get_dtype(device_type(device)) == SCALAR_TYPE_BFLOAT16 }
}

/// Whether the autocast of `device`'s type is on in this thread.
pub fn is_enabled(device: tch::Device) -> bool {
    // SAFETY: a plain getter of libtorch's thread-local autocast state.
    unsafe { at_is_autocast_enabled(device_type(device)) }
}

/// An autocast scope: entered by [`AutocastGuard::enter`], left when dropped — also while a
/// panic unwinds. Leaving the outermost scope clears the bf16 weight-copy cache, as PyTorch's
/// `torch.autocast.__exit__` does.
#[must_use = "autocast is left when the guard is dropped"]
pub struct AutocastGuard {
    /// The enabled flag before the scope; `None` when the scope changed nothing.
    previous: Option<bool>,
    /// The c10 device type whose autocast the scope set.
    device_type: i8,
}

impl AutocastGuard {
    /// Sets the autocast of `device`'s type (CUDA's or the CPU's) to `enabled` for the scope.
    /// Entering a disabled scope while autocast is off is a no-op (every f32 run).
    pub fn enter(device: tch::Device, enabled: bool) -> AutocastGuard {
        let device_type = device_type(device);
        // SAFETY: a plain getter of libtorch's thread-local autocast state.
        if !enabled && !unsafe { at_is_autocast_enabled(device_type) } {
            return AutocastGuard {
                previous: None,
                device_type,
            };
        }
        // SAFETY: libtorch's thread-local autocast state, restored in `drop`.
        let previous = unsafe {
            let previous = at_is_autocast_enabled(device_type);
            at_set_autocast_enabled(device_type, enabled);
            torch_sys::at_autocast_increment_nesting();
            previous
        };
        AutocastGuard {
            previous: Some(previous),
            device_type,
        }
    }
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        let Some(previous) = self.previous else {
            return;
        };
        // SAFETY: undoes exactly what `enter` did, in reverse order.
        unsafe {
            if torch_sys::at_autocast_decrement_nesting() == 0 {
                torch_sys::at_autocast_clear_cache();
            }
            at_set_autocast_enabled(self.device_type, previous);
        }
    }
}

/// Runs `f` with the autocast of `device`'s type (CUDA's or the CPU's) set to `enabled` (the
/// guarded replacement for `tch::autocast`).
pub fn autocast_on<T>(device: tch::Device, enabled: bool, f: impl FnOnce() -> T) -> T {
    let _scope = AutocastGuard::enter(device, enabled);
    f()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CUDA's autocast state, which libtorch keeps without a GPU too.
    const CUDA: tch::Device = tch::Device::Cuda(0);

    fn autocast<T>(enabled: bool, f: impl FnOnce() -> T) -> T {
        autocast_on(CUDA, enabled, f)
    }

    fn is_cuda_enabled() -> bool {
        is_enabled(CUDA)
    }

    /// The nesting depth, read by a balanced increment and decrement.
    fn nesting() -> i32 {
        // SAFETY: balanced calls on this thread's counter.
        unsafe {
            let depth = torch_sys::at_autocast_increment_nesting() - 1;
            torch_sys::at_autocast_decrement_nesting();
            depth
        }
    }

    #[test]
    fn the_autocast_type_can_be_set_to_bf16() {
        // The call reaches libtorch on any machine; the type only matters on CUDA.
        use_bf16_autocast_on(CUDA);
        assert!(bf16_autocast_is_set(CUDA));
    }

    #[test]
    fn a_scope_sets_and_restores_the_state() {
        assert!(!is_cuda_enabled());
        let inner = autocast(true, || (is_cuda_enabled(), nesting()));
        assert_eq!(inner, (true, 1));
        assert!(!is_cuda_enabled());
        assert_eq!(nesting(), 0);
        // Nested scopes: a disabled one inside an enabled one, then back.
        autocast(true, || {
            autocast(false, || assert!(!is_cuda_enabled()));
            assert!(is_cuda_enabled());
            assert_eq!(nesting(), 1);
        });
        assert_eq!((is_cuda_enabled(), nesting()), (false, 0));
    }

    #[test]
    fn a_panic_inside_the_scope_leaves_autocast_as_it_was() {
        let caught = std::panic::catch_unwind(|| {
            autocast(true, || -> () {
                assert!(is_cuda_enabled());
                panic!("CUDA out of memory. Tried to allocate 2.00 GiB");
            })
        });
        assert!(caught.is_err());
        assert!(
            !is_cuda_enabled(),
            "autocast stayed on after the caught panic"
        );
        assert_eq!(nesting(), 0, "the nesting counter did not return to 0");
    }

    #[test]
    fn a_cpu_scope_sets_and_restores_the_cpu_s_state_alone() {
        let cpu_enabled = || is_enabled(tch::Device::Cpu);
        use_bf16_autocast_on(tch::Device::Cpu);
        assert!(!cpu_enabled());
        let inner = autocast_on(tch::Device::Cpu, true, || {
            let x = tch::Tensor::ones([2, 2], (tch::Kind::Float, tch::Device::Cpu));
            (cpu_enabled(), is_cuda_enabled(), x.matmul(&x).kind())
        });
        assert_eq!(
            inner,
            (true, false, tch::Kind::BFloat16),
            "a CPU matmul in bf16"
        );
        assert!(!cpu_enabled());
        assert_eq!(nesting(), 0);
        autocast_on(tch::Device::Cpu, false, || assert!(!cpu_enabled()));
    }

    #[test]
    fn native_bf16_is_read_off_the_cpu_s_feature_list() {
        let x86 = |flags: &str| format!("processor\t: 0\nflags\t\t: fpu {flags} sse2\n");
        assert!(lists_native_bf16(&x86("avx512f amx_bf16 amx_tile")));
        assert!(lists_native_bf16(&x86("avx512_bf16")));
        assert!(!lists_native_bf16(&x86("avx2 fma avx512f avx512bw")));
        assert!(lists_native_bf16("Features\t: fp asimd bf16 i8mm\n"));
        assert!(!lists_native_bf16("Features\t: fp asimd\n"));
        assert!(!lists_native_bf16(""));
    }

    #[test]
    fn a_disabled_scope_changes_nothing() {
        let _scope = AutocastGuard::enter(CUDA, false);
        assert!(!is_cuda_enabled());
        assert_eq!(nesting(), 0);
    }
}
