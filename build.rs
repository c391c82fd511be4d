//! Link setup for the hslake binaries and end-to-end tests (hslake-capture pulls in libtorch):
//! keep libtorch_cuda linked even though no symbol of it is referenced (otherwise CUDA is
//! not registered at run time), and add rpaths to the venv's torch, NCCL and CUDA runtime
//! folders so `target/debug/hslake` runs without LD_LIBRARY_PATH.
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=PYTHON_SYS_EXECUTABLE");
    let python = std::env::var("PYTHON_SYS_EXECUTABLE").unwrap_or_else(|_| "python3".to_string());
    let out = Command::new(&python)
        .arg("-c")
        .arg("import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))")
        .output();
    let site = match out {
        Ok(o) if o.status.success() => PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()),
        _ => panic!("{python} cannot import torch; run scripts/setup.sh to create .venv"),
    };
    for dir in ["torch/lib", "nvidia/nccl/lib", "nvidia/cu13/lib"] {
        let d = site.join(dir);
        println!("cargo:rustc-link-search=native={}", d.display());
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", d.display());
    }
    println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
    println!("cargo:rustc-link-arg=-ltorch_cuda");
    println!("cargo:rustc-link-arg=-Wl,--as-needed");
}
