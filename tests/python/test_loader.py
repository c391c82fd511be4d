"""hslake.Loader end to end: real torch, datasets written by `hslake synth`, local disk and
a loopback S3 server (moto, env HSLAKE_TEST_S3_ENDPOINT)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import hslake
import plane_zstd
from s3_util import new_bucket

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("HSLAKE_BIN", ROOT / "target" / "debug" / "hslake"))
HIDDEN = 16
SAMPLES = 60


def synth(url: str, samples: int = SAMPLES, seed: int = 1, first_id: int = 0, commit_every: int = 10) -> None:
    assert BIN.exists(), f"{BIN} is missing: scripts/setup.sh builds it (or set HSLAKE_BIN)"
    cmd = [
        str(BIN), "synth", url, "--samples", str(samples), "--seq-len", "4:24", "--hidden", str(HIDDEN),
        "--layers", "1,2,3", "--final-norm", "--seed", str(seed), "--first-id", str(first_id),
        "--commit-every", str(commit_every),
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)


@pytest.fixture(scope="module")
def local_ds(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("ds") / "synth"
    synth(str(d))
    return d


def url_of(d: Path) -> str:
    return f"file://{d}"


def latest_manifest(d: Path) -> dict:
    files = sorted((d / "_hslake" / "versions").glob("*.json"))
    return json.loads(files[-1].read_text())


def stored(d: Path, columns: list[str]) -> dict[int, dict[str, np.ndarray]]:
    """Every sample of the latest version, read with pyarrow + numpy from the schema alone."""
    m = latest_manifest(d)
    hidden = m["schema"]["hidden_size"]
    out = {}
    for shard in m["shards"]:
        t = pq.read_table(d / shard["path"], columns=["sample_id", "seq_len", "input_ids", *columns])
        meta = json.loads(t.schema.field(columns[0]).metadata[b"hslake.tensor"])
        assert meta["dtype"] == "bf16" and meta["shape"] == [None, hidden]
        for row in t.to_pylist():
            n = row["seq_len"]
            out[row["sample_id"]] = {"input_ids": np.array(row["input_ids"]),
                                     **{c: plane_zstd.decode(row[c], meta, n) for c in columns}}
    return out


def all_ids(loader) -> list[int]:
    return [i for b in loader for i in b["sample_ids"].tolist()]


def test_dataloader_loop_yields_every_sample_once_with_eagle3_fields(local_ds):
    loader = hslake.Loader(url_of(local_ds), batch_size=7, seed=3, aux_layers=[1, 2, 3], target="final_norm")
    dl = torch.utils.data.DataLoader(loader, batch_size=None, num_workers=0)
    seen = []
    for b in dl:
        B, T = b["input_ids"].shape
        assert b["input_ids"].dtype == torch.int64
        assert b["aux_hidden_states"].shape == (B, T, 3 * HIDDEN)
        assert b["aux_hidden_states"].dtype == torch.bfloat16
        assert b["target_hidden_states"].shape == (B, T, HIDDEN)
        assert b["target_hidden_states"].dtype == torch.bfloat16
        for k in ("loss_mask", "attention_mask", "position_ids"):
            assert b[k].shape == (B, T)
        lens = b["attention_mask"].sum(1)
        assert int(lens.max()) == T
        # Padding holds zeros in the hidden states.
        pad = b["attention_mask"] == 0
        assert not b["target_hidden_states"][pad].any()
        seen += b["sample_ids"].tolist()
    assert sorted(seen) == list(range(SAMPLES))
    assert seen != list(range(SAMPLES)), "shuffled"
    assert loader.epoch == 1, "a full pass moves the state to the next epoch"
    assert hslake.Dataset(url_of(local_ds)).counts()["num_samples"] == SAMPLES


def test_two_ranks_are_disjoint_and_their_union_is_the_dataset(local_ds):
    for drop_last in (True, False):
        parts = [
            all_ids(hslake.Loader(url_of(local_ds), batch_size=4, rank=r, world_size=2, seed=9, drop_last=drop_last))
            for r in range(2)
        ]
        assert len(parts[0]) == len(parts[1])
        a, b = set(parts[0]), set(parts[1])
        assert a | b == set(range(SAMPLES))
        assert not (a & b)
    # 60 samples over 7 ranks: padding repeats 3 samples, dropping leaves 4 out.
    padded = [all_ids(hslake.Loader(url_of(local_ds), batch_size=5, rank=r, world_size=7)) for r in range(7)]
    assert {len(p) for p in padded} == {9} and set().union(*map(set, padded)) == set(range(SAMPLES))
    dropped = [all_ids(hslake.Loader(url_of(local_ds), batch_size=5, rank=r, world_size=7, drop_last=True))
               for r in range(7)]
    flat = [i for p in dropped for i in p]
    assert {len(p) for p in dropped} == {8} and len(set(flat)) == len(flat) == 56


def test_dataloader_workers_split_a_rank_without_overlap(local_ds):
    loader = hslake.Loader(url_of(local_ds), batch_size=4, rank=1, world_size=2, seed=2)
    expected = sorted(all_ids(hslake.Loader(url_of(local_ds), batch_size=4, rank=1, world_size=2, seed=2)))
    dl = torch.utils.data.DataLoader(loader, batch_size=None, num_workers=2)
    got = [i for b in dl for i in b["sample_ids"].tolist()]
    assert sorted(got) == expected


RESUME_SCRIPT = textwrap.dedent("""
    import json, sys, hslake
    url, state_file, out_file = sys.argv[1:4]
    loader = hslake.Loader(url, max_tokens=60, seed=5, decode_threads=3, prefetch_batches=2)
    loader.load_state_dict(json.load(open(state_file)))
    batches = [b["sample_ids"].tolist() for b in loader]
    json.dump(batches, open(out_file, "w"))
""")


def test_resume_after_k_batches_in_a_fresh_process_equals_the_uninterrupted_run(local_ds, tmp_path):
    url = url_of(local_ds)
    whole = [b["sample_ids"].tolist() for b in hslake.Loader(url, max_tokens=60, seed=5, decode_threads=3)]
    assert len(whole) > 6
    for k in (1, 4):
        first = hslake.Loader(url, max_tokens=60, seed=5, decode_threads=1)
        it = iter(first)
        head = [next(it)["sample_ids"].tolist() for _ in range(k)]
        (tmp_path / "state.json").write_text(json.dumps(first.state_dict()))
        subprocess.run([sys.executable, "-c", RESUME_SCRIPT, url, str(tmp_path / "state.json"), str(tmp_path / "out.json")],
                       check=True, timeout=120)
        rest = json.loads((tmp_path / "out.json").read_text())
        assert head + rest == whole, f"k={k}"


def test_resume_state_from_another_rank_is_refused(local_ds):
    a = hslake.Loader(url_of(local_ds), batch_size=4, rank=0, world_size=2)
    b = hslake.Loader(url_of(local_ds), batch_size=4, rank=1, world_size=2)
    with pytest.raises(hslake.ConfigError, match="rank = 0"):
        b.load_state_dict(a.state_dict())


def check_values_equal_store(url: str, d: Path, **kw):
    ref = stored(d, ["layer_1", "layer_2", "layer_3", "final_norm"])
    loader = hslake.Loader(url, batch_size=5, aux_layers=[3, "layer_1"], target=2, max_seq_len=20, **kw)
    seen = 0
    for b in loader:
        aux = b["aux_hidden_states"].view(torch.int16).numpy().view(np.uint16)
        tgt = b["target_hidden_states"].view(torch.int16).numpy().view(np.uint16)
        for i, sid in enumerate(b["sample_ids"].tolist()):
            r = ref[sid]
            n = min(len(r["input_ids"]), 20)
            assert int(b["attention_mask"][i].sum()) == n
            assert np.array_equal(b["input_ids"][i, :n].numpy(), r["input_ids"][:n])
            assert np.array_equal(aux[i, :n, :HIDDEN], r["layer_3"][:n]), "aux order: layer 3 first"
            assert np.array_equal(aux[i, :n, HIDDEN:], r["layer_1"][:n])
            assert np.array_equal(tgt[i, :n], r["layer_2"][:n])
            seen += 1
    assert seen == SAMPLES


def test_bf16_values_equal_what_the_store_holds(local_ds):
    check_values_equal_store(url_of(local_ds), local_ds)


def test_packed_batches_carry_cu_seqlens_and_respect_the_budget(local_ds):
    loader = hslake.Loader(url_of(local_ds), max_tokens=50, packed=True, seed=1)
    total = 0
    for b in loader:
        cu = b["cu_seqlens"]
        assert cu.dtype == torch.int32 and int(cu[0]) == 0
        assert b["input_ids"].shape == (1, int(cu[-1])) and int(cu[-1]) <= 50
        assert len(cu) == len(b["sample_ids"]) + 1
        starts = cu[:-1].long()
        assert (b["position_ids"][0, starts] == 0).all()
        assert b["document_ids"][0, -1].item() == len(b["sample_ids"]) - 1
        total += len(b["sample_ids"])
    assert total == SAMPLES


def test_follow_mode_reads_versions_committed_while_iterating(tmp_path):
    d = tmp_path / "follow"
    synth(str(d), samples=20, commit_every=0)
    loader = hslake.Loader(url_of(d), batch_size=4, follow=True, poll_interval=0.1, follow_idle_timeout=4.0)
    got = []
    writer = None
    for b in loader:
        got += b["sample_ids"].tolist()
        if writer is None:
            writer = threading.Thread(target=synth, args=(str(d),), kwargs=dict(samples=12, first_id=20, commit_every=6))
            writer.start()
    writer.join()
    assert sorted(got) == list(range(32)), "new samples read, none repeated"


# --- bad input -------------------------------------------------------------------------------

# A lookahead of about ten of these samples (3 points + final_norm, hidden 16, 4-24 tokens), so
# that an epoch of 60 spans several lookaheads.
SAMPLE_MODE = dict(shuffle_mode="sample", lookahead_bytes=20_000)


def check_sample_mode(url: str):
    whole = [b["sample_ids"].tolist() for b in hslake.Loader(url, max_tokens=60, seed=5, **SAMPLE_MODE)]
    flat = [i for b in whole for i in b]
    assert sorted(flat) == list(range(SAMPLES))
    window = all_ids(hslake.Loader(url, max_tokens=60, seed=5))
    assert flat != window, "another order than the window shuffle's"
    for k in (1, 4):
        first = hslake.Loader(url, max_tokens=60, seed=5, **SAMPLE_MODE)
        it = iter(first)
        head = [next(it)["sample_ids"].tolist() for _ in range(k)]
        second = hslake.Loader(url, max_tokens=60, seed=5, **SAMPLE_MODE)
        second.load_state_dict(json.loads(json.dumps(first.state_dict())))
        assert head + [b["sample_ids"].tolist() for b in second] == whole, f"k={k}"
    for drop_last in (True, False):
        parts = [all_ids(hslake.Loader(url, batch_size=4, rank=r, world_size=7, drop_last=drop_last, **SAMPLE_MODE))
                 for r in range(7)]
        flat = [i for p in parts for i in p]
        if drop_last:
            assert len(set(flat)) == len(flat) == 56
        else:
            assert {len(p) for p in parts} == {9} and set(flat) == set(range(SAMPLES))


def test_sample_shuffle_reads_every_sample_once_resumes_exactly_and_partitions_ranks(local_ds):
    check_sample_mode(url_of(local_ds))
    check_values_equal_store(url_of(local_ds), local_ds, **SAMPLE_MODE)


def test_sample_shuffle_state_is_refused_by_a_window_loader(local_ds):
    a = hslake.Loader(url_of(local_ds), batch_size=4, **SAMPLE_MODE)
    b = hslake.Loader(url_of(local_ds), batch_size=4)
    with pytest.raises(hslake.ConfigError, match="shuffle_mode = Sample"):
        b.load_state_dict(a.state_dict())


def test_bad_shuffle_mode_and_lookahead_are_named(local_ds):
    with pytest.raises(hslake.ConfigError, match='shuffle_mode="global".*expected `window` or `sample`'):
        hslake.Loader(url_of(local_ds), batch_size=2, shuffle_mode="global")
    with pytest.raises(hslake.ConfigError, match="lookahead_bytes \"0\": out of range"):
        hslake.Loader(url_of(local_ds), batch_size=2, shuffle_mode="sample", lookahead_bytes=0)


def test_every_option_is_listed_with_the_default_the_loader_uses_and_unknown_ones_are_refused(local_ds):
    listed = hslake.loader_options()
    defaults = {name: json.loads(default) for name, default, _ in listed}
    assert (defaults["shuffle_window"], defaults["shuffle_mode"], defaults["timeout"]) == (16, "window", 60.0)
    for name, _, doc in listed:
        assert doc and f"``{name}=" in hslake.Loader.__doc__, name
    # Every listed default given explicitly reads what no keyword at all reads.
    given = {k: v for k, v in defaults.items() if k not in ("batch_size", "max_tokens")}
    implicit = hslake.Loader(url_of(local_ds), batch_size=5)
    explicit = hslake.Loader(url_of(local_ds), batch_size=5, **given)
    assert explicit.state_dict() == implicit.state_dict()
    assert all_ids(explicit) == all_ids(implicit)
    with pytest.raises(hslake.ConfigError, match="unknown field `sead`"):
        hslake.Loader(url_of(local_ds), batch_size=5, sead=1)


def test_options_past_their_range_are_refused_by_name_without_an_abort(local_ds, tmp_path):
    # Before the ranges: 2**40 aborted the process (an allocation of 16 TiB of padding), 10**5
    # threads panicked ("can't spawn worker thread") and 10**6 hung.
    for name, value in [("pad_to_multiple_of", 2**40), ("decode_threads", 10**5),
                        ("decode_threads", 10**6), ("prefetch_batches", 2**62), ("batch_size", 2**40)]:
        given = {"batch_size": 2, name: value}
        with pytest.raises(hslake.ConfigError,
                           match=f'{name} "{value}": out of range; expected a whole number from 1 to '):
            hslake.Loader(url_of(local_ds), **given)
    with pytest.raises(hslake.ConfigError, match='timeout "1e308": out of range'):
        hslake.Loader(url_of(local_ds), batch_size=2, timeout=1e308)
    # The Dataset's and the native reader's (Ray's) timeout take the same range: before, 1e308
    # and NaN panicked converting them to a duration.
    from hslake._hslake import NativeReader
    for bad in (1e308, float("nan"), 0.0):
        with pytest.raises(hslake.ConfigError, match='timeout ".*": (out of range|not a number)'):
            hslake.Dataset(url_of(local_ds), timeout=bad)
        with pytest.raises(hslake.ConfigError, match='timeout ".*": (out of range|not a number)'):
            NativeReader(url_of(local_ds), None, None, None, bad)
    with pytest.raises(hslake.ConfigError, match='decode_threads "100000": out of range'):
        hslake.export_trainer_files(url_of(local_ds), "speculators", str(tmp_path / "out"), decode_threads=10**5)
    docs = {name: doc for name, _, doc in hslake.loader_options()}
    assert docs["decode_threads"].endswith("Range: 1 to 1024."), docs["decode_threads"]
    assert docs["pad_to_multiple_of"].endswith("Range: 1 to 65536."), docs["pad_to_multiple_of"]


def test_a_manifest_repeating_a_shard_is_refused_by_name(local_ds, tmp_path):
    # Before: every reader read (and counted) the repeated shard as often as it was named.
    bad = tmp_path / "bad"
    shutil.copytree(local_ds, bad)
    m = latest_manifest(bad)
    m["shards"] += [m["shards"][0]] * 2
    m["version"] += 1
    (bad / "_hslake" / "versions" / f"{m['version']:020}.json").write_text(json.dumps(m))
    named = f"shard {m['shards'][0]['path']} is named 3 times"
    with pytest.raises(hslake.HslakeError, match=named):
        hslake.Loader(url_of(bad), batch_size=2)
    with pytest.raises(hslake.HslakeError, match=named):
        hslake.Dataset(url_of(bad)).counts()


def test_rank_not_below_world_size_is_a_clear_error(local_ds):
    with pytest.raises(hslake.ConfigError, match="rank 2 is out of range for world_size 2"):
        hslake.Loader(url_of(local_ds), batch_size=2, rank=2, world_size=2)


def test_missing_layer_is_a_clear_error(local_ds):
    with pytest.raises(hslake.ConfigError, match=r"has no layer_7 .*it holds layer_1, layer_2, layer_3, final_norm"):
        hslake.Loader(url_of(local_ds), batch_size=2, aux_layers=[1, 7])


def test_nonexistent_version_is_a_clear_error(local_ds):
    with pytest.raises(hslake.ConfigError, match="version 99 does not exist"):
        hslake.Loader(url_of(local_ds), batch_size=2, version=99)


def test_not_a_dataset_is_a_clear_error(tmp_path):
    with pytest.raises(hslake.HslakeError, match="not an hslake dataset"):
        hslake.Loader(url_of(tmp_path), batch_size=2)


UNREACHABLE_SCRIPT = textwrap.dedent("""
    import hslake, time
    t = time.time()
    try:
        hslake.Loader("s3://some-bucket/ds", batch_size=2, timeout=30)
    except hslake.HslakeError as e:
        print("ERROR", round(time.time() - t, 1), e)
""")


def test_unreachable_s3_endpoint_fails_after_bounded_retries(tmp_path):
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens here now
    env = dict(os.environ, AWS_ENDPOINT=f"http://127.0.0.1:{port}", AWS_ALLOW_HTTP="true",
               AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="y", AWS_REGION="us-east-1")
    t = time.time()
    r = subprocess.run([sys.executable, "-c", UNREACHABLE_SCRIPT], env=env, capture_output=True, text=True, timeout=90)
    assert r.stdout.startswith("ERROR"), r.stdout + r.stderr
    assert time.time() - t < 60
    assert "some-bucket" in r.stdout or str(port) in r.stdout, r.stdout


def corrupt_copy(src: Path, dst: Path) -> str:
    shutil.copytree(src, dst)
    shard = latest_manifest(dst)["shards"][0]["path"]
    f = dst / shard
    b = bytearray(f.read_bytes())
    mid = len(b) // 3
    for i in range(mid, mid + 256):
        b[i] ^= 0x5A
    f.write_bytes(bytes(b))
    return shard


def test_corrupted_shard_errors_naming_the_file(local_ds, tmp_path):
    shard = corrupt_copy(local_ds, tmp_path / "bad")
    loader = hslake.Loader(url_of(tmp_path / "bad"), batch_size=4, shuffle=False)
    with pytest.raises(hslake.HslakeError, match=shard.replace(".", r"\.")):
        for _ in loader:
            pass


def test_corrupted_shard_is_skipped_and_counted_by_policy(local_ds, tmp_path):
    corrupt_copy(local_ds, tmp_path / "bad")
    loader = hslake.Loader(url_of(tmp_path / "bad"), batch_size=4, on_corrupt="skip")
    n = len(all_ids(loader))
    st = loader.stats()
    # Bytes garbled inside tensor values leave out their samples alone; inside other pages, their
    # row groups: either way every sample is read or counted as skipped.
    assert st["samples_skipped"] > 0
    assert n + st["samples_skipped"] == SAMPLES


def flip_value_copy(src: Path, dst: Path, column: str = "layer_2") -> tuple[str, int, int, int]:
    """Copy the dataset and flip one bit in the middle of the last zstd frame of one sample's
    `column` value (found with pyarrow, then as plain bytes in the file: tensor pages are
    uncompressed). The Parquet file still parses. Returns (shard, row group, row, sample id)."""
    shutil.copytree(src, dst)
    shard = latest_manifest(dst)["shards"][0]["path"]
    f = dst / shard
    pf = pq.ParquetFile(f)
    t = pf.read_row_group(0, columns=["sample_id", column])
    row = 1
    sample_id = t.column("sample_id")[row].as_py()
    value = t.column(column)[row].as_py()
    data = bytearray(f.read_bytes())
    start = data.find(value)
    assert start >= 0 and data.find(value, start + 1) < 0
    lens = np.frombuffer(value[:12], "<u4")  # bf16: three frames
    offset = start + 12 + int(lens[0]) + int(lens[1]) + int(lens[2]) // 2
    data[offset] ^= 0x10
    f.write_bytes(bytes(data))
    pq.ParquetFile(f).read()  # still a readable Parquet file
    return shard, 0, row, sample_id


def test_a_flipped_byte_in_a_tensor_value_fails_naming_file_row_group_and_sample(local_ds, tmp_path):
    shard, rg, row, sid = flip_value_copy(local_ds, tmp_path / "bad")
    meta = pq.read_metadata(tmp_path / "bad" / shard).metadata
    assert meta[b"hslake.value_checksum"] == b"crc32"
    loader = hslake.Loader(url_of(tmp_path / "bad"), batch_size=4, shuffle=False,
                           aux_layers=[1, 2, 3], target="final_norm")
    site = f"{shard}: row group {rg}: row {row} (sample {sid}) layer_2: "
    with pytest.raises(hslake.HslakeError) as e:
        for _ in loader:
            pass
    assert site in str(e.value), str(e.value)


def test_a_flipped_tensor_value_is_skipped_by_policy_and_the_rest_is_unchanged(local_ds, tmp_path):
    shard, rg, row, sid = flip_value_copy(local_ds, tmp_path / "bad")
    kw = dict(batch_size=4, shuffle=False, aux_layers=[1, 2, 3], target="final_norm")
    clean = {i: b for b in hslake.Loader(url_of(local_ds), **kw)
             for i, b in zip(b["sample_ids"].tolist(), [b] * len(b["sample_ids"]))}
    loader = hslake.Loader(url_of(tmp_path / "bad"), on_corrupt="skip", **kw)
    got = {}
    for b in loader:
        for j, i in enumerate(b["sample_ids"].tolist()):
            n = int(b["attention_mask"][j].sum())
            got[i] = b["aux_hidden_states"][j, :n].clone()
    st = loader.stats()
    # That sample alone is left out, not the rest of its row group.
    assert latest_manifest(tmp_path / "bad")["shards"][0]["row_groups"][rg] > 1
    assert st["samples_skipped"] == 1 and st["row_groups_skipped"] == 0
    assert sid not in got and len(got) + 1 == SAMPLES
    for i, t in got.items():
        cb = clean[i]
        j = cb["sample_ids"].tolist().index(i)
        n = int(cb["attention_mask"][j].sum())
        assert torch.equal(cb["aux_hidden_states"][j, :n], t), i


# --- the same over S3 ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def s3_ds(local_ds):
    endpoint = os.environ.get("HSLAKE_TEST_S3_ENDPOINT")
    if not endpoint:
        pytest.skip("HSLAKE_TEST_S3_ENDPOINT is not set (scripts/test.sh starts a loopback S3 server)")
    import boto3
    bucket = new_bucket(boto3.client("s3", endpoint_url=endpoint), "hslake-loader")
    url = f"s3://{bucket}/synth"
    synth(url)  # same seed and settings as local_ds: the same samples
    return url


def test_s3_loader_matches_local_and_ranks_partition(s3_ds, local_ds):
    remote = [b["sample_ids"].tolist() for b in hslake.Loader(s3_ds, batch_size=6, seed=4)]
    local = [b["sample_ids"].tolist() for b in hslake.Loader(url_of(local_ds), batch_size=6, seed=4)]
    assert remote == local
    parts = [set(all_ids(hslake.Loader(s3_ds, batch_size=4, rank=r, world_size=2, drop_last=True))) for r in range(2)]
    assert not (parts[0] & parts[1]) and parts[0] | parts[1] == set(range(SAMPLES))


def test_s3_bf16_values_equal_what_the_store_holds(s3_ds, local_ds):
    check_values_equal_store(s3_ds, local_ds)


def test_s3_resume_equals_uninterrupted(s3_ds):
    whole = [b["sample_ids"].tolist() for b in hslake.Loader(s3_ds, max_tokens=60, seed=5)]
    first = hslake.Loader(s3_ds, max_tokens=60, seed=5)
    it = iter(first)
    head = [next(it)["sample_ids"].tolist() for _ in range(3)]
    second = hslake.Loader(s3_ds, max_tokens=60, seed=5)
    second.load_state_dict(first.state_dict())
    assert head + [b["sample_ids"].tolist() for b in second] == whole


def test_s3_sample_shuffle_matches_local_resumes_exactly_and_partitions_ranks(s3_ds, local_ds):
    remote = all_ids(hslake.Loader(s3_ds, batch_size=6, seed=4, **SAMPLE_MODE))
    assert remote == all_ids(hslake.Loader(url_of(local_ds), batch_size=6, seed=4, **SAMPLE_MODE))
    check_sample_mode(s3_ds)
    check_values_equal_store(s3_ds, local_ds, **SAMPLE_MODE)


def batch_digests(loader) -> list[str]:
    """One sha256 per batch over every field's bytes, in field order."""
    import hashlib
    out = []
    for b in loader:
        h = hashlib.sha256()
        for k in sorted(b):
            t = b[k]
            t = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
            h.update(k.encode() + t.contiguous().numpy().tobytes())
        out.append(h.hexdigest())
    return out


def test_s3_epoch_under_read_faults_equals_the_fault_free_epoch(s3_ds, fault_proxy, monkeypatch):
    kw = dict(max_tokens=80, seed=9, aux_layers=[1, 2, 3], target="final_norm", decode_threads=2)
    clean = batch_digests(hslake.Loader(s3_ds, **kw))
    # 503 SlowDown, 500, resets before and after the store answered: each on 5 % of reads.
    classes = {"status_503", "status_500", "reset_before", "reset_after"}
    faults = [{"kind": "status", "code": 503}, {"kind": "status", "code": 500},
              {"kind": "reset_before"}, {"kind": "reset_after"}]
    fault_proxy.set_rules([{"name": "reads", "method": "GET", "fault": {"kind": "random", "p": 0.05, "of": faults}}],
                          seed=11)
    fault_proxy.reset_counters()
    monkeypatch.setenv("AWS_ENDPOINT", fault_proxy.endpoint)
    monkeypatch.setenv("HSLAKE_S3_RETRIES", "8")
    # An epoch reads few objects (footers and row groups of 6 shards): repeat until every class
    # has been met, at most 20 epochs.
    runs = 0
    while runs < 20 and set(fault_proxy.counters()["faults"]) != classes:
        got = batch_digests(hslake.Loader(s3_ds, **kw))
        runs += 1
        assert got == clean, f"epoch {runs}: batches differ under faults"
    c = fault_proxy.counters()
    print(f"loader over the fault proxy: {runs} epochs, {c['requests']} requests, faults {c['faults']}")
    assert set(c["faults"]) == classes, c


def test_installed_module_and_binary_are_optimised_builds():
    # What setup installs is what docs/PERFORMANCE.md measured: the hot crates at opt-level 3
    # (Cargo.toml's dev-profile overrides) without debug assertions (.cargo/install.toml, which
    # a plain `cargo build` leaves out); losing either makes the read path several times slower.
    info = hslake.build_info()
    assert info["optimized"] and info["benchmark_warning"] is None, info
    assert info["opt_level"] not in ("0", "1"), info
    assert not info["debug_assertions"], info
    out = subprocess.run([str(BIN), "--version"], check=True, capture_output=True, text=True).stdout
    assert "opt-level 3" in out or "opt-level 2" in out, out
