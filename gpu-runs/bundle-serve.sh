#!/usr/bin/env bash
# Make what a GPU host without Docker or package registries needs to serve a
# real vLLM 0.25.1 in the built images (gpu-runs/gpu-host-serve.sh), split into
# parts that can travel one at a time. Run it on a Debian machine that reaches
# Debian's archive and PyPI:
#
#   bash gpu-runs/bundle-serve.sh DIR [PART_SIZE]
#
# DIR receives payload/ and parts/part-NN (PART_SIZE each, default 12M: a part travels
# with the checkout, about 49 MB, within a call's 64 MiB):
#   payload/engine.tar.xz     Docker 26.1 binaries (made by gpu-runs/bundle.sh)
#   payload/vllm-0.25.1-*.whl the PyPI wheel minus two members AND their lines
#                             in its RECORD (zip -d, nothing else recompressed):
#                             vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so (190 MB,
#                             the Ampere flash-attention build; Hopper uses FA3)
#                             and vllm/vllm-rs (the opt-in Rust front end,
#                             VLLM_USE_RUST_FRONTEND=1 only). The smoke
#                             integrity check stops GPU-verified for a compiled
#                             file RECORD lists but the image lacks, so the GPU
#                             base is "the PyPI wheel minus these two members
#                             and their RECORD lines", and records say so.
#   payload/wheels/deps/      vLLM 0.25.1's requirements that the GPU host's
#                             Python lacks (list: gpu-runs/serve-wheels.txt)
#   payload/wheels/tool/      docker and unidiff for the tool itself
# The requirement list was worked out with pip's resolver in report mode
# (stand-in torch/torchvision/torchaudio/triton distributions for the host's
# own), minus the host's documented package list, minus distributions that only
# other paths import (listed as left out in serve-wheels.txt).
set -euo pipefail
dest=${1:?usage: bundle-serve.sh DIR [PART_SIZE]}
part_size=${2:-12M}
here=$(cd "$(dirname "$0")/.." && pwd)
cache=${VLLM_HOTFIX_CACHE:-$here/build/cache}
wheel=$(ls "$cache"/wheels/vllm-0.25.1-cp38-abi3-manylinux_2_28_x86_64.whl 2>/dev/null | head -1)
[ -f "$wheel" ] || { echo "no vLLM 0.25.1 x86_64 wheel in $cache/wheels (python3 build.py standin --version 0.25.1)" >&2; exit 2; }
mkdir -p "$dest/payload/wheels/deps" "$dest/payload/wheels/tool" "$dest/parts"
PY=${PYTHON:-python3}

if [ ! -f "$dest/payload/engine.tar.xz" ]; then
  tmp=$(mktemp -d)
  bash "$here/gpu-runs/bundle.sh" "$tmp" >/dev/null
  mv "$tmp/engine.tar.xz" "$dest/payload/" && mv "$tmp"/wheels/tool/*.whl "$dest/payload/wheels/tool/"
  rm -rf "$tmp"
fi
reduced=$dest/payload/$(basename "$wheel")
LEFT_OUT='vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs'
if [ ! -f "$reduced" ]; then
  cp "$wheel" "$reduced.tmp"
  # shellcheck disable=SC2086  # two member names, no spaces
  zip -q -d "$reduced.tmp" $LEFT_OUT
  # RECORD must not list what the wheel no longer holds: drop those lines, put RECORD back.
  record=vllm-0.25.1.dist-info/RECORD
  tmp=$(mktemp -d)
  mkdir -p "$tmp/${record%/*}"
  unzip -p "$reduced.tmp" "$record" | grep -v -e '^vllm/vllm_flash_attn/_vllm_fa2_C\.abi3\.so,' -e '^vllm/vllm-rs,' \
    >"$tmp/$record"
  zip -q -d "$reduced.tmp" "$record"
  (cd "$tmp" && zip -q -X "$reduced.tmp" "$record")
  rm -rf "$tmp"
  mv "$reduced.tmp" "$reduced"
fi
# Whatever made it: no RECORD line may name a member the wheel lacks.
"$PY" - "$reduced" <<'PYEOF'
import csv, io, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    names = set(z.namelist())
    record = next(n for n in names if n.endswith(".dist-info/RECORD"))
    rows = list(csv.reader(io.TextIOWrapper(z.open(record), encoding="utf-8")))
missing = [r[0] for r in rows if r and r[0] not in names]
if missing:
    sys.exit(f"{sys.argv[1]}: RECORD lists {len(missing)} member(s) the wheel lacks: {', '.join(missing[:5])}")
print(f"  {sys.argv[1].rsplit('/', 1)[-1]}: RECORD lists {len(rows)} entries, every one in the wheel")
PYEOF
pyget() {
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "${PY_VERSION:-3.12}" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$@"
}
grep -v '^#' "$here/gpu-runs/serve-wheels.txt" | grep . | while read -r req; do
  name=${req%%==*}
  ls "$dest/payload/wheels/deps/" | grep -qi "^$(echo "$name" | tr '-' '_')-${req#*==}-" || pyget "$dest/payload/wheels/deps" "$req"
done

rm -f "$dest"/parts/part-*
tar -C "$dest/payload" -cf - . | split -b "$part_size" -d -a 2 - "$dest/parts/part-"
(cd "$dest/parts" && sha256sum part-* >SHA256SUMS)
du -sh "$dest/payload" "$dest"/payload/* | sed 's/^/  /'
ls -l "$dest/parts" | sed 's/^/  /'
