#!/usr/bin/env bash
# The seed's failure end to end on a GPU host without Docker or a package
# registry: a real `vllm serve` of a tiny MiniMax-M3 in the unpatched GPU base
# and in the image the pipeline patched, through the engine, at concurrency
# 1, 2, 4, 8, 16.
#
#   bash gpu-runs/gpu-host-serve.sh PARTS_DIR OUTDIR
#
# PARTS_DIR holds part-NN and SHA256SUMS from gpu-runs/bundle-serve.sh (they can
# arrive one call at a time). Steps (STEPS, default all of them, in order):
#   unpack  check and join the parts; unzip vLLM's wheel (vllm/ + dist-info)
#   engine  Docker 26.1 with CDI over the host's NVIDIA devices
#           (gpu-runs/gpu-host-engine.sh's engine step)
#   base    GPU base REPO:v0.25.1 from the host's filesystem with its CUDA
#           toolkit, the real vLLM 0.25.1 and its missing requirements
#           (gpu_host.py base --cuda)
#   image   build.py image --base v0.25.1 --base-repo REPO (the patched image)
#   check   imports vLLM's server, engine core, model runner, the MiniMax-M3
#           model and flashinfer.norm inside the base, with the GPU (a report,
#           not a gate: it names a missing module before a server start would)
#   model   gpu-runs/tiny_minimax_m3.py writes the tiny model
#   smoke   build.py smoke --gpu require --serve-model on the images SMOKE_IMAGES
#           names (default: patched unpatched), one after the other
#   record  OUTDIR/record.json (gpu_host.py record)
# Each step skips what an earlier run on the same host already did.
#
# Environment: PYTHON (python3), GPU_BASE_REPO (vllm-gpu-base), GPU_HOST_WORK
# (/var/lib/vllm-hotfix-gpu), SERVE_MEM (0.3), CONCURRENCY (1,2,4,8,16),
# REQUESTS (32 per level), SERVE_ARGS (extra `vllm serve` arguments),
# SMOKE_IMAGES (patched unpatched), SMOKE_TIMEOUT (seconds for each smoke, default
# 500; the tool cleans up on TERM).
set -u
PARTS=$(cd "${1:?usage: gpu-host-serve.sh PARTS_DIR OUTDIR}" && pwd)
mkdir -p "${2:?usage: gpu-host-serve.sh PARTS_DIR OUTDIR}"
OUTDIR=$(cd "$2" && pwd)
HERE=$(cd "$(dirname "$0")/.." && pwd)
WORK=${GPU_HOST_WORK:-/var/lib/vllm-hotfix-gpu}
PY=$(command -v "${PYTHON:-python3}")
REPO_NAME=${GPU_BASE_REPO:-vllm-gpu-base}
TAG=v0.25.1
PATCHED=$REPO_NAME:$TAG-m3patch
STEPS=${STEPS:-unpack engine base image check model smoke record}
PAYLOAD=$WORK/payload
MODEL=$WORK/tiny-minimax-m3
export DOCKER_HOST=unix://$WORK/docker.sock PYTHONUNBUFFERED=1
LOG=$OUTDIR/run.log
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }
step() { case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
die() { log "error: $*"; exit 1; }
mkdir -p "$WORK"

if step unpack && [ ! -f "$PAYLOAD/.complete" ]; then
  log "unpack: $(ls "$PARTS" | grep -c '^part-') part(s) in $PARTS"
  (cd "$PARTS" && sha256sum -c --quiet SHA256SUMS) || die "a part is missing or damaged (sha256sum -c in $PARTS)"
  rm -rf "$PAYLOAD" && mkdir -p "$PAYLOAD"
  cat "$PARTS"/part-* | tar -C "$PAYLOAD" -xf - || die "cannot unpack the parts"
  rm -rf "$WORK/src" && mkdir -p "$WORK/src"
  "$PY" - "$PAYLOAD"/vllm-0.25.1-*.whl "$WORK/src" <<'PYEOF' || die "cannot unzip vLLM's wheel"
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    names = [n for n in z.namelist() if n.startswith(("vllm/", "vllm-0.25.1.dist-info/"))]
    z.extractall(sys.argv[2], names)
print(f"  {len(names)} files of {sys.argv[1].rsplit('/', 1)[-1]}")
PYEOF
  # gpu-host-engine.sh's bundle layout: vLLM's sources are in place already (it
  # skips unpacking them), the tool is this checkout.
  tar -C "$HERE" --exclude=./.gpucarry --exclude=./build -czf "$PAYLOAD/repo.tar.gz" .
  touch "$PAYLOAD/.complete"
  log "unpacked: $(du -sh "$PAYLOAD" | cut -f1)"
fi

if step engine; then
  STEPS=engine bash "$HERE/gpu-runs/gpu-host-engine.sh" "$PAYLOAD" "$OUTDIR" || die "engine step failed"
fi
export PYTHONPATH=$WORK/site
cd "$WORK/repo" 2>/dev/null || die "no $WORK/repo (run the engine step)"

if step base; then
  if "$PY" -c "import sys, docker; c = docker.DockerClient(base_url='$DOCKER_HOST'); c.images.get('$REPO_NAME:$TAG')" 2>/dev/null; then
    log "GPU base $REPO_NAME:$TAG already there"
  else
    log "GPU base $REPO_NAME:$TAG: host filesystem + CUDA toolkit + vLLM 0.25.1 + $(ls "$PAYLOAD"/wheels/deps | wc -l) wheels"
    "$PY" gpu-runs/gpu_host.py base "$REPO_NAME:$TAG" --vllm-src "$WORK/src" --wheels "$PAYLOAD/wheels/deps" \
      --python "$PY" --cuda >>"$LOG" 2>&1 || die "GPU base failed (see run.log)"
    log "GPU base done: $(tail -1 "$LOG")"
  fi
fi

if step image; then
  log "build.py image --base $TAG --base-repo $REPO_NAME --pull never"
  "$PY" build.py image --base "$TAG" --base-repo "$REPO_NAME" --pull never --no-smoke --tag "$PATCHED" \
    >>"$LOG" 2>&1 || die "build.py image failed (see run.log)"
  log "image done: $(tail -1 "$LOG")"
fi

if step check; then
  log "check: imports in $REPO_NAME:$TAG with the GPU"
  "$PY" - "$REPO_NAME:$TAG" "$PY" <<'PYEOF' 2>&1 | tee -a "$LOG"
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

if step model; then
  [ -f "$MODEL/model.safetensors" ] || "$PY" gpu-runs/tiny_minimax_m3.py "$MODEL" | tee -a "$LOG" || die "model failed"
fi

if step smoke; then
  # --enforce-eager: no torch.compile and no CUDA graph capture at start-up (the
  # bug is in the kernels' buffer layout, which eager mode runs the same way).
  # --min-tokens 32: the tiny model cannot stop early (its end-of-text logit is never the
  # largest), so a shorter reply means its attention read garbage and went NaN.
  serve=(--serve-model "$MODEL" --concurrency "${CONCURRENCY:-1,2,4,8,16}" --requests "${REQUESTS:-32}"
         --min-tokens 32)
  for a in --max-model-len 8192 --enforce-eager --gpu-memory-utilization "${SERVE_MEM:-0.3}" ${SERVE_ARGS:-}; do
    serve+=(--serve-arg="$a")
  done
  T=${SMOKE_TIMEOUT:-500}
  # One after the other: a vLLM server measures the GPU's free memory while it
  # starts, and another process allocating or freeing meanwhile upsets that.
  for which in ${SMOKE_IMAGES:-patched unpatched}; do
    case $which in
      patched) ref=$PATCHED; extra=() ;;
      unpatched) ref=$REPO_NAME:$TAG; extra=(--definition "$TAG") ;;
      *) die "SMOKE_IMAGES: patched and/or unpatched, not $which" ;;
    esac
    log "smoke $ref --gpu require ${serve[*]}"
    timeout "$T" "$PY" build.py smoke "$ref" --gpu require "${extra[@]}" "${serve[@]}" \
      --report "$OUTDIR/$which.json" >"$OUTDIR/smoke-$which.log" 2>&1
    log "smoke $which: exit code $?"
  done
fi

if step record; then
  "$PY" gpu-runs/gpu_host.py record "$OUTDIR/record.json" --patched "$OUTDIR/patched.json" \
    --unpatched "$OUTDIR/unpatched.json" --timings "$LOG" | tee -a "$LOG.summary"
  cat "$LOG.summary" >>"$LOG" && rm -f "$LOG.summary"
fi
log "done"
