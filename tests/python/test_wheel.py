"""The Python module as a user installs it: a wheel built by maturin, installed by pip (nothing
from the network, no dependencies) into a fresh venv that already has torch, and the loader run
from there over a dataset the installed module writes itself.

The fresh venv sees the repository's .venv packages (torch, numpy, ...) through a folder of links
named in a .pth file, every one but hslake's own: torch is neither downloaded nor copied, and the
repository's editable hslake stays out of sight. The wheel is built in the dev profile with the
setup build's settings (.cargo/install.toml), so it reuses what setup compiled."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

import hslake

ROOT = Path(__file__).resolve().parents[2]
SITE = Path(sysconfig.get_paths()["purelib"])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    maturin = shutil.which("maturin")
    assert maturin, "maturin is missing: scripts/setup.sh installs it (requirements-dev.txt)"
    out = tmp_path_factory.mktemp("wheels")
    build = subprocess.run(
        [maturin, "build", "--profile", "dev", "-m", str(ROOT / "python" / "Cargo.toml"),
         "--config", str(ROOT / ".cargo" / "install.toml"), "-i", sys.executable, "-o", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, build.stderr[-4000:]
    # Only our crates and pyo3 (its build script reruns under maturin's PYO3_CONFIG_FILE) may be
    # compiled here; anything else means the one-package build resolved features apart from the
    # workspace's and is compiling the dependency tree a second time.
    again = sorted({c for c in re.findall(r"Compiling (\S+) v", build.stderr)
                    if not c.startswith(("hslake", "pyo3"))})
    assert not again, (f"the wheel's build compiled {again} again: give python/Cargo.toml the features "
                       "the workspace turns on in them (see the comment there)")
    wheels = list(out.glob("hslake-*.whl"))
    assert len(wheels) == 1, wheels
    assert "-abi3-" in wheels[0].name, wheels[0].name
    return wheels[0]


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory, wheel) -> Path:
    root = tmp_path_factory.mktemp("venv")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    links = root / "repo-packages"
    links.mkdir()
    for entry in SITE.iterdir():
        if "hslake" not in entry.name and entry.suffix != ".pth" and entry.name != "__pycache__":
            (links / entry.name).symlink_to(entry)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "repo-packages.pth").write_text(f"{links}\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index", "--no-deps",
                    "--quiet", str(wheel)], check=True, capture_output=True, timeout=300)
    return venv


LOADER_RUN = textwrap.dedent("""
    import hashlib, json, sys
    import hslake, torch
    url = sys.argv[1]
    if sys.argv[2] == "write":
        hslake.write_synthetic(url, 24, (4, 20), 8, [1, 2], final_norm=True, seed=3, row_group_bytes=4096)
    loader = hslake.Loader(url, batch_size=5, seed=2, aux_layers=[1, 2], target="final_norm")
    batches = [{k: hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
                for k, v in sorted(b.items())} for b in loader]
    ids = sorted(i for b in hslake.Loader(url, batch_size=5) for i in b["sample_ids"].tolist())
    print(json.dumps({"hslake": hslake.__file__, "torch": torch.__file__, "ids": ids, "batches": batches}))
""")


def run_loader(python: str, url: str, mode: str, env: dict | None = None) -> dict:
    out = subprocess.run([python, "-c", LOADER_RUN, url, mode], check=True, capture_output=True, text=True,
                         timeout=300, cwd="/", env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_wheel_installs_into_a_fresh_venv_with_torch_and_its_loader_reads(fresh_venv, tmp_path):
    url = f"file://{tmp_path / 'ds'}"
    # The installed module writes the dataset and reads it.
    # PYTHONPATH could name a checkout's python/ folder: the fresh venv must see only the wheel.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    got = run_loader(str(fresh_venv / "bin" / "python"), url, "write", env)
    assert Path(got["hslake"]).is_relative_to(fresh_venv), got["hslake"]
    assert not Path(got["torch"]).resolve().is_relative_to(fresh_venv), "torch was copied into the venv"
    assert got["ids"] == list(range(24))
    # Batch for batch, byte for byte what the repository's own build of the module gives.
    want = run_loader(sys.executable, url, "read")
    assert Path(want["hslake"]).resolve().is_relative_to(Path(hslake.__file__).resolve().parent)
    assert got["batches"] == want["batches"] and len(got["batches"]) >= 5


def test_the_wheel_holds_the_package_and_declares_the_ray_extra(wheel):
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    for f in ["hslake/__init__.py", "hslake/loader.py", "hslake/ray.py", "hslake/_hslake.abi3.so"]:
        assert f in names, f
    assert "Provides-Extra: ray" in meta and "ray[data]==2.60.0" in meta
    assert not any(line.startswith("Requires-Dist: torch") for line in meta.splitlines())
