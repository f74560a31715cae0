#!/usr/bin/env python3
"""Check a GPU run's signed verdicts on another machine, and write what was found beside the record.

    python3 gpu-runs/verify_elsewhere.py RECORD_DIR

RECORD_DIR is a folder gpu-host-serve.sh wrote (its OUTDIR, with
<which>.json, <which>.dsse.json and signing-key.pub.pem). For each report,
the tool's own `verify IMAGE-ID --attestation <which>.dsse.json --key
signing-key.pub.pem --definition TAG --require-gpu PRODUCT` runs here (TAG: the
definition the signed verdict names; PRODUCT: the whole name of the GPU the
record's record.json names, e.g. "NVIDIA H200"), and securesystemslib's DSSE
implementation checks the same envelope with the same key. Writes
RECORD_DIR/verified-elsewhere.json: this machine, each command, its exit code
and answer, and whether the independent check agreed.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent
# The reports of gpu-host-serve.sh's runs, old and new; those present in the folder are checked.
WHICH = ("reference", "patched-cold", "patched", "patched-again", "unpatched-first", "unpatched")


def gpu_product(folder: Path) -> str:
    """The GPU product the record says the run had, by its whole name ("NVIDIA H100 80GB HBM3"): what the
    verdicts must name (verify compares whole names, never a part of one)."""
    devices = json.loads((folder / "record.json").read_text()).get("gpu_devices") or []
    names = {" ".join(str(d).split()) for d in devices}
    if len(names) != 1:
        raise SystemExit(f"{folder / 'record.json'}: gpu_devices {devices!r} name no single GPU model")
    return names.pop()


def independent(envelope: bytes, public_pem: bytes) -> dict[str, Any]:
    """securesystemslib's verdict on the envelope: not the tool's code."""
    from cryptography.hazmat.primitives import serialization
    from securesystemslib.dsse import Envelope
    from securesystemslib.signer import SSlibKey

    public = serialization.load_pem_public_key(public_pem)
    der = public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    key = SSlibKey.from_crypto(public, keyid=hashlib.sha256(der).hexdigest(),  # type: ignore[arg-type]
                               scheme="ecdsa-sha2-nistp256")
    env = Envelope.from_dict(json.loads(envelope))
    try:
        env.verify([key], 1)
    except Exception as exc:  # noqa: BLE001 - any refusal is the answer
        return {"verified": False, "error": f"{type(exc).__name__}: {exc}"}
    doc = json.loads(env.payload)
    return {"verified": True, "subject": [s["digest"]["sha256"] for s in doc["subject"]],
            "status": doc["predicate"].get("status"), "gpu_verified": doc["predicate"].get("gpu_verified")}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 64
    folder = Path(argv[0])
    pub = folder / "signing-key.pub.pem"
    product = gpu_product(folder)
    out: dict[str, Any] = {
        "checked_at": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {"system": platform.platform(), "python": platform.python_version()},
        "public_key_sha256": hashlib.sha256(pub.read_bytes()).hexdigest(),
        "verdicts": {},
    }
    with tempfile.TemporaryDirectory() as root:
        for which in (w for w in WHICH if (folder / f"{w}.dsse.json").exists()):
            report = json.loads((folder / f"{which}.json").read_text())
            envelope = folder / f"{which}.dsse.json"
            # verify decides for a definition: the one the signing host proved (else the one the labels claim; a
            # verdict that proved none is refused for it all the same).
            signed = json.loads(base64.b64decode(json.loads(envelope.read_bytes())["payload"]))["predicate"]
            definition = signed.get("definition") or (signed.get("claimed") or {}).get("definition") or "v0.25.1"
            cmd = ["verify", report["image_id"], "--attestation", str(envelope), "--key", str(pub),
                   "--definition", str(definition), "--require-gpu", product, "--json"]
            run = subprocess.run([sys.executable, str(HERE / "build.py"), "--root", root, *cmd],
                                 capture_output=True, text=True, check=False)
            answer = (json.dumps(json.loads(run.stdout), sort_keys=True) if run.returncode == 0
                      else (run.stderr.strip().splitlines() or [""])[0])
            payload = json.loads(base64.b64decode(json.loads(envelope.read_bytes())["payload"]))
            out["verdicts"][which] = {
                "image_id": report["image_id"],
                "report_status": report["status"],
                "signed_status": payload["predicate"].get("status"),
                "command": "python3 build.py " + " ".join(
                    c if not c.startswith(str(folder)) else c.replace(str(folder), "RECORD_DIR") for c in cmd),
                "exit_code": run.returncode,
                "answer": answer,
                "securesystemslib": independent(envelope.read_bytes(), pub.read_bytes()),
            }
    (folder / "verified-elsewhere.json").write_text(json.dumps(out, indent=2) + "\n")
    for which, v in out["verdicts"].items():
        print(f"{which}: exit {v['exit_code']}: {v['answer'][:160]}; securesystemslib verified "
              f"{v['securesystemslib']['verified']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
