#!/usr/bin/env bash
# Which module's output starts to depend on the batch's size: gpu-runs/batch_numerics.py in the GPU base,
# with the GPU, on the tiny model(s), after gpu-host-serve.sh made the engine, the base and the model(s).
#
#   bash gpu-runs/gpu-host-numerics.sh OUTDIR [MODEL_DIR...]
#
# Each MODEL_DIR (default: the one gpu-host-serve.sh writes, WORK/tiny-minimax-m3) is mounted read-only
# at /model; OUTDIR/numerics-<name>.json is what the probe wrote, OUTDIR/numerics-<name>.log its output.
# Like gpu-host-serve.sh, the call first checks this checkout against SOURCE_MANIFEST (the clean commit
# it names) and keeps that check in OUTDIR. Environment: PYTHON, GPU_BASE_REPO, GPU_HOST_WORK, SIZES
# (1,2,3,4,5,6,7,8,16), PROMPT_TOKENS (200), SOURCE_MANIFEST, DRY_RUN (print the container it would run).
set -u
OUTDIR=$(realpath -m "${1:?usage: gpu-host-numerics.sh OUTDIR [MODEL_DIR...]}")
shift
HERE=$(cd "$(dirname "$0")/.." && pwd)
case "$OUTDIR/" in "$HERE"/*) echo "error: OUTDIR $OUTDIR lies inside the checkout $HERE: put it outside"; exit 1 ;; esac
mkdir -p "$OUTDIR"
WORK=${GPU_HOST_WORK:-/var/lib/vllm-hotfix-gpu}
PY=$(command -v "${PYTHON:-python3}")
BASE=${GPU_BASE_REPO:-vllm-gpu-base}:v0.25.1
export DOCKER_HOST=unix://$WORK/docker.sock PYTHONUNBUFFERED=1 PYTHONPATH=$WORK/site
LOG=$OUTDIR/run.log
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }
[ $# -gt 0 ] || set -- "$WORK/tiny-minimax-m3"
src="$OUTDIR/source-$(date -u +%Y%m%dT%H%M%S)-$$.json"
if "$PY" "$HERE/gpu-runs/source_manifest.py" check "${SOURCE_MANIFEST:-$HERE/gpu-parts/source.json}" --root "$HERE" \
     --write "$src" >/dev/null 2>&1; then
  log "numerics: checkout clean at $("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['commit'])" "$src")"
elif [ -n "${DRY_RUN:-}" ]; then
  log "numerics: source check would refuse"
else
  log "error: the checkout is not the clean commit its manifest names ($src)"; exit 1
fi
rc=0
for model in "$@"; do
  name=$(basename "$model")
  log "numerics: $name in $BASE, sizes ${SIZES:-1,2,3,4,5,6,7,8,16}"
  if [ -n "${DRY_RUN:-}" ]; then
    log "+ docker run $BASE $PY /probe/batch_numerics.py /model /out/numerics-$name.json (model $model)"
    continue
  fi
  "$PY" - "$BASE" "$PY" "$HERE/gpu-runs" "$model" "$OUTDIR" "$name" "${SIZES:-1,2,3,4,5,6,7,8,16}" \
    "${PROMPT_TOKENS:-200}" >"$OUTDIR/numerics-$name.log" 2>&1 <<'PYEOF' || rc=1
import sys, docker
image, python, probe, model, out, name, sizes, tokens = sys.argv[1:]
client = docker.from_env(timeout=900)
c = client.containers.run(
    image, entrypoint=[python, "/probe/batch_numerics.py", "/model", f"/out/numerics-{name}.json",
                       "--sizes", sizes, "--prompt-tokens", tokens],
    detach=True, network_mode="none", shm_size="8g",
    volumes={probe: {"bind": "/probe", "mode": "ro"}, model: {"bind": "/model", "mode": "ro"},
             out: {"bind": "/out", "mode": "rw"}},
    device_requests=[docker.types.DeviceRequest(driver="cdi", device_ids=["nvidia.com/gpu=all"])])
try:
    status = c.wait(timeout=900)
    print(c.logs().decode(errors="replace")[-20000:])
    sys.exit(status.get("StatusCode", 1))
finally:
    c.remove(force=True)
PYEOF
  log "numerics: $name exit $rc; $(grep -c '"size"' "$OUTDIR/numerics-$name.log" 2>/dev/null) sizes compared"
done
exit $rc
