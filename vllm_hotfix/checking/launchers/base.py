"""What every launcher shares: the interface, the runner folder, the job, and reading the runner's report back.

The folder holds the runner, the probes, the patch set's checks and the job:
never a key. What comes back is the runner's report, the image's own word;
the host judges it (:mod:`vllm_hotfix.judges.judging`) before it is recorded or signed.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

from ...errors import Malformed, RunnerFailed
from ...inimage.runner import ANSWERS_MARK, BATCHES_MARK, JOB_VERSION, MOUNT, REPLIES_MARK, REPORT_MARK, RUNNER_FLAGS
from ...verdicts import Verdict

log = logging.getLogger(__name__)

# What the runner imports from the package: itself, the verdict types, the sweep's sender, the reference file
# format and the oracle's measures a recording uses. Nothing that judges a reply: the host does.
PACKAGE_FILES = ("__init__.py", "errors.py", "verdicts.py", "journal/__init__.py", "journal/atomic.py",
                 "inimage/__init__.py", "inimage/reference.py", "inimage/sweep.py", "inimage/oracle.py",
                 "inimage/recording.py", "inimage/runner/__init__.py", "inimage/runner/main.py",
                 "inimage/runner/probe_output.py", "inimage/runner/serve.py")
BOOTSTRAP = b'''"""Entry of the vllm-hotfix runner: python3 -I -S run.py JOB.json (this folder is put first on sys.path;
the job's python_path, the base's own sys.path folders, is added by the runner)."""
import os
import sys

# This folder first, even under -I or with another vllm_hotfix installed in the image.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vllm_hotfix.inimage.runner.main import main  # noqa: E402

sys.exit(main())
'''
TAIL = 20
LINE = 300  # characters of one line of a runner's output shown in an error


@dataclass(frozen=True, slots=True)
class Launched:
    """What came back from a runner: its report (the image's word, not yet judged by the host), its last log
    lines, and the reference answers it recorded (the file's bytes, when the job asked it to record)."""

    report: Verdict
    log_tail: str = ""
    answers: bytes | None = None
    batches: bytes | None = None  # the fixed-batch probe's raw replies (the job's ``batches`` part), unjudged
    replies: bytes | None = None  # the sweep's replies as they came (JSON, LEVEL:I -> reply), unjudged


class Launcher(Protocol):
    """Start the runner in the container image ``image`` (by ID or digest) and bring its results back.

    ``runner_dir`` is the staged folder (:func:`stage`), mounted read-only at
    :data:`~vllm_hotfix.inimage.runner.MOUNT`; ``job`` is what it was staged with;
    ``gpu`` the GPU request in ``--gpu-request`` words (``cdi:DEVICE``,
    ``gpus``, ``runtime:NAME``), None for none; ``model`` a folder mounted
    read-only at /model for the serve sweep.
    """

    name: str

    def launch(self, image: str, runner_dir: Path, job: Mapping[str, Any], gpu: str | None,
               model: Path | None = None) -> Launched: ...


def package_root() -> Path:
    return Path(str(resources.files("vllm_hotfix")))


def runner_files(extra: Mapping[str, bytes] | None = None) -> dict[str, bytes]:
    """Every file of the runner folder (relative path -> bytes), without the job."""
    root = package_root()
    files = {f"vllm_hotfix/{rel}": (root / rel).read_bytes() for rel in PACKAGE_FILES}
    files["run.py"] = BOOTSTRAP
    for probe in sorted((root / "inimage" / "probes").glob("*.py")):
        files[f"probes/{probe.name}"] = probe.read_bytes()
    files.update(extra or {})
    return dict(sorted(files.items()))


def job_bytes(job: Mapping[str, Any]) -> bytes:
    return json.dumps({**job, "version": JOB_VERSION}, indent=2, sort_keys=True).encode() + b"\n"


def stage(folder: Path, job: Mapping[str, Any], extra: Mapping[str, bytes] | None = None) -> Path:
    """Write the runner folder (runner, probes, ``extra`` checks, job.json)."""
    if folder.exists():
        shutil.rmtree(folder)
    for rel, data in {**runner_files(extra), "job.json": job_bytes(job)}.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    # World-readable: the image's user may not be root, and the mount is read-only anyway.
    for path in [folder, *folder.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return folder


def argv(python: str = "python3") -> list[str]:
    """The command a launcher runs in the image: isolated (no site module, so no .pth file or sitecustomize of
    the image runs; no PYTHON* variable; no user site)."""
    return [python, *RUNNER_FLAGS, f"{MOUNT}/run.py", f"{MOUNT}/job.json"]


def results(stdout: str, stderr: str, where: str) -> Launched:
    """The report a runner printed; RunnerFailed naming ``where`` when it printed none."""
    verdict: Verdict | None = None
    answers: bytes | None = None
    batches: bytes | None = None
    replies: bytes | None = None
    # Each of the last lines cut to a line's length: an image's output is never relayed whole.
    tail = "\n".join(ln[:LINE] for ln in stderr.strip().splitlines()[-TAIL:])
    what = {REPORT_MARK: "report", ANSWERS_MARK: "recorded answers", BATCHES_MARK: "batch replies",
            REPLIES_MARK: "sweep replies"}
    for line in stdout.splitlines():
        mark, _, body = line.strip().partition(" ")
        if mark not in what:
            continue
        try:
            data = base64.b64decode(body, validate=True)
            if mark == REPORT_MARK:
                doc = json.loads(data)
                if not isinstance(doc, dict):
                    raise Malformed(f"a {type(doc).__name__}, not an object")
                verdict = Verdict.from_dict(doc)
            elif mark == BATCHES_MARK:
                batches = data
            elif mark == REPLIES_MARK:
                replies = data
            else:
                answers = data
        except (binascii.Error, ValueError, Malformed) as exc:
            raise RunnerFailed(f"{where}: the runner's {what[mark]} is unreadable ({exc})") from None
    if verdict is None:
        last = (stderr.strip().splitlines() or ["no output"])[-1][:LINE]
        raise RunnerFailed(f"{where}: the runner gave no report ({last})", hint=f"its last lines:\n{tail}")
    return Launched(verdict, tail, answers, batches, replies)
