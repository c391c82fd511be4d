#!/usr/bin/env bash
# Checks formatting and lints, sets up (scripts/setup.sh) and runs every test: Rust unit and
# end-to-end tests, then the Python interoperability tests, all against a real S3-compatible
# server on 127.0.0.1 (moto), and the S3-backed ones a second time against SeaweedFS. Needs
# rustfmt and clippy (rustup components: clippy-driver) and what setup needs.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# Idle OpenMP threads sleep instead of spinning, for the tests too (why: scripts/setup.sh).
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
# From a fresh clone (CI) every crate builds once, where incremental caches (gigabytes under
# target/) only cost time. Set CARGO_INCREMENTAL=1 to keep them while iterating.
export CARGO_INCREMENTAL=${CARGO_INCREMENTAL:-0}
# Formatting first: it needs no build and fails in seconds.
cargo fmt --all --check
# Lints while building, so that a lint fails the run in minutes: scripts/lint-rustc.sh compiles
# the workspace's own crates with clippy's driver, every warning an error (what `cargo clippy
# --workspace --all-targets -- -D warnings` checks, without its second pass over every
# dependency in check mode). Set before setup, whose build is then linted too.
CLIPPY_DRIVER="$(rustc --print sysroot)/bin/clippy-driver"
export CLIPPY_DRIVER RUSTC_WORKSPACE_WRAPPER="$ROOT/scripts/lint-rustc.sh"
bash scripts/setup.sh
export PATH="$ROOT/.venv/bin:$PATH"
# The tests run the build that setup installs (.cargo/install.toml: no debug assertions or
# overflow checks in the crates of the read and write path), so they test what users run and
# compile the workspace once; a plain `cargo test` keeps those checks on. The test targets
# (benches too, which are only built) before any test runs.
CARGO=(cargo --config .cargo/install.toml)
"${CARGO[@]}" build --workspace --all-targets

# A real S3 endpoint on loopback for the object-storage tests.
source scripts/s3_server.sh
start_s3_server
trap stop_s3_server EXIT

"${CARGO[@]}" test --workspace

# The S3-backed tests once more on SeaweedFS, a second real S3 server (moto is a mock that
# takes unsigned requests): the store's conformance S3 cases and fault suite, the fault proxy's S3
# tests, the query engine on S3 and the loader on S3. --workspace, so that the features, and
# so the builds, are those of the run above; --tests, not --lib, which would build the Python
# extension (test = false) a second way.
stop_s3_server
start_s3_server seaweedfs
"${CARGO[@]}" test --workspace --test conformance s3::
"${CARGO[@]}" test --workspace --test faults --test s3_faults
"${CARGO[@]}" test --workspace --tests on_s3
python -m pytest -q tests/python/test_loader.py -k test_s3_
python -m pytest -q tests/python/test_fault_proxy.py
stop_s3_server
start_s3_server moto

# The Python tests run against target/debug/hslake, whose GPU commands run in hslake-gpu beside
# it: both from the build above, whose hslake-gpu reads HSLAKE_TEST_FAIL_ALL_REDUCE for the
# capture daemon's lost-rank test (Cargo.toml, the `fault-injection` dev-dependency).
python -m pytest -q tests/python
