#!/usr/bin/env bash
# One call of a GPU campaign on a GPU host reached by short calls, each carrying at most
# one part of the bundle and lasting at most ten minutes: the parts arrive one a call,
# the campaign (campaign.py) then runs detached while later calls only wait for it, and
# every call leaves what the run has written so far where the host copies it back, so
# that a host taken back early still leaves its reports.
#
#   bash gpu-runs/campaign-call.sh part FILE...   keep these parts (part-NN, SHA256SUMS) in PARTS
#   bash gpu-runs/campaign-call.sh start          copy this checkout to CHECKOUT (without the parts)
#                                                 and start campaign.py PARTS OUTDIR detached
#   bash gpu-runs/campaign-call.sh wait SECONDS   wait until the run is done or SECONDS have passed
#
# Every call first writes the host's clock (its seconds since it started, /proc/uptime)
# into OUTDIR/calls.log with what the call was, and at its end packs OUTDIR into
# SEND_BACK/campaign.tgz where SEND_BACK (a folder the host copies back after each call)
# is set. The
# campaign's own settings come from the environment of `start` (PARALLEL, ENGINE_GIB,
# MODELS, STEPS... see campaign.py). PARTS (/var/lib/vhp), CHECKOUT
# (/var/lib/vhc) and OUTDIR (/var/lib/vho) lie outside the copy a call runs in, so that
# they outlast it.
set -euo pipefail
PARTS=${PARTS:-/var/lib/vhp}
CHECKOUT=${CHECKOUT:-/var/lib/vhc}
OUTDIR=${OUTDIR:-/var/lib/vho}
HERE=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$PARTS" "$OUTDIR"

note() { echo "[$(date -u +%H:%M:%S)] host up $(cut -d' ' -f1 /proc/uptime) s: $*" | tee -a "$OUTDIR/calls.log"; }
send_back() {
  [ -n "${SEND_BACK:-}" ] || return 0
  tar -C "$OUTDIR" -czf "$SEND_BACK/campaign.tgz" . 2>/dev/null || true
  tail -40 "$OUTDIR/run.log" 2>/dev/null || true
}
running() { [ -f "$OUTDIR/campaign.pid" ] && kill -0 "$(cat "$OUTDIR/campaign.pid")" 2>/dev/null; }

case "${1:-}" in
  part)
    shift
    note "part $(for f in "$@"; do basename "$f"; done | tr '\n' ' ')"
    cp -- "$@" "$PARTS/"
    ;;
  start)
    if running; then
      note "start: the campaign runs already (pid $(cat "$OUTDIR/campaign.pid"))"
    else
      note "start: campaign.py $PARTS $OUTDIR (PARALLEL=${PARALLEL:-1} STEPS=${STEPS:-default})"
      rm -rf "$CHECKOUT" && mkdir -p "$CHECKOUT"
      # The checkout as it came, less the carried parts (they are in PARTS now).
      tar -C "$HERE" --exclude='./.gpucarry/part-*' --exclude=./.gpucarry/SHA256SUMS --exclude=./.git --exclude=./.venv \
        --exclude=./build --exclude=./.mypy_cache --exclude=./.ruff_cache --exclude=./.pytest_cache \
        --exclude=__pycache__ -cf - . | tar -C "$CHECKOUT" -xf -
      setsid "$(command -v "${PYTHON:-python3}")" "$CHECKOUT/gpu-runs/campaign.py" "$PARTS" "$OUTDIR" >"$OUTDIR/console.log" 2>&1 </dev/null &
      echo $! >"$OUTDIR/campaign.pid"
      sleep 1
    fi
    ;;
  wait)
    limit=${2:?usage: campaign-call.sh wait SECONDS}
    note "wait up to $limit s"
    end=$((SECONDS + limit))
    while running && [ $SECONDS -lt $end ]; do sleep 1; done
    if running; then note "still running"; else note "the run has ended"; fi
    ;;
  *)
    echo "usage: campaign-call.sh part FILE... | start | wait SECONDS" >&2
    exit 2
    ;;
esac
send_back
