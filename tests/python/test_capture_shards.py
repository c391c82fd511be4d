"""`hslake capture --shard I/N`: four processes fill one dataset on the loopback S3 server at the same
time through the commit protocol; two are killed mid-run and restarted with --resume, and the union
is the input, every sample exactly once."""
import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import boto3
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from capture_util import capture_cmd, hslake_bin, random_samples, randomize, read_dataset, save_model, write_jsonl
from s3_util import new_bucket

VOCAB = 101
N = 2000


@pytest.fixture
def s3_prefix():
    endpoint = os.environ.get("HSLAKE_TEST_S3_ENDPOINT")
    if not endpoint:
        pytest.skip("HSLAKE_TEST_S3_ENDPOINT is not set (scripts/test.sh starts a loopback S3 server)")
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    bucket = new_bucket(client, "hslake-capture-shards")
    prefix = uuid.uuid4().hex
    return client, bucket, prefix, f"s3://{bucket}/{prefix}/ds"


def shard_cmd(model, inputs, url, i, *extra):
    return capture_cmd() + ["--model", str(model), "--input", str(inputs), "--output", url, "--layers", "0,1",
                            "--dtype", "f32", "--no-progress", "--max-tokens-per-batch", "8",
                            "--commit-every", "10", "--commit-interval", "0.2", "--shard", f"{i}/4", *extra]


def committed_versions(client, bucket, prefix):
    listing = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/ds/_hslake/versions/")
    return listing.get("KeyCount", 0)


def test_four_shards_two_killed_and_resumed_fill_one_s3_dataset_exactly_once(tmp_path, s3_prefix):
    client, bucket, prefix, url = s3_prefix
    torch.manual_seed(3)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB)
    model = save_model(randomize(LlamaForCausalLM(cfg).float().eval(), seed=3), tmp_path / "m")
    rng = np.random.default_rng(4)
    samples = random_samples(rng.integers(4, 20, N).tolist(), VOCAB, seed=4)
    inputs = write_jsonl(tmp_path / "in.jsonl", samples)

    procs = [subprocess.Popen(shard_cmd(model, inputs, url, i), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(4)]
    # Kill shards 1 and 3 once the four together have committed a few versions.
    deadline = time.time() + 300
    while committed_versions(client, bucket, prefix) < 16 and time.time() < deadline:
        assert all(p.poll() is None for p in procs[1::2]), "a shard finished before it could be killed"
        time.sleep(0.05)
    for p in procs[1::2]:
        assert p.poll() is None, "a shard finished before it could be killed"
        p.send_signal(signal.SIGKILL)
        p.wait()
    for i in (0, 2):
        out, err = procs[i].communicate(timeout=600)
        assert procs[i].returncode == 0, err
    # A finished shard run again without --resume is refused: its own samples are committed (the
    # killed shards started without --resume, although the others had committed, too).
    r = subprocess.run(shard_cmd(model, inputs, url, 0), capture_output=True, text=True)
    assert r.returncode != 0 and f"already holds {N // 4} samples of shard 0/4; pass --resume" in r.stderr, r.stderr
    resumed = [subprocess.Popen(shard_cmd(model, inputs, url, i, "--resume"), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for i in (1, 3)]
    for p in resumed:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err

    v = subprocess.run([hslake_bin(), "verify", url], capture_output=True, text=True)
    assert v.returncode == 0, v.stdout + v.stderr
    local = tmp_path / "copy"
    c = subprocess.run([hslake_bin(), "cp", url, f"file://{local}"], capture_output=True, text=True)
    assert c.returncode == 0, c.stderr
    got, _ = read_dataset(local)  # asserts that no sample id appears twice
    assert sorted(got) == list(range(N))
    info = subprocess.run([hslake_bin(), "info", url, "--shards", "4", "--json"], capture_output=True, text=True)
    assert info.returncode == 0, info.stderr
    per_shard = json.loads(info.stdout)["input_shards"]
    assert [s["shard"] for s in per_shard] == ["0/4", "1/4", "2/4", "3/4"]
    assert [s["samples"] for s in per_shard] == [N // 4] * 4
    assert [s["tokens"] for s in per_shard] == [sum(len(samples[i]["input_ids"]) for i in range(k, N, 4))
                                                for k in range(4)]
    for sid in (0, 1, N // 2, N - 1):
        assert got[sid]["input_ids"] == samples[sid]["input_ids"]


def test_the_slurm_array_example_fills_one_dataset_from_its_tasks(tmp_path):
    """examples/slurm/capture_array.sh as Slurm runs it (its array variables set by hand, CPU)."""
    torch.manual_seed(5)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB)
    model = save_model(randomize(LlamaForCausalLM(cfg).float().eval(), seed=5), tmp_path / "m")
    inputs = write_jsonl(tmp_path / "in.jsonl", random_samples([5, 9, 3, 12, 7, 4, 8], VOCAB, seed=5))
    ds = tmp_path / "ds"
    script = Path(__file__).resolve().parents[2] / "examples" / "slurm" / "capture_array.sh"
    for task in (1, 0, 2):
        env = dict(os.environ, SLURM_ARRAY_TASK_COUNT="3", SLURM_ARRAY_TASK_ID=str(task), SLURM_ARRAY_TASK_MIN="0",
                   MODEL=str(model), INPUT=str(inputs), OUTPUT=f"file://{ds}", LAYERS="0,1", TP="1", DEVICE="cpu",
                   DTYPE="f32", HSLAKE=hslake_bin())
        r = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stderr
        assert f"input shard {task}/3" in r.stderr, r.stderr
    got, _ = read_dataset(ds)
    assert sorted(got) == list(range(7))
