//! Makes the `worker` binary (and the worker's tests) run without LD_LIBRARY_PATH: embeds an
//! rpath to the libtorch it was built against (and to the NCCL next to it), and links `torch_cuda` with `--no-as-needed` when
//! that libtorch has it — otherwise the linker drops the unused-looking library and CUDA is
//! silently unavailable at run time. The runtime's build script runs it too, as a module.

use std::path::PathBuf;

pub fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    let Some(lib_dir) = std::env::var_os("DEP_TCH_LIBTORCH_LIB").map(PathBuf::from) else {
        // torch-sys did not report a lib dir (e.g. a doc-only build): nothing to embed.
        return;
    };
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() != Ok("linux") {
        return;
    }
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib_dir.display());
    // The nccl backend loads libnccl.so at run time (scripts/setup.sh links it next to the
    // wheel's libnccl.so.2): let the loader find it through our rpath too.
    let nccl_dir = lib_dir.join("../../nvidia/nccl/lib");
    if nccl_dir.is_dir() {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", nccl_dir.display());
    }
    if lib_dir.join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-ltorch_cuda");
        println!("cargo:rustc-link-arg=-Wl,--as-needed");
    }
}
