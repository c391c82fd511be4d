"""Issue 44's items 4 and 5 at full size, on the CPU: what the capture daemon holds while it
checks large job inputs, and what one rendering of a hostile chat template takes.

- daemon: `hslake serve-capture` with a tiny Llama, one input of `--mb` MB (512-token samples,
  as tests/python/test_capture_daemon.py writes them) submitted alone, then six times at once
  under the default limits and under `--max-spool-bytes 1GB` (with the largest `--max-job-bytes`
  that allows). Each job captures one shard in a thousand, so the figures are the checks'; a
  submission told 503 retries. Prints the daemon's idle and peak resident memory (VmRSS sampled
  every 10 ms, and VmHWM) and how long until every submission was queued.
- templates: `hslake prepare` over one conversation with each of the issue's two templates as
  the model's chat template (SmolLM2's tokenizer), and with SmolLM2's own as the baseline: exit
  status, wall time, peak resident memory, and the reason the record was left out.

Prints one JSON object a line; `--out DIR` also writes them to DIR/hostile_inputs.jsonl.
Usage: .venv/bin/python benchmarks/cpu/hostile_inputs.py --mb 500 --out DIR
(needs the binaries scripts/setup.sh builds and ~1 GB free for the input).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "python"))

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from capture_util import hslake_bin, randomize, save_model  # noqa: E402
from test_capture_daemon import TOKEN, VOCAB, Daemon, big_input, job_body, proc_bytes  # noqa: E402

TEMPLATES = {
    "split": "{{ ('x' * 100000000).split('')|length }}",
    "doubling": "{% set ns=namespace(l=[1]) %}{% for i in range(40) %}{% set ns.l = ns.l + ns.l %}{% endfor %}",
}


def emit(out, record):
    line = json.dumps(record)
    print(line, flush=True)
    if out:
        with open(out / "hostile_inputs.jsonl", "a") as f:
            f.write(line + "\n")


class Peak:
    """The largest VmRSS of a process, sampled every 10 ms until stopped."""

    def __init__(self, pid):
        self.pid, self.peak, self.running = pid, 0, True
        self.thread = threading.Thread(target=self.watch)
        self.thread.start()

    def watch(self):
        while self.running:
            self.peak = max(self.peak, proc_bytes(self.pid, "VmRSS"))
            time.sleep(0.01)

    def stop(self):
        self.running = False
        self.thread.join()
        return max(self.peak, proc_bytes(self.pid, "VmHWM"))


def post(d, body):
    """POST /v1/jobs, waiting as long as a check of a large input takes (Daemon.request: 30 s)."""
    req = urllib.request.Request(d.url + "/v1/jobs", data=json.dumps(body).encode(), method="POST")
    req.add_header("Authorization", f"Bearer {TOKEN}")
    try:
        with urllib.request.urlopen(req, timeout=3600) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def submissions(tmp, model, inp, n, extra, name):
    """Runs a daemon, submits `inp` n times at once, and returns its memory and timing."""
    d = Daemon(tmp, model, tmp / f"state-{name}", log_name=f"daemon-{name}.log", extra=extra)
    try:
        d.wait_ready()
        idle = proc_bytes(d.proc.pid, "VmRSS")
        peak = Peak(d.proc.pid)
        start, answers = time.time(), {}
        barrier = threading.Barrier(n)

        def submit(i):
            body = job_body(inp, tmp / f"ds-{name}-{i}", shard="0/1000")
            barrier.wait()
            busy = 0
            while True:
                status, answer = post(d, body)
                if status != 503:
                    answers[i] = (status, answer, busy, time.time() - start)
                    return
                busy += 1
                time.sleep(0.5)

        threads = [threading.Thread(target=submit, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        queued = time.time() - start
        states = [d.wait_job(a[1]["id"], timeout=3600)["state"] for a in answers.values() if a[0] == 201]
        top = peak.stop()
        return {"daemon": name, "flags": " ".join(extra), "submissions": n,
                "input_bytes": inp.stat().st_size, "statuses": sorted(a[0] for a in answers.values()),
                "told_503": sum(a[2] for a in answers.values()), "seconds_until_all_queued": round(queued, 1),
                "job_states": states, "idle_rss_mb": round(idle / 1e6), "peak_rss_mb": round(top / 1e6),
                "growth_mb": round((top - idle) / 1e6),
                "growth_per_input_byte": round((top - idle) / inp.stat().st_size, 2)}
    finally:
        d.stop()


def template_run(tmp, name, text):
    """`hslake prepare` with `text` as the chat template: what became of the one conversation."""
    model = tmp / f"model-{name}"
    shutil.copytree(ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct", model,
                    ignore=shutil.ignore_patterns("*.safetensors"))
    (model / "chat_template.jinja").write_text(text)
    inp = tmp / "conversation.jsonl"
    inp.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                            {"role": "assistant", "content": "hello"}]}) + "\n")
    rejects = tmp / f"rejects-{name}.jsonl"
    cmd = [hslake_bin(), "prepare", "--model", str(model), "--input", str(inp),
           "--output", str(tmp / f"out-{name}.jsonl"), "--rejects", str(rejects)]
    # Peak memory from GNU time, whose own small process forks hslake: a child of this Python
    # process would report the interpreter's resident memory from before its exec (torch's).
    peak_file = tmp / f"peak-{name}"
    start = time.time()
    proc = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", str(peak_file), *cmd], capture_output=True, text=True)
    wall = time.time() - start
    stderr = proc.stderr
    peak_kib = int(peak_file.read_text().split()[-1])
    reasons = [json.loads(line).get("reason") for line in rejects.read_text().splitlines()] if rejects.exists() else []
    # GNU time reports a child killed by a signal as "Command terminated by signal N" first.
    signal = next((int(w.split()[-1]) for w in peak_file.read_text().splitlines() if "signal" in w), None)
    return {"template": name, "exit": -signal if signal else proc.returncode, "seconds": round(wall, 2),
            "peak_rss_mb": round(peak_kib / 1e3), "left_out": reasons, "stderr_tail": stderr[-300:]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=500, help="size of the job input")
    ap.add_argument("--out", type=Path, help="also write the JSON lines here")
    ap.add_argument("--skip-daemon", action="store_true")
    ap.add_argument("--skip-templates", action="store_true")
    a = ap.parse_args()
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="hostile-inputs-"))
    try:
        if not a.skip_templates:
            own = (ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct" / "chat_template.jinja").read_text()
            for name, text in [("smollm2-own (baseline)", own), *TEMPLATES.items()]:
                emit(a.out, template_run(tmp, name.split()[0], text) | {"template": name})
        if not a.skip_daemon:
            torch.manual_seed(11)
            cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=VOCAB)
            model = save_model(randomize(LlamaForCausalLM(cfg).float().eval(), seed=11), tmp / "m")
            inp = big_input(tmp / "input.jsonl", a.mb, seed=1)
            emit(a.out, submissions(tmp, model, inp, 1, (), "one-input-default-limits"))
            emit(a.out, submissions(tmp, model, inp, 6, (), "six-inputs-default-limits"))
            # Near the largest --max-job-bytes a 1 GB spool can check (1 MiB + 1.25 times it).
            emit(a.out, submissions(tmp, model, inp, 6, ("--max-job-bytes", "799MB", "--max-spool-bytes", "1GB"),
                                    "six-inputs-spool-1GB"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
