"""hslake.ray.read_hslake on a local Ray cluster (one per module: Ray starts slowly on 2 cores),
over a dataset of many small row groups written by `hslake synth`; the values are held against
the loader and against the shards read with pyarrow and the test's own plane_zstd decoder."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

ray = pytest.importorskip("ray", reason="Ray is not importable here: install it with pip install 'hslake[ray]'")

import hslake  # noqa: E402
import hslake.ray as hray  # noqa: E402
import plane_zstd  # noqa: E402
from ray.data.expressions import col  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("HSLAKE_BIN", ROOT / "target" / "debug" / "hslake"))
HIDDEN = 16
SAMPLES = 40
POINTS = ["layer_1", "layer_2", "layer_3", "final_norm"]


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def ds_dir(tmp_path_factory) -> Path:
    """Two versions (20 samples, then 40) in shards of a few row groups of two samples each."""
    assert BIN.exists(), f"{BIN} is missing: scripts/setup.sh builds it (or set HSLAKE_BIN)"
    d = tmp_path_factory.mktemp("ray") / "ds"
    subprocess.run([str(BIN), "synth", str(d), "--samples", str(SAMPLES), "--seq-len", "4:24",
                    "--hidden", str(HIDDEN), "--layers", "1,2,3", "--final-norm", "--seed", "5",
                    "--commit-every", "20", "--row-group-mb", "2KiB", "--shard-mb", "8KiB"],
                   check=True, capture_output=True, timeout=120)
    return d


def url(d: Path) -> str:
    return f"file://{d}"


def manifest(d: Path, version: int | None = None) -> dict:
    return hslake.Dataset(url(d)).manifest(version)


def stored(d: Path) -> dict[int, dict]:
    """Every row of the latest version: metadata with pyarrow, tensors with plane_zstd."""
    out = {}
    for shard in manifest(d)["shards"]:
        t = pq.read_table(d / shard["path"])
        metas = {p: json.loads(t.schema.field(p).metadata[b"hslake.tensor"]) for p in POINTS}
        for row in t.to_pylist():
            row = dict(row)
            for p in POINTS:
                bits = plane_zstd.decode(row[p], metas[p], row["seq_len"])
                assert metas[p]["dtype"] == "bf16"
                row[p] = (bits.astype(np.uint32) << 16).view(np.float32)
            out[row["sample_id"]] = row
    return out


def by_id(rows: list[dict]) -> dict[int, dict]:
    out = {r["sample_id"]: r for r in rows}
    assert len(out) == len(rows), "a sample was read twice"
    return out


def test_rows_metadata_and_tensors_equal_the_loader_and_the_files(cluster, ds_dir):
    ds = hray.read_hslake(url(ds_dir))
    got = by_id(ds.take_all())
    files = stored(ds_dir)
    assert sorted(got) == sorted(files) == list(range(SAMPLES))
    schema = ds.schema()
    assert [n for n in schema.names if n in POINTS] == POINTS
    for sid, want in files.items():
        row = got[sid]
        for c, v in want.items():
            if c in POINTS:
                assert row[c].dtype == np.float32 and row[c].shape == (want["seq_len"], HIDDEN), c
                np.testing.assert_array_equal(row[c], v, err_msg=f"sample {sid} {c}")
            elif c != "token_checksum":
                g = np.asarray(row[c]).tolist() if isinstance(v, list) else row[c]  # lists come as arrays or lists
                assert g == v, (sid, c)
    # The loader gives the same tensors (bf16 there, widened exactly here) and tokens.
    loader = hslake.Loader(url(ds_dir), batch_size=1, aux_layers=[1, 2, 3], target="final_norm")
    seen = 0
    for b in loader:
        sid = int(b["sample_ids"][0])
        row = got[sid]
        np.testing.assert_array_equal(np.concatenate([row[p] for p in POINTS[:3]], axis=1),
                                      b["aux_hidden_states"][0].float().numpy())
        np.testing.assert_array_equal(row["final_norm"], b["target_hidden_states"][0].float().numpy())
        assert np.asarray(row["input_ids"]).tolist() == b["input_ids"][0].tolist()
        seen += 1
    assert seen == SAMPLES


def test_one_read_task_per_row_group(cluster, ds_dir):
    m = manifest(ds_dir)
    row_groups = [rows for s in m["shards"] for rows in s["row_groups"]]
    assert len(row_groups) > 10, "the dataset is meant to have many row groups"
    source = hray.HslakeDatasource(url(ds_dir), points=[1], columns=["sample_id"])
    # Ray asks for its own guess of parallelism; without override_num_blocks it is ignored.
    for asked in (1, 7, 200):
        tasks = source.get_read_tasks(asked)
        assert [t.metadata.num_rows for t in tasks] == row_groups
    ds = hray.read_hslake(url(ds_dir), points=[1], columns=["sample_id"]).materialize()
    assert ds.num_blocks() == len(row_groups)
    assert sorted(ds.to_pandas()["sample_id"]) == list(range(SAMPLES))


@pytest.mark.parametrize("blocks", [1, 5, 31, SAMPLES])
def test_override_num_blocks_gives_that_many_blocks_each_row_once(cluster, ds_dir, blocks):
    ds = hray.read_hslake(url(ds_dir), points=["final_norm"], columns=["sample_id"],
                          override_num_blocks=blocks).materialize()
    assert ds.num_blocks() == blocks
    rows = by_id(ds.take_all())
    assert sorted(rows) == list(range(SAMPLES))
    files = stored(ds_dir)
    for sid in (0, 17, SAMPLES - 1):
        np.testing.assert_array_equal(rows[sid]["final_norm"], files[sid]["final_norm"])


def test_parallelism_is_honoured_as_override_num_blocks(cluster, ds_dir):
    ds = hray.read_hslake(url(ds_dir), points=[2], columns=["sample_id"], parallelism=3).materialize()
    assert ds.num_blocks() == 3 and ds.count() == SAMPLES


def test_where_keeps_matching_rows_in_each_of_its_forms(cluster, ds_dir):
    files = stored(ds_dir)
    want = sorted(s for s, r in files.items() if r["seq_len"] > 15 and r["layer_2_norm"] > 0)
    assert 0 < len(want) < SAMPLES
    forms = [
        (col("seq_len") > 15) & (col("layer_2_norm") > 0),
        "seq_len > 15 and layer_2_norm > 0",
        (pc.field("seq_len") > 15) & (pc.field("layer_2_norm") > 0),
    ]
    for where in forms:
        ds = hray.read_hslake(url(ds_dir), points=[2], columns=["sample_id", "seq_len"], where=where,
                              override_num_blocks=4)
        rows = by_id(ds.take_all())
        assert sorted(rows) == want, where
        for sid in want[:3]:
            np.testing.assert_array_equal(rows[sid]["layer_2"], files[sid]["layer_2"])
    # Split row groups (more blocks than row groups) filter by the rows of their own range.
    ds = hray.read_hslake(url(ds_dir), points=[2], columns=["sample_id"], where="seq_len > 15",
                          override_num_blocks=SAMPLES)
    assert sorted(by_id(ds.take_all())) == sorted(s for s, r in files.items() if r["seq_len"] > 15)
    nothing = hray.read_hslake(url(ds_dir), points=[2], columns=["sample_id"], where="seq_len > 1000")
    assert nothing.count() == 0


def fp8_e4m3_to_f32(codes: np.ndarray) -> np.ndarray:
    """OCP fp8 e4m3fn codes as float32 (no infinities; 0x7f and 0xff are NaN)."""
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> 3) & 0x0F
    man = (codes & 0x07).astype(np.float64)
    v = np.where(exp == 0, man / 8 * 2.0 ** -6, (1 + man / 8) * 2.0 ** (exp.astype(np.float64) - 7))
    return np.where((codes & 0x7F) == 0x7F, np.nan, sign * v).astype(np.float32)


@pytest.mark.parametrize("dtype, numpy_type", [("f16", np.float16), ("f32", np.float32), ("fp8_e4m3", np.float32)])
def test_each_stored_dtype_arrives_as_numpy_has_it(cluster, tmp_path, dtype, numpy_type):
    d = tmp_path / dtype
    # Seed 0: the synthetic outliers of other seeds overflow f16, which the writer refuses.
    hslake.write_synthetic(url(d), 6, (3, 9), HIDDEN, [4], seed=0, dtype=dtype)
    rows = by_id(hray.read_hslake(url(d), points=[4], columns=["sample_id", "seq_len"]).take_all())
    assert sorted(rows) == list(range(6))
    for shard in manifest(d)["shards"]:
        t = pq.read_table(d / shard["path"])
        meta = json.loads(t.schema.field("layer_4").metadata[b"hslake.tensor"])
        for row in t.to_pylist():
            want = plane_zstd.decode(row["layer_4"], meta, row["seq_len"])
            if dtype == "fp8_e4m3":
                scale_meta = json.loads(t.schema.field("layer_4_scale").metadata[b"hslake.tensor"])
                scales = plane_zstd.decode(row["layer_4_scale"], scale_meta, row["seq_len"])
                want = fp8_e4m3_to_f32(want) * scales[:, None]
            got = rows[row["sample_id"]]["layer_4"]
            assert got.dtype == numpy_type and got.shape == (row["seq_len"], HIDDEN)
            np.testing.assert_array_equal(got, want)


def test_version_pins_what_is_read(cluster, ds_dir):
    first = manifest(ds_dir, 1)
    assert first["counts"]["num_samples"] == 20
    ds = hray.read_hslake(url(ds_dir), version=1, points=[3], columns=["sample_id"])
    assert sorted(r["sample_id"] for r in ds.take_all()) == list(range(20))


@pytest.mark.parametrize("kwargs, named", [
    (dict(points=[9]), "point \"layer_9\""),
    (dict(points=["layer_x"]), "\"layer_x\""),
    (dict(points=[1, "layer_1"]), "given twice"),
    (dict(columns=["nope"]), "column \"nope\""),
    (dict(columns=["layer_1"]), "tensors are chosen with points="),
    (dict(version=99), "version 99"),
    (dict(where=col("no_such_column") > 1), "no_such_column"),
    (dict(where="seq_len >"), "does not parse"),
    (dict(where=42), "where: expected"),
    (dict(columns=[], points=[]), "nothing to read"),
    (dict(override_num_blocks=0), "override_num_blocks 0"),
])
def test_bad_input_is_refused_by_name(ds_dir, kwargs, named):
    with pytest.raises(hslake.ConfigError) as e:
        hray.read_hslake(url(ds_dir), **kwargs)
    assert named in str(e.value)


def test_a_missing_dataset_is_named(tmp_path):
    with pytest.raises(hslake.HslakeError) as e:
        hray.read_hslake(url(tmp_path / "absent"))
    assert "absent" in str(e.value) and "not an hslake dataset" in str(e.value)


def planted(src: Path, dst: Path, edit) -> tuple[str, dict]:
    """A copy of `src` whose newest version is its latest manifest with `edit(shard)` applied to
    the entry of its first shard of several row groups, as a hand edit or a foreign writer would
    make it; the copy's URL and the edited entry."""
    shutil.copytree(src, dst)
    versions = sorted((dst / "_hslake" / "versions").iterdir())
    m = json.loads(versions[-1].read_text())
    entry = next(s for s in m["shards"] if len(s["row_groups"]) > 2)
    edit(entry)
    m["version"] += 1
    (dst / "_hslake" / "versions" / f"{m['version']:020}.json").write_text(json.dumps(m))
    return url(dst), entry


def claim_one_group(s: dict) -> None:
    s["row_groups"] = [s["rows"]]


def claim_five_more_rows(s: dict) -> None:
    s["row_groups"][0] += 5
    s["rows"] += 5


def claim_most_groups(s: dict) -> None:
    # As many one-row groups as the manifest's own checks let the file's bytes hold (the issue's
    # 200,000 over a larger file): only the file can refute the claim.
    s["row_groups"] = [1] * (s["bytes"] // 64)
    s["rows"] = len(s["row_groups"])


@pytest.mark.parametrize("edit, named", [
    (claim_one_group, r"the file has \d+ row groups, the manifest says 1"),
    (claim_five_more_rows, r"row group 0 holds \d+ rows, the manifest says \d+"),
    (claim_most_groups, r"the file has \d+ row groups, the manifest says \d+"),
])
def test_read_tasks_hold_the_manifests_row_groups_to_the_file(cluster, ds_dir, tmp_path, edit, named):
    # Before: one claimed group over a shard of several returned its first group's rows, 5 extra
    # claimed rows returned the real ones, and 200,000 claimed groups hung for minutes (every
    # read task pickled the datasource and its every row group).
    bad, entry = planted(ds_dir, tmp_path / "bad", edit)
    with pytest.raises(Exception) as e:
        hray.read_hslake(bad, points=[1], columns=["sample_id"]).materialize()
    assert entry["path"] in str(e.value), str(e.value)
    assert re.search(named, str(e.value)), str(e.value)
    # The loader reads through the same check and names the same problem.
    with pytest.raises(hslake.HslakeError) as e:
        list(hslake.Loader(bad, batch_size=4, shuffle=False))
    assert entry["path"] in str(e.value) and re.search(named, str(e.value)), str(e.value)


def test_claims_no_file_could_hold_are_refused_before_any_read_task(ds_dir, tmp_path):
    def claim(s: dict) -> None:
        s["row_groups"] = [1] * 200_000
        s["rows"] = 200_000
        s["bytes"] = 200_000 * 64 - 1

    bad, _ = planted(ds_dir, tmp_path / "bad", claim)
    with pytest.raises(hslake.HslakeError, match="200000 row groups cannot fit in a file of 12799999 bytes"):
        hray.read_hslake(bad)


def sql(d: Path, query: str) -> dict:
    out = subprocess.run([str(BIN), "sql", url(d), "--format", "json", query],
                         check=True, capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[0])


def test_the_norms_example_matches_hslake_sql(cluster, ds_dir):
    # The example runs as its own driver on the module's cluster, as a user would run it.
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "ray_norms.py"), url(ds_dir),
                          "--points", "1,final_norm", "--where", "seq_len > 8", "--json",
                          "--address", ray.get_runtime_context().gcs_address],
                         check=True, capture_output=True, text=True, timeout=300)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert list(got) == ["layer_1", "final_norm"]
    for p, stats in got.items():
        want = sql(ds_dir, f"SELECT count(*) AS n, avg(tensor_norm({p})) AS mean, min(tensor_norm({p})) AS lo, "
                           f"max(tensor_norm({p})) AS hi, max(tensor_max_abs({p})) AS mx "
                           "FROM samples WHERE seq_len > 8")
        assert stats["samples"] == want["n"] > 0
        for k, w in [("mean_norm", "mean"), ("min_norm", "lo"), ("max_norm", "hi"), ("max_abs", "mx")]:
            assert stats[k] == pytest.approx(want[w], rel=1e-9), (p, k)


def test_hslake_ray_imports_without_torch():
    # Ray's workers unpickle every read task through `import hslake.ray`: torch would cost each
    # of them seconds and hundreds of MB.
    code = "import sys, hslake, hslake.ray; hslake.Dataset; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False"
