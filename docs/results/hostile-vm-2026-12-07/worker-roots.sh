#!/usr/bin/env bash
# Issue 44 item 9: what distributed workers read. Two workers of OLD (the build before the fix,
# no --allowed-root) and two of NEW (--allowed-root $d/allowed), on 127.0.0.1; a coordinator
# (NEW's `hslake sql --workers`) names a dataset outside the root, one reached through a link
# under the root that leads out, and one under the root. Then a NEW worker without the flag.
# Usage: worker-roots.sh OLD_HSLAKE NEW_HSLAKE
set -u
d=$(mktemp -d); echo t > "$d/token"; mkdir "$d/allowed"
NEW=$2
synth() { "$NEW" synth "file://$1" --samples 2000 --seq-len 64:256 --hidden 64 --layers 2 \
  --commit-every 250 --shard-mb 0 >/dev/null 2>&1; }
synth "$d/other/ds"; synth "$d/allowed/ds"
ln -s "$d/other" "$d/allowed/escape"
pids=()
logs=()
worker() { # BIN [ROOT]: starts one; its log in logs
  local log; log=$(mktemp -p "$d")
  HSLAKE_LOG=info NO_COLOR=1 "$1" serve-sql --worker --bind 127.0.0.1:0 --token-file "$d/token" \
    ${2:+--allowed-root "$2"} >/dev/null 2>"$log" & pids+=($!)
  logs+=("$log")
}
url() { # LOG
  for _ in $(seq 100); do grep -q "addr=" "$1" && break; sleep 0.2; done
  echo "http://$(grep -o 'addr=[0-9.:]*' "$1" | cut -d= -f2)"
}
query() { # WORKERS URL
  /usr/bin/time -f "%e s" -o "$d/time" "$NEW" sql "$2" \
    "SELECT count(*), sum(seq_len), avg(layer_2_norm) FROM samples" --format csv \
    --workers "$1" --worker-token-file "$d/token" --scan-partition-bytes 1MiB >"$d/out" 2>"$d/err"
  echo "exit $?, $(tail -1 "$d/time"): $(tail -1 "$d/out" | tr -d '\n') $(grep -v INFO "$d/err" | tail -1)"
}
worker "$1"; worker "$1"; worker "$NEW" "$d/allowed"; worker "$NEW" "$d/allowed"
old="$(url "${logs[0]}"),$(url "${logs[1]}")"
new="$(url "${logs[2]}"),$(url "${logs[3]}")"
echo "== dataset outside the root: file://$d/other/ds"
echo "  old workers: $(query "$old" "file://$d/other/ds")"
echo "  new workers: $(query "$new" "file://$d/other/ds")"
echo "== through a link under the root that leads out: file://$d/allowed/escape/ds"
echo "  new workers: $(query "$new" "file://$d/allowed/escape/ds")"
echo "== under the root: file://$d/allowed/ds (2000 samples, 8 shards), 3 runs each"
for i in 1 2 3; do
  echo "  old workers: $(query "$old" "file://$d/allowed/ds")"
  echo "  new workers: $(query "$new" "file://$d/allowed/ds")"
done
echo "== a new worker without --allowed-root"
"$NEW" serve-sql --worker --token-file "$d/token" >/dev/null 2>"$d/err"
echo "  exit $?: $(tail -1 "$d/err")"
for p in "${pids[@]}"; do kill "$p"; done; wait 2>/dev/null
rm -rf "$d"
