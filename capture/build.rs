//! Link setup for the capture crate's own tests and examples (dependents emit their own):
//! keep libtorch_cuda linked (or CUDA is not registered at run time), link NCCL from the
//! nvidia-nccl-cu13 wheel — the very copy libtorch_cuda loads — and CUDA's runtime from the
//! wheel, and add rpaths to those folders so binaries run without LD_LIBRARY_PATH.
use std::path::PathBuf;
use std::process::Command;

fn python() -> String {
    std::env::var("PYTHON_SYS_EXECUTABLE").unwrap_or_else(|_| "python3".to_string())
}

fn ask(code: &str) -> Option<PathBuf> {
    let out = Command::new(python()).arg("-c").arg(code).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8(out.stdout).ok()?;
    Some(PathBuf::from(s.trim()))
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=PYTHON_SYS_EXECUTABLE");
    let site = ask("import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))")
        .expect("python with torch (the repository's .venv) is needed to locate libtorch; run scripts/setup.sh");
    let torch_lib = site.join("torch/lib");
    let nccl_lib = site.join("nvidia/nccl/lib");
    let cuda_lib = site.join("nvidia/cu13/lib");
    for dir in [&torch_lib, &nccl_lib, &cuda_lib] {
        println!("cargo:rustc-link-search=native={}", dir.display());
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.display());
    }
    println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
    println!("cargo:rustc-link-arg=-ltorch_cuda");
    println!("cargo:rustc-link-arg=-Wl,--as-needed");
    println!("cargo:rustc-link-lib=dylib:+verbatim=libnccl.so.2");
    println!("cargo:rustc-link-lib=dylib:+verbatim=libcudart.so.13");
}
