//! The one libtorch link setup. It finds the torch wheel through the venv's python and:
//! - adds its torch, NCCL and CUDA-runtime folders as link search paths and links NCCL and the
//!   CUDA runtime from them — the very copies libtorch_cuda loads (these propagate to every
//!   binary that links this crate);
//! - keeps libtorch_cuda linked although no symbol of it is referenced (otherwise CUDA is not
//!   registered at run time) and adds rpaths to those folders, so binaries run without
//!   LD_LIBRARY_PATH. Cargo applies such linker arguments only to this package's own tests, so
//!   they also go out as `link_args` metadata, which a dependent binary's build script
//!   (the root build.rs) passes on.
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed=PYTHON_SYS_EXECUTABLE");
    let python = std::env::var("PYTHON_SYS_EXECUTABLE").unwrap_or_else(|_| "python3".to_string());
    let out = Command::new(&python)
        .arg("-c")
        .arg("import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))")
        .output();
    let site = match out {
        Ok(o) if o.status.success() => PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()),
        _ => panic!(
            "{python} cannot import torch, which is needed to locate libtorch; \
             run scripts/setup.sh to create .venv and put .venv/bin first on PATH"
        ),
    };
    let mut link_args = vec![];
    for dir in ["torch/lib", "nvidia/nccl/lib", "nvidia/cu13/lib"] {
        let d = site.join(dir);
        println!("cargo::rustc-link-search=native={}", d.display());
        link_args.push(format!("-Wl,-rpath,{}", d.display()));
    }
    link_args.extend(["-Wl,--no-as-needed", "-ltorch_cuda", "-Wl,--as-needed"].map(String::from));
    for arg in &link_args {
        println!("cargo::rustc-link-arg={arg}");
    }
    println!("cargo::metadata=link_args={}", link_args.join("\t"));
    println!("cargo::rustc-link-lib=dylib:+verbatim=libnccl.so.2");
    println!("cargo::rustc-link-lib=dylib:+verbatim=libcudart.so.13");
    // The runtime compiler of our kernels (quant/fused.rs, gpu/plane_split.rs), from the same
    // wheel folder.
    println!("cargo::rustc-link-lib=dylib:+verbatim=libnvrtc.so.13");
}
