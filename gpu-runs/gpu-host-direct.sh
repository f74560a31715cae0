#!/usr/bin/env bash
# Run the GPU probes directly on a GPU host's Python (no Docker, no vLLM install
# needed) and write their outputs plus a summary record to OUTDIR. The same
# probes inside the built images, through the host's engine: gpu-host-engine.sh.
#
#   bash gpu-runs/gpu-host-direct.sh [OUTDIR]        # OUTDIR defaults to ./gpu-out
#
# Needs python3 with torch (+ triton) and a CUDA GPU. vLLM 0.25.1's Python
# sources come from .vllm-src/vllm-0.25.1-py.tar.gz (see docs/gpu-verification.md
# for how to make it), or from an already unpacked tree in $VLLM_SRC_DIR.
set -u
cd "$(dirname "$0")/.."
OUTDIR=${1:-./gpu-out}
mkdir -p "$OUTDIR"
PY=${PYTHON:-python3}
VSRC=${VLLM_SRC_DIR:-/tmp/vllm-src-0.25.1}
TAR=.vllm-src/vllm-0.25.1-py.tar.gz
export PYTHONUNBUFFERED=1
if [ -f "$TAR" ] && [ ! -d "$VSRC/vllm" ]; then
    mkdir -p "$VSRC" && tar -xzf "$TAR" -C "$VSRC"
fi
if [ ! -d "$VSRC/vllm/models/minimax_m3" ]; then
    echo "no vLLM 0.25.1 sources in $VSRC (and no $TAR)" >&2
    exit 2
fi

{
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader
    "$PY" -c 'import sys, torch, triton; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__)'
} >"$OUTDIR/system.txt" 2>&1

"$PY" vllm_hotfix/inimage/probes/env_report.py >"$OUTDIR/env_report.json" 2>"$OUTDIR/env_report.stderr"
echo "env_report rc=$?" >>"$OUTDIR/system.txt"

"$PY" vllm_hotfix/inimage/probes/gpu_check.py --timeout "${EXTRA_TIMEOUT:-540}" \
    --extra patches/v0.25.1/checks/gpu_topk_layout.py \
    --extra-args="--vllm-src $VSRC --timeout ${WORKER_TIMEOUT:-240} --log $OUTDIR/topk_workers.jsonl" \
    >"$OUTDIR/gpu_check.json" 2>"$OUTDIR/gpu_check.stderr"
echo "gpu_check rc=$?" >>"$OUTDIR/system.txt"

# Summary record (the file committed as gpu-runs/<gpu>-<date>.json).
"$PY" - "$OUTDIR" <<'PYEOF'
import json, os, sys, time
out = sys.argv[1]
def load(name):
    try:
        with open(os.path.join(out, name)) as f:
            return json.load(f)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
sysl = open(os.path.join(out, "system.txt")).read().splitlines()
env = load("env_report.json")
gpu = load("gpu_check.json")
envd = next((c.get("data", {}) for c in env.get("checks", []) if c.get("name") == "env-report"), {})
smi = [x.strip() for x in (sysl[1] if len(sysl) > 1 else "").split(",")]
ver = (sysl[2] if len(sysl) > 2 else "").split()
rec = {
    "date": sysl[0] if sysl else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    "gpu": smi[0] if smi else None,
    "compute_capability": smi[1] if len(smi) > 1 else None,
    "driver": smi[2] if len(smi) > 2 else None,
    "python": ver[0] if ver else None,
    "torch": ver[1] if len(ver) > 1 else None,
    "torch_cuda": ver[2] if len(ver) > 2 else None,
    "triton": ver[3] if len(ver) > 3 else None,
    "packages": envd.get("packages"),
    "checks": [
        {"probe": probe, "name": c.get("name"), "status": c.get("status"), "detail": c.get("detail")}
        for probe, doc in (("env_report", env), ("gpu_check", gpu))
        for c in doc.get("checks", [])
    ],
}
reg = {}
for c in gpu.get("checks", []):
    if c.get("name") == "topk-layout":
        data = c.get("data") or {}
        reg = {"status": c.get("status"), "outcomes": data.get("outcomes"),
               "scenarios": {s: {k: (r.get("result") or {}).get(k) for k in
                                 ("impls", "write_views", "read_views", "decode", "prefill", "attention", "error")}
                             for s, r in (data.get("runs") or {}).items()}}
rec["regression_pr49149"] = reg
with open(os.path.join(out, "record.json"), "w") as f:
    json.dump(rec, f, indent=2)
print(json.dumps({k: rec[k] for k in ("date", "gpu", "driver", "torch", "triton")}))
for c in rec["checks"]:
    print(f"{c['status']:5} {c['name']}: {(c['detail'] or '')[:300]}")
PYEOF
