//! Records the optimisation level this crate is compiled at, so that binaries and the Python
//! module can say whether they are the build that benchmarks describe (see `build_info.rs`).
fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    // Cargo hands a build script the opt-level and profile of the crate it builds, per-package
    // overrides in [profile.*.package] included.
    for var in ["OPT_LEVEL", "PROFILE"] {
        let value = std::env::var(var).unwrap_or_else(|_| "unknown".into());
        println!("cargo::rustc-env=HSLAKE_BUILD_{var}={value}");
    }
}
