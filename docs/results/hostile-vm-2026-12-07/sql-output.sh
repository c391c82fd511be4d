#!/usr/bin/env bash
# Issue 44 item 3: `hslake sql -o` aimed at what it reads. Each attack against OLD (the build
# before the fix) and NEW, on a fresh dataset; prints the exit code, time and peak RSS, the
# error's last line, what `verify` says afterwards, and the link's target.
# Usage: sql-output.sh OLD_HSLAKE NEW_HSLAKE
set -u
attack() {
  local bin=$1 kind=$2
  local d; d=$(mktemp -d)
  "$bin" synth "file://$d/ds" --samples 2000 --seq-len 64:256 --hidden 64 --layers 2 \
    --commit-every 500 --shard-mb 0 >/dev/null 2>&1
  local newest; newest=$(ls "$d/ds/_hslake/versions" | sort | tail -1)
  echo "precious" > "$d/precious.csv"; ln -s "$d/precious.csv" "$d/link.csv"
  local out
  case $kind in
    shard) out="$d/ds/data/$(ls "$d/ds/data" | head -1)";;
    manifest) out="$d/ds/_hslake/versions/$(printf '%020d.json' $(( 10#${newest%.json} + 1 )))";;
    link) out="$d/link.csv";;
  esac
  /usr/bin/time -f "%e s, %M KB" -o "$d/time" "$bin" sql "file://$d/ds" \
    "SELECT sample_id, seq_len FROM samples" --format parquet -o "$out" >/dev/null 2>"$d/err"
  echo "  -o ${out#$d/}: exit $?, $(tail -1 "$d/time"): $(grep -v INFO "$d/err" | tail -1)"
  "$bin" verify "file://$d/ds" >"$d/verify" 2>&1
  echo "    then verify: exit $?, $(tail -1 "$d/verify" | sed 's/^.*verify: //')"
  "$bin" info "file://$d/ds" >/dev/null 2>"$d/info"
  echo "    then info: exit $?, $(grep -v INFO "$d/info" | tail -1 | cut -c1-200)"
  [ "$kind" = link ] && echo "    precious.csv (the link's target) now holds: $(head -c 12 "$d/precious.csv" | tr -dc '[:print:]')"
  rm -rf "$d"
}
for b in "old:$1" "new:$2"; do
  echo "== ${b%%:*} build: ${b#*:} (dataset: 2000 samples, 4 versions, 8 shards, 29 MB)"
  for k in shard manifest link; do attack "${b#*:}" $k; done
done
