"""A shard read with pyarrow and numpy alone (tests/python/plane_zstd.py, written from
docs/FORMAT.md): every [seq_len, H] tensor is rebuilt from the schema metadata and equals what hslake's own reader returns, for every dtype."""
import json
import os
import zlib
import subprocess
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

import plane_zstd

ROOT = Path(__file__).resolve().parents[2]
HSLAKE = ROOT / "target" / "debug" / "hslake"


def hslake(*args):
    return subprocess.run([str(HSLAKE), *map(str, args)], check=True, capture_output=True, text=True)


@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32", "fp8_e4m3"])
def test_pyarrow_and_numpy_rebuild_every_tensor(tmp_path, dtype):
    url = f"file://{tmp_path}/ds"
    hslake("synth", url, "--samples", 12, "--seq-len", "5:40", "--hidden", 24, "--layers", "1,7",
           "--final-norm", "--dtype", dtype, "--seed", 3, "--row-group-mb", 0)
    shards = sorted((tmp_path / "ds" / "data").glob("*.parquet"))
    assert shards
    seen = 0
    for shard in shards:
        table = pq.read_table(shard)
        schema = table.schema
        assert json.loads(schema.metadata[b"hslake.schema"])["dtype"] == dtype
        for row in table.to_pylist():
            seq_len = row["seq_len"]
            assert len(row["input_ids"]) == seq_len == len(row["loss_mask"])
            # Format 3: each row's tokens carry the CRC-32 of their ids and mask bytes.
            assert pq.read_metadata(shard).metadata[b"hslake.value_checksum"] == b"crc32"
            tokens = np.array(row["input_ids"], "<i4").tobytes() + np.array(row["loss_mask"], np.uint8).tobytes()
            assert row["token_checksum"] == zlib.crc32(tokens)
            out = tmp_path / f"export-{row['sample_id']}"
            hslake("export", url, "--sample", row["sample_id"], "--dir", out)
            assert np.array_equal(np.load(out / "input_ids.npy"), np.array(row["input_ids"], np.int32))
            for point in ["layer_1", "layer_7", "final_norm"]:
                meta = json.loads(schema.field(point).metadata[b"hslake.tensor"])
                assert meta["shape"] == [None, 24] and meta["dim_names"] == ["token", "hidden"]
                t = plane_zstd.decode(row[point], meta, seq_len)
                want = np.load(out / f"{point}.npy")
                assert t.shape == (seq_len, 24)
                assert np.array_equal(t.view(np.uint8), want.view(np.uint8)), point
                if dtype == "fp8_e4m3":
                    sm = json.loads(schema.field(meta["scale_column"]).metadata[b"hslake.tensor"])
                    scales = plane_zstd.decode(row[meta["scale_column"]], sm, seq_len)
                    assert sm["dtype"] == "f32" and np.array_equal(scales, np.load(out / f"{point}_scale.npy"))
                if dtype in ("bf16", "f32"):
                    # The statistics columns agree with the rebuilt values.
                    f = (t.astype(np.uint32) << 16).view(np.float32) if dtype == "bf16" else t
                    norm = np.linalg.norm(f.astype(np.float64), axis=1).mean()
                    assert np.isclose(row[f"{point}_norm"], norm, rtol=1e-4)
                    assert row[f"{point}_max_abs"] == np.abs(f).max()
            seen += 1
    assert seen == 12
