#!/usr/bin/env python3
"""Loader benchmark: hslake against its peers on the very same samples, in one run.

Writes one synthetic dataset with hslake, then the same samples (read back in storage order)
in each peer's format, and reads one full shuffled epoch with every reader, each in a fresh
subprocess:
  torch.load   one torch.save file per sample in SpecForge's offline layout
               (rows_*/data_{id}.ckpt: input_ids, loss_mask, hidden_state [1, T, H],
               aux_hidden_state [1, T, 3H]), loaded as SpecForge's load_feature_file does
               (torch.load, mmap=True), torch DataLoader, shuffle;
  safetensors  one safetensors file per sample in speculators' offline layout
               (hidden_states/hs_{i}.safetensors: hidden_states [T, 4, H] = aux layers then the
               target, token_ids [T]; input_ids and loss_mask in an Arrow index as its datasets
               directory), loaded with safetensors.torch.load_file as speculators' FileTransfer
               does, token ids checked against the index as its ArrowDataset does, DataLoader;
  lance take   pylance: `take()` of shuffled indices, one batch per call, DataLoader workers;
  lance ds     pylance's own `lance.torch.data.LanceDataset` (contiguous batches, the same
               order every epoch: no shuffle, shown as its upper bound);
  mosaicml     mosaicml-streaming MDS shards (zstd), `StreamingDataset(shuffle=True)`; each read is
               a first epoch (StreamingDataset keeps the shards it decompresses beside the zstd
               ones and reads those in later epochs: they are removed before each read);
  hslake       `hslake.Loader` from local disk, window shuffle (and from loopback S3 servers
               with --s3: moto, or --s3 moto,seaweedfs for both side by side);
  hslake_all   the same with one window of every row group: a per-sample permutation whose
               memory grows with the dataset;
  hslake_sample  `shuffle_mode="sample"`: a full per-sample permutation read in lookaheads
               of --lookahead-mb (one row per value given; memory bounded by the lookahead;
               also from S3 with --s3, the first value).
Peers use `--workers` DataLoader worker processes, hslake `--workers` decode threads; a comma
list (`--workers 1,2,4`) reads one epoch per reader and value. Every reader delivers the same
padded batch (input_ids, loss_mask, attention_mask [B, T], aux_hidden_states [B, T, 3H] and
target_hidden_states [B, T, H] in bf16, sample_ids [B]).

Correctness (the run fails, exit 1, if any reader is wrong): every sample exactly once per
epoch, and one probe sample's tensors bit-equal to what hslake wrote (sha256 of its
unpadded input_ids, loss_mask, aux and target bits).

Reported per reader: tokens/s over the epoch, decoded GB/s (the hidden states of the tokens
delivered: aux layers + target, bf16), epoch CPU seconds (user+system from building the reader
to the end of the epoch, its worker processes included, imports not) and from them GB per CPU
second (= per core) and, with --draft-tokens-per-s, the cores that draft step's rate needs,
time to the first batch (from building the reader), CPU seconds of the reader's whole process
tree (imports included), peak proportional set size
(PSS, summed over the tree, sampled every 50 ms: shared pages counted once), bytes on disk
and write time of its format, and the shuffle-mixing metric: distinct runs of 64
consecutive storage-order samples in a batch, averaged over full batches (a full per-sample
permutation gives about 30.5 for batches of 32; reading in storage order gives 1-2).

Peers (pylance, mosaicml-streaming) are installed into .venv on first use from
requirements-peers.txt with --no-deps, which leaves torch and numpy alone.
The hslake module must be optimised (scripts/setup.sh installs such a build); the script warns
loudly when it is not. Real EAGLE-3 sizes: benchmarks/cpu/loader_real.sh.

Usage: .venv/bin/python benchmarks/cpu/loader.py --samples 20000 --hidden 64 --out /tmp/hsbench
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The loopback S3 servers scripts/s3_server.sh starts.
S3_SERVERS = ("moto", "seaweedfs")
RUN = 64  # storage-order run length of the mixing metric
READERS = ["torch", "safetensors", "lance_take", "lance_dataset", "mosaicml", "hslake", "hslake_all", "hslake_sample"]
CHILD_IMPORTS = {"safetensors": ["safetensors.torch", "pyarrow"], "lance_take": ["lance"],
                 "lance_dataset": ["lance", "lance.torch.data"], "mosaicml": ["streaming"],
                 "hslake": ["hslake"], "hslake_all": ["hslake"], "hslake_sample": ["hslake"]}

# The modules each peer reader needs beyond torch (installed by ensure_peers when missing).
PEER_MODULES = {"lance_take": "lance", "lance_dataset": "lance", "mosaicml": "streaming"}
# Samples per rows_* folder: `hslake export --format specforge`'s default (--rows-per-dir).
SPECFORGE_ROWS_PER_DIR = 5000
# speculators' datasets directory keeps its rows in this one Arrow stream file.
SPECULATORS_INDEX = "data-00000-of-00001.arrow"


def tree_pids(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            pass
    return out


def tree_pss(pid: int) -> int:
    """Proportional set size of a process and its descendants: pages shared between them
    (torch's libraries in forked DataLoader workers) count once, not once per process."""
    total = 0
    for p in tree_pids(pid):
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            pass
    return total


def run_child(args: list[str], env: dict | None = None) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.Popen([sys.executable, __file__, "--child", *args], stdout=subprocess.PIPE, env=env)
    peak = 0
    while p.poll() is None:
        peak = max(peak, tree_pss(p.pid))
        time.sleep(0.05)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = p.stdout.read().decode()
    if p.returncode != 0:
        raise SystemExit(f"FAILED: reader {args[0]} exited with {p.returncode}: {out[-2000:]}")
    r = json.loads(out.strip().splitlines()[-1])
    r["peak_pss"] = peak
    r["cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return r


def dir_bytes(d: Path) -> int:
    """Allocated bytes of the files under d."""
    return sum(os.stat(os.path.join(r, f)).st_blocks * 512 for r, _, fs in os.walk(d) for f in fs)


# --- one padded batch, the same for every reader -----------------------------------------------

def pad_collate(items: list[dict]) -> dict:
    """Items of sample_id, input_ids [T], loss_mask [T], aux [T, 3H] and target [T, H] (bf16)."""
    import torch

    n = len(items)
    t = max(x["input_ids"].shape[0] for x in items)
    k = items[0]["aux"].shape[-1]
    h = items[0]["target"].shape[-1]
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
        aux[i, :m] = x["aux"]
        tgt[i, :m] = x["target"]
    return {"input_ids": ids, "loss_mask": mask, "attention_mask": att, "aux_hidden_states": aux,
            "target_hidden_states": tgt,
            "sample_ids": torch.tensor([int(x["sample_id"]) for x in items], dtype=torch.long)}


def arrow_items(table, hidden: int, k: int) -> list[dict]:
    """Rows of an Arrow table/batch (the Lance layout) as pad_collate items, without copies."""
    import numpy as np
    import torch

    cols = {c: table.column(c) for c in ("sample_id", "input_ids", "loss_mask", "aux", "target")}
    out = []
    for i in range(table.num_rows):
        ids = torch.from_numpy(cols["input_ids"][i].values.to_numpy(zero_copy_only=False))
        t = ids.shape[0]
        aux = np.frombuffer(cols["aux"][i].as_buffer(), dtype=np.int16).reshape(t, k * hidden)
        tgt = np.frombuffer(cols["target"][i].as_buffer(), dtype=np.int16).reshape(t, hidden)
        out.append({"sample_id": cols["sample_id"][i].as_py(), "input_ids": ids,
                    "loss_mask": torch.from_numpy(cols["loss_mask"][i].values.to_numpy(zero_copy_only=False)),
                    "aux": torch.from_numpy(aux).view(torch.bfloat16),
                    "target": torch.from_numpy(tgt).view(torch.bfloat16)})
    return out


def sample_digest(input_ids, loss_mask, aux, target) -> str:
    """sha256 over one sample's unpadded tensors (bf16 as its bits, ids and mask as int64)."""
    import torch

    h = hashlib.sha256()
    for t, dt in ((input_ids, torch.int64), (loss_mask, torch.int64), (aux, torch.int16), (target, torch.int16)):
        t = t.contiguous()
        h.update((t.to(dt) if dt == torch.int64 else t.view(dt)).numpy().tobytes())
    return h.hexdigest()


# --- children: one reader each ------------------------------------------------------------------

def child_torch(c: dict):
    import torch

    # SpecForge's offline reader walks the tree for *.ckpt and loads each file with its
    # load_feature_file: torch.load(path, weights_only=False, mmap=True).
    files = sorted(Path(c["dir"]).glob("rows_*/data_*.ckpt"))

    class PtFiles(torch.utils.data.Dataset):
        def __len__(self):
            return len(files)

        def __getitem__(self, i):
            x = torch.load(files[i], weights_only=False, mmap=True)
            return {"sample_id": int(files[i].stem.removeprefix("data_")), "input_ids": x["input_ids"],
                    "loss_mask": x["loss_mask"], "aux": x["aux_hidden_state"][0], "target": x["hidden_state"][0]}

    g = torch.Generator().manual_seed(0)
    return torch.utils.data.DataLoader(PtFiles(), batch_size=c["batch_size"], shuffle=True,
                                       num_workers=c["workers"], collate_fn=pad_collate, generator=g)


def child_safetensors(c: dict):
    import pyarrow as pa
    import torch
    from safetensors.torch import load_file

    d = Path(c["dir"])

    class HsFiles(torch.utils.data.Dataset):
        def __init__(self):
            self.rows = None  # memory-mapped in each worker, as `datasets.load_from_disk` maps it

        def __len__(self):
            return c["samples"]

        def __getitem__(self, i):
            if self.rows is None:
                self.rows = pa.ipc.open_stream(pa.memory_map(str(d / SPECULATORS_INDEX))).read_all()
            x = load_file(d / "hidden_states" / f"hs_{i}.safetensors")
            ids = torch.from_numpy(self.rows.column("input_ids")[i].values.to_numpy(zero_copy_only=False))
            # speculators' ArrowDataset drops a sample whose file's token ids differ from its row.
            if not torch.equal(x["token_ids"], ids):
                raise ValueError(f"hs_{i}.safetensors: token_ids differ from row {i} of {SPECULATORS_INDEX}")
            hs = x["hidden_states"]
            return {"sample_id": self.rows.column("sample_id")[i].as_py(), "input_ids": x["token_ids"],
                    "loss_mask": torch.from_numpy(
                        self.rows.column("loss_mask")[i].values.to_numpy(zero_copy_only=False)),
                    "aux": hs[:, :-1].flatten(1), "target": hs[:, -1]}

    g = torch.Generator().manual_seed(0)
    return torch.utils.data.DataLoader(HsFiles(), batch_size=c["batch_size"], shuffle=True,
                                       num_workers=c["workers"], collate_fn=pad_collate, generator=g)


def child_lance_take(c: dict):
    import lance
    import torch

    cols = ["sample_id", "input_ids", "loss_mask", "aux", "target"]

    class Take(torch.utils.data.Dataset):
        def __init__(self):
            self.ds = None  # opened in each worker: a Lance dataset is not fork-safe

        def __len__(self):
            return c["samples"]

        def __getitem__(self, idx: list[int]):
            if self.ds is None:
                self.ds = lance.dataset(c["dir"])
            return pad_collate(arrow_items(self.ds.take(idx, columns=cols), c["hidden"], c["k"]))

    g = torch.Generator().manual_seed(0)
    sampler = torch.utils.data.BatchSampler(torch.utils.data.RandomSampler(range(c["samples"]), generator=g),
                                            c["batch_size"], drop_last=False)
    return torch.utils.data.DataLoader(Take(), batch_size=None, sampler=sampler, num_workers=c["workers"])


def lance_batch(batch, hidden: int, k: int, **_) -> dict:
    return pad_collate(arrow_items(batch, hidden, k))


def child_lance_dataset(c: dict):
    import functools

    import torch
    from lance.torch.data import LanceDataset

    ds = LanceDataset(c["dir"], batch_size=c["batch_size"],
                      columns=["sample_id", "input_ids", "loss_mask", "aux", "target"],
                      to_tensor_fn=functools.partial(lance_batch, hidden=c["hidden"], k=c["k"]))
    # LanceDataset opens the dataset here; a forked worker using it crashed (segfault, 1 in 2
    # runs), as pylance warns ("lance is not fork-safe"), so workers are spawned.
    return torch.utils.data.DataLoader(ds, batch_size=None, num_workers=c["workers"],
                                       multiprocessing_context="spawn" if c["workers"] else None)


def drop_mds_raw(d: Path) -> None:
    """Remove the decompressed shard copies StreamingDataset keeps beside the zstd shards of a
    local dataset, so that each read is a first epoch and "on disk" is the dataset as written."""
    for z in d.glob("*.mds.zstd"):
        z.with_suffix("").unlink(missing_ok=True)


def child_mosaicml(c: dict):
    import numpy as np
    import torch
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    drop_mds_raw(Path(c["dir"]))
    hidden, k = c["hidden"], c["k"]

    class Mds(StreamingDataset):
        def __getitem__(self, i):
            x = super().__getitem__(i)
            t = x["input_ids"].shape[0]
            return {"sample_id": int(x["sample_id"]), "input_ids": torch.from_numpy(x["input_ids"]),
                    "loss_mask": torch.from_numpy(x["loss_mask"]),
                    "aux": torch.from_numpy(np.frombuffer(x["aux"], np.int16).reshape(t, k * hidden)).view(torch.bfloat16),
                    "target": torch.from_numpy(np.frombuffer(x["target"], np.int16).reshape(t, hidden)).view(torch.bfloat16)}

    ds = Mds(local=c["dir"], shuffle=True, shuffle_seed=1, batch_size=c["batch_size"])
    return torch.utils.data.DataLoader(ds, batch_size=c["batch_size"], num_workers=c["workers"],
                                       collate_fn=pad_collate)


def child_hslake(c: dict):
    import hslake

    return hslake.Loader(c["url"], batch_size=c["batch_size"], decode_threads=c["workers"], seed=0,
                         aux_layers=c["layers"], target="final_norm", **c["options"])


def child_hslake_all(c: dict):
    return child_hslake(c)


def child_hslake_sample(c: dict):
    return child_hslake(c)


def drain(it, t0: float, c: dict) -> dict:
    first = None
    tokens = batches = 0
    ids: list[int] = []
    mixing: list[int] = []
    digest = None
    for b in it:
        if first is None:
            first = time.perf_counter() - t0
        att = b["attention_mask"]
        tokens += int(att.sum())
        batch_ids = b["sample_ids"].tolist()
        ids += batch_ids
        batches += 1
        if len(batch_ids) == c["batch_size"]:
            mixing.append(len({s // RUN for s in batch_ids}))
        if c["probe"] in batch_ids:
            i = batch_ids.index(c["probe"])
            n = int(att[i].sum())
            digest = sample_digest(b["input_ids"][i, :n], b["loss_mask"][i, :n], b["aux_hidden_states"][i, :n],
                                   b["target_hidden_states"][i, :n])
        if time.perf_counter() - t0 > c["max_seconds"]:
            break
    secs = time.perf_counter() - t0
    seen = set(ids)
    return {"tokens": tokens, "samples": len(ids), "batches": batches, "seconds": secs, "first_batch_s": first,
            "duplicates": len(ids) - len(seen), "missing": c["samples"] - len(seen & set(range(c["samples"]))),
            "foreign": len(seen - set(range(c["samples"]))), "probe_digest": digest,
            "mixing": sum(mixing) / len(mixing) if mixing else float("nan")}


# --- writing the peers' formats -----------------------------------------------------------------

def storage_order(url: str, layers: list[int]):
    """(sample_id, input_ids, loss_mask, aux [T, 3H], target [T, H]) in storage order."""
    import hslake

    # Batches pad every sample to the longest: at EAGLE-3 sizes (~75 MB a sample) 64 of them
    # padded took 24 GB, so a batch is at most ~64 MiB of average samples.
    counts = hslake.Dataset(url).counts()
    batch = max(1, min(64, (64 << 20) * counts["num_samples"] // max(counts["raw_bytes"], 1)))
    for b in hslake.Loader(url, batch_size=batch, shuffle=False, aux_layers=layers, target="final_norm"):
        lens = b["attention_mask"].sum(1).tolist()
        for i, sid in enumerate(b["sample_ids"].tolist()):
            n = lens[i]
            yield (sid, b["input_ids"][i, :n], b["loss_mask"][i, :n], b["aux_hidden_states"][i, :n],
                   b["target_hidden_states"][i, :n])


def write_pt(url: str, layers: list[int], d: Path) -> None:
    import torch

    for i, (sid, ids, mask, aux, tgt) in enumerate(storage_order(url, layers)):
        first = i // SPECFORGE_ROWS_PER_DIR * SPECFORGE_ROWS_PER_DIR
        folder = d / f"rows_{first}-{first + SPECFORGE_ROWS_PER_DIR}"
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({"input_ids": ids.clone(), "loss_mask": mask.clone(), "hidden_state": tgt.clone().unsqueeze(0),
                    "aux_hidden_state": aux.clone().unsqueeze(0)}, folder / f"data_{sid}.ckpt")


def write_st(url: str, layers: list[int], d: Path) -> None:
    import pyarrow as pa
    import torch
    from safetensors.torch import save_file

    (d / "hidden_states").mkdir(parents=True)
    sids, ids_rows, mask_rows = [], [], []
    for i, (sid, ids, mask, aux, tgt) in enumerate(storage_order(url, layers)):
        t, h = tgt.shape
        # Per token: the aux layers, then the target ([T, k + 1, H]), as speculators stores them.
        hs = torch.cat([aux.reshape(t, -1, h), tgt.reshape(t, 1, h)], dim=1)
        save_file({"hidden_states": hs, "token_ids": ids.clone()}, str(d / "hidden_states" / f"hs_{i}.safetensors"))
        sids.append(sid)
        ids_rows.append(ids.numpy())
        mask_rows.append(mask.numpy())
    rows = pa.table({"sample_id": pa.array(sids, pa.int64()), "input_ids": pa.array(ids_rows, pa.list_(pa.int64())),
                     "loss_mask": pa.array(mask_rows, pa.list_(pa.int64())),
                     "seq_len": pa.array([len(x) for x in ids_rows], pa.int64())})
    with pa.OSFile(str(d / SPECULATORS_INDEX), "wb") as f, pa.ipc.new_stream(f, rows.schema) as w:
        w.write_table(rows)


def write_lance(url: str, layers: list[int], d: Path) -> None:
    import lance
    import pyarrow as pa
    import torch

    schema = pa.schema([("sample_id", pa.int64()), ("input_ids", pa.list_(pa.int64())),
                        ("loss_mask", pa.list_(pa.int64())), ("aux", pa.large_binary()),
                        ("target", pa.large_binary())])

    def batches():
        rows, size = [], 0
        for sid, ids, mask, aux, tgt in storage_order(url, layers):
            rows.append((sid, ids.tolist(), mask.tolist(), aux.contiguous().view(torch.int16).numpy().tobytes(),
                         tgt.contiguous().view(torch.int16).numpy().tobytes()))
            size += len(rows[-1][3]) + len(rows[-1][4])
            # By count for small samples, by bytes for EAGLE-3-sized ones (~75 MB each).
            if len(rows) == 256 or size >= 256 << 20:
                size = 0
                yield pa.RecordBatch.from_arrays([pa.array(list(col), t) for col, t in
                                                  zip(zip(*rows), schema.types)], schema=schema)
                rows = []
        if rows:
            yield pa.RecordBatch.from_arrays([pa.array(list(col), t) for col, t in zip(zip(*rows), schema.types)],
                                             schema=schema)

    # Several fragments (at least 8), so that LanceDataset spreads them over the DataLoader workers.
    import hslake

    per_file = max(1, min(2048, hslake.Dataset(url).counts()["num_samples"] // 8))
    lance.write_dataset(pa.RecordBatchReader.from_batches(schema, batches()), str(d), max_rows_per_file=per_file)


def write_mds(url: str, layers: list[int], d: Path) -> None:
    import torch
    from streaming import MDSWriter

    cols = {"sample_id": "int64", "input_ids": "ndarray:int64", "loss_mask": "ndarray:int64", "aux": "bytes",
            "target": "bytes"}
    with MDSWriter(out=str(d), columns=cols, compression="zstd", size_limit="64mb") as w:
        for sid, ids, mask, aux, tgt in storage_order(url, layers):
            w.write({"sample_id": sid, "input_ids": ids.numpy(), "loss_mask": mask.numpy(),
                     "aux": aux.contiguous().view(torch.int16).numpy().tobytes(),
                     "target": tgt.contiguous().view(torch.int16).numpy().tobytes()})


def probe_digest(url: str, layers: list[int], probe: int) -> str:
    for sid, ids, mask, aux, tgt in storage_order(url, layers):
        if sid == probe:
            return sample_digest(ids, mask, aux, tgt)
    raise SystemExit(f"FAILED: sample {probe} is not in {url}")


def ensure_peers(modules: set[str]) -> None:
    """Install the peer readers on first use, without touching torch or numpy."""
    import importlib.util

    if any(importlib.util.find_spec(m) is None for m in modules):
        print("installing the peer readers (requirements-peers.txt, --no-deps)", file=sys.stderr)
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "-r",
                               str(ROOT / "requirements-peers.txt")])


# --- S3 ------------------------------------------------------------------------------------------

def start_s3_server(kind: str) -> tuple[subprocess.Popen, str]:
    """Starts `kind` (moto or seaweedfs) on a free loopback port with scripts/s3_server.sh, the
    helper the tests use, and returns its endpoint; the server runs until the returned process's
    stdin is closed (stop_s3_server)."""
    script = ('source scripts/s3_server.sh && start_s3_server "$1" || exit 1; '
              'echo "$HSLAKE_TEST_S3_ENDPOINT"; read -r _; stop_s3_server')
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    p = subprocess.Popen(["bash", "-c", script, "s3_server", kind], cwd=ROOT, env=env, text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    endpoint = p.stdout.readline().strip()
    if not endpoint:
        p.wait()
        raise SystemExit(f"the {kind} S3 server did not start (scripts/s3_server.sh; its log is in .cache/)")
    return p, endpoint


def stop_s3_server(p: subprocess.Popen) -> None:
    p.stdin.close()
    p.wait(timeout=60)


def upload(local: Path, endpoint: str, bucket: str, prefix: str) -> None:
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                      region_name="us-east-1")
    s3.create_bucket(Bucket=bucket)
    for root, _, files in os.walk(local):
        for f in files:
            full = Path(root) / f
            s3.upload_file(str(full), bucket, f"{prefix}/{full.relative_to(local)}")


# --- main ----------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=20_000)
    ap.add_argument("--seq-len", default="32:160")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--aux-layers", default="1,2,3", help="captured aux layers (plus final_norm as target)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--workers", default="2",
                    help="DataLoader workers of peers = hslake decode threads; a comma list reads one epoch per "
                         "reader and value (S3 and --checksum-rounds use the first)")
    ap.add_argument("--draft-tokens-per-s", type=float,
                    help="a draft training step's tokens/s (benchmarks/gpu/draft_step.py): report the cores each "
                         "reader needs to keep up with it, from its epoch CPU seconds per token")
    ap.add_argument("--row-group-mb", type=float, default=4.0)
    ap.add_argument("--shuffle-window", type=int, default=16)
    ap.add_argument("--prefetch-row-groups", type=int, default=4)
    ap.add_argument("--lookahead-mb", default="256",
                    help="lookahead_bytes of the sample-shuffle reader, in MiB (a comma list: one row each)")
    ap.add_argument("--readers", default=",".join(READERS), help=f"subset of {','.join(READERS)}")
    ap.add_argument("--max-seconds", type=float, default=900.0,
                    help="stop a reader after this long (the epoch check then fails)")
    ap.add_argument("--out", default="/tmp/hslake-bench")
    ap.add_argument("--s3", nargs="?", const="moto", default="",
                    help="also hslake from loopback S3 servers, started here: a comma list of "
                         f"{','.join(S3_SERVERS)} (default moto)")
    ap.add_argument("--keep", action="store_true", help="reuse the datasets in --out if present")
    ap.add_argument("--json-out", help="also write the results as JSON here")
    ap.add_argument("--checksum-rounds", type=int, default=0,
                    help="also read the hslake dataset (CRC-32 value checksums) and copies written with "
                         "format 2's zstd checksums and without checksums, alternating, this many times "
                         "each (window shuffle, local disk)")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()

    if a.child:
        kind, cfg = a.child[0], json.loads(a.child[1])
        import importlib
        import warnings

        # Read-only numpy views are never written through; Lance is opened after the fork.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        warnings.filterwarnings("ignore", message="lance is not fork-safe")
        # Imports are not the reader's time to first batch.
        for m in ["torch", *CHILD_IMPORTS.get(kind, [])]:
            importlib.import_module(m)
        t0, cpu0 = time.perf_counter(), os.times()
        reader = globals()[f"child_{kind}"](cfg)
        r = drain(reader, t0, cfg)
        # Dropping the reader joins its worker processes, so that their CPU time is in os.times().
        del reader
        gc.collect()
        cpu1 = os.times()
        r["epoch_cpu_s"] = sum(cpu1[:4]) - sum(cpu0[:4])
        print(json.dumps(r))
        return

    import hslake

    # Modules from before build_info existed were all dev-profile builds unless told otherwise.
    build = hslake.build_info() if hasattr(hslake, "build_info") else {
        "describe": "unknown (module without build_info)", "benchmark_warning": "module without build_info"}
    if build["benchmark_warning"]:
        bar = "!" * 100
        print(f"{bar}\nWARNING: {build['benchmark_warning']}\n{bar}", file=sys.stderr)
    readers = [r for r in a.readers.split(",") if r]
    unknown = set(readers) - set(READERS)
    if unknown:
        raise SystemExit(f"unknown readers {sorted(unknown)}; expected some of {READERS}")
    peer_modules = {PEER_MODULES[r] for r in readers if r in PEER_MODULES}
    if peer_modules:
        ensure_peers(peer_modules)
    s3_kinds = [k for k in a.s3.split(",") if k]
    if set(s3_kinds) - set(S3_SERVERS):
        raise SystemExit(f"--s3 {a.s3!r}: expected a comma list of {','.join(S3_SERVERS)}")
    workers = [int(x) for x in a.workers.split(",") if x]
    if not workers or min(workers) < 1:
        raise SystemExit(f"--workers {a.workers!r}: expected positive counts, e.g. 2 or 1,2,4")

    layers = [int(x) for x in a.aux_layers.split(",")]
    lo, hi = (int(x) for x in a.seq_len.split(":"))
    out = Path(a.out)
    dirs = {"hslake": out / "hslake", "torch": out / "pt", "safetensors": out / "st", "lance": out / "lance",
            "mosaicml": out / "mds"}
    fmt_of = {"torch": "torch", "safetensors": "safetensors", "lance_take": "lance", "lance_dataset": "lance",
              "mosaicml": "mosaicml", "hslake": "hslake", "hslake_all": "hslake", "hslake_sample": "hslake"}
    writers = {"torch": write_pt, "safetensors": write_st, "lance": write_lance, "mosaicml": write_mds}
    times_file = out / "write_seconds.json"
    if not a.keep:
        shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    write_s = json.loads(times_file.read_text()) if times_file.exists() else {}
    url = f"file://{dirs['hslake']}"
    if not dirs["hslake"].exists():
        t = time.perf_counter()
        hslake.write_synthetic(str(dirs["hslake"]), a.samples, (lo, hi), a.hidden, layers, final_norm=True, seed=0,
                               row_group_bytes=int(a.row_group_mb * (1 << 20)), shard_bytes=64 << 20)
        write_s["hslake"] = time.perf_counter() - t
    # The same samples under each value checksum: the default dataset carries CRC-32.
    sum_urls = {"crc32": url}
    for kind, checksum, sub in [("zstd_xxh64", "zstd_xxh64", "hslake_xxh64"), ("off", None, "hslake_nosum")]:
        d = out / sub
        sum_urls[kind] = f"file://{d}"
        if a.checksum_rounds and not d.exists():
            hslake.write_synthetic(str(d), a.samples, (lo, hi), a.hidden, layers, final_norm=True, seed=0,
                                   row_group_bytes=int(a.row_group_mb * (1 << 20)), shard_bytes=64 << 20,
                                   value_checksum=checksum)
    for fmt in sorted({fmt_of[r] for r in readers} - {"hslake"}):
        if not dirs[fmt].exists():
            t = time.perf_counter()
            writers[fmt](url, layers, dirs[fmt])
            # Includes reading the samples back from hslake in storage order (a small part).
            write_s[fmt] = time.perf_counter() - t
    times_file.write_text(json.dumps(write_s))
    counts = hslake.Dataset(str(dirs["hslake"])).counts()
    n = counts["num_samples"]
    if n != a.samples:
        raise SystemExit(f"{dirs['hslake']} holds {n} samples, not --samples {a.samples}; drop --keep")
    probe = (n // 2 + 7) % n  # any sample; the modulo keeps tiny test runs in range
    expected = probe_digest(url, layers, probe)

    common = {"batch_size": a.batch_size, "workers": workers[0], "max_seconds": a.max_seconds, "samples": n,
              "hidden": a.hidden, "k": len(layers), "layers": layers, "probe": probe}
    hs_opts = {"shuffle_window": a.shuffle_window, "prefetch_row_groups": a.prefetch_row_groups}
    lookaheads = [float(x) for x in a.lookahead_mb.split(",")]

    def sample_opts(mb: float) -> dict:
        return {"prefetch_row_groups": a.prefetch_row_groups, "shuffle_mode": "sample",
                "lookahead_bytes": int(mb * (1 << 20))}
    runs = []  # (name, reader kind, format, config, env)
    names = {"torch": "torch.load files, SpecForge layout (DataLoader)",
             "safetensors": "safetensors files, speculators layout (DataLoader)",
             "lance_take": "Lance take() of shuffled indices",
             "lance_dataset": "Lance LanceDataset (contiguous, unshuffled)",
             "mosaicml": "MosaicML streaming (MDS, zstd)"}
    for w in workers:
        cw = {**common, "workers": w}
        for r in readers:
            if r == "hslake":
                runs.append((f"hslake, window shuffle ({a.shuffle_window} row groups)", "hslake", "hslake",
                             {**cw, "url": url, "options": hs_opts}, None))
            elif r == "hslake_all":
                # One window of every row group: a per-sample permutation of the epoch, but the loader
                # then holds each row group from its first to its last use (most of the dataset).
                runs.append(("hslake, one window of all row groups", "hslake_all", "hslake",
                             {**cw, "url": url, "options": {**hs_opts, "shuffle_window": 1 << 30}}, None))
            elif r == "hslake_sample":
                for mb in lookaheads:
                    runs.append((f"hslake, sample shuffle (lookahead {mb:g} MiB)", "hslake_sample", "hslake",
                                 {**cw, "url": url, "options": sample_opts(mb)}, None))
            else:
                runs.append((names[r], r, fmt_of[r], {**cw, "dir": str(dirs[fmt_of[r]])}, None))
    # Alternating, so that a noisy machine slows both alike; reported as best / median / worst.
    for i in range(a.checksum_rounds):
        for kind, u in sum_urls.items():
            runs.append((f"hslake, value checksums {kind}, round {i + 1}", "hslake", "hslake",
                         {**common, "url": u, "options": hs_opts}, None))
    servers = []  # every S3 server started, stopped in the finally below
    try:
        for kind in (s3_kinds if "hslake" in readers else []):
            p, endpoint = start_s3_server(kind)
            servers.append(p)
            bucket = f"bench-{os.getpid()}"
            upload(dirs["hslake"], endpoint, bucket, "ds")
            env = dict(os.environ, AWS_ENDPOINT=endpoint, AWS_ALLOW_HTTP="true", AWS_ACCESS_KEY_ID="testing",
                       AWS_SECRET_ACCESS_KEY="testing", AWS_REGION="us-east-1")
            runs.append((f"hslake, loopback S3 ({kind}), window shuffle", "hslake", "hslake",
                         {**common, "url": f"s3://{bucket}/ds", "options": hs_opts}, env))
            if "hslake_sample" in readers:
                mb = lookaheads[0]
                runs.append((f"hslake, loopback S3 ({kind}), sample shuffle (lookahead {mb:g} MiB)",
                             "hslake_sample", "hslake",
                             {**common, "url": f"s3://{bucket}/ds", "options": sample_opts(mb)}, env))
        results = {}
        # Hidden-state bytes a token decodes to: the aux layers and the target, bf16.
        state_bytes = (len(layers) + 1) * a.hidden * 2
        for name, kind, fmt, cfg, env in runs:
            print(f"reading: {name}, {cfg['workers']} workers", file=sys.stderr)
            key = f"{name}, {cfg['workers']} workers"
            try:
                r = run_child([kind, json.dumps(cfg)], env)
            except SystemExit as e:
                # One reader's crash is reported as a failure; the others still run.
                print(e, file=sys.stderr)
                results[key] = {"format": fmt, "reader": name, "workers": cfg["workers"], "error": str(e)}
                continue
            r.update(format=fmt, reader=name, workers=cfg["workers"],
                     decoded_gb_per_s=r["tokens"] * state_bytes / r["seconds"] / 1e9,
                     gb_per_cpu_s=r["tokens"] * state_bytes / r["epoch_cpu_s"] / 1e9)
            if a.draft_tokens_per_s:
                r["cores_for_draft"] = a.draft_tokens_per_s * r["epoch_cpu_s"] / max(r["tokens"], 1)
            results[key] = r
            if a.json_out:  # so far, in case a later reader is stopped from outside
                Path(a.json_out).write_text(json.dumps({"results": results, "write_seconds": write_s,
                                                        "counts": counts, "build": build, "partial": True}))
    finally:
        for p in servers:
            stop_s3_server(p)
        if dirs["mosaicml"].exists():
            drop_mds_raw(dirs["mosaicml"])

    print(f"\n{n} samples, {counts['num_tokens']} tokens, seq_len {a.seq_len}, hidden {a.hidden}, "
          f"aux layers {layers} + final_norm, bf16 ({state_bytes} bytes of states a token); batch {a.batch_size}; "
          f"workers: DataLoader worker processes (peers) / decode threads (hslake); hslake row groups of "
          f"{a.row_group_mb} MiB raw, prefetch_row_groups {a.prefetch_row_groups}; {os.cpu_count()} CPUs; "
          f"load average {os.getloadavg()[0]:.2f}; hslake build: {build['describe']}")
    if build["benchmark_warning"]:
        print(f"WARNING: {build['benchmark_warning']}")
    print(f"raw tensors {counts['raw_bytes'] / 1e6:.1f} MB\n")
    draft = f"cores for {a.draft_tokens_per_s:,.0f} tokens/s" if a.draft_tokens_per_s else None
    cores_col = f" {draft} |" if draft else ""
    print(f"| reader | workers | tokens/s | decoded GB/s | epoch CPU s | GB per CPU s |{cores_col} first batch "
          f"| process CPU s | peak PSS | on disk | write | mixing (of {a.batch_size}) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |" + (" ---: |" if draft else "")
          + " ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results.values():
        f = r["format"]
        if "error" in r:
            print(f"| {r['reader']} | {r['workers']} | failed: {r['error'][:200]} |")
            continue
        cores = f" {r['cores_for_draft']:.1f} |" if draft else ""
        print(f"| {r['reader']} | {r['workers']} | {r['tokens'] / r['seconds']:,.0f} | {r['decoded_gb_per_s']:.2f} "
              f"| {r['epoch_cpu_s']:.1f} | {r['gb_per_cpu_s']:.2f} |{cores} {r['first_batch_s']:.2f} s "
              f"| {r['cpu_s']:.1f} | {r['peak_pss'] / 2**20:.0f} MiB | {dir_bytes(dirs[f]) / 1e6:.0f} MB "
              f"| {write_s.get(f, float('nan')):.1f} s | {r['mixing']:.1f} |")
    if a.checksum_rounds:
        print(f"\nvalue checksums, {a.checksum_rounds} alternating rounds each (best / median / worst):")
        best = {}
        for kind in sum_urls:
            rs = [r for name, r in results.items() if f"value checksums {kind}," in name and "error" not in r]
            tps = sorted(r["tokens"] / r["seconds"] for r in rs)
            cpu = sorted(r["tokens"] / r["cpu_s"] for r in rs)
            best[kind] = (tps[-1], cpu[-1])
            print(f"checksums {kind:10}: tokens/s {tps[-1]:,.0f} / {tps[len(tps) // 2]:,.0f} / {tps[0]:,.0f}; "
                  f"tokens per CPU s {cpu[-1]:,.0f} / {cpu[len(cpu) // 2]:,.0f} / {cpu[0]:,.0f}")
        for kind in ["crc32", "zstd_xxh64"]:
            print(f"cost of {kind} (best vs best off): tokens/s {100 * (1 - best[kind][0] / best['off'][0]):+.1f} %, "
                  f"tokens per CPU s {100 * (1 - best[kind][1] / best['off'][1]):+.1f} %")
    failures = []
    for name, r in results.items():
        if "error" in r:
            failures.append(f"{name}: {r['error']}")
            continue
        if r["samples"] == 0 or r["missing"] or r["duplicates"] or r["foreign"]:
            failures.append(f"{name}: {r['samples']} samples read, {r['missing']} missing, {r['duplicates']} "
                            f"repeated, {r['foreign']} unknown ids (expected each of {n} exactly once)")
        if r["probe_digest"] != expected:
            failures.append(f"{name}: sample {probe} differs from what hslake wrote "
                            f"(sha256 {r['probe_digest']} != {expected})")
    summary = {"results": results, "write_seconds": write_s, "counts": counts, "build": build,
               "bytes": {f: dir_bytes(d) for f, d in dirs.items() if d.exists()}, "failures": failures}
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    if failures:
        print("\nFAILED correctness checks:\n  " + "\n  ".join(failures), file=sys.stderr)
        sys.exit(1)
    print("\nall readers returned every sample exactly once, probe sample bit-equal", file=sys.stderr)


if __name__ == "__main__":
    main()
