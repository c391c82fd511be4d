#!/usr/bin/env python3
"""Loader benchmark: hslake vs. one torch.save file per sample read with torch.load.

Writes one synthetic dataset with hslake, exports the very same samples as one torch.save file
per sample in SpecForge's layout (input_ids [T], loss_mask [T], aux_hidden_state [1, T, 3H],
hidden_state [1, T, H]), then reads a full shuffled epoch with
  1. torch DataLoader (torch.load per file, shuffle, pad-collate, `--workers` worker processes),
  2. hslake.Loader from local disk (`--workers` decode threads),
  3. hslake.Loader from a loopback S3 server (moto_server, started here unless
     HSLAKE_TEST_S3_ENDPOINT is set),
each in a fresh subprocess, and reports tokens/s, bytes on disk, peak RSS (summed over the
reader's process tree, sampled every 50 ms) and time to first batch (from building the
loader to holding the first batch). All readers deliver the same padded batch: input_ids,
loss_mask, attention_mask [B, T], aux [B, T, 3H] and target [B, T, H] in bf16.

Build the module optimised first:  cargo build --release -p hslake-python && bash scripts/python_module.sh release
Usage: .venv/bin/python scripts/bench_loader.py --samples 100000 --hidden 16 --out /tmp/hsbench
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

LAYERS = [1, 2, 3]


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            pass
    return total


def run_child(args: list[str], env: dict | None = None) -> dict:
    p = subprocess.Popen([sys.executable, __file__, "--child", *args], stdout=subprocess.PIPE, env=env)
    peak = 0
    while p.poll() is None:
        peak = max(peak, tree_rss(p.pid))
        time.sleep(0.05)
    out = p.stdout.read().decode()
    if p.returncode != 0:
        raise SystemExit(f"child {args} failed ({p.returncode}): {out}")
    r = json.loads(out.strip().splitlines()[-1])
    r["peak_rss"] = peak
    return r


def dir_bytes(d: Path) -> tuple[int, int]:
    """(apparent bytes, allocated bytes) of the files under d."""
    app = alloc = 0
    for root, _, files in os.walk(d):
        for f in files:
            st = os.stat(os.path.join(root, f))
            app += st.st_size
            alloc += st.st_blocks * 512
    return app, alloc


# --- children: one reader each ------------------------------------------------------------

def child_torch(pt_dir: str, batch_size: int, workers: int, max_seconds: float) -> dict:
    import torch

    files = sorted(Path(pt_dir).glob("*.pt"))

    class PtFiles(torch.utils.data.Dataset):
        def __len__(self):
            return len(files)

        def __getitem__(self, i):
            return torch.load(files[i])

    def pad_collate(items):
        n = len(items)
        t = max(x["input_ids"].shape[0] for x in items)
        h = items[0]["hidden_state"].shape[-1]
        k = items[0]["aux_hidden_state"].shape[-1]
        ids = torch.zeros(n, t, dtype=torch.long)
        mask = torch.zeros(n, t, dtype=torch.long)
        att = torch.zeros(n, t, dtype=torch.long)
        aux = torch.zeros(n, t, k, dtype=torch.bfloat16)
        tgt = torch.zeros(n, t, h, dtype=torch.bfloat16)
        for i, x in enumerate(items):
            m = x["input_ids"].shape[0]
            ids[i, :m] = x["input_ids"]
            mask[i, :m] = x["loss_mask"]
            att[i, :m] = 1
            aux[i, :m] = x["aux_hidden_state"][0]
            tgt[i, :m] = x["hidden_state"][0]
        return {"input_ids": ids, "loss_mask": mask, "attention_mask": att,
                "aux_hidden_states": aux, "target_hidden_states": tgt}

    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    dl = torch.utils.data.DataLoader(PtFiles(), batch_size=batch_size, shuffle=True, num_workers=workers,
                                     collate_fn=pad_collate, generator=g, persistent_workers=False)
    return drain(dl, t0, max_seconds)


def child_hslake(url: str, batch_size: int, workers: int, max_seconds: float, window: int, prefetch: int) -> dict:
    import hslake

    t0 = time.perf_counter()
    loader = hslake.Loader(url, batch_size=batch_size, decode_threads=workers, seed=0, shuffle=True,
                           shuffle_window=window, prefetch_row_groups=prefetch, aux_layers=LAYERS,
                           target="final_norm")
    return drain(loader, t0, max_seconds)


def own_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def drain(it, t0: float, max_seconds: float) -> dict:
    rss0 = own_rss()  # after importing torch (and hslake): the part no loader setting changes
    first = None
    tokens = samples = batches = 0
    for b in it:
        if first is None:
            first = time.perf_counter() - t0
        tokens += int(b["attention_mask"].sum())
        samples += b["input_ids"].shape[0]
        batches += 1
        if time.perf_counter() - t0 > max_seconds:
            break
    secs = time.perf_counter() - t0
    return {"tokens": tokens, "samples": samples, "batches": batches, "seconds": secs, "first_batch_s": first,
            "rss_after_import": rss0}


# --- setup ------------------------------------------------------------------------------------

def export_pt(url: str, pt_dir: Path) -> None:
    """The same samples as one torch.save file per sample, SpecForge layout."""
    import hslake
    import torch

    pt_dir.mkdir(parents=True)
    loader = hslake.Loader(url, batch_size=256, shuffle=False, aux_layers=LAYERS, target="final_norm")
    for b in loader:
        lens = b["attention_mask"].sum(1).tolist()
        for i, sid in enumerate(b["sample_ids"].tolist()):
            n = lens[i]
            torch.save({
                "input_ids": b["input_ids"][i, :n].clone(),
                "loss_mask": b["loss_mask"][i, :n].clone(),
                "aux_hidden_state": b["aux_hidden_states"][i, :n].clone().unsqueeze(0),
                "hidden_state": b["target_hidden_states"][i, :n].clone().unsqueeze(0),
            }, pt_dir / f"{sid:08d}.pt")


def start_moto() -> tuple[subprocess.Popen, str]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    moto = shutil.which("moto_server") or str(Path(sys.executable).parent / "moto_server")
    p = subprocess.Popen([moto, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    import urllib.request
    for _ in range(100):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/")
            break
        except OSError:
            time.sleep(0.1)
    return p, f"http://127.0.0.1:{port}"


def upload(local: Path, endpoint: str, bucket: str, prefix: str) -> None:
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                      region_name="us-east-1")
    s3.create_bucket(Bucket=bucket)
    for root, _, files in os.walk(local):
        for f in files:
            full = Path(root) / f
            s3.upload_file(str(full), bucket, f"{prefix}/{full.relative_to(local)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--seq-len", default="32:160")
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2, help="torch DataLoader workers = hslake decode threads")
    ap.add_argument("--row-group-mb", type=float, default=4.0)
    ap.add_argument("--shuffle-window", type=int, default=16)
    ap.add_argument("--prefetch-row-groups", type=int, default=4)
    ap.add_argument("--skip-torch", action="store_true", help="only the hslake readers")
    ap.add_argument("--max-seconds", type=float, default=600.0, help="stop a reader after this long")
    ap.add_argument("--out", default="/tmp/hslake-bench")
    ap.add_argument("--skip-s3", action="store_true")
    ap.add_argument("--keep", action="store_true", help="reuse the datasets in --out if present")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()

    if a.child:
        kind, *rest = a.child
        if kind == "torch":
            r = child_torch(rest[0], int(rest[1]), int(rest[2]), float(rest[3]))
        else:
            r = child_hslake(rest[0], int(rest[1]), int(rest[2]), float(rest[3]), int(rest[4]), int(rest[5]))
        print(json.dumps(r))
        return

    import hslake

    out = Path(a.out)
    ds_dir, pt_dir = out / "hslake", out / "pt"
    lo, hi = (int(x) for x in a.seq_len.split(":"))
    if not (a.keep and ds_dir.exists() and pt_dir.exists()):
        shutil.rmtree(out, ignore_errors=True)
        t = time.perf_counter()
        hslake.write_synthetic(str(ds_dir), a.samples, (lo, hi), a.hidden, LAYERS, final_norm=True, seed=0,
                               row_group_bytes=int(a.row_group_mb * (1 << 20)), shard_bytes=64 << 20)
        print(f"wrote hslake dataset in {time.perf_counter() - t:.1f} s", file=sys.stderr)
        t = time.perf_counter()
        export_pt(f"file://{ds_dir}", pt_dir)
        print(f"wrote {a.samples} torch.save files in {time.perf_counter() - t:.1f} s", file=sys.stderr)

    counts = hslake.Dataset(str(ds_dir)).counts()
    results = {}
    common = [str(a.batch_size), str(a.workers), str(a.max_seconds)]
    hs = [str(a.shuffle_window), str(a.prefetch_row_groups)]
    if not a.skip_torch:
        results["torch.load files (DataLoader)"] = run_child(["torch", str(pt_dir), *common])
    results["hslake, local disk"] = run_child(["hslake", f"file://{ds_dir}", *common, *hs])
    moto = None
    if not a.skip_s3:
        endpoint = os.environ.get("HSLAKE_TEST_S3_ENDPOINT")
        if not endpoint:
            moto, endpoint = start_moto()
        try:
            bucket = f"bench-{os.getpid()}"
            t = time.perf_counter()
            upload(ds_dir, endpoint, bucket, "ds")
            print(f"uploaded to S3 in {time.perf_counter() - t:.1f} s", file=sys.stderr)
            env = dict(os.environ, AWS_ENDPOINT=endpoint, AWS_ALLOW_HTTP="true", AWS_ACCESS_KEY_ID="testing",
                       AWS_SECRET_ACCESS_KEY="testing", AWS_REGION="us-east-1")
            results["hslake, loopback S3 (moto)"] = run_child(
                ["hslake", f"s3://{bucket}/ds", *common, *hs], env)
        finally:
            if moto:
                moto.terminate()

    pt_bytes, pt_alloc = dir_bytes(pt_dir)
    ds_bytes, ds_alloc = dir_bytes(ds_dir)
    base = results.get("torch.load files (DataLoader)")
    base_tps = base["tokens"] / base["seconds"] if base else float("nan")
    print(f"\n{a.samples} samples, {counts['num_tokens']} tokens, seq_len {a.seq_len}, hidden {a.hidden}, "
          f"aux layers {LAYERS} + final_norm, bf16; batch {a.batch_size}, {a.workers} workers/threads; "
          f"shuffle_window {a.shuffle_window}, prefetch_row_groups {a.prefetch_row_groups}, "
          f"row groups of {a.row_group_mb} MiB raw; "
          f"{os.cpu_count()} CPUs")
    print(f"bytes on disk: torch.save files {pt_bytes / 1e6:.1f} MB ({pt_alloc / 1e6:.1f} MB allocated); "
          f"hslake {ds_bytes / 1e6:.1f} MB ({ds_alloc / 1e6:.1f} MB allocated); "
          f"raw tensors {counts['raw_bytes'] / 1e6:.1f} MB\n")
    print("| reader | samples | tokens/s | vs torch.load | first batch | peak RSS (tree) | RSS after imports |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in results.items():
        tps = r["tokens"] / r["seconds"]
        print(f"| {name} | {r['samples']} | {tps:,.0f} | {tps / base_tps:.1f}x | {r['first_batch_s']:.3f} s "
              f"| {r['peak_rss'] / 2**20:.0f} MiB | {r['rss_after_import'] / 2**20:.0f} MiB |")
    print(json.dumps({"results": results, "pt_bytes": pt_bytes, "hslake_bytes": ds_bytes, "counts": counts}))


if __name__ == "__main__":
    main()
