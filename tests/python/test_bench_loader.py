"""benchmarks/cpu/loader.py's readers of the trainers' own per-sample files (SpecForge's torch.save
files, speculators' safetensors files): each sample once per worker count, or a failed run."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "cpu" / "loader.py"
SAMPLES = 24


def bench(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCH), "--samples", str(SAMPLES), "--seq-len", "8:24", "--hidden", "16",
         "--batch-size", "4", "--out", str(out), "--json-out", str(out.parent / "bench.json"), *extra],
        capture_output=True, text=True, timeout=600)


def test_reads_the_trainers_files_once_each_for_every_worker_count(tmp_path):
    out = tmp_path / "bench"
    p = bench(out, "--readers", "torch,safetensors,hslake", "--workers", "1,2", "--draft-tokens-per-s", "1000")
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads((tmp_path / "bench.json").read_text())
    assert summary["failures"] == []
    runs = sorted((r["format"], r["workers"]) for r in summary["results"].values())
    assert runs == [("hslake", 1), ("hslake", 2), ("safetensors", 1), ("safetensors", 2), ("torch", 1), ("torch", 2)]
    for r in summary["results"].values():
        assert r["samples"] == SAMPLES and r["missing"] == 0 and r["duplicates"] == 0
        assert r["epoch_cpu_s"] > 0 and r["gb_per_cpu_s"] > 0 and r["cores_for_draft"] > 0
    # The trainers' own layouts: SpecForge's rows_*/data_{id}.ckpt, speculators' hs_{row}.safetensors.
    assert sorted(f.name for f in (out / "pt" / "rows_0-5000").iterdir()) == sorted(
        f"data_{i}.ckpt" for i in range(SAMPLES))
    assert sorted(f.name for f in (out / "st" / "hidden_states").iterdir()) == sorted(
        f"hs_{i}.safetensors" for i in range(SAMPLES))


def test_fails_when_a_speculators_file_differs_from_what_hslake_wrote(tmp_path):
    import pyarrow as pa
    import torch
    from safetensors.torch import load_file, save_file

    out = tmp_path / "bench"
    assert bench(out, "--readers", "safetensors", "--workers", "1").returncode == 0
    probe = (SAMPLES // 2 + 7) % SAMPLES
    rows = pa.ipc.open_stream(pa.memory_map(str(out / "st" / "data-00000-of-00001.arrow"))).read_all()
    row = rows.column("sample_id").to_pylist().index(probe)
    path = out / "st" / "hidden_states" / f"hs_{row}.safetensors"
    x = load_file(path)
    x["hidden_states"].view(torch.int16)[0, 0, 0] ^= 1  # one bit of the first aux value
    save_file(x, str(path))

    p = bench(out, "--readers", "safetensors", "--workers", "1", "--keep")
    assert p.returncode == 1
    assert f"sample {probe} differs from what hslake wrote" in p.stderr
