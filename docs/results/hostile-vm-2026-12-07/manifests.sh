#!/usr/bin/env bash
# Issue 44 items 6-8 at the issue's sizes: manifests that repeat a shard or name 10^5 / 10^6
# shards, a Ray read over lying row-group claims, loader options past their ranges.
# Usage: manifests.sh BIN PYTHONPATH OUT_DIR   (BIN: the hslake binary; PYTHONPATH: where the
# matching `hslake` package is). Each command's RSS, wall time and exit code come from
# /usr/bin/time; outputs are cut to their last lines.
set -u
BIN=$1; PYP=$2; OUT=$3
HERE=$(cd "$(dirname "$0")" && pwd)
W=$(mktemp -d /tmp/hostile-manifests.XXXX)
mkdir -p "$OUT"
t() { local name=$1; shift; { echo "\$ $*"; /usr/bin/time -f "rss=%MKB wall=%es exit=%x" timeout "${TMO:-600}" "$@" 2>&1 | tail -4; } > "$OUT/$name.txt"; tail -1 "$OUT/$name.txt"; }
"$BIN" synth "file://$W/base" --samples 10 --seq-len 4:24 --hidden 16 --layers 1,2 --seed 1 >/dev/null 2>&1
python3 "$HERE/plant_manifest.py" "$W/base" "$W/rep1e5" repeat 100000
python3 "$HERE/plant_manifest.py" "$W/base" "$W/d1e6" distinct 1000000
python3 "$HERE/plant_manifest.py" "$W/base" "$W/d1e5" distinct 100000 links
echo "repeats 10^5: sql count"; t rep1e5-count "$BIN" sql "file://$W/rep1e5" "SELECT count(*) FROM samples"
echo "repeats 10^5: info"; t rep1e5-info "$BIN" info "file://$W/rep1e5"
echo "repeats 10^5: repair --drop-missing"; t rep1e5-repair-missing "$BIN" repair "file://$W/rep1e5" --drop-missing
echo "repeats 10^5: repair --drop-repeats"; t rep1e5-repair-repeats "$BIN" repair "file://$W/rep1e5" --drop-repeats
echo "repeats 10^5: verify after"; t rep1e5-verify "$BIN" verify "file://$W/rep1e5"
echo "repeats 10^5: count after"; t rep1e5-count-after "$BIN" sql "file://$W/rep1e5" "SELECT count(*) FROM samples"
echo "10^6 shards: info"; t d1e6-info "$BIN" info "file://$W/d1e6"
echo "10^6 shards: sql count"; t d1e6-count "$BIN" sql "file://$W/d1e6" "SELECT count(*) FROM samples"
echo "10^5 shards (readable): info"; t d1e5-info "$BIN" info "file://$W/d1e5"
echo "10^5 shards (readable): sql count"; t d1e5-count "$BIN" sql "file://$W/d1e5" "SELECT count(*) FROM samples"
echo "loader options past range"
for kw in "pad_to_multiple_of=2**40" "decode_threads=10**5" "decode_threads=10**6"; do
  name=loader-${kw%%=*}-$(echo "${kw#*=}" | tr -d '*')
  TMO=120 t "$name" env PYTHONPATH="$PYP" python3 -c "
import hslake
try:
    l = hslake.Loader('file://$W/base', batch_size=2, $kw)
    print('opened'); print(sum(1 for _ in l), 'batches')
except Exception as e:
    print(type(e).__name__, str(e)[:300])"
done
rm -rf "$W"
