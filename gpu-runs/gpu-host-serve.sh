#!/usr/bin/env bash
# The seed's failure and fix end to end on a GPU host without Docker or a
# package registry, and the record of it, made by this script alone: a real
# `vllm serve` of a tiny MiniMax-M3 in the image the pipeline patched and in
# the unpatched GPU base, through the engine, at concurrency 1, 2, 4, 8, 16,
# every reply judged against reference answers (no --min-tokens).
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
# Steps (STEPS, default all of them, in order); each skips what is done, so a
# step cut short is run again as it was:
#   unpack    check and join the parts; unzip vLLM's wheel (vllm/ + dist-info),
#             refusing a wheel whose RECORD lists a member it lacks
#   engine    Docker 26.1 with CDI over the host's NVIDIA devices
#             (gpu-runs/gpu-host-engine.sh's engine step)
#   base      GPU base REPO:v0.25.1 (gpu_host.py base --cuda); made again when
#             the parts it came from changed
#   image     build.py image --base v0.25.1 --base-repo REPO (the patched image)
#   model     gpu-runs/tiny_minimax_m3.py writes the tiny model
#   inputs    hashes the model and the base into WORK/inputs.json the first
#             time (after either was made), and refuses (gpu_host.py inputs
#             --check) to go on with a model or base whose hash changed since
#   check     (not in the default) imports vLLM's server, engine core, model
#             runner, MiniMax-M3 and flashinfer.norm in the base, with the GPU
#   cold      the patched image, compile caches emptied first, records the
#             reference answers: --record-reference OUTDIR/answers.json
#   warm      the patched image again, caches warm, --reference answers.json
#   unpatched the base, --definition v0.25.1 --reference answers.json
#   record    OUTDIR/record.json (gpu_host.py record, from the reports alone)
# Every smoke runs with --gpu require --keep-going (so the unpatched base's
# sweep runs after its GPU checks failed), no --min-tokens, and signs its
# verdict with a P-256 key made here (WORK/signing-key.pem; the public key is
# copied to OUTDIR/signing-key.pub.pem) into OUTDIR/<which>.dsse.json.
#
# On a host that allows 10 minutes per command, three calls:
#   STEPS="unpack engine base image model inputs"   (about 4 min; base 2 min)
#   STEPS="cold"                                    (cold server start about 3 min)
#   STEPS="warm unpatched record"                   (if it runs out: STEPS="unpatched record")
#
# OUTDIR gets run.log, dockerd.log, smoke-<which>.log, <which>.json (patched-cold,
# patched, unpatched), <which>.dsse.json, answers.json, signing-key.pub.pem and
# record.json.
#
# REFERENCE_FROM (an earlier run's folder: its answers.json, for a model of the same hash).
# Environment: PYTHON (python3), GPU_BASE_REPO (vllm-gpu-base), GPU_HOST_WORK
# (/var/lib/vllm-hotfix-gpu), SERVE_MEM (0.3), CONCURRENCY (1,2,4,8,16),
# REQUESTS (32 per level), SERVE_ARGS (extra `vllm serve` arguments),
# TIMEOUT_COLD (540), TIMEOUT_WARM (240), TIMEOUT_UNPATCHED (300) seconds per
# smoke (the tool cleans up on TERM), TARGET_SECONDS (120, the record's smoke
# time target), DRY_RUN (1: print each engine-touching command instead of
# running it; a self-test of the steps' logic without a GPU or an engine).
set -u
PARTS=$(cd "${1:?usage: gpu-host-serve.sh PARTS_DIR OUTDIR}" && pwd)
mkdir -p "${2:?usage: gpu-host-serve.sh PARTS_DIR OUTDIR}"
OUTDIR=$(cd "$2" && pwd)
HERE=$(cd "$(dirname "$0")/.." && pwd)
WORK=${GPU_HOST_WORK:-/var/lib/vllm-hotfix-gpu}
PY=$(command -v "${PYTHON:-python3}")
REPO_NAME=${GPU_BASE_REPO:-vllm-gpu-base}
TAG=v0.25.1
BASE=$REPO_NAME:$TAG
PATCHED=$REPO_NAME:$TAG-m3patch
STEPS=${STEPS:-unpack engine base image model inputs cold warm unpatched record}
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
    # To the log and stderr only, whatever the caller does with the command's output.
    { printf '+'; printf ' %q' "$@"; printf '\n'; } | tee -a "$LOG" >&2
    return 0
  fi
  "$@"
}
mkdir -p "$WORK"
log "checkout $HERE: $(git -C "$HERE" rev-parse HEAD 2>/dev/null || echo 'not a git checkout'); steps: $STEPS"
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
  tar -C "$HERE" --exclude=./.gpucarry --exclude=./build -czf "$PAYLOAD/repo.tar.gz" .
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
# No --min-tokens: every reply is judged against the reference answers, as a
# site judges its own model, which can stop early.
serve=(--serve-model "$MODEL" --concurrency "${CONCURRENCY:-1,2,4,8,16}" --requests "${REQUESTS:-32}")
# shellcheck disable=SC2086  # SERVE_ARGS is a list of words
for a in --max-model-len 8192 --enforce-eager --gpu-memory-utilization "${SERVE_MEM:-0.3}" ${SERVE_ARGS:-}; do
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
  check_inputs
  ensure_key
  log "smoke $which: $ref --gpu require --keep-going $* ${serve[*]}"
  local start=$SECONDS rc=0
  act timeout "$limit" "$PY" build.py smoke "$ref" --gpu require --keep-going "$@" "${serve[@]}" \
    --sign-key "$KEY" --attestation "$OUTDIR/$which.dsse.json" --report "$OUTDIR/$which.json" \
    >"$OUTDIR/smoke-$which.log" 2>&1 || rc=$?
  log "smoke $which: exit code $rc after $((SECONDS - start)) s ($(grep -h '^==> phases' "$OUTDIR/smoke-$which.log" | tail -1))"
  [ "$rc" != 124 ] || log "smoke $which: cut short at $limit s; run this step again"
}

if step cold; then
  if [ ! -f "$OUTDIR/patched-cold.json" ]; then
    # Cold means no compile cache of any base on any GPU, and answers recorded afresh.
    act rm -rf "$VLLM_HOTFIX_CACHE/compile"
    rm -f "$ANSWERS"
  fi
  smoke patched-cold "$PATCHED" "${TIMEOUT_COLD:-540}" --record-reference "$ANSWERS"
fi
if step warm; then
  [ -f "$ANSWERS" ] || [ -n "$DRY_RUN" ] || die "no $ANSWERS: run the cold step first"
  smoke patched "$PATCHED" "${TIMEOUT_WARM:-240}" --reference "$ANSWERS"
fi
# REFERENCE_FROM=DIR: judge with the reference answers an earlier run recorded (its OUTDIR, kept in
# gpu-runs/), on a model whose hash must equal the one that run's inputs.json names.
if [ -n "${REFERENCE_FROM:-}" ] && [ -z "$DRY_RUN" ] && { step unpatched || step warm; }; then
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

if step unpatched; then
  [ -f "$ANSWERS" ] || [ -n "$DRY_RUN" ] || die "no $ANSWERS: run the cold step first"
  # The base carries no labels: --definition judges it by the patch set it lacks.
  smoke unpatched "$BASE" "${TIMEOUT_UNPATCHED:-300}" --definition "$TAG" --reference "$ANSWERS"
fi

if step record; then
  for which in patched-cold patched unpatched; do
    [ -f "$OUTDIR/$which.json" ] || [ -n "$DRY_RUN" ] || die "no $OUTDIR/$which.json: run the $which smoke first"
  done
  signed=()
  for which in patched-cold patched unpatched; do
    [ ! -f "$OUTDIR/$which.dsse.json" ] || signed+=(--attestation "${which/-/_}=$OUTDIR/$which.dsse.json")
  done
  act "$PY" gpu-runs/gpu_host.py record "$OUTDIR/record.json" --patched "$OUTDIR/patched.json" \
    --patched-cold "$OUTDIR/patched-cold.json" --unpatched "$OUTDIR/unpatched.json" --timings "$LOG" \
    --model "$MODEL" --base "$BASE" --reference "$ANSWERS" --inputs-from "$INPUTS" --public-key "$PUBKEY" \
    --target-seconds "${TARGET_SECONDS:-120}" "${signed[@]}" | tee -a "$LOG.summary"
  rc=${PIPESTATUS[0]}
  cat "$LOG.summary" >>"$LOG" && rm -f "$LOG.summary"
  [ "$rc" = 0 ] || die "gpu_host.py record refused (exit $rc)"
fi
log "done"
