#!/usr/bin/env bash
# Downloads vLLM 0.26.0 and the wheels its offline hidden-state extraction needs on the GPU machine (which has
# torch 2.11 and no network; docs/guide/capture.md#side-by-side-with-vllm), slims the vLLM wheel, and cuts the lot
# into parts one GPU call can carry each. Runs here, on the CPU machine, from the repository root:
#   bash benchmarks/gpu/vllm_wheels.sh
# Result: .vl1/vlpart.aa, .vl2/vlpart.ab, .vl3/vlpart.ac (58 MiB each at most; git-ignored through the common
# .git/info/exclude), the pieces of one tar of every wheel, flat. On the GPU, carry one folder per call
# (run's `carry: [".vl1"]`, then .vl2, .vl3; `bash gpu-run/vllm_compare.sh stash` moves each to /tmp/vl), then
# run vllm_compare.sh, which joins and installs them.
#
# Slimming (a rewrite of the wheel's zip with the same entries and compression, less these and their RECORD lines):
# FlashAttention 2's library (Hopper runs FA3), the vllm-rs front end, the SM100 (Blackwell) FMHA sources,
# DeepGEMM's C++ headers (JIT for FP8, which a bf16 run never compiles), and DeepGEMM's extension built for
# other Pythons than 3.12. 290 MiB -> about 141 MiB.
#
# Knobs: WORK (download folder, default /tmp/vllm-wheels; wheels already there are not fetched again), PART_MIB (58).
set -euo pipefail
cd "$(dirname "$0")/../.."
W=${WORK:-/tmp/vllm-wheels}
PY=${PYTHON:-$PWD/.venv/bin/python3}
mkdir -p "$W/deps"
FLAGS=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
DEPS=(annotated-types==0.8.0 apache-tvm-ffi==0.1.10 cachetools==8.0.2 cbor2==6.3.0 fastapi==0.136.3 httpx2==2.17.0
  msgspec==0.23.0 openai==3.63.0 openai-harmony==0.0.8 partial-json-parser==0.2.1.1.post7 pybase64==1.5.1
  pydantic==2.14.4 pydantic-core==2.50.5 pyzmq==27.3.0 sniffio==1.3.1 starlette==1.10.0 typing-extensions==4.16.0
  typing-inspection==0.4.5 xgrammar==0.2.7)

ls "$W"/vllm-0.26.0-*.whl >/dev/null 2>&1 || "$PY" -m pip download -q -d "$W" "${FLAGS[@]}" vllm==0.26.0
"$PY" -m pip download -q -d "$W/deps" "${FLAGS[@]}" "${DEPS[@]}"
# llguidance publishes manylinux_2_31 wheels only.
"$PY" -m pip download -q -d "$W/deps" "${FLAGS[@]}" --platform manylinux_2_31_x86_64 llguidance==1.7.6

WHEEL=$(ls "$W"/vllm-0.26.0-*.whl | head -1)
mkdir -p "$W/out"
"$PY" - "$WHEEL" "$W/out/$(basename "$WHEEL")" <<'EOF'
import re, sys, zipfile
src, dst = sys.argv[1:]
DROP = re.compile(r"^vllm/(vllm_flash_attn/_vllm_fa2_C\.abi3\.so$|vllm-rs(/|$)|third_party/fmha_sm100/"
                  r"|third_party/deep_gemm/include/|third_party/deep_gemm/_C\.cpython-(?!312-)[^/]*$)")
kept = dropped = 0
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
    for info in zin.infolist():
        if DROP.search(info.filename):
            dropped += info.file_size
            continue
        data = zin.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            lines = data.decode().splitlines(keepends=True)
            data = "".join(l for l in lines if not DROP.search(l.split(",", 1)[0])).encode()
        zout.writestr(info, data, compress_type=info.compress_type)
        kept += info.file_size
print(f"{dst}: kept {kept / 2**20:.0f} MiB uncompressed, dropped {dropped / 2**20:.0f} MiB")
EOF
cp "$W"/deps/*.whl "$W/out/"
(cd "$W/out" && tar cf ../wheels.tar *.whl)
rm -rf .vl[0-9]* "$W/parts"
mkdir -p "$W/parts"
split -b "${PART_MIB:-58}m" "$W/wheels.tar" "$W/parts/vlpart."
i=0
for part in "$W"/parts/vlpart.*; do
  i=$((i + 1))
  mkdir -p ".vl$i"
  mv "$part" ".vl$i/"
done
EXCLUDE="$(git rev-parse --git-common-dir)/info/exclude"
mkdir -p "$(dirname "$EXCLUDE")"
for d in .vl*/; do
  grep -qxF "/${d}" "$EXCLUDE" 2>/dev/null || echo "/${d}" >> "$EXCLUDE"
done
ls -la .vl*/
du -sh "$W/wheels.tar"
