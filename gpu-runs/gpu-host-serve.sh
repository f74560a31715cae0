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
# MODELS (default "s0-l2:0:2 s1-l3:1:3 s2-l4:2:4"): NAME:SEED:LAYERS, each made by
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
#   reference per model, the reference image records the reference answers
#             (--record-reference OUTDIR/NAME/answers.json): every model's side by side (PARALLEL),
#             all cold (the compile caches emptied once, before the first)
#   unpatched1 the first model's base beside the recordings, without a reference (none exists yet):
#             it writes the base's compile cache in place (OUTDIR/NAME/unpatched-first.json)
#   patched   the first model's patched image alone, after them: the first smoke of a new image on
#             a host whose base is warm, and the campaign's warm verdict with every judge; the later
#             models' side by side
#   makesmoke the first model's third start, alone: `make smoke` with images/v0.25.1.toml's [smoke]
#             table (patched-third.json); the later models' third start by the long command
#   badrecord the first model's recordings from the second builds (assemble builder) of the broken
#             backports RECORD_MUTANTS: the golden must refuse each (nothing written)
#   golden    per model, on the host's Python (no engine): gpu-runs/golden_run.py on the model with its
#             reference answers (OUTDIR/NAME/golden.json), beside the smokes that follow the recordings
#   unpatched per model, side by side: the base, --definition v0.25.1 --reference its answers
#   patched2  per model, side by side: the patched image again, a second server start
#   patched3  (the later models' third start; the first model's is makesmoke)
#   variantsmoke each variant image, --root its own root (OUTDIR/NAME/variant-V.json): must pass
#   mutantsmoke each mutant image, --root its own root (OUTDIR/NAME/mutant-M.json): must fail; every
#             mutant for the first model, MUTANTS_OTHERS for the others
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
# Time plan: one run, started detached on the GPU host after the parts arrived, the
# calls that follow only waiting for it (a lease holds 30 minutes; the campaign must fit
# 25 of them, counted from the host's start). Seconds measured on one H100 (2026-12-06,
# 2026-12-07 before this plan): setup (unpack, engine, base, images, backports, models,
# inputs) 133; a cold reference 258 alone; eight smokes side by side about 146 wall; a
# warm smoke alone 73-84 (before the server started ahead of the in-image checks).
# Planned: setup 133 + the three recordings beside the first base's run about 300 + two
# smokes alone about 140 + 36 smokes side by side at 8 (the two bad recordings cold, first)
# about 660 + records 20: about 1,250 s, with the host's start and the parts' transfer
# about 1,450 s. The queue starts a smoke as soon as one ends (not in batches). With
#   PARALLEL=8 ENGINE_GIB=5 bash gpu-runs/gpu-host-serve.sh PARTS OUTDIR
# (the tiny models need about 0.65 GiB of KV cache at concurrency 16 (3 layers x 2,304
# bytes a token x 16 requests of at most 5,722 tokens, reasoned from their shapes): the
# 2 GiB given leaves room, and 8 smokes' 16 engines then fit an 80 GB GPU by
# fitting_parallel below). CALL_BUDGET still stops a call from starting a smoke it has no
# time for, where the run is made in several calls instead; every step skips what is done,
# so the same STEPS again go on from where a run stopped.
#
# OUTDIR gets run.log, dockerd.log, signing-key.pub.pem and source-*.json; OUTDIR/NAME/
# per model smoke-<which>.log, <which>.json (reference, patched, patched-again,
# patched-third, unpatched-first, unpatched, variant-V, mutant-M, badrecord-M), <which>.dsse.json,
# answers.json, inputs.json and record.json.
#
# REFERENCE_FROM (an earlier run's OUTDIR: its NAME/answers.json, for a model of the same hash).
# TP (1): --tensor-parallel-size of every server; on a host with N GPUs, a run per size, each in its own OUTDIR:
#   TP=2 STEPS="reference patched unpatched record" bash gpu-runs/gpu-host-serve.sh PARTS OUTDIR-tp2
# (the images, model and inputs made once, by the default steps' first call).
# Environment: PYTHON (python3), GPU_BASE_REPO (vllm-gpu-base), GPU_HOST_WORK
# (/var/lib/vllm-hotfix-gpu), SERVE_MEM (0.05), KV_BYTES (2147483648; empty: let
# vLLM size the KV cache, and start the server after the GPU checks; the defaults are
# images/v0.25.1.toml's [smoke] serve_args, which make smoke uses),
# CONCURRENCY (1,2,4,8,16), REQUESTS (32 per level), MUTANTS (names, default every
# gpu-runs/mutants/*.patch), MUTANTS_OTHERS (the later models' mutants), RECORD_MUTANTS
# (the badrecord step's), VARIANTS (names, default every gpu-runs/variants/*.patch), CALL_BUDGET and SMOKE_ESTIMATE (110) seconds, SERVE_ARGS (extra `vllm
# serve` arguments), TIMEOUT_REFERENCE (540), TIMEOUT_WARM (240) seconds per
# smoke (the tool cleans up on TERM), TARGET_SECONDS (60, the record's smoke
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
STEPS=${STEPS:-unpack engine base image refimage mutants variants model inputs reference unpatched1 patched makesmoke badrecord golden unpatched patched2 variantsmoke mutantsmoke record}
# The broken backports (gpu-runs/mutants/NAME.patch): each built from a project root of its own (mutants.py root).
MUTANTS=${MUTANTS:-$(cd "$HERE/gpu-runs/mutants" 2>/dev/null && ls -- *.patch 2>/dev/null | sed 's/\.patch$//' | tr '\n' ' ')}
MUTANT_ROOTS=$WORK/mutant-roots
# The correct backports written another way (gpu-runs/variants/NAME.patch): built and judged as the mutants are.
VARIANTS=${VARIANTS:-$(cd "$HERE/gpu-runs/variants" 2>/dev/null && ls -- *.patch 2>/dev/null | sed 's/\.patch$//' | tr '\n' ' ')}
VARIANT_ROOTS=$WORK/variant-roots
# The models (NAME:SEED:LAYERS, each made by gpu-runs/tiny_minimax_m3.py --seed SEED --layers LAYERS): the images
# are shared; each model has its own reference, smokes and record under OUTDIR/NAME/.
MODELS=${MODELS:-s0-l2:0:2 s1-l3:1:3 s2-l4:2:4}
# The broken backports the later models are judged with (the first model gets every one).
MUTANTS_OTHERS=${MUTANTS_OTHERS:-decode-side-unfixed prefill-write-unfixed read-unfixed}
# The broken backports built a second time by the assemble builder and used as recording images (badrecord).
RECORD_MUTANTS=${RECORD_MUTANTS:-decode-side-unfixed decode-write-unfixed}
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
    case " $RECORD_MUTANTS " in
      *" $name "*)
        [ "$kind" = mutant ] || continue
        # Its second build, another image of the same broken backport: the recording image of step badrecord.
        act "$PY" build.py --root "$roots/$name" image --definition "$TAG" --base-repo "$REPO_NAME" --pull never \
          --no-smoke --builder assemble --tag "$REPO_NAME:$TAG-$kind-$name-assembled" >>"$LOG" 2>&1 \
          || die "build.py image --builder assemble of $kind $name failed (see run.log)"
        log "$kind $name (assemble builder) done: $(tail -1 "$LOG")" ;;
    esac
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
KV_BYTES=${KV_BYTES-2147483648}
# shellcheck disable=SC2086  # SERVE_ARGS is a list of words
for a in --max-model-len 8192 --enforce-eager --gpu-memory-utilization "${SERVE_MEM:-0.05}" \
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
  awk -v t="$total_mib" -v m="${SERVE_MEM:-0.05}" -v e="${ENGINE_GIB:-10}" \
    'BEGIN { n = int(((t / 1024) * (1 - m) / e + 1) / 2); print (n < 1 ? 1 : n) }'
}
if [ "$PARALLEL" -gt 1 ] && command -v nvidia-smi >/dev/null; then
  total=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1 | tr -dc 0-9)
  if [ -n "$total" ]; then
    most=$(fitting_parallel "$total")
    if [ "$PARALLEL" -gt "$most" ]; then
      log "PARALLEL=$PARALLEL lowered to $most: $((total / 1024)) GiB GPU, SERVE_MEM ${SERVE_MEM:-0.05}, ${ENGINE_GIB:-10} GiB per engine"
      PARALLEL=$most
    fi
  fi
fi
# The queue: at most PARALLEL smokes at once, a new one started as soon as one ends (not in batches that wait for
# their slowest), in the order they are queued.
queued() {
  if [ "$PARALLEL" -le 1 ]; then
    smoke "$@"
    return 0
  fi
  check_inputs
  ensure_key
  while [ "$(jobs -rp | wc -l)" -ge "$PARALLEL" ]; do
    wait -n || true
  done
  SMOKE_ESTIMATE=${BATCH_ESTIMATE:-200} smoke "$@" &
}
flush() {
  wait
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
  # A model whose recording wrote no answers (refused, or cut short) has nothing to be judged against: its smokes
  # are not run and the campaign goes on with the other models (the record says what is missing).
  [ ! -f "$ANSWERS" ] || return 0
  # A dry run records nothing: it goes on as if its recordings had written answers, unless a recording was done
  # already (its report there) without them.
  [ -z "$DRY_RUN" ] || [ -f "$MOUT/reference.json" ] || return 0
  log "no $ANSWERS (its recording wrote none: see $MOUT/smoke-reference.log): $MNAME's $1 not run"
  return 1
}

# The campaign's order (one GPU, PARALLEL smokes at once):
#   1. every model's reference recorded side by side, cold (the compile caches emptied once, before the first; a
#      recording's cache is a folder of its own anyway), and beside them the first model's base without a reference
#      (unpatched-first): the base writes the shared compile cache in place, so that
#   2. the first model's patched image, alone, is the first smoke of a new image on a host whose base is warm and
#      the campaign's warm verdict with every judge; then alone its third start through `make smoke` and the
#      definition's [smoke] table (patched-third);
#   3. side by side, in this order (a run cut short by CALL_BUDGET loses the extras, not a model): every model's
#      base and the later models' patched image, the recordings of broken backports' second builds (badrecord,
#      which the golden must refuse), the other starts, every model's variants, the broken backports every model
#      is judged with (MUTANTS_OTHERS), the first model's others; the golden forward of each model
#      (golden_run.py, the host's torch) beside them.
first_model() { [ "$MNAME" = "$(IFS=: read -r n _ <<<"${MODELS%% *}"; echo "$n")" ]; }
recording() {
  [ -f "$MOUT/reference.json" ] || rm -f "$ANSWERS"
  queued reference "$REFIMG" "${TIMEOUT_REFERENCE:-540}" --record-reference "$ANSWERS"
}
if step reference; then
  use_model "${MODELS%% *}"
  if [ ! -f "$MOUT/reference.json" ]; then
    act rm -rf "$VLLM_HOTFIX_CACHE/compile"
  fi
  each_model recording
fi
if step unpatched1; then
  use_model "${MODELS%% *}"
  # No reference yet (its answers are being recorded beside it): judged by form; its report says how the base ran.
  queued unpatched-first "$BASE" "${TIMEOUT_REFERENCE:-540}" --definition "$TAG"
fi
flush
if step patched || step patched2 || step patched3 || step makesmoke || step unpatched || step golden \
    || step variantsmoke || step mutantsmoke; then
  each_model reference_from
fi

# The golden forward of each model against its reference answers (host's torch; no engine, no vLLM).
golden_model() {
  if [ -f "$MOUT/golden.json" ]; then
    log "golden $MNAME: done already ($MOUT/golden.json)"
    return 0
  fi
  need_answers golden || return 0
  log "golden $MNAME: golden_run.py $MODEL --reference $ANSWERS"
  act "$PY" gpu-runs/golden_run.py "$MODEL" --reference "$ANSWERS" --out "$MOUT/golden.json" \
    >"$MOUT/golden.log" 2>&1 || log "golden $MNAME: exit code $? (see $MOUT/golden.log)"
}

# make_smoke LIMIT: the first model's third start of the patched image as the runbook runs it: `make smoke` with the
# definition's [smoke] table for gpu, concurrency, requests and the server's arguments, the model, reference and
# key as make's variables. Its verdict is held to the long command's (patched) in the record.
make_smoke() {
  local which=patched-third
  if [ -f "$MOUT/$which.json" ]; then
    log "smoke $MNAME/$which: done already ($MOUT/$which.json)"
    return 0
  fi
  need_answers "make smoke" || return 0
  check_inputs
  ensure_key
  local mk rc=0 start=$SECONDS
  mk=$(command -v make || echo "$HERE/.gpucarry/make")
  log "smoke $MNAME/$which: make smoke IMAGE=$PATCHED MODEL=$MODEL REFERENCE=$ANSWERS (images/$TAG.toml [smoke])"
  act timeout "$1" "$mk" -C "$HERE" smoke PYTHON="$PY" IMAGE="$PATCHED" MODEL="$MODEL" REFERENCE="$ANSWERS" \
    SIGN_KEY="$KEY" ARGS="--keep-going --base-repo $REPO_NAME --attestation $MOUT/$which.dsse.json --report $MOUT/$which.json" \
    >"$MOUT/smoke-$which.log" 2>&1 || rc=$?
  log "smoke $MNAME/$which: exit code $rc after $((SECONDS - start)) s ($(grep -h '^==> phases' "$MOUT/smoke-$which.log" | tail -1))"
}

# 2. Alone: the first model's patched image (the long command), then its third start through make smoke.
alone() {
  first_model || return 0
  if step patched; then
    if need_answers "patched smoke"; then
      smoke patched "$PATCHED" "${TIMEOUT_WARM:-240}" --reference "$ANSWERS"
    else
      # Its warm time all the same, without answers to judge (the report says which checks did not run).
      smoke patched-unjudged "$PATCHED" "${TIMEOUT_WARM:-240}"
    fi
  fi
  if step makesmoke || step patched3; then
    make_smoke "${TIMEOUT_WARM:-240}"
  fi
}
each_model alone

# 3. Side by side. The broken backports' second builds (the assemble builder) as recording images: the golden must
# refuse each recording (nothing written), where the recording of a backport that is wrong without crashing would
# otherwise judge every later run against itself.
bad_recordings() {
  first_model && step badrecord || return 0
  for m in $RECORD_MUTANTS; do
    rm -f "$MOUT/badrecord-$m.answers.json"
    queued "badrecord-$m" "$REPO_NAME:$TAG-mutant-$m-assembled" "${TIMEOUT_REFERENCE:-540}" \
      --root "$MUTANT_ROOTS/$m" --record-reference "$MOUT/badrecord-$m.answers.json"
  done
}
# The queue's order puts first what each model's record needs, so that a run cut short by its budget (CALL_BUDGET)
# loses the extras, not a model: every model's base and patched image, then the bad recordings, the other starts,
# the variants, the broken backports every model is judged with (MUTANTS_OTHERS), then the first model's others.
essentials() {
  # The base carries no labels: --definition judges it by the patch set it lacks.
  if step unpatched; then
    need_answers "base" || return 0
    queued unpatched "$BASE" "${TIMEOUT_WARM:-240}" --definition "$TAG" --reference "$ANSWERS"
  fi
  if ! first_model && step patched; then
    need_answers "patched smoke" || return 0
    queued patched "$PATCHED" "${TIMEOUT_WARM:-240}" --reference "$ANSWERS"
  fi
}
more_starts() {
  if step patched2; then
    need_answers "second start" || return 0
    queued patched-again "$PATCHED" "${TIMEOUT_WARM:-240}" --reference "$ANSWERS"
  fi
  if ! first_model && { step patched3 || step makesmoke; }; then
    need_answers "third start" || return 0
    queued patched-third "$PATCHED" "${TIMEOUT_WARM:-240}" --reference "$ANSWERS"
  fi
}
variant_smokes() {
  step variantsmoke || return 0
  need_answers variants || return 0
  for v in $VARIANTS; do
    queued "variant-$v" "$REPO_NAME:$TAG-variant-$v" "${TIMEOUT_WARM:-240}" --root "$VARIANT_ROOTS/$v" \
      --reference "$ANSWERS"
  done
}
# mutant_smokes NAMES: these broken backports of this model.
mutant_smokes() {
  step mutantsmoke || return 0
  need_answers mutants || return 0
  for m in $1; do
    queued "mutant-$m" "$REPO_NAME:$TAG-mutant-$m" "${TIMEOUT_WARM:-240}" --root "$MUTANT_ROOTS/$m" \
      --reference "$ANSWERS"
  done
}
common_mutants() { mutant_smokes "${MUTANTS_OTHERS:-$MUTANTS}"; }
first_models_other_mutants() {
  first_model || return 0
  local rest="" m
  for m in $MUTANTS; do
    case " ${MUTANTS_OTHERS:-$MUTANTS} " in *" $m "*) ;; *) rest="$rest $m" ;; esac
  done
  mutant_smokes "$rest"
}
if step golden; then
  (each_model golden_model) &
fi
each_model essentials
each_model bad_recordings
each_model more_starts
each_model variant_smokes
each_model common_mutants
each_model first_models_other_mutants
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
  # The first model's patched smoke and its make smoke ran alone: theirs are the warm verdicts. The others' ran
  # side by side with the rest (their times are shown, not held to the target).
  if first_model; then
    more+=(--warm patched --warm patched-third --make-smoke patched_third)
  else
    more+=(--side-by-side)
  fi
  for m in $RECORD_MUTANTS; do
    [ ! -f "$MOUT/badrecord-$m.json" ] || more+=(--bad-recording "$m=$MOUT/badrecord-$m.json")
  done
  [ ! -r /proc/uptime ] || { cat /proc/uptime >"$MOUT/host-uptime.txt"; more+=(--host-uptime "$MOUT/host-uptime.txt"); }
  [ ! -f "$OUTDIR/calls.log" ] || more+=(--calls "$OUTDIR/calls.log")
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
    --reference "$ANSWERS" --inputs-from "$INPUTS" --public-key "$PUBKEY" --target-seconds "${TARGET_SECONDS:-60}" \
    --source-manifest "$SOURCE_MANIFEST" --source-root "$HERE" "${calls[@]}" "${signed[@]}" | tee -a "$LOG.summary"
  local rc=${PIPESTATUS[0]}
  cat "$LOG.summary" >>"$LOG" && rm -f "$LOG.summary"
  # A refused record is said and the next model's is still written: what came back is kept either way.
  [ "$rc" = 0 ] || { log "error: gpu_host.py record of $MNAME refused (exit $rc)"; RECORD_MISSING=1; }
}
if step record; then
  RECORD_MISSING=
  each_model record_model
  [ -z "$RECORD_MISSING" ] || die "a model's record is missing a report (see above): run its smokes, then record"
fi
log "done"
