"""Issue 44 item 6 at the issue's sizes: Ray Data over a manifest whose first shard of several
row groups claims one row group, 5 more rows, or 200,000 one-row groups (rows and bytes grown to
match, so only the file refutes it). Prints, per claim, what read_hslake(...).materialize() did
and how long it took. Usage: python ray_claims.py HSLAKE_BIN TIMEOUT_S (run with the matching
`hslake` package first on PYTHONPATH)."""
import json, os, shutil, subprocess, sys, tempfile, time

BIN, LIMIT = sys.argv[1], float(sys.argv[2])
CLAIMS = {
    "one_group": lambda s: s.update(row_groups=[s["rows"]]),
    "five_more_rows": lambda s: s.update(row_groups=[s["row_groups"][0] + 5] + s["row_groups"][1:], rows=s["rows"] + 5),
    "200k_groups": lambda s: s.update(row_groups=[1] * 200_000, rows=200_000, bytes=200_000 * 64),
}
CHILD = """
import sys, time, ray, hslake.ray
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
t = time.time()
try:
    n = hslake.ray.read_hslake(sys.argv[1], points=[1], columns=["sample_id"]).materialize().count()
    print(f"returned {n} rows, no error", end="")
except Exception as e:
    lines = str(e).splitlines()
    named = [l for l in lines if "HslakeError:" in l] or lines[-1:]
    print(f"{type(e).__name__}: {named[-1].strip()[:300]}", end="")
print(f" ({time.time() - t:.1f} s)")
"""
work = tempfile.mkdtemp()
src = os.path.join(work, "src")
subprocess.run([BIN, "synth", f"file://{src}", "--samples", "40", "--seq-len", "4:24", "--hidden", "16",
                "--layers", "1,2,3", "--final-norm", "--seed", "5", "--row-group-mb", "2KiB", "--shard-mb", "64KiB"],
               check=True, capture_output=True)
for name, edit in CLAIMS.items():
    d = os.path.join(work, name)
    shutil.copytree(src, d)
    vdir = os.path.join(d, "_hslake", "versions")
    m = json.load(open(os.path.join(vdir, sorted(os.listdir(vdir))[-1])))
    entry = next(s for s in m["shards"] if len(s["row_groups"]) > 2)
    real = (len(entry["row_groups"]), entry["rows"])
    edit(entry)
    m["version"] += 1
    json.dump(m, open(os.path.join(vdir, f"{m['version']:020}.json"), "w"))
    t = time.time()
    try:
        out = subprocess.run([sys.executable, "-c", CHILD, f"file://{d}"], capture_output=True, text=True,
                             timeout=LIMIT).stdout.strip()
    except subprocess.TimeoutExpired:
        out = f"no result within {LIMIT:.0f} s (killed)"
    print(f"{name} (file: {real[0]} row groups, {real[1]} rows): {out}; wall {time.time() - t:.1f} s", flush=True)
shutil.rmtree(work)
