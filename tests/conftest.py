"""Shared fixtures: a real engine, real stand-in bases, and leak checks.

Nothing here mocks the engine. Stand-in bases are made once per machine from
the real vLLM wheels (see vllm_hotfix/standin.py) and reused across runs.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from vllm_hotfix import standin
from vllm_hotfix.engine import Engine
from vllm_hotfix.tarball import tar_bytes

REPO = Path(__file__).resolve().parent.parent
STANDIN_REPO = "vllm/vllm-openai"  # the same name `make demo` uses: identical content
# Every container started by this test run (and the CLIs it spawns) carries
# this label, so the leak check ignores other users of the same engine.
RUN_ID = os.environ.setdefault("VLLM_HOTFIX_RUN_ID", f"pytest-{uuid.uuid4().hex[:12]}")


@pytest.fixture(scope="session")
def engine() -> Engine:
    return Engine.connect()


def make_standin(engine: Engine, version: str, ref: str | None = None, sources: str | None = None) -> str:
    ref = ref or f"{STANDIN_REPO}:v{version}"
    return standin.make(engine, REPO, version, ref, lambda _l: None, sources_version=sources).id


@pytest.fixture(scope="session")
def base_v0251(engine: Engine) -> str:
    return make_standin(engine, "0.25.1")


@pytest.fixture(scope="session")
def base_v0260(engine: Engine) -> str:
    return make_standin(engine, "0.26.0")


@pytest.fixture(scope="session")
def base_v0270(engine: Engine) -> str:
    return make_standin(engine, "0.27.0")


def derive(engine: Engine, base: str, ref: str, dockerfile_body: str, files: dict[str, bytes] | None = None,
           modes: dict[str, int] | None = None) -> str:
    """Build ``FROM base`` + body and tag it ``ref`` (test fixtures only)."""
    ctx = dict(files or {})
    ctx["Dockerfile"] = f"FROM {base}\n{dockerfile_body}\n".encode()
    image_id = engine.build(tar_bytes(ctx, modes))
    engine.tag(image_id, ref)
    return image_id


@dataclass
class Result:
    rc: int
    out: str
    err: str

    @property
    def last_error(self) -> str:
        lines = [ln for ln in self.err.splitlines() if ln.startswith("error: ")]
        return lines[-1] if lines else ""


def fails(result: Result, *needles: str) -> None:
    """A failed command: non-zero exit and one `error:` line holding every needle."""
    assert result.rc != 0, result.err
    line = result.last_error
    assert line, f"no error line in:\n{result.err}"
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"


def cli(*args: str, root: Path | None = None, env: dict[str, str] | None = None, timeout: int = 600) -> Result:
    """Run `python build.py ...` as a user would."""
    cmd = [sys.executable, str(REPO / "build.py")]
    if root is not None:
        cmd += ["--root", str(root)]
    full_env = dict(os.environ, **(env or {}))
    proc = subprocess.run([*cmd, *args], capture_output=True, text=True, env=full_env, timeout=timeout)
    return Result(proc.returncode, proc.stdout, proc.stderr)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A copy of images/ and patches/ that a test may break."""
    root = tmp_path / "project"
    shutil.copytree(REPO / "images", root / "images")
    shutil.copytree(REPO / "patches", root / "patches")
    return root


@pytest.fixture
def unique() -> str:
    return uuid.uuid4().hex[:10]


def _scratch_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), f"vllm-hotfix-scratch-{RUN_ID}-*")))


@pytest.fixture(autouse=True)
def no_leftovers(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test must leave no container, scratch folder or reject file."""
    before_dirs = _scratch_dirs()
    uses_engine = "engine" in request.fixturenames or any(
        n.startswith("base_") for n in request.fixturenames
    )
    before_containers: set[str] = set()
    if uses_engine:
        before_containers = set(Engine.connect().containers_with_role(RUN_ID))
    yield
    assert _scratch_dirs() <= before_dirs, "scratch folders left behind"
    strays = glob.glob(str(REPO / "**" / "*.rej"), recursive=True) + glob.glob(
        str(REPO / "**" / "*.orig"), recursive=True
    )
    assert not strays, f"reject/backup files left behind: {strays}"
    if uses_engine:
        after = set(Engine.connect().containers_with_role(RUN_ID))
        assert after <= before_containers, f"containers left behind: {after - before_containers}"


def docker_cli(*args: str) -> str:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=True).stdout
