#!/usr/bin/env bash
# The seed's failure and fix end to end on a GPU host without Docker or a
# package registry, and the record of it, made by this script alone: a real
# `vllm serve` of tiny MiniMax-M3 models in the image the pipeline patched, in
# another build of the same definition (the reference image), in the
# unpatched GPU base, in each broken backport (gpu-runs/mutants/) and each
# correct one written another way (gpu-runs/variants/), through the engine, at
# concurrency 1, 2, 4, 8, 16, every reply judged by the oracle against answers
# recorded from the reference image.
#
#   bash gpu-runs/gpu-host-serve.sh PARTS_DIR OUTDIR
#
# MODELS (default "s0-l2:0:2 s1-l2:1:2 s1-l3:1:3"): NAME:SEED:LAYERS, each made by
# gpu-runs/tiny_minimax_m3.py --seed SEED --layers LAYERS. The images (base,
# patched, reference image, mutants, variants) are built once and shared; each
# model has its own reference answers, smokes and record in OUTDIR/NAME/ (run.log,
# the signing key's public half and the source checks stay in OUTDIR).
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
#   image     build.py image --definition v0.25.1 --base-repo REPO (the patched image,
#             REPO:v0.25.1-m3patch, the Dockerfile builder)
#   refimage  the same definition by the assemble builder (REPO:v0.25.1-m3patch-assembled):
#             the reference image, another image than the one judged
#   mutants   each broken backport of gpu-runs/mutants/ (MUTANTS, default all) as the patched
#             image is built, from a project root of its own (gpu-runs/mutants.py root):
#             REPO:v0.25.1-mutant-NAME
#   variants  each correct backport of gpu-runs/variants/ (VARIANTS, default all), the same
#             way: REPO:v0.25.1-variant-NAME
#   model     gpu-runs/tiny_minimax_m3.py writes each model of MODELS (WORK/models/NAME)
#   inputs    hashes each model and the base into WORK/inputs-NAME.json the first
#             time (after either was made), and refuses (gpu_host.py inputs
#             --check) to go on with a model or base whose hash changed since
#   gpuonly   (not in the default) the patched image and the base, GPU checks alone (no server, no
#             reference): OUTDIR/gpuonly-patched.json, gpuonly-unpatched.json
#   topk      (not in the default; no engine) the topk-layout check on the host's Python against
#             vLLM 0.25.1's sources as shipped, with the real patch, every variant and every
#             mutant (gpu-runs/topk_table.py): OUTDIR/topk-table/table.md and one JSON per name
#   check     (not in the default) imports vLLM's server, engine core, model
#             runner, MiniMax-M3 and flashinfer.norm in the base, with the GPU
#   reference per model, the reference image records the reference answers:
#             --record-reference OUTDIR/NAME/answers.json (every level under fixed
#             batches, twice, bit for bit; the HTTP sweep), then its own sweep; the
#             first model's alone with the compile caches emptied first (cold), the
#             others' side by side (PARALLEL), warm
#   patched   per model, alone: the patched image, caches warm, --reference its answers
#   unpatched1 (not in the default) the base's first run here (OUTDIR/NAME/unpatched-first.json)
#   unpatched per model, alone: the base, --definition v0.25.1 --reference its answers (warm)
#   patched2  per model, side by side: the patched image again, a second server start
#             (OUTDIR/NAME/patched-again.json)
#   patched3  and a third (patched-third.json): no false failure in 3 starts
#   variantsmoke each variant image, --root its own root (OUTDIR/NAME/variant-V.json): must pass
#   mutantsmoke each mutant image, --root its own root (OUTDIR/NAME/mutant-M.json): must fail
#   golden    per model, on the host's Python (no engine): gpu-runs/golden_run.py on the model with its
#             reference answers (OUTDIR/NAME/golden.json: the golden forward's noise against vLLM
#             and its confident positions), after the reference
#   record    OUTDIR/NAME/record.json per model (gpu_host.py record, from the reports alone)
# Every smoke runs with --gpu require --keep-going (so the unpatched base's
# sweep runs after its GPU checks failed), no --min-tokens, and signs its
# verdict with a P-256 key made here (WORK/signing-key.pem; the public key is
# copied to OUTDIR/signing-key.pub.pem) into OUTDIR/<which>.dsse.json. The
# sweep's server runs with --no-enable-prefix-caching and VLLM_BATCH_INVARIANT=1
# (the tool adds both) and here with --kv-cache-memory-bytes, so that vLLM does
# not measure the GPU's free memory and the server starts while the GPU checks
# run.
#
# Time plan: calls of at most 10 minutes on one 80 GB H100, after the parts; 30
# minutes hold three of them, and the whole campaign needs four. Seconds from the H100 runs' run.log (2026-12-05 oracle,
# 2026-12-06 exact): unpack 5, engine 8, base 132-143, image and reference image
# 1-2 each, cold reference 283-308 (server start 175-195, fixed batches 215), warm
# patched 71-77, warm unpatched 58; a mutant or variant build and a model are
# estimated at 2 and 5 s (not timed there), a warm reference at 150 s (a warm
# smoke plus the recording's second fixed-batch pass and 24 s of recording;
# estimated), and a batch of PARALLEL=8 warm smokes at 200 s (each smoke is two
# engine starts of mostly CPU on 16 cores; estimated, not measured). With
# CALL_BUDGET=540 a call starts no smoke it has no time for, and the same STEPS
# again go on from there (every step skips what is done):
#   call 1  STEPS="unpack engine base image refimage mutants variants model inputs reference"
#           setup about 200 s, the first model's cold reference about 300 s: about 500 s
#           (the other references are not started: a batch would pass the budget)
#   call 2  STEPS="reference golden patched unpatched patched2 patched3 variantsmoke mutantsmoke"
#           the other two references side by side (about 200 s), the first model's
#           patched and unpatched alone (75 + 60 s: the campaign's warm times), then one
#           side-by-side batch of 8 (about 200 s): about 535 s
#   call 3  the same STEPS plus record: two more batches (about 400 s) and the records
# Side by side there are 46 smokes: the later models' patched and unpatched (4), every
# model's second and third start (6), variants (9) and mutants (27), in that order, 6
# batches of 8. By call 3, 24 have run: every start, base and variant of every model and
# 5 of the first model's mutants; the 22 mutant smokes left need a fourth call (about
# 600 s; the same STEPS, then record again). About 2,240 s in all by these estimates.
# Each call, with the side-by-side settings the estimate assumes (the tiny models need
# about 0.65 GiB of KV cache at concurrency 16 (3 layers x 2,304 bytes a token x 16
# requests of at most 5,722 tokens, reasoned from their shapes): 2 GiB leaves
# room, and 8 smokes' 16 engines then fit an 80 GB GPU by fitting_parallel below):
#   PARALLEL=8 KV_BYTES=2147483648 SERVE_MEM=0.05 ENGINE_GIB=5 CALL_BUDGET=540 \
#     STEPS="..." bash gpu-runs/gpu-host-serve.sh PARTS OUTDIR
# The batch time is the estimate least known: run.log times every smoke, so the first
# batch of call 2 says how many of the rest fit. The golden step (per model, on the host's
# Python, while no smoke runs) is not in these sums: its time on a GPU is not measured yet.
#
# OUTDIR gets run.log, dockerd.log, signing-key.pub.pem and source-*.json; OUTDIR/NAME/
# per model smoke-<which>.log, <which>.json (reference, patched, patched-again,
# patched-third, unpatched-first, unpatched, variant-V, mutant-M), <which>.dsse.json,
# answers.json, inputs.json and record.json.
#
# REFERENCE_FROM (an earlier run's OUTDIR: its NAME/answers.json, for a model of the same hash).
# TP (1): --tensor-parallel-size of every server; on a host with N GPUs, a run per size, each in its own OUTDIR:
#   TP=2 STEPS="reference patched unpatched record" bash gpu-runs/gpu-host-serve.sh PARTS OUTDIR-tp2
# (the images, model and inputs made once, by the default steps' first call).
# Environment: PYTHON (python3), GPU_BASE_REPO (vllm-gpu-base), GPU_HOST_WORK
# (/var/lib/vllm-hotfix-gpu), SERVE_MEM (0.3), KV_BYTES (4294967296; empty: let
# vLLM size the KV cache, and start the server after the GPU checks),
# CONCURRENCY (1,2,4,8,16), REQUESTS (32 per level), MUTANTS (names, default every
# gpu-runs/mutants/*.patch), VARIANTS (names, default every gpu-runs/variants/*.patch), CALL_BUDGET and SMOKE_ESTIMATE (110) seconds, SERVE_ARGS (extra `vllm
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
STEPS=${STEPS:-unpack engine base image refimage mutants variants model inputs reference golden patched unpatched patched2 patched3 variantsmoke mutantsmoke record}
# The broken backports (gpu-runs/mutants/NAME.patch): each built from a project root of its own (mutants.py root).
MUTANTS=${MUTANTS:-$(cd "$HERE/gpu-runs/mutants" 2>/dev/null && ls -- *.patch 2>/dev/null | sed 's/\.patch$//' | tr '\n' ' ')}
MUTANT_ROOTS=$WORK/mutant-roots
# The correct backports written another way (gpu-runs/variants/NAME.patch): built and judged as the mutants are.
VARIANTS=${VARIANTS:-$(cd "$HERE/gpu-runs/variants" 2>/dev/null && ls -- *.patch 2>/dev/null | sed 's/\.patch$//' | tr '\n' ' ')}
VARIANT_ROOTS=$WORK/variant-roots
# The models (NAME:SEED:LAYERS, each made by gpu-runs/tiny_minimax_m3.py --seed SEED --layers LAYERS): the images
# are shared; each model has its own reference, smokes and record under OUTDIR/NAME/.
MODELS=${MODELS:-s0-l2:0:2 s1-l2:1:2 s1-l3:1:3}
DRY_RUN=${DRY_RUN:-}
PAYLOAD=$WORK/payload
KEY=$WORK/signing-key.pem
PUBKEY=$OUTDIR/signing-key.pub.pem
# The tool's caches (wheels, the compile caches of build/cache/compile/<base>/<gpu>/) stay on the host.
export VLLM_HOTFIX_CACHE=$WORK/cache
export DOCKER_HOST=unix://$WORK/docker.sock PYTHONUNBUFFERED=1
LOG=$OUTDIR/run.log
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }
step() { case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
# use_model NAME:SEED:LAYERS: the model's folder, its OUTDIR subfolder, answers and input hashes.
use_model() {
  IFS=: read -r MNAME MSEED MLAYERS <<<"$1"
  case "$MNAME:$MSEED:$MLAYERS" in
    *[!A-Za-z0-9.:_-]*|:*|*::*|*:) die "MODELS entry '$1': NAME:SEED:LAYERS (letters, digits, . _ -)" ;;
  esac
  MODEL=$WORK/models/$MNAME
  MOUT=$OUTDIR/$MNAME
  ANSWERS=$MOUT/answers.json
  INPUTS=$WORK/inputs-$MNAME.json
  mkdir -p "$MOUT"
}
# each_model FUNCTION: FUNCTION once per model of MODELS, in order, with use_model's variables set.
each_model() {
  local spec
  for spec in $MODELS; do
    use_model "$spec"
    "$@"
  done
}
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
    rm -f "$WORK"/inputs-*.json  # a new base: its hash is written again below
    log "GPU base done: $(tail -1 "$LOG")"
  fi
fi

if step image; then
  log "build.py image --definition $TAG --base-repo $REPO_NAME --pull never"
  act "$PY" build.py image --definition "$TAG" --base-repo "$REPO_NAME" --pull never --no-smoke --tag "$PATCHED" \
    >>"$LOG" 2>&1 || die "build.py image failed (see run.log)"
  log "image done: $(tail -1 "$LOG")"
fi

if step refimage; then
  # Another image of the same definition: the reference answers must not come from the image judged.
  log "build.py image --builder assemble --tag $REFIMG (the reference image)"
  act "$PY" build.py image --definition "$TAG" --base-repo "$REPO_NAME" --pull never --no-smoke --builder assemble \
    --tag "$REFIMG" >>"$LOG" 2>&1 || die "build.py image --builder assemble failed (see run.log)"
  log "reference image done: $(tail -1 "$LOG")"
fi

# The broken backports (gpu-runs/mutants/) and the correct ones written another way (gpu-runs/variants/) are built
# alike, each from a project root of its own with its patch in the real patch's place: KIND ROOTS "NAMES".
build_backports() {
  local kind=$1 roots=$2 names=$3 name
  for name in $names; do
    log "$kind $name: build.py --root $roots/$name image (gpu-runs/${kind}s/$name.patch in the real patch's place)"
    act "$PY" gpu-runs/mutants.py root "$name" "$roots/$name" >>"$LOG" 2>&1 || die "mutants.py root $name failed"
    act "$PY" build.py --root "$roots/$name" image --definition "$TAG" --base-repo "$REPO_NAME" --pull never --no-smoke \
      --tag "$REPO_NAME:$TAG-$kind-$name" >>"$LOG" 2>&1 || die "build.py image of $kind $name failed (see run.log)"
    log "$kind $name done: $(tail -1 "$LOG")"
  done
}

if step mutants; then build_backports mutant "$MUTANT_ROOTS" "$MUTANTS"; fi
if step variants; then build_backports variant "$VARIANT_ROOTS" "$VARIANTS"; fi

make_model() {
  if [ ! -f "$MODEL/model.safetensors" ]; then
    log "model $MNAME: tiny_minimax_m3.py --seed $MSEED --layers $MLAYERS"
    act "$PY" gpu-runs/tiny_minimax_m3.py "$MODEL" --seed "$MSEED" --layers "$MLAYERS" | tee -a "$LOG" \
      || die "model $MNAME failed"
    rm -f "$INPUTS"
  fi
}
if step model; then
  each_model make_model
fi

# Inputs kept on the host are reused only when their hashes are the ones written when they were made.
check_inputs() {
  if [ -f "$INPUTS" ]; then
    act "$PY" gpu-runs/gpu_host.py inputs --model "$MODEL" --base "$BASE" --check "$INPUTS" >/dev/null \
      || die "an input changed since $INPUTS was written (see the line above); remove it to start again"
  else
    act "$PY" gpu-runs/gpu_host.py inputs --model "$MODEL" --base "$BASE" --write "$INPUTS" >/dev/null \
      || die "cannot hash the inputs"
    log "inputs of $MNAME hashed into $INPUTS"
  fi
}
if step inputs; then
  each_model check_inputs
fi

if step topk; then
  log "topk: gpu_topk_layout.py against the base, the real patch, every variant and every mutant"
  act "$PY" gpu-runs/topk_table.py prepare "$WORK/src" "$WORK/topk" >>"$LOG" 2>&1 \
    || die "topk_table.py prepare failed (see run.log)"
  act "$PY" gpu-runs/topk_table.py run "$WORK/topk" --vllm-src "$WORK/src" --wheels "$PAYLOAD/wheels/deps" \
    --out "$OUTDIR/topk-table" 2>&1 | tee -a "$LOG"
  log "topk: exit code ${PIPESTATUS[0]} ($OUTDIR/topk-table/table.md)"
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
serve=(--concurrency "${CONCURRENCY:-1,2,4,8,16}" --requests "${REQUESTS:-32}")
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
  if [ -f "$MOUT/$which.json" ]; then
    log "smoke $MNAME/$which: done already ($MOUT/$which.json)"
    return 0
  fi
  # CALL_BUDGET: a smoke this call has no time for is not started (the same STEPS again go on from it); the
  # steps after it still run, the record included, from the reports there are.
  if [ -n "${CALL_BUDGET:-}" ] && [ $((SECONDS + ${SMOKE_ESTIMATE:-110})) -gt "$CALL_BUDGET" ]; then
    log "smoke $MNAME/$which: not started, ${SECONDS} s into a call of ${CALL_BUDGET} s; run this step again"
    return 0
  fi
  check_inputs
  ensure_key
  log "smoke $MNAME/$which: $ref --gpu require --keep-going --base-repo $REPO_NAME $*${NO_SERVE:+ (no server)}${NO_SERVE:- --serve-model $MODEL ${serve[*]}}"
  local start=$SECONDS rc=0
  # --base-repo: the definition's base is REPO:v0.25.1 here (the unpatched base's smoke has no build record).
  local served=(--serve-model "$MODEL" "${serve[@]}")
  [ -z "${NO_SERVE:-}" ] || served=()  # the gpuonly step's smokes: the GPU checks alone
  act timeout "$limit" "$PY" build.py smoke "$ref" --gpu require --keep-going --base-repo "$REPO_NAME" "$@" "${served[@]}" \
    --sign-key "$KEY" --attestation "$MOUT/$which.dsse.json" --report "$MOUT/$which.json" \
    >"$MOUT/smoke-$which.log" 2>&1 || rc=$?
  log "smoke $MNAME/$which: exit code $rc after $((SECONDS - start)) s ($(grep -h '^==> phases' "$MOUT/smoke-$which.log" | tail -1))"
  [ "$rc" != 124 ] || log "smoke $MNAME/$which: cut short at $limit s; run this step again"
}

# PARALLEL=N: the smokes of the steps patched2, patched3, variantsmoke and mutantsmoke, and the references of
# the models after the first, run N at a time (each its own server, probe and GPU checks on the one GPU; with
# --kv-cache-memory-bytes no server sizes its KV cache from the GPU's free memory, and no reply depends on what
# else runs). Their smoke times are then not warm times alone: the record's warm times are patched's and
# unpatched's, which run alone. BATCH_ESTIMATE (200) s per batch against CALL_BUDGET.
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
# They do not depend on the model: the first model's folder holds them.
if step gpuonly; then
  use_model "${MODELS%% *}"
  NO_SERVE=1 smoke gpuonly-patched "$PATCHED" "${TIMEOUT_WARM:-240}"
  NO_SERVE=1 smoke gpuonly-unpatched "$BASE" "${TIMEOUT_WARM:-240}" --definition "$TAG"
fi

# REFERENCE_FROM=DIR: judge with the reference answers an earlier run recorded (its OUTDIR, kept in gpu-runs/:
# DIR/NAME/answers.json per model), on a model whose hash must equal the one that run's DIR/NAME/inputs.json names.
reference_from() {
  [ -n "${REFERENCE_FROM:-}" ] && [ -z "$DRY_RUN" ] || return 0
  local want have
  want=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['inputs']['model']['sha256'])" \
         "$REFERENCE_FROM/$MNAME/inputs.json") || die "cannot read $REFERENCE_FROM/$MNAME/inputs.json"
  have=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['inputs']['model']['sha256'])" "$INPUTS") \
    || die "cannot read $INPUTS (run the inputs step)"
  [ "$want" = "$have" ] || die "model $MNAME here ($have) is not the one $REFERENCE_FROM answered with ($want)"
  if [ ! -f "$ANSWERS" ]; then
    cp "$REFERENCE_FROM/$MNAME/answers.json" "$ANSWERS" || die "no $REFERENCE_FROM/$MNAME/answers.json"
  fi
  log "reference answers of $MNAME from $REFERENCE_FROM (model $have): $(sha256sum "$ANSWERS" | cut -c1-64)"
}
need_answers() {
  [ -f "$ANSWERS" ] || [ -n "$DRY_RUN" ] || die "no $ANSWERS: run the reference step for $MNAME first"
}

# The first model's reference is the cold one (no compile cache of any base on any GPU, answers recorded
# afresh): alone. The other models' references are warm and go side by side (PARALLEL).
first_reference() {
  if [ ! -f "$MOUT/reference.json" ]; then
    act rm -rf "$VLLM_HOTFIX_CACHE/compile"
    rm -f "$ANSWERS"
  fi
  smoke reference "$REFIMG" "${TIMEOUT_REFERENCE:-540}" --record-reference "$ANSWERS"
}
more_reference() {
  [ -f "$MOUT/reference.json" ] || rm -f "$ANSWERS"
  queued reference "$REFIMG" "${TIMEOUT_REFERENCE:-540}" --record-reference "$ANSWERS"
}
if step reference; then
  use_model "${MODELS%% *}"
  first_reference
  for spec in ${MODELS#* }; do
    [ "$spec" != "${MODELS%% *}" ] || continue  # one model only: nothing more
    use_model "$spec"
    more_reference
  done
  flush
fi
if step patched || step patched2 || step patched3 || step unpatched || step unpatched1 || step golden; then
  each_model reference_from
fi

# The golden forward of each model against its reference answers (host's torch; no engine, no vLLM).
golden_model() {
  if [ -f "$MOUT/golden.json" ]; then
    log "golden $MNAME: done already ($MOUT/golden.json)"
    return 0
  fi
  need_answers
  log "golden $MNAME: golden_run.py $MODEL --reference $ANSWERS"
  act "$PY" gpu-runs/golden_run.py "$MODEL" --reference "$ANSWERS" --out "$MOUT/golden.json" \
    >"$MOUT/golden.log" 2>&1 || log "golden $MNAME: exit code $? (see $MOUT/golden.log)"
}
if step golden; then
  each_model golden_model
fi

# The warm times (patched, unpatched): the first model's smokes alone, one after the other. The other models'
# patched and unpatched smokes go side by side (below): their records say so (--side-by-side) and leave the warm
# times to the first model's record.
first_model() { [ "$MNAME" = "$(IFS=: read -r n _ <<<"${MODELS%% *}"; echo "$n")" ]; }
# patched_and_unpatched RUN: this model's patched smoke and the base's two, each through RUN (smoke: now, one
# after the other; queued: side by side with the rest).
patched_and_unpatched() {
  local run=$1
  if step patched; then
    need_answers
    "$run" patched "$PATCHED" "${TIMEOUT_WARM:-240}" --reference "$ANSWERS"
  fi
  # The base carries no labels: --definition judges it by the patch set it lacks.
  if step unpatched1; then
    need_answers
    "$run" unpatched-first "$BASE" "${TIMEOUT_WARM:-240}" --definition "$TAG" --reference "$ANSWERS"
  fi
  if step unpatched; then
    need_answers
    "$run" unpatched "$BASE" "${TIMEOUT_WARM:-240}" --definition "$TAG" --reference "$ANSWERS"
  fi
}
alone() { first_model || return 0; patched_and_unpatched smoke; }
each_model alone

# Side by side (PARALLEL), across the models, in this order so that a call that runs out of time cuts the mutants
# of the later models first: the later models' patched and unpatched smokes and every model's second and third
# start of the patched image, then every model's correct
# variants, then every model's broken backports, each judged as the patched image is, by its own patch set
# (--root): its files landed as the patch made them, so only the GPU checks, the exact judge and the sweep can tell
# them apart.
starts() {
  first_model || patched_and_unpatched queued
  if step patched2; then
    need_answers
    queued patched-again "$PATCHED" "${TIMEOUT_WARM:-240}" --reference "$ANSWERS"
  fi
  if step patched3; then
    need_answers
    queued patched-third "$PATCHED" "${TIMEOUT_WARM:-240}" --reference "$ANSWERS"
  fi
}
variant_smokes() {
  step variantsmoke || return 0
  need_answers
  for v in $VARIANTS; do
    queued "variant-$v" "$REPO_NAME:$TAG-variant-$v" "${TIMEOUT_WARM:-240}" --root "$VARIANT_ROOTS/$v" \
      --reference "$ANSWERS"
  done
}
mutant_smokes() {
  step mutantsmoke || return 0
  need_answers
  for m in $MUTANTS; do
    queued "mutant-$m" "$REPO_NAME:$TAG-mutant-$m" "${TIMEOUT_WARM:-240}" --root "$MUTANT_ROOTS/$m" \
      --reference "$ANSWERS"
  done
}
each_model starts
each_model variant_smokes
each_model mutant_smokes
flush

# Each model's record: MOUT/record.json (gpu_host.py record, from the reports alone).
record_model() {
  # The record needs these; the other starts, the variants and the mutants are recorded where their reports are
  # (its findings say what is missing).
  local which
  for which in reference patched unpatched; do
    if [ ! -f "$MOUT/$which.json" ] && [ -z "$DRY_RUN" ]; then
      log "record $MNAME: no $MOUT/$which.json yet: run its smoke first"
      RECORD_MISSING=1
      return 0
    fi
  done
  local signed=() more=() calls=() f
  first_model || more+=(--side-by-side)
  for which in reference patched patched-again patched-third unpatched-first unpatched; do
    [ ! -f "$MOUT/$which.dsse.json" ] || signed+=(--attestation "${which/-/_}=$MOUT/$which.dsse.json")
  done
  [ ! -f "$MOUT/unpatched-first.json" ] || more+=(--unpatched-first "$MOUT/unpatched-first.json")
  [ ! -f "$MOUT/patched-again.json" ] || more+=(--patched-again "$MOUT/patched-again.json")
  [ ! -f "$MOUT/patched-third.json" ] || more+=(--patched-third "$MOUT/patched-third.json")
  for m in $MUTANTS; do
    [ ! -f "$MOUT/mutant-$m.json" ] || more+=(--mutant "$m=$MOUT/mutant-$m.json")
    [ ! -f "$MOUT/mutant-$m.dsse.json" ] || signed+=(--attestation "mutant_$m=$MOUT/mutant-$m.dsse.json")
  done
  for v in $VARIANTS; do
    [ ! -f "$MOUT/variant-$v.json" ] || more+=(--variant "$v=$MOUT/variant-$v.json")
    [ ! -f "$MOUT/variant-$v.dsse.json" ] || signed+=(--attestation "variant_$v=$MOUT/variant-$v.dsse.json")
  done
  for f in "$OUTDIR"/source-*.json; do
    [ ! -f "$f" ] || calls+=(--source-call "$f")
  done
  [ ! -f "$MOUT/golden.json" ] || more+=(--golden-run "$MOUT/golden.json")
  # The inputs the smokes ran with, kept beside the record (REFERENCE_FROM reads them).
  [ ! -f "$INPUTS" ] || cp "$INPUTS" "$MOUT/inputs.json"
  act "$PY" gpu-runs/gpu_host.py record "$MOUT/record.json" --reference-run "$MOUT/reference.json" \
    --patched "$MOUT/patched.json" --unpatched "$MOUT/unpatched.json" "${more[@]}" --timings "$LOG" \
    --model "$MODEL" --model-made "gpu-runs/tiny_minimax_m3.py --seed $MSEED --layers $MLAYERS" --base "$BASE" \
    --reference "$ANSWERS" --inputs-from "$INPUTS" --public-key "$PUBKEY" --target-seconds "${TARGET_SECONDS:-90}" \
    --source-manifest "$SOURCE_MANIFEST" --source-root "$HERE" "${calls[@]}" "${signed[@]}" | tee -a "$LOG.summary"
  local rc=${PIPESTATUS[0]}
  cat "$LOG.summary" >>"$LOG" && rm -f "$LOG.summary"
  [ "$rc" = 0 ] || die "gpu_host.py record of $MNAME refused (exit $rc)"
}
if step record; then
  RECORD_MISSING=
  each_model record_model
  [ -z "$RECORD_MISSING" ] || die "a model's record is missing a report (see above): run its smokes, then record"
fi
log "done"
