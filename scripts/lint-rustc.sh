#!/usr/bin/env bash
# The compiler of the workspace's own crates in scripts/test.sh (cargo's RUSTC_WORKSPACE_WRAPPER):
# clippy's driver, which compiles as rustc does and lints as `cargo clippy` does, every warning
# an error. The tests' build is then the lint as well; `cargo clippy` would go over every
# dependency a second time in check mode (about 5 of CI's minutes on 2 cores). Dependencies are
# compiled by rustc itself, so they are the same builds as setup's.
exec "${CLIPPY_DRIVER:-$(rustc --print sysroot)/bin/clippy-driver}" "$@" -D warnings
