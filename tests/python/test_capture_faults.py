"""`hslake capture` writing to S3 through the fault proxy: every fault class at random on about
10 % of requests, and the "applied but response lost" fault aimed at the put-if-absent manifest
writes. Every sample lands exactly once, `hslake verify` is clean and the capture reports success
(no commit reported failed that landed)."""
import os
import subprocess

import boto3
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hslake
from capture_util import capture_cmd, hslake_bin, random_samples, randomize, save_model, write_jsonl
from s3_util import new_bucket

VOCAB = 101
N = 240
RUNS = 6
CLASSES = [{"kind": "status", "code": 503}, {"kind": "status", "code": 500}, {"kind": "reset_before"},
           {"kind": "reset_after"}, {"kind": "delay", "ms": 20}, {"kind": "truncate", "bytes": 10}]


def test_capture_under_storage_faults_writes_every_sample_exactly_once(tmp_path, fault_proxy):
    direct = os.environ["HSLAKE_TEST_S3_ENDPOINT"]
    torch.manual_seed(5)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB)
    path = save_model(randomize(LlamaForCausalLM(cfg).float().eval(), seed=5), tmp_path / "m")
    lengths = np.random.default_rng(6).integers(4, 24, N).tolist()
    inputs = write_jsonl(tmp_path / "in.jsonl", random_samples(lengths, VOCAB, seed=7))
    bucket = new_bucket(boto3.client("s3", endpoint_url=direct), "hslake-capture-faults")
    totals = {}
    for run in range(RUNS):
        url = f"s3://{bucket}/ds-{run}"
        fault_proxy.set_rules([
            # Half of the manifest puts land but their response is lost: the writer must find its
            # own commit rather than fail it or commit its shards again.
            {"name": "lost-commit", "method": "PUT", "key": r"_hslake/versions/.*\.json",
             "header": "If-None-Match", "probability": 0.5, "fault": {"kind": "reset_after"}},
            {"name": "random", "fault": {"kind": "random", "p": 0.1 / len(CLASSES), "of": CLASSES}},
        ], seed=100 + run)
        fault_proxy.reset_counters()
        env = dict(os.environ, AWS_ENDPOINT=fault_proxy.endpoint, HSLAKE_S3_RETRIES="10", HSLAKE_LOG="warn")
        cmd = capture_cmd() + ["--model", str(path), "--input", str(inputs), "--output", url, "--layers", "0,1",
                               "--dtype", "f32", "--device", "cpu", "--no-progress",
                               "--max-tokens-per-batch", "64", "--commit-every", "30"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        c = fault_proxy.counters()
        for k, v in c["faults"].items():
            totals[k] = totals.get(k, 0) + v
        assert r.returncode == 0, f"run {run}: capture failed under faults {c['faults']}:\n{r.stderr[-3000:]}"

        # Read back without the proxy: every sample exactly once, and verify clean.
        ids = [i for b in hslake.Loader(url, batch_size=16, shuffle=False) for i in b["sample_ids"].tolist()]
        assert sorted(ids) == list(range(N)), f"run {run}: {len(ids)} samples, {len(set(ids))} distinct"
        v = subprocess.run([hslake_bin(), "verify", url], capture_output=True, text=True,
                           env=dict(os.environ, AWS_ENDPOINT=direct))
        assert v.returncode == 0, v.stdout + v.stderr
        lost = next(x for x in c["rules"] if x["name"] == "lost-commit")
        assert lost["faults"].get("reset_after", 0) > 0, f"run {run}: no manifest put lost its response: {c}"
        print(f"run {run}: {c['requests']} requests, faults {c['faults']}, on manifest puts {lost['faults']}")
    print(f"capture under faults: {RUNS} runs of {N} samples; faults injected per class: {totals}")
    for cls in ["status_503", "status_500", "reset_before", "reset_after", "delay", "truncate"]:
        assert totals.get(cls, 0) > 0, f"{cls} never injected in {RUNS} runs: {totals}"
