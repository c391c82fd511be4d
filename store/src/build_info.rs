//! Which build this is: the profile and optimisation level of the store's hot path, so that a
//! benchmark run on an unoptimised build can say so instead of reporting misleading figures.

/// The Cargo profile the store was built in (`debug` for dev and profiles inheriting it,
/// `release` otherwise).
pub const PROFILE: &str = env!("HSLAKE_BUILD_PROFILE");
/// The store's `opt-level` (`0`..`3`, `s` or `z`), per-package overrides included.
pub const OPT_LEVEL: &str = env!("HSLAKE_BUILD_OPT_LEVEL");
/// Whether debug assertions are compiled into the store.
pub const DEBUG_ASSERTIONS: bool = cfg!(debug_assertions);

/// Whether the store's code is optimised enough for its benchmark figures to mean anything.
pub const fn optimized() -> bool {
    is_optimized_level(OPT_LEVEL)
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

// opt-level 0 and 1 leave the decode loops unvectorised and unlined; 2, 3, s and z do not.
const fn is_optimized_level(level: &str) -> bool {
    !matches!(level.as_bytes(), b"0" | b"1")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opt_levels_zero_and_one_are_unoptimized() {
        assert!(!is_optimized_level("0"));
        assert!(!is_optimized_level("1"));
        for level in ["2", "3", "s", "z"] {
            assert!(is_optimized_level(level), "{level}");
        }
    }

    #[test]
    fn warning_exactly_when_unoptimized() {
        assert_eq!(benchmark_warning().is_some(), !optimized());
        assert!(describe().contains(OPT_LEVEL));
    }
}
