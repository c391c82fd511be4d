//! With the `capture` feature, the `hslake-gpu` binary links libtorch: capture/build.rs finds
//! it and hands over the linker arguments a binary needs (rpaths, libtorch_cuda kept linked),
//! which cargo applies only to the package whose build script emits them; this passes them on
//! to hslake-gpu alone, since `hslake` must not load libtorch at all.
fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed=DEP_HSLAKE_TORCH_LINK_ARGS");
    if let Ok(args) = std::env::var("DEP_HSLAKE_TORCH_LINK_ARGS") {
        for arg in args.split('\t').filter(|a| !a.is_empty()) {
            println!("cargo::rustc-link-arg-bin=hslake-gpu={arg}");
            // A test that calls the capture crate itself (tests/cli_prepare.rs reads prepare's
            // output with capture's reader) links libtorch too and must find it; the rpaths
            // alone change nothing for the tests that do not.
            if arg.starts_with("-Wl,-rpath,") {
                println!("cargo::rustc-link-arg-tests={arg}");
            }
        }
    }
}
