"""Each model's record at the end of the GPU campaign (campaign.py): gpu_host.py record from its reports alone."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from campaign_core import HERE, Context, Model, tee


def record_argv(c: Context, m: Model, first: bool) -> list[str]:
    s = c.settings
    more: list[str] = []
    signed: list[str] = []
    # The first model's patched smoke ran alone: its time is the warm verdict's. Its make smoke and the others'
    # smokes ran side by side with the rest (their times are shown, not held to the target).
    more += ["--warm", "patched", "--make-smoke", "patched_third"] if first else ["--side-by-side"]
    for name in s.record_mutants:
        if (m.out / f"badrecord-{name}.json").is_file():
            more += ["--bad-recording", f"{name}={m.out / f'badrecord-{name}.json'}"]
    uptime = Path("/proc/uptime")
    if os.access(uptime, os.R_OK):
        (m.out / "host-uptime.txt").write_text(uptime.read_text())
        more += ["--host-uptime", str(m.out / "host-uptime.txt")]
    if (s.outdir / "calls.log").is_file():  # which call of the lent host made what (campaign-call.sh)
        more += ["--calls", str(s.outdir / "calls.log")]
    for which in ("reference", "patched", "patched-again", "patched-third", "unpatched-first", "unpatched"):
        if (m.out / f"{which}.dsse.json").is_file():
            signed += ["--attestation", f"{which.replace('-', '_', 1)}={m.out / f'{which}.dsse.json'}"]
    for which in ("unpatched-first", "patched-again", "patched-third"):
        if (m.out / f"{which}.json").is_file():
            more += [f"--{which}", str(m.out / f"{which}.json")]
    for kind, names in (("mutant", s.mutants), ("variant", s.variants)):
        for name in names:
            if (m.out / f"{kind}-{name}.json").is_file():
                more += [f"--{kind}", f"{name}={m.out / f'{kind}-{name}.json'}"]
            if (m.out / f"{kind}-{name}.dsse.json").is_file():
                signed += ["--attestation", f"{kind}_{name}={m.out / f'{kind}-{name}.dsse.json'}"]
    calls = [a for f in sorted(s.outdir.glob("source-*.json")) for a in ("--source-call", str(f))]
    if (m.out / "golden.json").is_file():
        more += ["--golden-run", str(m.out / "golden.json")]
    return [s.python, "gpu-runs/gpu_host.py", "record", str(m.out / "record.json"),
            "--reference-run", str(m.out / "reference.json"), "--patched", str(m.out / "patched.json"),
            "--unpatched", str(m.out / "unpatched.json"), *more, "--timings", str(s.log_path),
            "--model", m.folder, "--model-made", f"gpu-runs/tiny_minimax_m3.py --seed {m.seed} --layers {m.layers}",
            "--base", s.base, "--reference", str(m.answers), "--inputs-from", str(m.inputs),
            "--public-key", str(s.pubkey), "--target-seconds", s.get("TARGET_SECONDS", "60"),
            "--source-manifest", s.source_manifest, "--source-root", str(HERE), *calls, *signed]


def record_model(c: Context, m: Model, first: bool) -> bool:
    """OUTDIR/NAME/record.json; False where a report it needs is missing or gpu_host.py record refused it (said,
    and the next model's is still written: what came back is kept either way)."""
    s = c.settings
    # The record needs these; the other starts, the variants and the mutants are recorded where their reports
    # are (its findings say what is missing).
    for which in ("reference", "patched", "unpatched"):
        if not (m.out / f"{which}.json").is_file() and not s.dry_run:
            c.log.line(f"record {m.name}: no {m.out / f'{which}.json'} yet: run its smoke first")
            return False
    argv = record_argv(c, m, first)
    # The inputs the smokes ran with, kept beside the record (REFERENCE_FROM reads them).
    if m.inputs.is_file():
        shutil.copyfile(m.inputs, m.out / "inputs.json")
    summary = Path(f"{s.log_path}.summary")
    rc = c.shell.act(argv, tee(summary))
    if summary.is_file():
        c.log.raw(summary.read_text(encoding="utf-8", errors="replace"), s.log_path, None)
        summary.unlink()
    if rc != 0:
        c.log.line(f"error: gpu_host.py record of {m.name} refused (exit {rc})")
        return False
    return True


def records(c: Context) -> None:
    missing = False
    for m in c.models():
        missing |= not record_model(c, m, c.is_first(m))
    if missing:
        raise c.log.die("a model's record is missing a report (see above): run its smokes, then record")


