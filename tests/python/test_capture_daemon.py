"""The capture daemon (`hslake serve-capture`) and its client (`hslake jobs`): jobs run in order and
write what a one-shot `hslake capture` writes, the API refuses bad tokens and bad jobs and keeps
serving, neither kill -9 nor SIGTERM loses or repeats a sample, and hostile clients (floods of
half-open connections, large concurrent submissions, markup in job values) leave it serving within
its bounds."""
import glob
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid

import boto3
import numpy as np
import pytest
import torch
from prometheus_client.openmetrics.parser import text_string_to_metric_families
from transformers import LlamaConfig, LlamaForCausalLM

from capture_util import hslake_bin, hslake_gpu_bin, random_samples, randomize, read_dataset, run_capture, save_model, write_jsonl
from flood import Flooders
from s3_util import new_bucket

VOCAB = 101
TOKEN = "s3cret-token"
LAYERS = [0, 1]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    """One `hslake serve-capture` process on a free loopback port."""

    def __init__(self, tmp, model, state, log_name="daemon.log", extra=(), env=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        token_file = tmp / "token"
        token_file.write_text(TOKEN + "\n")
        self.log = open(tmp / log_name, "ab")
        self.cmd = [hslake_bin(), "serve-capture", "--model", str(model), "--dtype", "f32",
                    "--bind", f"127.0.0.1:{self.port}", "--state", str(state), "--token-file", str(token_file),
                    *extra]
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=self.log, env=env)

    def request(self, method, path, body=None, token=TOKEN):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                raw = r.read().decode()
                status = r.status
        except urllib.error.HTTPError as e:
            raw, status = e.read().decode(), e.code
        try:
            return status, json.loads(raw)
        except json.JSONDecodeError:
            return status, raw

    def wait_listening(self, timeout=60):
        deadline = time.time() + timeout
        while time.time() < deadline:
            assert self.proc.poll() is None, f"daemon exited with {self.proc.returncode}"
            try:
                if self.request("GET", "/healthz", token=None)[0] == 200:
                    return
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.05)
        raise AssertionError("daemon did not start listening")

    def wait_ready(self, timeout=60):
        self.wait_listening(timeout)
        deadline = time.time() + timeout
        while self.request("GET", "/readyz", token=None)[0] != 200:
            assert time.time() < deadline, "never ready"
            time.sleep(0.05)

    def wait_job(self, job_id, timeout=300):
        deadline = time.time() + timeout
        while time.time() < deadline:
            status, job = self.request("GET", f"/v1/jobs/{job_id}")
            assert status == 200, job
            if job["state"] in ("done", "failed", "cancelled"):
                return job
            time.sleep(0.1)
        raise AssertionError(f"job {job_id} did not end")

    def cli(self, *args, check=True):
        env = dict(os.environ, HSLAKE_TOKEN=TOKEN)
        r = subprocess.run([hslake_bin(), "jobs", "--server", self.url, *map(str, args)],
                           capture_output=True, text=True, env=env, timeout=600)
        if check and r.returncode != 0:
            raise AssertionError(f"hslake jobs {args} failed ({r.returncode}):\n{r.stderr}")
        return r

    def stop(self, sig=signal.SIGTERM, timeout=30):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=timeout)
        self.log.close()
        return self.proc.returncode


@pytest.fixture
def daemon_setup(tmp_path):
    torch.manual_seed(11)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB)
    model = save_model(randomize(LlamaForCausalLM(cfg).float().eval(), seed=11), tmp_path / "m")
    return tmp_path, model


def inputs(tmp, name, n, seed):
    rng = np.random.default_rng(seed)
    return write_jsonl(tmp / f"{name}.jsonl", random_samples(rng.integers(4, 24, n).tolist(), VOCAB, seed=seed))


def job_body(inp, out, **extra):
    return dict({"input": str(inp), "output": f"file://{out}", "layers": [str(l) for l in LAYERS],
                 "final_norm": True, "max_tokens_per_batch": 48}, **extra)


def assert_same_dataset(a, b):
    """Bit for bit: the same samples, tokens and tensor values."""
    da, _ = read_dataset(a)
    db, _ = read_dataset(b)
    assert sorted(da) == sorted(db)
    for sid, ra in da.items():
        rb = db[sid]
        assert ra["input_ids"] == rb["input_ids"] and ra["loss_mask"] == rb["loss_mask"]
        for col in [f"layer_{l}" for l in LAYERS] + ["final_norm"]:
            assert ra[col].tobytes() == rb[col].tobytes(), f"sample {sid} {col} differs"


def verify(ds):
    v = subprocess.run([hslake_bin(), "verify", f"file://{ds}"], capture_output=True, text=True)
    assert v.returncode == 0, v.stdout + v.stderr


def status_history(state, job_id):
    files = sorted(glob.glob(str(state / "jobs" / f"{job_id:08d}" / "status-*.json")))
    return [json.load(open(f)) for f in files]


def test_three_jobs_run_in_order_and_equal_one_shot_capture(daemon_setup):
    tmp, model = daemon_setup
    ins = [inputs(tmp, f"in{i}", 40 + 10 * i, seed=i) for i in range(3)]
    d = Daemon(tmp, model, tmp / "state")
    try:
        d.wait_ready()
        ids = []
        for i in range(2):
            status, job = d.request("POST", "/v1/jobs", job_body(ins[i], tmp / f"ds{i}"))
            assert status == 201, job
            assert job["state"] == "queued"
            ids.append(job["id"])
        # The third through the CLI client, with a path relative to its working directory.
        r = subprocess.run([hslake_bin(), "jobs", "--server", d.url, "submit", "--input", ins[2].name,
                            "--output", "ds2", "--layers", "0,1", "--final-norm", "--max-tokens-per-batch", "48"],
                           capture_output=True, text=True, cwd=tmp, env=dict(os.environ, HSLAKE_TOKEN=TOKEN))
        assert r.returncode == 0, r.stderr
        ids.append(int(r.stdout.strip()))
        assert ids == [1, 2, 3]
        w = d.cli("wait", 3)
        assert json.loads(w.stdout)["state"] == "done"
        jobs = [d.wait_job(i) for i in ids]
        assert [j["state"] for j in jobs] == ["done"] * 3
        assert [j["samples_done"] for j in jobs] == [40, 50, 60]
        # One at a time in submission order: each ran after the one before it had ended.
        ended = [status_history(tmp / "state", i)[-1]["at"] for i in ids]
        started = [status_history(tmp / "state", i)[0]["at"] for i in ids]
        assert [h["state"] for i in ids for h in status_history(tmp / "state", i)] == ["running", "done"] * 3
        assert started[1] >= ended[0] and started[2] >= ended[1], (started, ended)
        ls = d.cli("ls").stdout
        assert sum(" done " in line for line in ls.splitlines()) == 3, ls
        shown = json.loads(d.cli("show", 2).stdout)
        assert shown["summary"]["samples"] == 50 and shown["compression_ratio"] > 1.0

        # /metrics, read by the Prometheus client library's parser, agrees with the summaries.
        status, text = d.request("GET", "/metrics")
        assert status == 200
        families = {f.name: f for f in text_string_to_metric_families(text)}
        value = lambda name, **labels: next(s.value for s in families[name].samples
                                             if s.labels == labels and s.name.endswith(("_total", name)))
        summaries = [j["summary"] for j in jobs]
        assert value("hslake_capture_samples") == sum(s["samples"] for s in summaries) == 150
        assert value("hslake_capture_tokens") == sum(s["tokens"] for s in summaries)
        assert value("hslake_capture_raw_bytes") == sum(s["raw_bytes"] for s in summaries)
        assert value("hslake_capture_stored_bytes") == sum(s["written_bytes"] for s in summaries)
        assert value("hslake_capture_commits") == sum(j["commits"] for j in jobs) >= 3
        commit_count = next(s.value for s in families["hslake_capture_commit_seconds"].samples
                            if s.name == "hslake_capture_commit_seconds_count")
        assert commit_count == value("hslake_capture_commits")
        assert [j["raw_bytes"] for j in jobs] == [s["raw_bytes"] for s in summaries]
        assert value("hslake_capture_forward_seconds") == pytest.approx(sum(s["compute_secs"] for s in summaries))
        assert value("hslake_capture_jobs", state="done") == 3
        assert value("hslake_capture_queue_depth") == 0
        assert value("hslake_capture_ready") == 1
    finally:
        assert d.stop() == 0
    log = open(tmp / "daemon.log").read()
    assert "job started" in log and "job{id=1}" in log and "job{id=3}" in log, log

    for i in range(3):
        run_capture(model, ins[i], tmp / f"one{i}", LAYERS, "--max-tokens-per-batch", 48, final_norm=True)
        assert_same_dataset(tmp / f"ds{i}", tmp / f"one{i}")
        verify(tmp / f"ds{i}")


def test_wrong_token_and_bad_jobs_are_refused_and_the_daemon_keeps_serving(daemon_setup):
    tmp, model = daemon_setup
    good = inputs(tmp, "good", 12, seed=1)
    d = Daemon(tmp, model, tmp / "state")
    try:
        d.wait_listening()
        assert d.request("GET", "/healthz", token=None)[0] == 200
        for token in (None, "wrong"):
            for method, path in (("GET", "/v1/jobs"), ("GET", "/v1/jobs/1"), ("DELETE", "/v1/jobs/1"),
                                 ("GET", "/metrics")):
                status, body = d.request(method, path, token=token)
                assert status == 401, (method, path, token, body)
            status, body = d.request("POST", "/v1/jobs", job_body(good, tmp / "x"), token=token)
            assert status == 401, body
        r = subprocess.run([hslake_bin(), "jobs", "--server", d.url, "ls"], capture_output=True, text=True,
                           env=dict(os.environ, HSLAKE_TOKEN="wrong"))
        assert r.returncode != 0 and "401" in r.stderr, r.stderr

        (tmp / "bad.jsonl").write_text('{"input_ids": [1, 2]}\n{"input_ids": [3, 500]}\n')
        bad_jobs = [
            (job_body(good, tmp / "a", layers=["7"]), "layer"),
            (job_body(tmp / "missing.jsonl", tmp / "b"), "missing.jsonl"),
            (job_body(tmp / "bad.jsonl", tmp / "c"), "line 2: token id 500"),
            (dict(job_body(good, tmp / "d"), layerz=["0"]), "unknown field `layerz`"),
            (job_body(good, tmp / "e", layers=[], final_norm=False), "nothing to capture"),
            (job_body(good, tmp / "f", overlong="chop"), "unknown overlong policy"),
            # Extreme numbers and places: refused by the checks the CLI's flags go through.
            (job_body(good, tmp / "g", zstd_level=1000), "--zstd-level 1000: out of range"),
            (job_body(good, tmp / "g", zstd_level=-2**31), "--zstd-level -2147483648: out of range"),
            (job_body(good, tmp / "g", commit_interval=1e308), '--commit-interval "1e308": out of range'),
            (job_body(good, tmp / "g", commit_interval="-1s"), "from 1ms to 365d"),
            (dict(job_body(good, tmp / "g"), output="file:///"), "file:/// is the root of a filesystem"),
        ]
        for body, expected in bad_jobs:
            status, answer = d.request("POST", "/v1/jobs", body)
            assert 400 <= status < 500, (body, status, answer)
            assert expected in answer["error"], (expected, answer)
        assert not (tmp / "c").exists(), "a refused job must not create its dataset"
        # Outside the allowed outputs (by default the directory holding --state): 403.
        elsewhere = tmp.parent / f"{tmp.name}-elsewhere"
        status, answer = d.request("POST", "/v1/jobs", job_body(good, elsewhere))
        assert status == 403 and "outside the outputs this daemon allows" in answer["error"], answer
        status, answer = d.request("POST", "/v1/jobs", job_body(good, tmp / "state" / "jobs"))
        assert status == 403 and "inside the daemon's --state" in answer["error"], answer
        assert not elsewhere.exists()
        # The client's flags go through the same checks before anything is sent.
        r = d.cli("submit", "--input", good, "--output", tmp / "h", "--layers", "0", "--commit-interval", "1e308",
                  check=False)
        assert r.returncode == 2 and "from 1ms to 365d" in r.stderr, r.stderr
        status, answer = d.request("GET", "/v1/jobs")
        assert status == 200 and answer["jobs"] == []

        status, job = d.request("POST", "/v1/jobs", job_body(good, tmp / "ds"))
        assert status == 201, job
        assert d.wait_job(job["id"])["state"] == "done"
        # The same dataset asked for other capture points: refused like the CLI refuses it.
        status, answer = d.request("POST", "/v1/jobs", job_body(good, tmp / "ds", layers=["1"], resume=True))
        assert status == 422 and "schema" in answer["error"], answer
        # Without resume, a non-empty dataset is refused with the CLI's advice.
        status, answer = d.request("POST", "/v1/jobs", job_body(good, tmp / "ds"))
        assert status == 422 and "pass --resume" in answer["error"], answer
        assert d.request("GET", "/v1/jobs/99")[0] == 404
        assert d.request("DELETE", f"/v1/jobs/{job['id']}")[0] == 409
        assert d.proc.poll() is None
    finally:
        assert d.stop() == 0


def test_cancel_commits_what_is_done_and_a_queued_job_never_runs(daemon_setup):
    tmp, model = daemon_setup
    n = 5000
    big = inputs(tmp, "big", n, seed=3)
    d = Daemon(tmp, model, tmp / "state")
    try:
        d.wait_listening()
        body = job_body(big, tmp / "ds", max_tokens_per_batch=8, commit_every=20, commit_interval=0.2)
        first = d.request("POST", "/v1/jobs", body)[1]["id"]
        second = d.request("POST", "/v1/jobs", job_body(big, tmp / "never"))[1]["id"]
        assert "cancelled" in d.cli("cancel", second).stdout
        while d.request("GET", f"/v1/jobs/{first}")[1]["samples_done"] < 20:
            time.sleep(0.01)
        status, answer = d.request("DELETE", f"/v1/jobs/{first}")
        assert status == 202, answer
        job = d.wait_job(first)
        assert job["state"] == "cancelled"
        assert d.wait_job(second)["state"] == "cancelled"
        held, _ = read_dataset(tmp / "ds")
        assert 0 < len(held) < n and len(held) == job["summary"]["samples"]
        assert d.cli("wait", first, check=False).returncode == 1
    finally:
        assert d.stop() == 0
    verify(tmp / "ds")
    assert not glob.glob(str(tmp / "never" / "data" / "*")), "the cancelled queued job wrote shards"


def test_kill_9_at_random_moments_then_restart_captures_every_sample_exactly_once(daemon_setup):
    tmp, model = daemon_setup
    # Large enough that all 20 kills land while jobs still run: measured on a 2-core VM, the
    # kills took 14 s in all (start-ups included) and the jobs capture ~550 samples a second, so
    # they see at most ~7,700 of these 15,750 samples.
    sizes = [6000, 4500, 5250]
    ins = [inputs(tmp, f"in{i}", n, seed=20 + i) for i, n in enumerate(sizes)]
    state = tmp / "state"
    d = Daemon(tmp, model, state, "run0.log")
    d.wait_listening()
    for i in range(3):
        body = job_body(ins[i], tmp / f"ds{i}", max_tokens_per_batch=8, commit_every=10, commit_interval=0.1)
        assert d.request("POST", "/v1/jobs", body)[0] == 201
    rng = random.Random(1234)
    runs = 20
    # Each run is killed at a random moment: even runs from just after start (recovering the job
    # list, loading the model) to well into a job, odd runs only once they have resumed the
    # interrupted job, at a random point of its forward, writing or committing. Timed from the
    # start alone, a loaded machine's slower start-ups made most kills land before any job ran.
    for run in range(runs):
        if run > 0:
            d = Daemon(tmp, model, state, f"run{run}.log")
        if run % 2 == 1:
            log = tmp / f"run{run}.log"
            deadline = time.time() + 30
            while "resumed=1" not in log.read_text() and time.time() < deadline:
                assert d.proc.poll() is None, f"run {run} exited with {d.proc.returncode}"
                time.sleep(0.02)
            time.sleep(rng.uniform(0.0, 0.6))
        else:
            time.sleep(rng.uniform(0.0, 1.2))
        assert d.proc.poll() is None, f"run {run} exited with {d.proc.returncode}"
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait()
        d.log.close()
    d = Daemon(tmp, model, state, "last.log")
    try:
        d.wait_listening()
        jobs = [d.wait_job(i + 1) for i in range(3)]
        assert [j["state"] for j in jobs] == ["done"] * 3, jobs
    finally:
        assert d.stop() == 0
    # Most restarts found a job interrupted mid-run and resumed it (every odd run by design, as its
    # predecessor's kill left a job running; the check is that restarts really do resume).
    resumed = sum("resumed=1" in open(tmp / f"run{r}.log").read() for r in range(1, runs))
    resumed += "resumed=1" in open(tmp / "last.log").read()
    assert resumed >= runs // 2, resumed
    for i, n in enumerate(sizes):
        got, _ = read_dataset(tmp / f"ds{i}")  # asserts that no sample id appears twice
        assert sorted(got) == list(range(n))
        verify(tmp / f"ds{i}")
        # Finished exactly once: one "done" record, nothing after it.
        states = [h["state"] for h in status_history(state, i + 1)]
        assert states.count("done") == 1 and states[-1] == "done", states
    # Bit for bit what one uninterrupted capture writes (the job that most kills interrupted
    # would take longest; the smallest shows the same).
    run_capture(model, ins[1], tmp / "one1", LAYERS, "--max-tokens-per-batch", 8, final_norm=True)
    assert_same_dataset(tmp / "ds1", tmp / "one1")


def test_sigterm_mid_job_exits_zero_quickly_and_a_restart_completes_the_job(daemon_setup):
    tmp, model = daemon_setup
    n = 4000
    inp = inputs(tmp, "in", n, seed=9)
    state = tmp / "state"
    d = Daemon(tmp, model, state)
    d.wait_listening()
    body = job_body(inp, tmp / "ds", max_tokens_per_batch=8, commit_every=50, commit_interval=1.0)
    job_id = d.request("POST", "/v1/jobs", body)[1]["id"]
    while d.request("GET", f"/v1/jobs/{job_id}")[1]["samples_done"] < 30:
        time.sleep(0.05)
    t = time.time()
    assert d.stop(signal.SIGTERM, timeout=10) == 0
    assert time.time() - t < 10
    partial, _ = read_dataset(tmp / "ds")
    assert 0 < len(partial) < n
    d = Daemon(tmp, model, state)
    try:
        d.wait_listening()
        job = d.wait_job(job_id)
        assert job["state"] == "done"
        assert job["summary"]["skipped_committed"] == len(partial)
        assert job["summary"]["samples"] == n - len(partial)
    finally:
        assert d.stop() == 0
    full, _ = read_dataset(tmp / "ds")
    assert sorted(full) == list(range(n))
    verify(tmp / "ds")


def test_a_job_list_and_input_on_s3_survive_kill_9_and_the_job_completes_once(daemon_setup):
    endpoint = os.environ.get("HSLAKE_TEST_S3_ENDPOINT")
    if not endpoint:
        pytest.skip("HSLAKE_TEST_S3_ENDPOINT is not set (scripts/test.sh starts a loopback S3 server)")
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    bucket = new_bucket(client, "hslake-daemon-state")
    prefix = uuid.uuid4().hex
    state = f"s3://{bucket}/{prefix}/state"
    tmp, model = daemon_setup
    n = 3000
    inp = inputs(tmp, "in", n, seed=8)
    # The input, too, is read from the object store.
    client.upload_file(str(inp), bucket, f"{prefix}/in.jsonl")
    allow = ("--allowed-output", f"file://{tmp}", "--max-job-bytes", "1MiB")
    d = Daemon(tmp, model, state, extra=allow)
    d.wait_listening()
    missing = job_body(f"s3://{bucket}/{prefix}/missing.jsonl", tmp / "x")
    status, answer = d.request("POST", "/v1/jobs", missing)
    assert status == 422 and f"s3://{bucket}/{prefix}/missing.jsonl: download" in answer["error"], answer
    bad_key = f"{prefix}/bad.jsonl"
    client.put_object(Bucket=bucket, Key=bad_key, Body=b'{"input_ids": [1]}\n{"input_ids": [500]}\n')
    status, answer = d.request("POST", "/v1/jobs", job_body(f"s3://{bucket}/{bad_key}", tmp / "y"))
    assert status == 422 and f"s3://{bucket}/{bad_key}: line 2: token id 500" in answer["error"], answer
    # An object over --max-job-bytes is refused by its size, before any of it is downloaded.
    big_key = f"{prefix}/big.jsonl"
    client.put_object(Bucket=bucket, Key=big_key, Body=b'{"input_ids": [1]}\n' * 120_000)
    status, answer = d.request("POST", "/v1/jobs", job_body(f"s3://{bucket}/{big_key}", tmp / "z"))
    assert status == 413 and "--max-job-bytes" in answer["error"] and "1MiB" in answer["error"], answer
    body = job_body(f"s3://{bucket}/{prefix}/in.jsonl", tmp / "ds", max_tokens_per_batch=8, commit_every=20,
                    commit_interval=0.2)
    status, job = d.request("POST", "/v1/jobs", body)
    assert status == 201, job
    job_id = job["id"]
    while d.request("GET", f"/v1/jobs/{job_id}")[1]["samples_done"] < 40:
        time.sleep(0.02)
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait()
    d.log.close()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/state")["Contents"]]
    assert keys == [f"{prefix}/state/jobs/00000001/spec.json", f"{prefix}/state/jobs/00000001/status-000001.json"]
    d = Daemon(tmp, model, state, extra=allow)
    try:
        d.wait_listening()
        job = d.wait_job(job_id)
        assert job["state"] == "done" and job["summary"]["skipped_committed"] > 0, job
    finally:
        assert d.stop() == 0
    full, _ = read_dataset(tmp / "ds")
    assert sorted(full) == list(range(n))
    verify(tmp / "ds")


def chromium_path():
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return None


def test_the_dashboard_shows_a_running_job_and_its_throughput_in_chromium(daemon_setup):
    """The dashboard in a real headless Chromium (Debian's package, driven by Playwright) while a
    job runs: the job's row, a non-empty throughput chart, the dataset's summary, no console errors."""
    sync_api = pytest.importorskip("playwright.sync_api")
    browser_path = chromium_path()
    if not browser_path:
        pytest.skip("no chromium on PATH (scripts/setup.d/30-chromium.sh installs Debian's package)")
    tmp, model = daemon_setup
    n = 20000
    inp = inputs(tmp, "in", n, seed=12)
    d = Daemon(tmp, model, tmp / "state")
    try:
        d.wait_listening()
        body = job_body(inp, tmp / "ds", max_tokens_per_batch=8, commit_every=50, commit_interval=0.2)
        job_id = d.request("POST", "/v1/jobs", body)[1]["id"]
        # The page itself needs no token; its data does.
        status, page = d.request("GET", "/", token=None)
        assert status == 200 and "hslake capture daemon" in page
        errors = []
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
            tab = browser.new_page()
            tab.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            tab.on("pageerror", lambda e: errors.append(str(e)))
            tab.goto(f"{d.url}/#token={TOKEN}")
            tab.wait_for_selector(f"#jobs tr[data-job='{job_id}']", timeout=30000)
            # Two refreshes a second apart while tokens flow give the chart its first segment.
            tab.wait_for_function("document.querySelector('#throughput polyline') !== null", timeout=30000)
            assert d.request("GET", f"/v1/jobs/{job_id}")[1]["state"] == "running", "the job ended too soon"
            row = tab.inner_text(f"#jobs tr[data-job='{job_id}']")
            assert "running" in row and f"file://{tmp / 'ds'}" in row, row
            points = tab.get_attribute("#throughput polyline", "points").split()
            assert len(points) >= 1
            tab.wait_for_function("document.querySelector('#datasets tbody').innerText.includes('layer_0')",
                                  timeout=30000)
            datasets = tab.inner_text("#datasets tbody")
            assert f"file://{tmp / 'ds'}" in datasets and "layer_0, layer_1, final_norm" in datasets, datasets
            tab.screenshot(path=str(tmp / "dashboard.png"), full_page=True)
            browser.close()
        assert errors == [], errors
        assert (tmp / "dashboard.png").stat().st_size > 0
        d.request("DELETE", f"/v1/jobs/{job_id}")
        assert d.wait_job(job_id)["state"] == "cancelled"
    finally:
        assert d.stop() == 0


def test_a_job_failing_mid_run_is_failed_with_its_cause_and_the_next_job_runs(tmp_path):
    torch.manual_seed(13)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB)
    model = randomize(LlamaForCausalLM(cfg).float().eval(), seed=13)
    with torch.no_grad():
        # Every final_norm state becomes NaN, which the writer refuses: known only once the job runs.
        model.model.norm.weight[0] = float("nan")
    path = save_model(model, tmp_path / "m")
    inp = inputs(tmp_path, "in", 30, seed=13)
    d = Daemon(tmp_path, path, tmp_path / "state")
    try:
        d.wait_listening()
        status, bad = d.request("POST", "/v1/jobs", job_body(inp, tmp_path / "nan"))
        assert status == 201, bad
        status, good = d.request("POST", "/v1/jobs", job_body(inp, tmp_path / "ok", final_norm=False))
        assert status == 201, good
        failed = d.wait_job(bad["id"])
        assert failed["state"] == "failed" and "NaN" in failed["error"], failed
        assert d.wait_job(good["id"])["state"] == "done"
        assert d.cli("wait", bad["id"], check=False).returncode == 1
        assert d.proc.poll() is None
    finally:
        assert d.stop() == 0
    states = [h["state"] for h in status_history(tmp_path / "state", bad["id"])]
    assert states == ["running", "failed"]
    got, _ = read_dataset(tmp_path / "ok")
    assert sorted(got) == list(range(30))


@pytest.mark.parametrize("fault,cause", [
    ("1:12", "injected failure"),
    # An allocation libtorch refuses: the job's record names the error and the knobs to lower.
    ("1:12:oom", "out of memory: "),
])
def test_a_lost_rank_fails_its_job_with_the_cause_and_the_daemon_exits_non_zero(daemon_setup, fault, cause):
    tmp, model = daemon_setup
    # Only a test build reads HSLAKE_TEST_FAIL_ALL_REDUCE; a normal one never looks at it.
    version = subprocess.run([hslake_gpu_bin(), "--version"], capture_output=True, text=True, check=True).stdout
    if "with test fault injection" not in version:
        pytest.skip("this hslake-gpu is built without test fault injection; "
                    "`cargo test` (scripts/test.sh runs it) builds one that has it")
    inp = inputs(tmp, "in", 30, seed=17)
    # Rank 1 of the in-process TP group fails its 12th all-reduce (the job's third batch): the
    # ranks cannot run another job, so the daemon must record the failure and exit, not hang.
    env = dict(os.environ, HSLAKE_TEST_FAIL_ALL_REDUCE=fault)
    d = Daemon(tmp, model, tmp / "state", extra=("--tp", "2"), env=env)
    try:
        d.wait_listening()
        status, job = d.request("POST", "/v1/jobs", job_body(inp, tmp / "ds", max_tokens_per_batch=24))
        assert status == 201, job
        code = d.proc.wait(timeout=120)
    finally:
        d.stop()
    assert code != 0
    log = (tmp / "daemon.log").read_text()
    assert "cannot run more jobs" in log and cause in log and "panicked" not in log, log[-2000:]
    history = status_history(tmp / "state", job["id"])
    assert [h["state"] for h in history] == ["running", "failed"], history
    assert cause in history[-1]["error"]
    if fault.endswith(":oom"):
        assert "--max-tokens-per-batch" in history[-1]["error"], history[-1]["error"]


def open_fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def proc_bytes(pid, field):
    """A /proc/PID/status memory field (VmRSS, VmHWM) in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"/proc/{pid}/status has no {field}")


# The CI form floods with 2,000 connections for 6 s; docs/PERFORMANCE.md's figures come from
# benchmarks/cpu/daemon.sh, which sets these to 20,000 and longer.
FLOOD_CONNECTIONS = int(os.environ.get("HSLAKE_FLOOD_CONNECTIONS", "2000"))
FLOOD_SECONDS = float(os.environ.get("HSLAKE_FLOOD_SECONDS", "6"))


def test_a_flood_of_half_open_connections_leaves_the_api_answering_within_a_second(daemon_setup):
    """A client holding thousands of connections that never finish their headers gets its share
    (--max-connections-per-client) for --header-timeout at a time; everyone else is answered at
    once, and the daemon's descriptors stay under --max-connections."""
    tmp, model = daemon_setup
    cap, per_client = 256, 64
    d = Daemon(tmp, model, tmp / "state", extra=("--max-connections", str(cap), "--max-connections-per-client",
                                                 str(per_client), "--header-timeout", "2s"))
    flood = None
    try:
        d.wait_ready()
        idle_fds = open_fds(d.proc.pid)
        flood = Flooders(d.port, FLOOD_CONNECTIONS, "127.0.0.2")
        flood.wait_opened(FLOOD_CONNECTIONS)
        latencies, peak_fds = [], 0
        end = time.time() + FLOOD_SECONDS
        while time.time() < end:
            for path, token in (("/v1/jobs", TOKEN), ("/healthz", None)):
                t = time.perf_counter()
                status, _ = d.request("GET", path, token=token)
                latencies.append(time.perf_counter() - t)
                assert status == 200, (path, status)
            peak_fds = max(peak_fds, open_fds(d.proc.pid))
            time.sleep(0.05)
        held, opened, closed = flood.total("open"), flood.total("opened"), flood.total("closed")
        stats = {"connections": FLOOD_CONNECTIONS, "requests": len(latencies),
                 "p50_ms": 1000 * statistics.median(latencies),
                 "p99_ms": 1000 * sorted(latencies)[int(0.99 * (len(latencies) - 1))],
                 "max_ms": 1000 * max(latencies), "idle_fds": idle_fds, "peak_fds": peak_fds,
                 "flood_open": held, "flood_opened": opened, "closed_by_server": closed}
        print("flood:", json.dumps(stats))
        assert max(latencies) < 1.0, stats
        assert peak_fds - idle_fds <= cap, stats
        # Refused or cut off at the header deadline, not absorbed: the server closed far more
        # connections than the client's share.
        assert closed >= FLOOD_CONNECTIONS - per_client, stats
    finally:
        if flood:
            flood.stop()
        assert d.stop() == 0
    log = (tmp / "daemon.log").read_text()
    assert "refusing connections: 127.0.0.2 holds --max-connections-per-client 64" in log, log[-2000:]


def big_input(path, mb, seed):
    """JSONL of 512-token samples, about `mb` MB."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        while f.tell() < mb * 1_000_000:
            ids = rng.integers(0, VOCAB, (256, 512))
            f.write("".join('{"input_ids": [' + ", ".join(map(str, row)) + "]}\n" for row in ids.tolist()))
    return path


# The CI form: 50 MB submissions against --max-job-bytes 20MB. benchmarks/cpu/daemon.sh runs
# 500 MB ones against 200MB (docs/PERFORMANCE.md).
SUBMISSION_MB = int(os.environ.get("HSLAKE_SUBMISSION_MB", "50"))


def test_concurrent_large_submissions_are_refused_or_spooled_within_a_memory_bound(daemon_setup):
    """Six submissions at once: three inputs over --max-job-bytes are refused with 413 before a byte
    is read; three valid ones are checked at most --max-spool-bytes at a time (the rest told 503,
    and retried), and all three are queued and run. The daemon's peak memory stays within a bound."""
    tmp, model = daemon_setup
    job_mb = SUBMISSION_MB * 2 // 5
    too_big = [big_input(tmp / f"big{i}.jsonl", SUBMISSION_MB, seed=i) for i in range(3)]
    valid = [big_input(tmp / f"ok{i}.jsonl", job_mb * 3 // 5, seed=10 + i) for i in range(3)]
    d = Daemon(tmp, model, tmp / "state",
               extra=("--max-job-bytes", f"{job_mb}MB", "--max-spool-bytes", f"{job_mb * 3 // 2}MB"))
    try:
        d.wait_ready()
        idle = proc_bytes(d.proc.pid, "VmRSS")
        peak, watching = [idle], [True]

        def watch():
            while watching[0]:
                peak[0] = max(peak[0], proc_bytes(d.proc.pid, "VmRSS"))
                time.sleep(0.01)

        watcher = threading.Thread(target=watch)
        watcher.start()
        answers, start = {}, threading.Barrier(6)

        def submit(inp, retry):
            # A one-in-a-thousand shard keeps the runs short; the whole input is still checked.
            body = job_body(inp, tmp / f"ds-{inp.stem}", shard="0/1000")
            start.wait()
            seen = []
            deadline = time.time() + 300
            while time.time() < deadline:
                status, answer = d.request("POST", "/v1/jobs", body)
                seen.append((status, answer))
                if not (retry and status == 503):
                    break
                time.sleep(0.2)
            answers[inp.name] = seen

        threads = [threading.Thread(target=submit, args=(p, p in valid)) for p in too_big + valid]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        ids = []
        for p in too_big:
            [(status, answer)] = answers[p.name]
            assert status == 413 and f"at most {job_mb}MiB (--max-job-bytes)" in answer["error"], answer
        for p in valid:
            status, answer = answers[p.name][-1]
            assert status == 201, answer
            ids.append(answer["id"])
        busy = [a for p in valid for s, a in answers[p.name] if s == 503]
        assert busy and all("--max-spool-bytes" in a["error"] for a in busy), answers
        # Charged what a check may hold, more than the input's bytes: by bytes two of these
        # checks fit in the spool at once, by what they hold one does.
        assert all("checking this input may take" in a["error"] for a in busy), busy
        assert [d.wait_job(i)["state"] for i in ids] == ["done"] * 3
        watching[0] = False
        watcher.join()
        peak_rss = max(peak[0], proc_bytes(d.proc.pid, "VmHWM"))
        growth_mb = (peak_rss - idle) / 2**20
        print("submissions:", json.dumps({"submission_mb": SUBMISSION_MB, "max_job_mb": job_mb,
                                          "idle_rss_mb": idle / 2**20, "peak_growth_mb": growth_mb}))
        # Three parses at once of the refused inputs alone would take ~10x their size; the bound is
        # what the checks may hold (--max-spool-bytes, 1.5 x --max-job-bytes) plus a run.
        assert growth_mb < 10 * job_mb, growth_mb
        assert d.proc.poll() is None
    finally:
        assert d.stop() == 0


def one_token_samples(path, mb, ids=True):
    """JSONL of one-token samples, about `mb` MB: the most records a byte, with integer ids the
    most a check holds (the ids seen), and the most memory a byte once read."""
    with open(path, "w") as f:
        i = 0
        while f.tell() < mb * 1_000_000:
            f.write("".join((f'{{"id":{j},"input_ids":[1]}}\n' if ids else '{"input_ids":[1]}\n')
                            for j in range(i, i + 10_000)))
            i += 10_000
    return path


def test_a_check_is_charged_what_it_holds_and_samples_past_max_job_bytes_are_refused(daemon_setup):
    """What a submission costs once read, not its bytes: the check of an input is charged what it
    may hold (1 MiB plus 1.25 times the input, 25-byte records with integer ids being the most),
    and the memory a check of the worst input actually took stays under that; an input whose
    samples would take more than --max-job-bytes in memory (one-token samples: 197 bytes each
    from 18 bytes of JSON) is refused by name although its file is small enough; and a
    --max-spool-bytes below what the largest input's check may take is refused at start."""
    tmp, model = daemon_setup
    # 20 MB of 25-byte records with ids (800,000 ids): the run keeps one shard in a thousand.
    worst = one_token_samples(tmp / "worst.jsonl", 20)
    size = worst.stat().st_size
    charged = 2**20 + size * 5 // 4
    dense = one_token_samples(tmp / "dense.jsonl", 6, ids=False)
    d = Daemon(tmp, model, tmp / "state", extra=("--max-job-bytes", "24MB", "--max-spool-bytes", "32MB"))
    try:
        d.wait_ready()
        idle = proc_bytes(d.proc.pid, "VmRSS")
        status, answer = d.request("POST", "/v1/jobs", job_body(worst, tmp / "ds-worst", shard="0/1000"))
        # The check's peak, read as it answers (the job then runs, and holds memory of its own).
        grew = proc_bytes(d.proc.pid, "VmHWM") - idle
        assert status == 201, answer
        print("check:", json.dumps({"input_mb": size / 1e6, "charged_mb": charged / 1e6, "grew_mb": grew / 1e6}))
        # The reader read all of it into records before: about 12 times its size.
        assert grew < charged, (grew, charged)
        assert d.wait_job(answer["id"])["state"] == "done"

        status, answer = d.request("POST", "/v1/jobs", job_body(dense, tmp / "ds-dense"))
        assert status == 413, answer
        assert "samples take more than 25165824 bytes in memory once read" in answer["error"], answer
        assert "(--max-job-bytes)" in answer["error"], answer
        assert not (tmp / "ds-dense").exists()
    finally:
        assert d.stop() == 0
    small = Daemon(tmp, model, tmp / "state2", log_name="small.log",
                   extra=("--max-job-bytes", "24MB", "--max-spool-bytes", "24MB"))
    assert small.proc.wait(timeout=60) != 0
    small.stop()
    log = (tmp / "small.log").read_text()
    assert "a job of the largest size could never be checked" in log, log[-2000:]


def test_the_job_list_comes_in_pages_filtered_by_state(daemon_setup):
    tmp, model = daemon_setup
    small = inputs(tmp, "small", 4, seed=4)
    d = Daemon(tmp, model, tmp / "state")
    try:
        d.wait_ready()
        ids = [d.request("POST", "/v1/jobs", job_body(small, tmp / f"ds{i}"))[1]["id"] for i in range(7)]
        for i in ids:
            d.wait_job(i)
        assert d.request("DELETE", f"/v1/jobs/{ids[0]}")[0] == 409
        seen, after, pages = [], 0, 0
        while True:
            status, page = d.request("GET", f"/v1/jobs?limit=3&after={after}")
            assert status == 200 and len(page["jobs"]) <= 3, page
            seen += [j["id"] for j in page["jobs"]]
            pages += 1
            if page["next"] is None:
                break
            after = page["next"]
        assert seen == ids and pages == 3
        status, page = d.request("GET", "/v1/jobs?state=queued,running")
        assert status == 200 and page == {"jobs": [], "next": None}
        status, page = d.request("GET", f"/v1/jobs?state=done&after={ids[4]}")
        assert [j["id"] for j in page["jobs"]] == ids[5:]
        for query, message in [("limit=0", "limit=\"0\": expected 1 to 1000"), ("limit=5000", "expected 1 to 1000"),
                               ("after=x", "expected a job id"), ("state=finished", "state=\"finished\""),
                               ("sort=id", "unknown query parameter \"sort\"")]:
            status, answer = d.request("GET", f"/v1/jobs?{query}")
            assert status == 400 and message in answer["error"], (query, answer)
        ls = d.cli("ls", "--state", "done").stdout
        assert sum(" done " in line for line in ls.splitlines()) == 7, ls
    finally:
        assert d.stop() == 0


HOSTILE = {
    "img": '<img src=x onerror="window.__xss=1">',
    "script": "<script>window.__xss=2<",
    "attr": '"><svg onload=window.__xss=3>',
}


def test_the_dashboard_shows_hostile_job_values_as_text_and_runs_no_script(daemon_setup):
    """Markup in an input path, an output path and (through them) an error message: the dashboard
    in Chromium shows each as literal text, creates no element from it and runs none of it. Its
    job table comes a page at a time."""
    sync_api = pytest.importorskip("playwright.sync_api")
    browser_path = chromium_path()
    if not browser_path:
        pytest.skip("no chromium on PATH (scripts/setup.d/30-chromium.sh installs Debian's package)")
    tmp, model = daemon_setup
    hostile_in = tmp / (HOSTILE["img"] + ".jsonl")
    write_jsonl(hostile_in, random_samples([5, 6], VOCAB, seed=1))
    hostile_out = tmp / HOSTILE["script"] / "script>" / HOSTILE["attr"]
    d = Daemon(tmp, model, tmp / "state")
    try:
        d.wait_ready()
        # Job 1 keeps the engine busy while job 2 loses its input: when 1 is cancelled, 2 fails
        # with an error naming the hostile path, 3 (hostile paths) runs, and 4 keeps the engine
        # busy again so that the 50 after it stay queued.
        big = inputs(tmp, "big", 20000, seed=12)
        gone = tmp / (HOSTILE["attr"] + ".jsonl")
        write_jsonl(gone, random_samples([5], VOCAB, seed=2))
        bodies = [job_body(big, tmp / "busy1", max_tokens_per_batch=8), job_body(gone, tmp / "gone-ds"),
                  job_body(hostile_in, hostile_out), job_body(big, tmp / "busy2", max_tokens_per_batch=8)]
        for i, body in enumerate(bodies, start=1):
            status, job = d.request("POST", "/v1/jobs", body)
            assert status == 201 and job["id"] == i, job
        os.remove(gone)
        small = inputs(tmp, "small", 3, seed=3)
        fillers = [d.request("POST", "/v1/jobs", job_body(small, tmp / f"f{i}"))[1]["id"] for i in range(50)]
        assert fillers[-1] == 54
        d.request("DELETE", "/v1/jobs/1")
        failed = d.wait_job(2)
        assert failed["state"] == "failed" and HOSTILE["attr"] in failed["error"], failed
        assert d.wait_job(3)["state"] == "done"
        dialogs, errors = [], []
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
            tab = browser.new_page()
            tab.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
            tab.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            tab.on("pageerror", lambda e: errors.append(str(e)))
            tab.goto(f"{d.url}/#token={TOKEN}")
            tab.wait_for_selector("#jobs tr[data-job='3']", timeout=30000)
            assert "running" in tab.inner_text("#jobs tr[data-job='4']")
            tab.wait_for_function("document.querySelector('#datasets tbody').innerText.includes('onload')",
                                  timeout=30000)
            text = tab.inner_text("#jobs tbody")
            assert str(hostile_out) in text, text
            assert HOSTILE["attr"] in tab.inner_text("#jobs tr[data-job='2']")
            assert f"file://{hostile_out}" in tab.inner_text("#datasets tbody")
            # Nothing of it became markup: no element but the progress bars' spans, no script ran.
            made = tab.evaluate("""[...document.querySelectorAll('#jobs tbody *, #datasets tbody *')]
                .map(e => e.tagName).filter(t => !['TR', 'TD', 'SPAN'].includes(t))""")
            assert made == [], made
            assert tab.evaluate("window.__xss") is None
            # 54 jobs: the first page holds 50, the next the rest; the filter narrows to one state.
            assert tab.locator("#jobs tbody tr").count() == 50
            assert tab.inner_text("#page") == "page 1"
            tab.click("#next-page")
            tab.wait_for_selector("#jobs tr[data-job='54']", timeout=10000)
            assert tab.locator("#jobs tbody tr").count() == 4
            tab.click("#prev-page")
            tab.wait_for_selector("#jobs tr[data-job='1']", timeout=10000)
            tab.select_option("#state-filter", "failed")
            tab.wait_for_function("document.querySelectorAll('#jobs tbody tr').length === 1", timeout=10000)
            assert tab.inner_text("#jobs tbody tr").startswith("2")
            browser.close()
        assert dialogs == [] and errors == [], (dialogs, errors)
        d.request("DELETE", "/v1/jobs/4")
    finally:
        assert d.stop() == 0


def test_a_streaming_daemon_exports_its_passes_and_writes_what_a_resident_capture_writes(daemon_setup):
    tmp, model = daemon_setup
    inp = inputs(tmp, "in", 30, seed=4)
    d = Daemon(tmp, model, tmp / "state", extra=("--placement", "stream", "--pass-tokens", "96"))
    try:
        d.wait_ready()
        status, job = d.request("POST", "/v1/jobs", job_body(inp, tmp / "ds"))
        assert status == 201, job
        assert d.wait_job(job["id"])["state"] == "done"
        status, text = d.request("GET", "/metrics")
        assert status == 200
        samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
        passes = sum(s.value for s in samples if s.name == "hslake_capture_stream_passes_total")
        assert passes >= 2, text
        last = {s.labels["figure"]: s.value for s in samples
                if s.name == "hslake_capture_stream_last_pass" and s.labels["stream"] == "0"}
        assert set(last) == {"tokens", "layers", "copy_gb_per_second", "compute_seconds", "hidden_share",
                             "first_sample_seconds", "seconds"}, last
        assert 0 < last["tokens"] <= 96 + 48 and last["layers"] == 2 and 0 <= last["hidden_share"] <= 1, last
    finally:
        assert d.stop() == 0
    assert "stream 0 pass:" in open(tmp / "daemon.log").read()
    run_capture(model, inp, tmp / "one", LAYERS, "--placement", "resident", "--max-tokens-per-batch", 48,
                final_norm=True)
    assert_same_dataset(tmp / "ds", tmp / "one")
    verify(tmp / "ds")
