//! Which build this is: the profile and optimisation level of the store's hot path, so that a
//! benchmark run on an unoptimised build can say so instead of reporting misleading figures.
use hslake_schemas::CrateBuild;

/// How the store was compiled (`schemas/build.rs` records it).
pub const BUILD: CrateBuild = hslake_schemas::crate_build!();
/// The Cargo profile the store was built in (`debug` for dev and profiles inheriting it,
/// `release` otherwise).
pub const PROFILE: &str = BUILD.profile;
/// The store's `opt-level` (`0`..`3`, `s` or `z`), per-package overrides included.
pub const OPT_LEVEL: &str = BUILD.opt_level;
/// Whether debug assertions are compiled into the store.
pub const DEBUG_ASSERTIONS: bool = BUILD.debug_assertions;

/// Whether the store's code is optimised enough for its benchmark figures to mean anything.
pub const fn optimized() -> bool {
    BUILD.optimized()
}

/// One line for `--version` and benchmark headers, e.g. `profile debug, opt-level 3`.
pub fn describe() -> String {
    format!(
        "profile {PROFILE}, opt-level {OPT_LEVEL}{}",
        if DEBUG_ASSERTIONS {
            ", debug assertions"
        } else {
            ""
        }
    )
}

/// The warning a benchmark prints first when [`optimized`] is false; `None` otherwise.
pub fn benchmark_warning() -> Option<String> {
    (!optimized()).then(|| {
        format!(
            "UNOPTIMISED BUILD ({}): figures are many times slower than an optimised build \
             and must not be reported; build with scripts/setup.sh (hot crates at opt-level 3) \
             or --release",
            describe()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warning_exactly_when_unoptimized() {
        assert_eq!(benchmark_warning().is_some(), !optimized());
        assert!(describe().contains(OPT_LEVEL));
        assert_eq!(BUILD.name, "hslake-store");
    }
}
