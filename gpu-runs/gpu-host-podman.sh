#!/usr/bin/env bash
# The GPU smoke through podman on a GPU host without Docker and without a network:
#
#   bash gpu-runs/gpu-host-podman.sh BUNDLE OUTDIR
#
# BUNDLE is a folder made by gpu-runs/bundle.sh with podman.tar.xz from
# gpu-runs/bundle-podman.sh added. The images are made as gpu-host-engine.sh
# makes them (its steps engine, base and image, with the bundled Docker engine
# on its own socket), then copied into podman's store by ID (the engine's
# image export, `podman load`), and smoke-tested by the runner through podman
# with the GPUs as the CDI device nvidia.com/gpu=all:
#
# 1. gpu-host-engine.sh BUNDLE OUTDIR with STEPS="engine base image" (skipped
#    with STEPS_ENGINE=none when the images are already there);
# 2. unpacks podman, writes the CDI spec podman reads (/var/run/cdi, CDI 0.5.0);
# 3. saves the patched image and the unpatched base from the engine, loads them into podman;
# 4. `build.py smoke --launcher podman --gpu require` on both, side by side (the base with --keep-going,
#    so its GPU checks run after patch-landed fails; --sign-key SIGN_KEY when set);
# 5. writes OUTDIR/record-podman.json (gpu_host.py record).
# Environment as gpu-host-engine.sh, plus PODMAN_HOME (/var/lib/vllm-hotfix-podman),
# SIGN_KEY (a PEM file, mode 0600: this host signs after judging the report), PODMAN_ULIMITS (see
# bundle-podman.sh), SOURCE_MANIFEST (the record's source check, as in gpu-host-serve.sh).
set -u
BUNDLE=$(cd "${1:?usage: gpu-host-podman.sh BUNDLE OUTDIR}" && pwd)
mkdir -p "${2:?usage: gpu-host-podman.sh BUNDLE OUTDIR}"
OUTDIR=$(cd "$2" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
WORK=${GPU_HOST_WORK:-/var/lib/vllm-hotfix-gpu}
PY=$(command -v "${PYTHON:-python3}")
REPO_NAME=${GPU_BASE_REPO:-vllm-gpu-base}
TAG=v0.25.1
PATCHED=$REPO_NAME:$TAG-m3patch
DRIVER_DIR=${DRIVER_DIR:-/usr/local/nvidia}
export PODMAN_HOME=${PODMAN_HOME:-/var/lib/vllm-hotfix-podman} PYTHONUNBUFFERED=1
LOG=$OUTDIR/run-podman.log
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }
die() { log "error: $*"; exit 1; }

# 1. the images, made by the bundled engine as in the Docker run
if [ "${STEPS_ENGINE:-}" != none ]; then
  STEPS="engine base image" bash "$here/gpu-host-engine.sh" "$BUNDLE" "$OUTDIR" || die "gpu-host-engine.sh failed"
fi
export DOCKER_HOST=unix://$WORK/docker.sock PYTHONPATH=$WORK/site

# 2. podman and its CDI spec
mkdir -p "$WORK/podman"
if [ ! -x "$WORK/podman/bin/podman" ]; then
  xz -dc "$BUNDLE/podman.tar.xz" | tar -C "$WORK/podman" -xf - || die "cannot unpack $BUNDLE/podman.tar.xz"
fi
export PATH=$WORK/podman/bin:$PATH
log "$(podman --version)"
mkdir -p /var/run/cdi
"$PY" - /var/run/cdi/nvidia.json "$DRIVER_DIR" <<'PYEOF' | tee -a "$LOG"
import glob, json, os, stat, sys
spec_path, driver = sys.argv[1], sys.argv[2]
nodes = [p for p in sorted(glob.glob("/dev/nvidia*")) if stat.S_ISCHR(os.stat(p).st_mode)]
common = {"env": [], "mounts": []}
if os.path.isdir(driver):
    common["mounts"].append({"hostPath": driver, "containerPath": driver, "options": ["ro", "nosuid", "nodev", "bind"]})
    common["env"].append(f"LD_LIBRARY_PATH={driver}/lib64:{driver}/lib")
# podman 4.3 reads CDI specs up to version 0.5.0.
spec = {"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu",
        "devices": [{"name": "all", "containerEdits": {"deviceNodes": [{"path": p} for p in nodes]}}],
        "containerEdits": common}
with open(spec_path, "w") as fh:
    json.dump(spec, fh, indent=1)
print(f"  cdi spec {spec_path}: nvidia.com/gpu=all over {', '.join(nodes) or 'no device node'}")
PYEOF

# 3. the same images, by ID, into podman's store
for ref in "$PATCHED" "$REPO_NAME:$TAG"; do
  id=$("$PY" -c "import docker,sys; print(docker.from_env().images.get(sys.argv[1]).id)" "$ref") \
    || die "the engine has no $ref"
  if ! podman image exists "$id"; then
    log "copying $ref ($id) into podman"
    "$PY" -c "
import docker, sys
for chunk in docker.from_env().images.get(sys.argv[1]).save(named=True):
    sys.stdout.buffer.write(chunk)" "$ref" | podman load >>"$LOG" 2>&1 || die "podman load of $ref failed"
  fi
done

# 4. smoke through podman
cd "$WORK/repo" || die "no $WORK/repo"
sign=()
[ -n "${SIGN_KEY:-}" ] && sign=(--sign-key "$SIGN_KEY" --attestation "$OUTDIR/patched-podman.dsse.json")
# Side by side (one GPU is plenty for the GPU checks of two images; no server is started here).
log "smoke --launcher podman --gpu require: $PATCHED and $REPO_NAME:$TAG, side by side"
"$PY" build.py smoke "$PATCHED" --launcher podman --gpu require --gpu-request cdi:nvidia.com/gpu=all \
  --report "$OUTDIR/patched-podman.json" "${sign[@]}" >"$OUTDIR/smoke-patched-podman.log" 2>&1 &
p1=$!
"$PY" build.py smoke "$REPO_NAME:$TAG" --launcher podman --gpu require --gpu-request cdi:nvidia.com/gpu=all \
  --definition "$TAG" --keep-going --report "$OUTDIR/unpatched-podman.json" >"$OUTDIR/smoke-unpatched-podman.log" 2>&1 &
p2=$!
wait $p1; r1=$?
wait $p2; r2=$?
log "smoke exit codes: patched $r1, unpatched $r2"

# 5. the record
# podman started the smokes: the record names it (the engine only built the images). SOURCE_MANIFEST: see
# gpu-host-serve.sh; the record is refused unless the checkout that ran is that clean commit.
"$PY" gpu-runs/gpu_host.py record "$OUTDIR/record-podman.json" --patched "$OUTDIR/patched-podman.json" \
  --unpatched "$OUTDIR/unpatched-podman.json" --timings "$LOG" --launcher podman \
  --launcher-version "$(podman --version)" --source-manifest "${SOURCE_MANIFEST:-gpu-parts/source.json}" \
  --source-root "$(pwd)" | tee -a "$LOG"
log "done"
