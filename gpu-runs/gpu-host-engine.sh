#!/usr/bin/env bash
# The real pipeline on a GPU host that has no Docker and no package registry,
# from a folder made by gpu-runs/bundle.sh:
#
#   bash gpu-runs/gpu-host-engine.sh BUNDLE OUTDIR
#
# 1. unpacks the Docker 26.1 binaries, vLLM's sources, the tool and its wheels;
# 2. writes a CDI spec for nvidia.com/gpu=all over the host's NVIDIA device
#    nodes (and its driver folder, if it keeps one outside the system's), the
#    spec `nvidia-ctk cdi generate` would write on a host with the toolkit;
# 3. starts dockerd with the cdi feature on its own socket (none runs here);
# 4. makes a GPU base image from this host's own filesystem (gpu_host.py base);
# 5. runs `build.py image --definition v0.25.1 --base-repo <that base> --pull never`;
# 6. runs `build.py smoke --gpu require` on the patched image and on the
#    unpatched base, side by side;
# 7. writes OUTDIR/record.json (gpu_host.py record).
# OUTDIR gets run.log, dockerd.log, smoke-*.log, patched.json, unpatched.json
# and record.json. Steps already done (engine up, base present) are skipped, so
# a second run on the same host resumes.
#
# Environment: PYTHON (default python3: the Python holding torch, which the base
# runs and the tool runs with), GPU_BASE_REPO (vllm-gpu-base), GPU_HOST_WORK
# (/var/lib/vllm-hotfix-gpu), GPU_HOST_ENGINE_DIR (already unpacked engine
# binaries instead of BUNDLE/engine.tar.xz), DRIVER_DIR (/usr/local/nvidia),
# BASE_PATHS (what of / goes into the base; see gpu_host.py), STEPS (default
# "engine base image smoke record").
set -u
BUNDLE=$(cd "${1:?usage: gpu-host-engine.sh BUNDLE OUTDIR}" && pwd)
mkdir -p "${2:?usage: gpu-host-engine.sh BUNDLE OUTDIR}"
OUTDIR=$(cd "$2" && pwd)
WORK=${GPU_HOST_WORK:-/var/lib/vllm-hotfix-gpu}
PY=$(command -v "${PYTHON:-python3}")
REPO_NAME=${GPU_BASE_REPO:-vllm-gpu-base}
TAG=v0.25.1
PATCHED=$REPO_NAME:$TAG-m3patch
DRIVER_DIR=${DRIVER_DIR:-/usr/local/nvidia}
STEPS=${STEPS:-engine base image smoke record}
export DOCKER_HOST=unix://$WORK/docker.sock PYTHONUNBUFFERED=1
LOG=$OUTDIR/run.log
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }
step() { case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
die() { log "error: $*"; exit 1; }

log "host: $(uname -r), $(. /etc/os-release 2>/dev/null && echo "$PRETTY_NAME"), python $PY"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
  | sed 's/^/  gpu: /' | tee -a "$LOG"
mkdir -p "$WORK"/{engine,src,repo,site,cdi,data,exec}

# 1. unpack
ENGINE=${GPU_HOST_ENGINE_DIR:-$WORK/engine}
if [ ! -x "$ENGINE/dockerd" ]; then
  xz -dc "$BUNDLE/engine.tar.xz" | tar -C "$ENGINE" -xf - || die "cannot unpack $BUNDLE/engine.tar.xz"
fi
if [ ! -d "$WORK/src/vllm" ]; then
  if [ -f "$BUNDLE/vllm-src.SHA256SUMS" ]; then
    # The whole wheel in parts (bundle.sh with VLLM_FULL=1): every part checked, then joined.
    (cd "$BUNDLE" && sha256sum -c --quiet vllm-src.SHA256SUMS) || die "a vllm-src part is missing or damaged"
    cat "$BUNDLE"/vllm-src.tar.gz.part-* | tar -C "$WORK/src" -xzf - || die "cannot unpack the vllm-src parts"
  else
    tar -C "$WORK/src" -xzf "$BUNDLE/vllm-src.tar.gz" || die "cannot unpack vllm-src"
  fi
  log "vLLM from the bundle: $(find "$WORK/src/vllm" -name '*.so' | wc -l) compiled file(s)"
fi
rm -rf "$WORK/repo" && mkdir -p "$WORK/repo" && tar -C "$WORK/repo" -xzf "$BUNDLE/repo.tar.gz" || die "no repo"
"$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check --upgrade \
  --target "$WORK/site" "$BUNDLE"/wheels/tool/*.whl >>"$LOG" 2>&1 || die "cannot install the tool's wheels"
export PYTHONPATH=$WORK/site
ping() { "$PY" -c "import docker; docker.DockerClient(base_url='$DOCKER_HOST', timeout=5).ping()" 2>/dev/null; }

# 2 + 3. CDI spec and engine
if step engine && ! ping; then
  "$PY" - "$WORK/cdi/nvidia.json" "$DRIVER_DIR" <<'PYEOF' | tee -a "$LOG"
import glob, json, os, stat, sys
spec_path, driver = sys.argv[1], sys.argv[2]
nodes = [p for p in sorted(glob.glob("/dev/nvidia*")) if stat.S_ISCHR(os.stat(p).st_mode)]
common = {"env": [], "mounts": []}
if os.path.isdir(driver):
    # The driver's user-space libraries live here, not in the system's library path.
    common["mounts"].append({"hostPath": driver, "containerPath": driver, "options": ["ro", "nosuid", "nodev", "bind"]})
    common["env"].append(f"LD_LIBRARY_PATH={driver}/lib64:{driver}/lib")
spec = {"cdiVersion": "0.6.0", "kind": "nvidia.com/gpu",
        "devices": [{"name": "all", "containerEdits": {"deviceNodes": [{"path": p} for p in nodes]}}],
        "containerEdits": common}
with open(spec_path, "w") as fh:
    json.dump(spec, fh, indent=1)
print(f"  cdi spec {spec_path}: nvidia.com/gpu=all over {', '.join(nodes) or 'no device node'}")
PYEOF
  echo "{\"features\": {\"cdi\": true}, \"cdi-spec-dirs\": [\"$WORK/cdi\"]}" >"$WORK/daemon.json"
  # An engine killed with its host session leaves its pid file: clear it unless that process lives.
  if [ -f "$WORK/dockerd.pid" ] && ! kill -0 "$(cat "$WORK/dockerd.pid")" 2>/dev/null; then
    rm -f "$WORK/dockerd.pid"
  fi
  log "starting dockerd ($("$ENGINE/dockerd" --version))"
  PATH=$ENGINE:$PATH setsid "$ENGINE/dockerd" --config-file "$WORK/daemon.json" --host "$DOCKER_HOST" \
    --data-root "$WORK/data" --exec-root "$WORK/exec" --pidfile "$WORK/dockerd.pid" \
    --iptables=false --bridge=none --userland-proxy=false >"$OUTDIR/dockerd.log" 2>&1 </dev/null &
  for _ in $(seq 1 120); do ping && break; sleep 0.5; done
  ping || { tail -20 "$OUTDIR/dockerd.log" | tee -a "$LOG"; die "dockerd did not answer in 60 s"; }
  log "engine up"
fi
ping || die "no engine answers on $DOCKER_HOST"

cd "$WORK/repo" || die "no $WORK/repo"
# 4. the GPU base
if step base; then
  log "GPU base $REPO_NAME:$TAG from this host's filesystem"
  # shellcheck disable=SC2086
  "$PY" gpu-runs/gpu_host.py base "$REPO_NAME:$TAG" --vllm-src "$WORK/src" --wheels "$BUNDLE/wheels/base" \
    --python "$PY" ${BASE_PATHS:+--paths $BASE_PATHS} >>"$LOG" 2>&1 || die "GPU base failed (see run.log)"
  log "GPU base done: $(tail -1 "$LOG")"
fi
# 5. the real pipeline
if step image; then
  log "build.py image --definition $TAG --base-repo $REPO_NAME --pull never"
  "$PY" build.py image --definition "$TAG" --base-repo "$REPO_NAME" --pull never --no-smoke --tag "$PATCHED" \
    >>"$LOG" 2>&1 || die "build.py image failed (see run.log)"
  log "image done: $(tail -1 "$LOG")"
fi
# 6. smoke both, side by side (one GPU is plenty for two probe containers)
if step smoke; then
  log "smoke --gpu require: $PATCHED and $REPO_NAME:$TAG"
  "$PY" build.py smoke "$PATCHED" --gpu require --report "$OUTDIR/patched.json" >"$OUTDIR/smoke-patched.log" 2>&1 &
  p1=$!
  # The base carries no labels: --definition runs the patch set's own checks on it too.
  "$PY" build.py smoke "$REPO_NAME:$TAG" --gpu require --definition "$TAG" --report "$OUTDIR/unpatched.json" \
    >"$OUTDIR/smoke-unpatched.log" 2>&1 &
  p2=$!
  wait $p1; r1=$?
  wait $p2; r2=$?
  log "smoke exit codes: patched $r1, unpatched $r2"
fi
# 7. the record
if step record; then
  # SOURCE_MANIFEST (see campaign.py): the record is refused unless the checkout that ran is that commit.
  "$PY" gpu-runs/gpu_host.py record "$OUTDIR/record.json" --patched "$OUTDIR/patched.json" \
    --unpatched "$OUTDIR/unpatched.json" --timings "$LOG" \
    --source-manifest "${SOURCE_MANIFEST:-$BUNDLE/source.json}" | tee -a "$LOG.summary"
  cat "$LOG.summary" >>"$LOG" && rm -f "$LOG.summary"
fi
log "done"
