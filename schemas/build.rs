//! Records the profile and optimisation level the crate is compiled at, for its
//! `hslake_schemas::crate_build!()` (schemas/src/build_info.rs). One script for every crate on
//! the read and write path: store, loader and prepare name it with `build = "../schemas/build.rs"`.
fn main() {
    // Cargo hands a build script the opt-level and profile of the crate it builds, per-package
    // overrides in [profile.*.package] included; a change of either makes a new build of the
    // crate, which runs this again.
    for var in ["OPT_LEVEL", "PROFILE"] {
        println!("cargo::rerun-if-env-changed={var}");
        let value = std::env::var(var).unwrap_or_else(|_| "unknown".into());
        println!("cargo::rustc-env=HSLAKE_BUILD_{var}={value}");
    }
}
