#!/usr/bin/env bash
# The seed's failure and fix end to end on a GPU host without Docker or a
# package registry, and the record of it, made by this script alone: a real
# `vllm serve` of a tiny MiniMax-M3 in the image the pipeline patched, in
# another build of the same definition (the reference image) and in the
# unpatched GPU base, through the engine, at concurrency 1, 2, 4, 8, 16, every
# reply judged by the oracle (bit for bit at concurrency 1, within recorded
# noise above it) against answers recorded from the reference image.
#
#   bash gpu-runs/gpu-host-serve.sh PARTS_DIR OUTDIR
#
# PARTS_DIR holds part-NN and SHA256SUMS from gpu-runs/bundle-serve.sh (they can
# arrive one call at a time). The GPU base is the host's filesystem (its Python,
# torch, Triton and CUDA toolkit) plus the PyPI vLLM 0.25.1 wheel minus two
# members AND their RECORD lines (see bundle-serve.sh: the integrity check stops
# GPU-verified for a compiled file RECORD lists but the image lacks), plus the
# requirements the host's Python lacks.
#
# What ran: every call first checks this checkout against SOURCE_MANIFEST
# (default CHECKOUT/gpu-parts/source.json, made where the tree was sent from by
# `python3 gpu-runs/source_manifest.py make`: the commit, its tree, every
# tracked file's git blob ID) and refuses to go on unless every tracked file
# hashes as in that commit and no other file lies beside them
# (OUTDIR/source-<time>.json keeps each call's check; the record step refuses
# unless every call's tree is the commit's). OUTDIR must lie outside the
# checkout.
#
# Steps (STEPS, default all of them, in order); each skips what is done, so a
# step cut short is run again as it was:
#   unpack    check and join the parts; unzip vLLM's wheel (vllm/ + dist-info),
#             refusing a wheel whose RECORD lists a member it lacks
#   engine    Docker 26.1 with CDI over the host's NVIDIA devices
#             (gpu-runs/gpu-host-engine.sh's engine step)
#   base      GPU base REPO:v0.25.1 (gpu_host.py base --cuda); made again when
#             the parts it came from changed
#   image     build.py image --base v0.25.1 --base-repo REPO (the patched image,
#             REPO:v0.25.1-m3patch, the Dockerfile builder)
#   refimage  the same definition by the assemble builder (REPO:v0.25.1-m3patch-assembled):
#             the reference image, another image than the one judged
#   mutants   each broken backport of gpu-runs/mutants/ (MUTANTS, default all) as the patched
#             image is built, from a project root of its own (gpu-runs/mutants.py root):
#             REPO:v0.25.1-mutant-NAME
#   model     gpu-runs/tiny_minimax_m3.py writes the tiny model (with the gains
#             that make it read its prompt)
#   inputs    hashes the model and the base into WORK/inputs.json the first
#             time (after either was made), and refuses (gpu_host.py inputs
#             --check) to go on with a model or base whose hash changed since
#   gpuonly   (not in the default) the patched image and the base, GPU checks alone (no server, no
#             reference): OUTDIR/gpuonly-patched.json, gpuonly-unpatched.json
#   check     (not in the default) imports vLLM's server, engine core, model
#             runner, MiniMax-M3 and flashinfer.norm in the base, with the GPU
#   reference the reference image, compile caches emptied first (cold), records
#             the reference answers: --record-reference OUTDIR/answers.json
#             (over HTTP concurrency 1 twice, then 16 for the noise; and every
#             level under fixed batches, twice, bit for bit), then its own sweep
#   patched   the patched image, caches warm, --reference answers.json
#   patched2  the patched image again: a second server start (OUTDIR/patched-again.json)
#   patched3  and a third (OUTDIR/patched-third.json): no false failure in 3 starts
#   unpatched1 (not in the default) the base's first run here (OUTDIR/unpatched-first.json)
#   unpatched the base, --definition v0.25.1 --reference answers.json (warm)
#   mutantsmoke each mutant image, --root its own root --reference answers.json
#             (OUTDIR/mutant-NAME.json)
#   record    OUTDIR/record.json (gpu_host.py record, from the reports alone)
# Every smoke runs with --gpu require --keep-going (so the unpatched base's
# sweep runs after its GPU checks failed), no --min-tokens, and signs its
# verdict with a P-256 key made here (WORK/signing-key.pem; the public key is
# copied to OUTDIR/signing-key.pub.pem) into OUTDIR/<which>.dsse.json. The
# sweep's server runs with --no-enable-prefix-caching and VLLM_BATCH_INVARIANT=1
# (the tool adds both) and here with --kv-cache-memory-bytes, so that vLLM does
# not measure the GPU's free memory and the server starts while the GPU checks
# run.
#
# On a host that allows 10 minutes per command, calls after the parts (CALL_BUDGET=540
# ends a call before a smoke it has no time for; the same STEPS again go on from there):
#   STEPS="unpack engine base image refimage mutants model inputs"  (about 4 min; base 2 min)
#   STEPS="reference"                                        (cold server start, about 5 min)
#   STEPS="patched patched2 patched3 unpatched mutantsmoke record"  (warm, at most 90 s each)
#
# OUTDIR gets run.log, dockerd.log, smoke-<which>.log, <which>.json (reference,
# patched, patched-again, unpatched-first, unpatched), <which>.dsse.json, answers.json,
# signing-key.pub.pem, source-*.json and record.json.
#
# REFERENCE_FROM (an earlier run's folder: its answers.json, for a model of the same hash).
# TP (1): --tensor-parallel-size of every server; on a host with N GPUs, a run per size, each in its own OUTDIR:
#   TP=2 STEPS="reference patched unpatched record" bash gpu-runs/gpu-host-serve.sh PARTS OUTDIR-tp2
# (the images, model and inputs made once, by the default steps' first call).
# Environment: PYTHON (python3), GPU_BASE_REPO (vllm-gpu-base), GPU_HOST_WORK
# (/var/lib/vllm-hotfix-gpu), SERVE_MEM (0.3), KV_BYTES (4294967296; empty: let
# vLLM size the KV cache, and start the server after the GPU checks),
# CONCURRENCY (1,2,4,8,16), REQUESTS (32 per level), MUTANTS (names, default every
# gpu-runs/mutants/*.patch), CALL_BUDGET and SMOKE_ESTIMATE (110) seconds, SERVE_ARGS (extra `vllm
# serve` arguments), TIMEOUT_REFERENCE (540), TIMEOUT_WARM (240) seconds per
# smoke (the tool cleans up on TERM), TARGET_SECONDS (90, the record's smoke
# time target for the warm runs), SOURCE_MANIFEST, DRY_RUN (1: print each
# engine-touching command instead of running it, and say where a source check
# would refuse; a self-test of the steps' logic without a GPU or an engine).
set -u
PARTS=$(cd "${1:?usage: gpu-host-serve.sh PARTS_DIR OUTDIR}" && pwd)
OUTDIR=$(realpath -m "${2:?usage: gpu-host-serve.sh PARTS_DIR OUTDIR}")
HERE=$(cd "$(dirname "$0")/.." && pwd)
# Refused before anything is made: an OUTDIR inside the checkout would be files beside the commit's.
case "$OUTDIR/" in "$HERE"/*) echo "error: OUTDIR $OUTDIR lies inside the checkout $HERE: put it outside (the source check would count its files)"; exit 1 ;; esac
mkdir -p "$OUTDIR"
WORK=${GPU_HOST_WORK:-/var/lib/vllm-hotfix-gpu}
PY=$(command -v "${PYTHON:-python3}")
REPO_NAME=${GPU_BASE_REPO:-vllm-gpu-base}
TAG=v0.25.1
BASE=$REPO_NAME:$TAG
PATCHED=$REPO_NAME:$TAG-m3patch
REFIMG=$REPO_NAME:$TAG-m3patch-assembled
STEPS=${STEPS:-unpack engine base image refimage mutants model inputs reference patched patched2 patched3 unpatched mutantsmoke record}
# The broken backports (gpu-runs/mutants/NAME.patch): each built from a project root of its own (mutants.py root).
MUTANTS=${MUTANTS:-$(cd "$HERE/gpu-runs/mutants" 2>/dev/null && ls -- *.patch 2>/dev/null | sed 's/\.patch$//' | tr '\n' ' ')}
MUTANT_ROOTS=$WORK/mutant-roots
DRY_RUN=${DRY_RUN:-}
PAYLOAD=$WORK/payload
MODEL=$WORK/tiny-minimax-m3
KEY=$WORK/signing-key.pem
PUBKEY=$OUTDIR/signing-key.pub.pem
ANSWERS=$OUTDIR/answers.json
INPUTS=$WORK/inputs.json
# The tool's caches (wheels, the compile caches of build/cache/compile/<base>/<gpu>/) stay on the host.
export VLLM_HOTFIX_CACHE=$WORK/cache
export DOCKER_HOST=unix://$WORK/docker.sock PYTHONUNBUFFERED=1
LOG=$OUTDIR/run.log
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }
step() { case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
die() { log "error: $*"; exit 1; }
# An engine-touching command: run, or under DRY_RUN printed (one line, shell-quoted).
act() {
  if [ -n "$DRY_RUN" ]; then
    # To the log and stderr only, whatever the caller does with the command's output; each as one whole
    # line in one write (a caller's stderr may go to the log too: two copies, never one line cut into another).
    local line
    line="+$(printf ' %q' "$@")"
    printf '%s\n' "$line" >>"$LOG"
    printf '%s\n' "$line" >&2
    return 0
  fi
  "$@"
}
mkdir -p "$WORK"
SOURCE_MANIFEST=${SOURCE_MANIFEST:-$HERE/gpu-parts/source.json}
# What runs here: the tracked files of the commit SOURCE_MANIFEST names, nothing else beside them.
src="$OUTDIR/source-$(date -u +%Y%m%dT%H%M%S)-$$.json"
if "$PY" "$HERE/gpu-runs/source_manifest.py" check "$SOURCE_MANIFEST" --root "$HERE" --write "$src" >/dev/null 2>"$src.err"; then
  log "checkout $HERE: commit $("$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['commit'], 'tree', d['tree'], 'clean')" "$src"); steps: $STEPS"
  rm -f "$src.err"
else
  why=$(cat "$src.err" 2>/dev/null; "$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); print('tree', d['tree'], 'not', d['tree_expected'], 'differ', d['differ'], 'missing', d['missing'], 'extra', d['extra'], 'sender_clean', d['sender_clean'])" "$src" 2>/dev/null)
  rm -f "$src.err"
  if [ -n "$DRY_RUN" ]; then
    log "source check: would refuse (${why:-no manifest}); steps: $STEPS"
  else
    die "source check against $SOURCE_MANIFEST: not the clean commit it names (${why:-no manifest}); make it with gpu-runs/source_manifest.py make in a clean checkout, and send that tree"
  fi
fi
PARTS_SUM=$(sha256sum "$PARTS/SHA256SUMS" 2>/dev/null | cut -d' ' -f1)

if step unpack; then
  if [ ! -f "$PAYLOAD/.complete" ] || [ "$(cat "$PAYLOAD/.complete")" != "$PARTS_SUM" ]; then
    parts=("$PARTS"/part-*)
    log "unpack: ${#parts[@]} part(s) in $PARTS"
    (cd "$PARTS" && sha256sum -c --quiet SHA256SUMS) || die "a part is missing or damaged (sha256sum -c in $PARTS)"
    rm -rf "$PAYLOAD" && mkdir -p "$PAYLOAD"
    cat "$PARTS"/part-* | tar -C "$PAYLOAD" -xf - || die "cannot unpack the parts"
    rm -rf "$WORK/src" && mkdir -p "$WORK/src"
    "$PY" - "$PAYLOAD"/vllm-0.25.1-*.whl "$WORK/src" <<'PYEOF' || die "vLLM's wheel: see the line above"
import csv, io, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    have = set(z.namelist())
    record = next(n for n in have if n.endswith(".dist-info/RECORD"))
    listed = [r[0] for r in csv.reader(io.TextIOWrapper(z.open(record), encoding="utf-8")) if r]
    missing = [n for n in listed if n not in have]
    if missing:
        # The integrity check would refuse GPU-verified for them: the bundle must drop their RECORD lines.
        sys.exit(f"{sys.argv[1]}: RECORD lists {', '.join(missing)}, which the wheel lacks "
                 "(make the parts again with gpu-runs/bundle-serve.sh)")
    names = [n for n in have if n.startswith(("vllm/", "vllm-0.25.1.dist-info/"))]
    z.extractall(sys.argv[2], names)
print(f"  {len(names)} files of {sys.argv[1].rsplit('/', 1)[-1]}; RECORD lists only what it holds")
PYEOF
    echo "$PARTS_SUM" >"$PAYLOAD/.complete"
    log "unpacked: $(du -sh "$PAYLOAD" | cut -f1)"
  fi
  # The checkout running this script, as gpu-host-engine.sh unpacks it (refreshed on every run).
  tar -C "$HERE" --exclude=./.gpucarry --exclude=./build --exclude=./gpu-parts --exclude=./.git -czf "$PAYLOAD/repo.tar.gz" .
fi

if step engine; then
  act env STEPS=engine bash "$HERE/gpu-runs/gpu-host-engine.sh" "$PAYLOAD" "$OUTDIR" || die "engine step failed"
fi
export PYTHONPATH=$WORK/site
# The tool signs verdicts with `cryptography`, which a GPU host's Python may lack: its wheels
# (and cffi's) travel among vLLM's requirements; they go where the tool's other wheels went.
if ! "$PY" -c "import cryptography" 2>/dev/null && [ -d "$PAYLOAD/wheels/deps" ]; then
  act "$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check --upgrade \
    --target "$WORK/site" "$PAYLOAD"/wheels/deps/cryptography-*.whl "$PAYLOAD"/wheels/deps/cffi-*.whl \
    "$PAYLOAD"/wheels/deps/pycparser-*.whl >>"$LOG" 2>&1 || die "cannot install cryptography for the tool"
fi
# The tool runs from this checkout, never from a copy an earlier run left.
cd "$HERE" || die "cannot enter $HERE"
have_image() {
  "$PY" -c "import docker; docker.DockerClient(base_url='$DOCKER_HOST').images.get('$1')" 2>/dev/null
}

if step base; then
  if [ -z "$DRY_RUN" ] && have_image "$BASE" && [ "$(cat "$WORK/base.parts" 2>/dev/null)" = "$PARTS_SUM" ]; then
    log "GPU base $BASE already there, made from these parts"
  else
    log "GPU base $BASE: host filesystem + CUDA toolkit + vLLM 0.25.1 + $(ls "$PAYLOAD"/wheels/deps 2>/dev/null | wc -l) wheels"
    act "$PY" gpu-runs/gpu_host.py base "$BASE" --vllm-src "$WORK/src" --wheels "$PAYLOAD/wheels/deps" \
      --python "$PY" --cuda >>"$LOG" 2>&1 || die "GPU base failed (see run.log)"
    echo "$PARTS_SUM" >"$WORK/base.parts"
    rm -f "$INPUTS"  # a new base: its hash is written again below
    log "GPU base done: $(tail -1 "$LOG")"
  fi
fi

if step image; then
  log "build.py image --base $TAG --base-repo $REPO_NAME --pull never"
  act "$PY" build.py image --base "$TAG" --base-repo "$REPO_NAME" --pull never --no-smoke --tag "$PATCHED" \
    >>"$LOG" 2>&1 || die "build.py image failed (see run.log)"
  log "image done: $(tail -1 "$LOG")"
fi

if step refimage; then
  # Another image of the same definition: the reference answers must not come from the image judged.
  log "build.py image --builder assemble --tag $REFIMG (the reference image)"
  act "$PY" build.py image --base "$TAG" --base-repo "$REPO_NAME" --pull never --no-smoke --builder assemble \
    --tag "$REFIMG" >>"$LOG" 2>&1 || die "build.py image --builder assemble failed (see run.log)"
  log "reference image done: $(tail -1 "$LOG")"
fi

if step mutants; then
  for m in $MUTANTS; do
    log "mutant $m: build.py --root $MUTANT_ROOTS/$m image (gpu-runs/mutants/$m.patch in the real patch's place)"
    act "$PY" gpu-runs/mutants.py root "$m" "$MUTANT_ROOTS/$m" >>"$LOG" 2>&1 || die "mutants.py root $m failed"
    act "$PY" build.py --root "$MUTANT_ROOTS/$m" image --base "$TAG" --base-repo "$REPO_NAME" --pull never --no-smoke \
      --tag "$REPO_NAME:$TAG-mutant-$m" >>"$LOG" 2>&1 || die "build.py image of mutant $m failed (see run.log)"
    log "mutant $m done: $(tail -1 "$LOG")"
  done
fi

if step model; then
  if [ ! -f "$MODEL/model.safetensors" ]; then
    act "$PY" gpu-runs/tiny_minimax_m3.py "$MODEL" | tee -a "$LOG" || die "model failed"
    rm -f "$INPUTS"
  fi
fi

# Inputs kept on the host are reused only when their hashes are the ones written when they were made.
check_inputs() {
  if [ -f "$INPUTS" ]; then
    act "$PY" gpu-runs/gpu_host.py inputs --model "$MODEL" --base "$BASE" --check "$INPUTS" >/dev/null \
      || die "an input changed since $INPUTS was written (see the line above); remove it to start again"
  else
    act "$PY" gpu-runs/gpu_host.py inputs --model "$MODEL" --base "$BASE" --write "$INPUTS" >/dev/null \
      || die "cannot hash the inputs"
    log "inputs hashed into $INPUTS"
  fi
}
if step inputs; then
  check_inputs
fi

if step check; then
  log "check: imports in $BASE with the GPU"
  act "$PY" - "$BASE" "$PY" <<'PYEOF' 2>&1 | tee -a "$LOG"
import sys, docker
image, python = sys.argv[1], sys.argv[2]
code = (
    "import importlib, time\n"
    "for m in ['vllm.entrypoints.openai.api_server', 'vllm.v1.engine.core', 'vllm.v1.worker.gpu_model_runner',\n"
    "          'vllm.models.minimax_m3.nvidia.model', 'flashinfer.norm']:\n"
    "    t = time.monotonic()\n"
    "    try:\n"
    "        importlib.import_module(m); print(f'  ok   {m} ({time.monotonic() - t:.1f} s)')\n"
    "    except Exception as e:\n"
    "        print(f'  FAIL {m}: {type(e).__name__}: {e}')\n"
    "import torch; print('  torch', torch.__version__, 'cuda', torch.cuda.is_available())\n"
)
client = docker.from_env(timeout=600)
out = client.containers.run(image, entrypoint=[python, "-c", code], remove=True, stderr=True,
                            device_requests=[docker.types.DeviceRequest(driver="cdi", device_ids=["nvidia.com/gpu=all"])])
print(out.decode(errors="replace")[-4000:])
PYEOF
fi

# The signing key: made once on this host; only its public half leaves it.
ensure_key() {
  if [ ! -f "$KEY" ]; then
    (umask 077
     if command -v openssl >/dev/null; then
       openssl ecparam -name prime256v1 -genkey -noout -out "$KEY.tmp"
     else
       "$PY" -c "
import sys
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
key = ec.generate_private_key(ec.SECP256R1())
open(sys.argv[1], 'wb').write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                serialization.NoEncryption()))" "$KEY.tmp"
     fi) && mv "$KEY.tmp" "$KEY" || die "cannot make a signing key"
    log "signing key made: $KEY"
  fi
  [ ! -s "$PUBKEY" ] || [ "$PUBKEY" -nt "$KEY" ] || rm -f "$PUBKEY"
  [ ! -s "$PUBKEY" ] || return 0  # written already (smokes in the background must not rewrite it at once)
  if command -v openssl >/dev/null; then
    openssl ec -in "$KEY" -pubout -out "$PUBKEY" 2>/dev/null || die "cannot write the public key"
  else
    "$PY" -c "
import sys
from cryptography.hazmat.primitives import serialization
key = serialization.load_pem_private_key(open(sys.argv[1], 'rb').read(), None)
open(sys.argv[2], 'wb').write(key.public_key().public_bytes(serialization.Encoding.PEM,
                              serialization.PublicFormat.SubjectPublicKeyInfo))" "$KEY" "$PUBKEY" \
      || die "cannot write the public key"
  fi
}

# --enforce-eager: no torch.compile and no CUDA graph capture at start-up (the
# bug is in the kernels' buffer layout, which eager mode runs the same way).
# --kv-cache-memory-bytes: vLLM sizes the KV cache from it instead of measuring
# the GPU's free memory, so the GPU checks' processes may come and go while it
# starts (the smoke then overlaps the two).
# No --min-tokens: every reply is judged by the oracle, as a site judges its
# own model, which can stop early.
serve=(--serve-model "$MODEL" --concurrency "${CONCURRENCY:-1,2,4,8,16}" --requests "${REQUESTS:-32}")
# TP=N: every server (the sweep's and the fixed-batch engine) on N GPUs, the patch set's GPU checks on each of
# them; the reference is recorded at N too (a reference of another size is refused), so give each TP an OUTDIR.
TP=${TP:-1}
case "$TP" in ''|*[!0-9]*|0) die "TP=$TP: a whole number of GPUs, 1 or more" ;; esac
[ "$TP" = 1 ] || serve+=(--serve-arg=--tensor-parallel-size --serve-arg="$TP")
KV_BYTES=${KV_BYTES-4294967296}
# shellcheck disable=SC2086  # SERVE_ARGS is a list of words
for a in --max-model-len 8192 --enforce-eager --gpu-memory-utilization "${SERVE_MEM:-0.3}" \
         ${KV_BYTES:+--kv-cache-memory-bytes "$KV_BYTES"} ${SERVE_ARGS:-}; do
  serve+=(--serve-arg="$a")
done
# smoke WHICH IMAGE TIMEOUT ARGS...: one smoke, unless its report is there already.
# One at a time: a vLLM server measures the GPU's free memory while it starts,
# and another process allocating or freeing meanwhile upsets that.
smoke() {
  local which=$1 ref=$2 limit=$3
  shift 3
  if [ -f "$OUTDIR/$which.json" ]; then
    log "smoke $which: done already ($OUTDIR/$which.json)"
    return 0
  fi
  # CALL_BUDGET: a smoke this call has no time for is not started (the same STEPS again go on from it); the
  # steps after it still run, the record included, from the reports there are.
  if [ -n "${CALL_BUDGET:-}" ] && [ $((SECONDS + ${SMOKE_ESTIMATE:-110})) -gt "$CALL_BUDGET" ]; then
    log "smoke $which: not started, ${SECONDS} s into a call of ${CALL_BUDGET} s; run this step again"
    return 0
  fi
  check_inputs
  ensure_key
  log "smoke $which: $ref --gpu require --keep-going --base-repo $REPO_NAME $*${NO_SERVE:+ (no server)}${NO_SERVE:- ${serve[*]}}"
  local start=$SECONDS rc=0
  # --base-repo: the definition's base is REPO:v0.25.1 here (the unpatched base's smoke has no build record).
  local served=("${serve[@]}")
  [ -z "${NO_SERVE:-}" ] || served=()  # the gpuonly step's smokes: the GPU checks alone
  act timeout "$limit" "$PY" build.py smoke "$ref" --gpu require --keep-going --base-repo "$REPO_NAME" "$@" "${served[@]}" \
    --sign-key "$KEY" --attestation "$OUTDIR/$which.dsse.json" --report "$OUTDIR/$which.json" \
    >"$OUTDIR/smoke-$which.log" 2>&1 || rc=$?
  log "smoke $which: exit code $rc after $((SECONDS - start)) s ($(grep -h '^==> phases' "$OUTDIR/smoke-$which.log" | tail -1))"
  [ "$rc" != 124 ] || log "smoke $which: cut short at $limit s; run this step again"
}

# PARALLEL=N: the smokes of the steps patched2, patched3 and mutantsmoke run N at a time (each its own server,
# probe and GPU checks on the one GPU; with --kv-cache-memory-bytes no server sizes its KV cache from the GPU's
# free memory, and no reply depends on what else runs). Their smoke times are then not warm times alone: the
# record's warm times are patched's and unpatched's, which run alone. BATCH_ESTIMATE (200) s per batch against
# CALL_BUDGET.
PARALLEL=${PARALLEL:-1}
# Each vLLM engine still refuses to start unless the GPU's free memory is at least SERVE_MEM of its total
# (vLLM's worker checks it at start-up, KV size given or not), and a smoke starts two engines (the server and
# the fixed-batch probe). With ENGINE_GIB (10) GiB held by each engine already running, the last of N smokes'
# 2N engines starts only where (2N - 1) x ENGINE_GIB + SERVE_MEM x total fits the GPU: PARALLEL is lowered to
# that (reasoned from vLLM's check and the tiny model's size, not measured).
fitting_parallel() {
  local total_mib=$1
  awk -v t="$total_mib" -v m="${SERVE_MEM:-0.3}" -v e="${ENGINE_GIB:-10}" \
    'BEGIN { n = int(((t / 1024) * (1 - m) / e + 1) / 2); print (n < 1 ? 1 : n) }'
}
if [ "$PARALLEL" -gt 1 ] && command -v nvidia-smi >/dev/null; then
  total=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1 | tr -dc 0-9)
  if [ -n "$total" ]; then
    most=$(fitting_parallel "$total")
    if [ "$PARALLEL" -gt "$most" ]; then
      log "PARALLEL=$PARALLEL lowered to $most: $((total / 1024)) GiB GPU, SERVE_MEM ${SERVE_MEM:-0.3}, ${ENGINE_GIB:-10} GiB per engine"
      PARALLEL=$most
    fi
  fi
fi
pending=0
queued() {
  if [ "$PARALLEL" -le 1 ]; then
    smoke "$@"
    return 0
  fi
  check_inputs
  ensure_key
  SMOKE_ESTIMATE=${BATCH_ESTIMATE:-200} smoke "$@" &
  pending=$((pending + 1))
  if [ "$pending" -ge "$PARALLEL" ]; then
    wait
    pending=0
  fi
}
flush() {
  wait
  pending=0
}

# The patched image and the base with their GPU checks alone (no server, no reference): the layer identity
# check, the isolated runner and the patch set's GPU checks on this GPU, in minutes instead of the run's twenty.
if step gpuonly; then
  NO_SERVE=1 smoke gpuonly-patched "$PATCHED" "${TIMEOUT_WARM:-240}"
  NO_SERVE=1 smoke gpuonly-unpatched "$BASE" "${TIMEOUT_WARM:-240}" --definition "$TAG"
fi
if step reference; then
  if [ ! -f "$OUTDIR/reference.json" ]; then
    # Cold means no compile cache of any base on any GPU, and answers recorded afresh.
    act rm -rf "$VLLM_HOTFIX_CACHE/compile"
    rm -f "$ANSWERS"
  fi
  smoke reference "$REFIMG" "${TIMEOUT_REFERENCE:-540}" --record-reference "$ANSWERS"
fi
# REFERENCE_FROM=DIR: judge with the reference answers an earlier run recorded (its OUTDIR, kept in
# gpu-runs/), on a model whose hash must equal the one that run's inputs.json names.
if [ -n "${REFERENCE_FROM:-}" ] && [ -z "$DRY_RUN" ] && { step unpatched || step patched || step patched2; }; then
  want=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['inputs']['model']['sha256'])" \
         "$REFERENCE_FROM/inputs.json") || die "cannot read $REFERENCE_FROM/inputs.json"
  have=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['inputs']['model']['sha256'])" "$INPUTS") \
    || die "cannot read $INPUTS (run the inputs step)"
  [ "$want" = "$have" ] || die "the model here ($have) is not the one $REFERENCE_FROM answered with ($want)"
  if [ ! -f "$ANSWERS" ]; then
    cp "$REFERENCE_FROM/answers.json" "$ANSWERS" || die "no $REFERENCE_FROM/answers.json"
  fi
  log "reference answers from $REFERENCE_FROM (model $have): $(sha256sum "$ANSWERS" | cut -c1-64)"
fi
if step patched; then
  [ -f "$ANSWERS" ] || [ -n "$DRY_RUN" ] || die "no $ANSWERS: run the reference step first"
  smoke patched "$PATCHED" "${TIMEOUT_WARM:-240}" --reference "$ANSWERS"
fi
# The base carries no labels: --definition judges it by the patch set it lacks.
if step unpatched1; then
  [ -f "$ANSWERS" ] || [ -n "$DRY_RUN" ] || die "no $ANSWERS: run the reference step first"
  smoke unpatched-first "$BASE" "${TIMEOUT_WARM:-240}" --definition "$TAG" --reference "$ANSWERS"
fi
if step unpatched; then
  [ -f "$ANSWERS" ] || [ -n "$DRY_RUN" ] || die "no $ANSWERS: run the reference step first"
  smoke unpatched "$BASE" "${TIMEOUT_WARM:-240}" --definition "$TAG" --reference "$ANSWERS"
fi

# The patched image's second and third server starts: after the base, so that with PARALLEL they join the
# mutants' batches and the warm times of patched and unpatched stay their own.
if step patched2; then
  [ -f "$ANSWERS" ] || [ -n "$DRY_RUN" ] || die "no $ANSWERS: run the reference step first"
  queued patched-again "$PATCHED" "${TIMEOUT_WARM:-240}" --reference "$ANSWERS"
fi
if step patched3; then
  [ -f "$ANSWERS" ] || [ -n "$DRY_RUN" ] || die "no $ANSWERS: run the reference step first"
  queued patched-third "$PATCHED" "${TIMEOUT_WARM:-240}" --reference "$ANSWERS"
fi
# Each broken backport judged as the patched image is, by its own patch set (--root): its files landed as the
# mutant made them, so only the GPU checks, the exact judge and the sweep can fail it.
if step mutantsmoke; then
  [ -f "$ANSWERS" ] || [ -n "$DRY_RUN" ] || die "no $ANSWERS: run the reference step first"
  for m in $MUTANTS; do
    queued "mutant-$m" "$REPO_NAME:$TAG-mutant-$m" "${TIMEOUT_WARM:-240}" --root "$MUTANT_ROOTS/$m" --reference "$ANSWERS"
  done
fi
flush

if step record; then
  # The record needs these; the other starts and the mutants are recorded where their reports are (its
  # findings say what is missing).
  for which in reference patched unpatched; do
    [ -f "$OUTDIR/$which.json" ] || [ -n "$DRY_RUN" ] || die "no $OUTDIR/$which.json: run its smoke first"
  done
  signed=()
  for which in reference patched patched-again patched-third unpatched-first unpatched; do
    [ ! -f "$OUTDIR/$which.dsse.json" ] || signed+=(--attestation "${which/-/_}=$OUTDIR/$which.dsse.json")
  done
  first=()
  [ ! -f "$OUTDIR/unpatched-first.json" ] || first=(--unpatched-first "$OUTDIR/unpatched-first.json")
  [ ! -f "$OUTDIR/patched-third.json" ] || first+=(--patched-third "$OUTDIR/patched-third.json")
  for m in $MUTANTS; do
    [ ! -f "$OUTDIR/mutant-$m.json" ] || first+=(--mutant "$m=$OUTDIR/mutant-$m.json")
    [ ! -f "$OUTDIR/mutant-$m.dsse.json" ] || signed+=(--attestation "mutant_$m=$OUTDIR/mutant-$m.dsse.json")
  done
  calls=()
  for f in "$OUTDIR"/source-*.json; do
    [ ! -f "$f" ] || calls+=(--source-call "$f")
  done
  [ ! -f "$OUTDIR/patched-again.json" ] || first+=(--patched-again "$OUTDIR/patched-again.json")
  act "$PY" gpu-runs/gpu_host.py record "$OUTDIR/record.json" --reference-run "$OUTDIR/reference.json" \
    --patched "$OUTDIR/patched.json" \
    --unpatched "$OUTDIR/unpatched.json" "${first[@]}" --timings "$LOG" --model "$MODEL" --base "$BASE" --reference "$ANSWERS" \
    --inputs-from "$INPUTS" --public-key "$PUBKEY" --target-seconds "${TARGET_SECONDS:-90}" \
    --source-manifest "$SOURCE_MANIFEST" --source-root "$HERE" "${calls[@]}" "${signed[@]}" | tee -a "$LOG.summary"
  rc=${PIPESTATUS[0]}
  cat "$LOG.summary" >>"$LOG" && rm -f "$LOG.summary"
  [ "$rc" = 0 ] || die "gpu_host.py record refused (exit $rc)"
fi
log "done"
