#!/usr/bin/env bash
# Make the folder a GPU host without Docker or package registries needs to run
# the pipeline there (gpu-runs/gpu-host-engine.sh). Run it on a Debian machine
# that reaches Debian's archive and PyPI:
#
#   bash gpu-runs/bundle.sh DIR [VLLM_WHEEL]
#
# DIR receives:
#   engine.tar.xz    Debian 13's docker.io 26.1 dockerd, containerd,
#                    containerd-shim-runc-v2 and runc, Debian 12's tini-static
#                    as docker-init (no CLI: the tool talks to the engine itself)
#   vllm-src.tar.gz  vLLM's Python sources and its dist-info from the wheel (VLLM_FULL=1: the
#                    whole wheel less two members, as vllm-src.tar.gz.part-NN + vllm-src.SHA256SUMS)
#   wheels/tool/     what the tool needs beyond a typical GPU host's Python
#   wheels/base/     what `vllm.models.minimax_m3.common` needs to import beyond
#                    the same (installed into the GPU base image, not the host)
#   repo.tar.gz      this checkout's committed tree (git archive HEAD)
# PY_VERSION (default 3.12) is the GPU host's Python version, for the wheels.
# VLLM_WHEEL defaults to the wheel in the tool's cache (build.py standin fetches it).
set -euo pipefail
dest=${1:?usage: bundle.sh DIR [VLLM_WHEEL]}
here=$(cd "$(dirname "$0")/.." && pwd)
wheel=${2:-$(ls "${VLLM_HOTFIX_CACHE:-$here/build/cache}"/wheels/vllm-0.25.1-*.whl 2>/dev/null | head -1)}
[ -f "$wheel" ] || { echo "no vLLM 0.25.1 wheel (give one, or run: python3 build.py standin --version 0.25.1)" >&2; exit 2; }
PY=${PYTHON:-python3}
mkdir -p "$dest/wheels/tool" "$dest/wheels/base"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Engine binaries: downloaded with a private apt state, never installed here
# (trixie packages would replace this machine's C library).
mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
mirror=${mirror:-http://deb.debian.org/debian}
mkdir -p "$tmp/lists/partial" "$tmp/cache/archives/partial" "$tmp/debs" "$tmp/root" "$tmp/engine"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror trixie main" >"$tmp/sources.list"
apt_opts=(-o "Dir::Etc::SourceList=$tmp/sources.list" -o Dir::Etc::SourceParts=/dev/null
          -o "Dir::State::Lists=$tmp/lists" -o "Dir::Cache=$tmp/cache" -o Debug::NoLocking=1)
apt-get "${apt_opts[@]}" update -q >/dev/null
(cd "$tmp/debs" && apt-get "${apt_opts[@]}" download docker.io containerd runc >/dev/null)
for deb in "$tmp"/debs/*.deb; do dpkg -x "$deb" "$tmp/root"; done
for b in dockerd containerd containerd-shim-runc-v2 runc; do
  install -m 0755 "$(find "$tmp/root" -path "*bin/$b" -type f | head -1)" "$tmp/engine/$b"
done
tini=$(command -v tini-static || true)
[ -n "$tini" ] || { apt-get install -y -q tini >/dev/null; tini=$(command -v tini-static); }
install -m 0755 "$tini" "$tmp/engine/docker-init"
strip --strip-unneeded "$tmp"/engine/dockerd "$tmp"/engine/containerd "$tmp"/engine/containerd-shim-runc-v2 2>/dev/null || true
# -9e: a third slower than -6 here, 4 MB less to carry.
tar -C "$tmp/engine" -cf - . | xz -T0 -9e >"$dest/engine.tar.xz"

# vLLM's Python sources with their dist-info (the probes read RECORD and METADATA). With VLLM_FULL=1,
# the whole wheel (its compiled files too, so the GPU checks run vLLM's own kernels and the image can be
# GPU-verified) less the Ampere flash-attention build and the opt-in Rust front end, whose RECORD lines go
# with them (as bundle-serve.sh), split into parts of PART_SIZE (default 62M) that travel one at a time.
mkdir -p "$tmp/vllm"
if [ -n "${VLLM_FULL:-}" ]; then
  (cd "$tmp/vllm" && unzip -q "$wheel" -x 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' 'vllm/vllm-rs')
  record=$(cd "$tmp/vllm" && ls -d vllm-*.dist-info)/RECORD
  grep -v -e '^vllm/vllm_flash_attn/_vllm_fa2_C\.abi3\.so,' -e '^vllm/vllm-rs,' "$tmp/vllm/$record" >"$tmp/RECORD"
  mv "$tmp/RECORD" "$tmp/vllm/$record"
  rm -f "$dest"/vllm-src.tar.gz "$dest"/vllm-src.tar.gz.part-* "$dest"/vllm-src.SHA256SUMS
  tar -C "$tmp/vllm" -czf - . | split -b "${PART_SIZE:-62M}" -d -a 2 - "$dest/vllm-src.tar.gz.part-"
  (cd "$dest" && sha256sum vllm-src.tar.gz.part-* >vllm-src.SHA256SUMS)
else
  (cd "$tmp/vllm" && unzip -q "$wheel" 'vllm/*.py' 'vllm-*.dist-info/*')
  tar -C "$tmp/vllm" -czf "$dest/vllm-src.tar.gz" .
fi

# Wheels for the GPU host's Python (3.12 on x86_64 unless PY_VERSION says otherwise).
pyget() {
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "${PY_VERSION:-3.12}" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$@"
}
# cryptography (with cffi, pycparser): `smoke` loads it for signed verdicts; a GPU host's torch Python
# lacks it (the 2026-12-03 podman run stopped on that first).
pyget "$dest/wheels/tool" docker==7.1.0 unidiff==0.7.5 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12
# Measured against a GPU host whose Python has torch, triton, transformers, numpy,
# aiohttp, requests, psutil, pillow, einops, cloudpickle, uvloop, py-cpuinfo and
# prometheus-client: importing the indexer and sparse attention, and building a
# VllmConfig, needs these as well.
pyget "$dest/wheels/base" annotated-types==0.8.0 cachetools==8.0.2 cbor2==6.3.0 httpcore2==2.16.2 httpx2==2.16.2 \
  jiter==0.19.0 msgspec==0.23.0 openai==3.57.0 openai-harmony==0.0.8 pybase64==1.5.1 pydantic==2.14.4 \
  pydantic_core==2.50.5 pyzmq==27.3.0 sniffio==1.3.1 truststore==0.10.5 typing-inspection==0.4.5

git -C "$here" archive --format=tar.gz -o "$(cd "$dest" && pwd)/repo.tar.gz" HEAD
du -sh "$dest"/* "$dest"/wheels/* | sed 's/^/  /'
