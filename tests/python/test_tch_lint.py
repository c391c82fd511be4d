"""The build refuses a libtorch call that panics when libtorch fails (a CUDA out-of-memory, say):
clippy.toml's disallowed methods, and capture's and hslake-gpu's `unwrap_used` / `expect_used`
warnings, which scripts/lint-rustc.sh (every build's compiler) makes errors. Each is checked by
compiling a planted violation with clippy's driver against the tch that the build linked."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TARGET = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))


def clippy_driver() -> str:
    driver = os.environ.get("CLIPPY_DRIVER")
    if not driver:
        sysroot = subprocess.run(["rustc", "--print", "sysroot"], capture_output=True, text=True,
                                 check=True).stdout.strip()
        driver = str(Path(sysroot) / "bin" / "clippy-driver")
    assert Path(driver).exists(), f"{driver}: clippy's driver is missing (rustup component add clippy)"
    return driver


def tch_rlib() -> Path:
    rlibs = sorted((TARGET / "debug" / "deps").glob("libtch-*.rlib"), key=lambda p: p.stat().st_mtime)
    if not rlibs:
        pytest.skip(f"no libtch-*.rlib under {TARGET}/debug/deps: build the capture feature first")
    return rlibs[-1]


def crate_lints(path: Path) -> str:
    """The crate-level `#![warn(clippy::...)]` / `#![cfg_attr(test, ...)]` lines of a crate root."""
    lines = [line for line in path.read_text().splitlines() if re.match(r"#!\[(warn|cfg_attr)\(.*clippy::", line)]
    assert lines, f"{path}: no crate-level clippy lints"
    return "\n".join(lines)


def lint(tmp_path: Path, header: str, body: str) -> subprocess.CompletedProcess:
    """Compiles `header` + `body` as a library that uses tch, linted as the workspace's crates are."""
    src = tmp_path / "planted.rs"
    src.write_text(f"{header}\n//! Planted.\nuse tch::Tensor;\n{body}\n")
    deps = TARGET / "debug" / "deps"
    cmd = [clippy_driver(), "--edition", "2021", "--crate-type", "lib", "--crate-name", "planted",
           "--emit", "metadata", "--out-dir", str(tmp_path), "-L", f"dependency={deps}",
           "--extern", f"tch={tch_rlib()}", str(src), "-D", "warnings"]
    # clippy reads clippy.toml from CLIPPY_CONF_DIR, as it does from the workspace root in a build.
    env = dict(os.environ, CLIPPY_CONF_DIR=str(ROOT))
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


CAPTURE = ROOT / "capture" / "src" / "lib.rs"
GPU_BIN = ROOT / "src" / "bin" / "hslake-gpu" / "main.rs"
PLANTED = {
    # An operation that unwraps its fallible twin inside tch.
    "matmul": ("", "pub fn f(t: &Tensor) -> Tensor { t.matmul(t) }", "disallowed"),
    # A Scalar-taking fallible form: tch panics dropping the Scalar when the operation fails.
    "scalar": ("", "pub fn f(t: &Tensor) -> Result<Tensor, tch::TchError> { t.f_add_scalar(1.0) }",
               "disallowed"),
    "synchronize": ("", "pub fn f() { tch::Cuda::synchronize(0) }", "disallowed"),
    # A fallible call unwrapped by hand, in capture and in hslake-gpu.
    "capture unwrap": (crate_lints(CAPTURE), "pub fn f(t: &Tensor) -> Tensor { t.f_matmul(t).unwrap() }",
                       "unwrap_used"),
    "hslake-gpu expect": (crate_lints(GPU_BIN), "pub fn f(t: &Tensor) -> Tensor { t.f_relu().expect(\"x\") }",
                          "expect_used"),
}


@pytest.mark.parametrize("name", PLANTED)
def test_a_planted_panicking_libtorch_call_fails_the_lint(tmp_path, name):
    header, body, lint_name = PLANTED[name]
    r = lint(tmp_path, header, body)
    assert r.returncode != 0 and lint_name in r.stderr, f"{name}: {r.returncode}\n{r.stderr}"


def test_the_fallible_forms_pass_the_lint(tmp_path):
    body = """
/// Fallible forms only.
pub fn f(t: &Tensor, one: &Tensor) -> Result<Tensor, tch::TchError> {
    t.f_matmul(t)?.f_add(one)
}"""
    r = lint(tmp_path, crate_lints(CAPTURE), body)
    assert r.returncode == 0, r.stderr


def test_clippy_toml_is_what_the_generator_writes_for_the_locked_tch():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "clippy_tch.py")], capture_output=True, text=True,
                       check=True, timeout=300)
    assert r.stdout == (ROOT / "clippy.toml").read_text(), \
        "clippy.toml is stale: python3 scripts/clippy_tch.py > clippy.toml"
