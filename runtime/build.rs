//! The runtime's build script: compiles the C++ shims `csrc/grad_hooks.cpp` (gradient-ready
//! hooks for `ddp::overlap`), `csrc/fused_adamw.cpp` (multi-tensor AdamW for `optim`) and
//! `csrc/param_storage.cpp` (ZeRO stage 3's parameter storage, `ddp::gate`) against the libtorch
//! that `tch` links, and embeds the same rpath
//! as the worker's (`../worker/build.rs`, run here as a module) so that this crate's tests find
//! libtorch without LD_LIBRARY_PATH.
//!
//! Libtorch is found as torch-sys finds it: `LIBTORCH_INCLUDE`, else `LIBTORCH` (which
//! `scripts/setup.sh` puts in `.cargo/config.toml` for every cargo command), else the parent
//! of the lib directory torch-sys reports; the C++ ABI follows `LIBTORCH_CXX11_ABI` (default 1,
//! torch-sys's default and how the PyTorch wheels are built).

use std::path::PathBuf;

#[path = "../worker/build.rs"]
mod libtorch_rpath;

const SHIMS: [&str; 3] = [
    "csrc/grad_hooks.cpp",
    "csrc/fused_adamw.cpp",
    "csrc/param_storage.cpp",
];
const HEADERS: [&str; 1] = ["csrc/shim_error.h"];

fn main() {
    libtorch_rpath::main();
    for file in SHIMS.iter().chain(&HEADERS) {
        println!("cargo:rerun-if-changed={file}");
    }
    let root = libtorch_root();
    let include = root.join("include");
    let hook_header = include.join("torch/csrc/autograd/function_hook.h");
    if !hook_header.is_file() {
        panic!(
            "{} is missing: libtorch at {} has no C++ headers (the PyTorch wheel's torch/ has them; \
             run `. scripts/setup.sh`), or it predates PyTorch 2.1's post-accumulate-grad hooks",
            hook_header.display(),
            root.display()
        );
    }
    let abi = env("LIBTORCH_CXX11_ABI").unwrap_or_else(|| "1".to_string());
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        // Also in tests (whose profile builds this crate at -O0): the hook runs once per
        // parameter per backward pass.
        .opt_level(2)
        // Libtorch's headers as system headers: warnings from our file only.
        .flag("-isystem")
        .flag(include.display().to_string())
        .flag("-isystem")
        .flag(include.join("torch/csrc/api/include").display().to_string())
        .define("_GLIBCXX_USE_CXX11_ABI", abi.as_str())
        .define("GLOG_USE_GLOG_EXPORT", None)
        .files(SHIMS)
        .compile("gptrec_shims");
}

/// The libtorch directory that holds `include/` (see the module comment).
fn libtorch_root() -> PathBuf {
    if let Some(dir) = env("LIBTORCH_INCLUDE").or_else(|| env("LIBTORCH")) {
        return PathBuf::from(dir);
    }
    // torch-sys found libtorch another way (LIBTORCH_USE_PYTORCH): include/ is beside lib/.
    if let Some(lib) = env("DEP_TCH_LIBTORCH_LIB") {
        if let Some(root) = PathBuf::from(lib).parent() {
            return root.to_path_buf();
        }
    }
    panic!(
        "LIBTORCH is not set: the runtime compiles a C++ shim against libtorch's headers. Run \
         `. scripts/setup.sh` once (it installs PyTorch and writes .cargo/config.toml, which sets \
         LIBTORCH for cargo), or export LIBTORCH=<the PyTorch wheel's torch/ directory>"
    );
}

/// A non-empty environment variable, watched for changes.
fn env(name: &str) -> Option<String> {
    println!("cargo:rerun-if-env-changed={name}");
    std::env::var(name).ok().filter(|v| !v.is_empty())
}
