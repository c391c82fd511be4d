"""Per-layer norm statistics of an hslake dataset, computed on a Ray cluster.

    python examples/ray_norms.py s3://bucket/kimi-hs --points 2,30,58,final_norm
    python examples/ray_norms.py file:///data/ds --where "seq_len > 512" --address auto

Every read task decodes one row group (hslake.ray.read_hslake); a map over the rows reduces each
sample's [seq_len, hidden] tensor to the numbers the SQL tensor functions give per sample
(tensor_norm: mean over tokens of the token's L2 norm; tensor_max_abs), and Ray's aggregations
combine them per layer. NaN and ±Inf elements are skipped, as those functions skip them, so that
the table matches

    hslake sql URL "SELECT count(*), avg(tensor_norm(layer_2)), min(tensor_norm(layer_2)),
                    max(tensor_norm(layer_2)), max(tensor_max_abs(layer_2)) FROM samples"
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import ray
from ray.data.aggregate import Count, Max, Mean, Min

import hslake.ray


def per_sample(batch: dict, points: list[str]) -> dict:
    """Each sample's mean token L2 norm and largest |x| per point, over finite elements."""
    out = {}
    for p in points:
        norms, max_abs = [], []
        for t in batch[p]:
            x = np.asarray(t, dtype=np.float64)
            x = np.where(np.isfinite(x), x, 0.0)
            norms.append(float(np.sqrt((x * x).sum(axis=1)).mean()) if len(x) else np.nan)
            max_abs.append(float(np.abs(x).max()) if x.size else np.nan)
        out[f"{p}_norm"] = np.array(norms)
        out[f"{p}_max_abs"] = np.array(max_abs)
    return out


def layer_norms(url: str, points: list[str] | None = None, version: int | None = None,
                where: str | None = None) -> dict[str, dict[str, float]]:
    """{point: {samples, mean_norm, min_norm, max_norm, max_abs}} over the (filtered) version."""
    ds = hslake.ray.read_hslake(url, version=version, points=points, columns=[], where=where)
    names = [c for c in ds.schema().names]
    stats = ds.map_batches(per_sample, fn_args=(names,), batch_format="numpy")
    aggs = [Count()]
    for p in names:
        aggs += [Mean(f"{p}_norm"), Min(f"{p}_norm"), Max(f"{p}_norm"), Max(f"{p}_max_abs")]
    r = stats.aggregate(*aggs)
    return {p: {"samples": int(r["count()"]), "mean_norm": r[f"mean({p}_norm)"],
                "min_norm": r[f"min({p}_norm)"], "max_norm": r[f"max({p}_norm)"],
                "max_abs": r[f"max({p}_max_abs)"]} for p in names}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("url", help="dataset URL (file://, s3://, or a local path)")
    ap.add_argument("--points", help="comma-separated capture points (2, layer_2, final_norm); default: all")
    ap.add_argument("--version", type=int, help="dataset version (default: latest)")
    ap.add_argument("--where", help="rows to keep, over the metadata columns, e.g. 'seq_len > 512'")
    ap.add_argument("--address", help="Ray cluster to join (default: start a local one)")
    ap.add_argument("--num-cpus", type=int, help="CPUs of the local cluster")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args(argv)
    points = args.points.split(",") if args.points else None
    ray.init(address=args.address, num_cpus=args.num_cpus, include_dashboard=False,
             log_to_driver=False, configure_logging=False)
    try:
        result = layer_norms(args.url, points, args.version, args.where)
    except hslake.HslakeError as e:
        print(f"ray_norms: {e}", file=sys.stderr)
        return 2
    finally:
        ray.shutdown()
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{'point':<12} {'samples':>8} {'mean norm':>12} {'min norm':>12} {'max norm':>12} {'max |x|':>12}")
    for p, s in result.items():
        print(f"{p:<12} {s['samples']:>8} {s['mean_norm']:>12.6g} {s['min_norm']:>12.6g} "
              f"{s['max_norm']:>12.6g} {s['max_abs']:>12.6g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
