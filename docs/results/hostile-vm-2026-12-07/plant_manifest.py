"""Plant version N+1 of a dataset copy: mode repeat (one shard n times) or distinct (n paths; files
are symlinks to the one real shard so that readers can open them)."""
import json, os, shutil, sys
src, dst, mode, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
if os.path.exists(dst):
    shutil.rmtree(dst)
shutil.copytree(src, dst, symlinks=True)
vdir = os.path.join(dst, "_hslake", "versions")
last = sorted(os.listdir(vdir))[-1]
m = json.load(open(os.path.join(vdir, last)))
e = m["shards"][0]
shards = []
real = os.path.join(dst, e["path"])
for i in range(n):
    s = dict(e)
    if mode == "distinct":
        s["path"] = f"data/s{i:07d}.parquet"
        s["min_sample_id"] = s["max_sample_id"] = 0
        if len(sys.argv) > 5 and sys.argv[5] == "links":
            os.symlink(real, os.path.join(dst, s["path"]))
    shards.append(s)
m["shards"] = shards
m["version"] += 1
m["parent"] = m["version"] - 1
out = os.path.join(vdir, f"{m['version']:020}.json")
with open(out, "w") as f:
    json.dump(m, f, indent=2)
print(out, os.path.getsize(out))
