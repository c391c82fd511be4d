//! How a crate on the read and write path was compiled, so that binaries, the Python module and
//! the tests can tell an optimised build from one whose figures mean nothing: each such crate
//! records its profile and opt-level with the build script `schemas/build.rs` and exposes a
//! [`CrateBuild`] made by [`crate_build!`].

/// How one crate was compiled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CrateBuild {
    /// The package name, e.g. `hslake-store`.
    pub name: &'static str,
    /// The Cargo profile (`debug` for dev and profiles inheriting it, `release` otherwise).
    pub profile: &'static str,
    /// Its `opt-level` (`0`..`3`, `s` or `z`), per-package overrides included.
    pub opt_level: &'static str,
    /// Whether debug assertions are compiled in.
    pub debug_assertions: bool,
}

impl CrateBuild {
    /// Whether it is optimised enough for benchmark figures to mean anything: opt-level 0 and 1
    /// leave the encode and decode loops unvectorised and their helpers not inlined.
    pub const fn optimized(&self) -> bool {
        !matches!(self.opt_level.as_bytes(), b"0" | b"1")
    }
}

/// The [`CrateBuild`] of the crate this is expanded in, which must run `schemas/build.rs` as its
/// build script (`build = "../schemas/build.rs"` in its Cargo.toml). A macro because `env!` and
/// `cfg!` must be read where the crate itself is compiled.
#[macro_export]
macro_rules! crate_build {
    () => {
        $crate::CrateBuild {
            name: env!("CARGO_PKG_NAME"),
            profile: env!("HSLAKE_BUILD_PROFILE"),
            opt_level: env!("HSLAKE_BUILD_OPT_LEVEL"),
            debug_assertions: cfg!(debug_assertions),
        }
    };
}

/// How this crate was compiled.
pub const BUILD: CrateBuild = crate_build!();

#[cfg(test)]
mod tests {
    use super::*;

    fn at(opt_level: &'static str) -> CrateBuild {
        CrateBuild { opt_level, ..BUILD }
    }

    #[test]
    fn opt_levels_zero_and_one_are_unoptimized() {
        assert!(!at("0").optimized());
        assert!(!at("1").optimized());
        for level in ["2", "3", "s", "z"] {
            assert!(at(level).optimized(), "{level}");
        }
    }

    #[test]
    fn records_its_own_package_and_build() {
        assert_eq!(BUILD.name, "hslake-schemas");
        assert_eq!(BUILD.debug_assertions, cfg!(debug_assertions));
        assert!(!BUILD.opt_level.is_empty() && BUILD.opt_level != "unknown");
    }
}
