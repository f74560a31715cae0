"""Shared fixtures: a real engine, real stand-in bases, and leak checks.

Tests live in tier folders, by what they need, and are marked by folder:
unit/ (no engine, no registry, no network: `make unit`), serve/ (the serve
sweep and serve-check against a fake OpenAI-compatible server on loopback; no
engine, no registry), engine/ (the default
Docker engine, registries on loopback ports, PyPI wheels), platforms/ (a
Docker 26.1 engine that keeps platforms, with qemu) and gpu_access/ (CDI and
GPU request paths). Importing this file connects to nothing: engine fixtures
connect only when a test asks for them.

Nothing here mocks the engine. Stand-in bases are made once per machine from
the real vLLM wheels (see vllm_hotfix/building/standin.py) and reused across runs.

A session that reaches an engine ends by comparing every engine it could use
with what they held when it started, and fails naming any image, tag or
container it left (the stand-ins' rootfs cache excepted). `make test` runs
one worker per engine (see :func:`pytest_collection_modifyitems`): the
tests of one engine run one after another on one worker, sharing its
stand-ins and built image; the engines' lanes run side by side.
"""

from __future__ import annotations

import atexit
import functools
import gc
import importlib.util
import json
import logging
import os
import pkgutil
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

import cli_here
import github_api
from vllm_hotfix.building import standin
from vllm_hotfix.engine import Engine
from vllm_hotfix.tarball import tar_bytes

REPO = Path(__file__).resolve().parent.parent
# The tests' own namespace, one per run: a test run never tags (or replaces)
# anything under the real vllm/vllm-openai name on the engine it runs against,
# and two runs on one engine never untag each other's stand-ins.
# One token per run, shared by its workers (set before they start); each worker
# adds its own name, so that no worker takes another's container for its own.
RUN_TOKEN = os.environ.setdefault("VLLM_HOTFIX_TEST_TOKEN", uuid.uuid4().hex[:12])
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
# Every container started by this test run (and the CLIs it spawns) carries
# this label, so the leak check ignores other users of the same engine.
RUN_ID = f"pytest-{RUN_TOKEN}" + (f"-{WORKER}" if WORKER else "")
os.environ["VLLM_HOTFIX_RUN_ID"] = RUN_ID
STANDIN_REPO = "hotfix-test/vllm-openai-" + RUN_ID
TIERS = ("unit", "numerics", "serve", "engine", "platforms", "gpu_access")
# The tiers that see no engine: pure logic, the model's forward in PyTorch on the CPU, the sweep against a fake server.
ENGINELESS = ("unit", "numerics", "serve")
# Where a unit test's engine and package index would be: nowhere, so a unit
# test that reaches for either fails at once instead of passing slowly.
NO_ENGINE = "unix:///nonexistent/docker.sock"
NO_INDEX = "http://127.0.0.1:9/simple"


DEFAULT_ENGINE = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
# Other instances of the default engine (`.ci/services start-second-engine`, `start-third-engine`): the test
# modules named below build there, each instance a lane of its own beside the default engine's, each lane one
# engine's only builder. Where an instance does not answer, its modules build on the default engine.
SECOND_ENGINE = os.environ.get("SECOND_DOCKER_HOST") or "unix:///run/vllm-hotfix-second/docker.sock"
THIRD_ENGINE = os.environ.get("THIRD_DOCKER_HOST") or "unix:///run/vllm-hotfix-third/docker.sock"
INSTANCE_LANES = {
    SECOND_ENGINE: ("second-engine", frozenset({
        "test_signed_launchers.py", "test_smoke_push.py", "test_assemble.py", "test_image.py",
        "test_registry_files.py", "test_file_facts.py", "test_integrity_base.py", "test_fail_closed.py",
    })),
    THIRD_ENGINE: ("third-engine", frozenset({
        "test_in_registry.py", "test_identity.py", "test_attest.py", "test_podman_store.py",
        "test_referrers_api.py", "test_registry_history.py",
    })),
}
# Every engine a session may use: the default one, its other instances and the platform-aware 26.1 one.
ENGINES = tuple(dict.fromkeys([
    DEFAULT_ENGINE,
    *INSTANCE_LANES,
    os.environ.get("VLLM_HOTFIX_PLATFORM_ENGINE") or os.environ.get("CDI_DOCKER_HOST")
    or "unix:///run/vllm-hotfix-cdi/docker.sock",
]))
# The tool's own cache, kept on purpose across runs (as build/cache is): the
# stand-ins' Debian root file systems, made once per engine with mmdebstrap.
KEPT_REPOSITORIES = (standin.ROOTFS_REF.split(":")[0],)
RUN_LABEL = "io.vllm-hotfix.run"
RUN_PREFIX = f"pytest-{RUN_TOKEN}"
# Fixtures that reach the default engine: a test that asks for one runs in the default engine's lane.
DEFAULT_ENGINE_FIXTURES = ("engine", "built", "built_once")
# Names the suite gives images: hotfix-test/..., and pushes' local tags to loopback registries.
TEST_NAMES = re.compile(r"^(hotfix-test/|127\.0\.0\.1:\d+/)")


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the lane marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with its tier, the folder it sits in under tests/, and its engine's lane.

    ``make test`` runs three workers (``-n 3 --dist loadgroup``; ``WORKERS=N``
    another number) and five lanes, each lane in order on one worker: every
    test that reaches the default engine; the modules of each instance in
    ``INSTANCE_LANES``, on that instance of the same engine; every one that
    reaches only the Docker 26.1 engine (platforms, GPU access); the fault
    tests that start and kill an engine of their own. Unit, numerics and
    serve tests go to whichever worker is free. Only one lane builds on each
    instance of the default engine, so each test's own check for untagged
    images there still names the test that left one (the 26.1 engine's
    images are checked once, for the whole run).
    """
    here = Path(__file__).resolve().parent
    for item in items:
        parts = item.path.resolve().relative_to(here).parts
        tier = parts[0] if len(parts) > 1 else ""
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: tests belong in a tier folder ({', '.join(TIERS)})")
        item.add_marker(getattr(pytest.mark, tier))
        if tier in ENGINELESS:
            continue
        names = getattr(item, "fixturenames", ())
        default = any(n in DEFAULT_ENGINE_FIXTURES or n.startswith("base_") for n in names)
        if "private" in names and not default:
            lane = "private-engine"  # an engine of the test's own (tests/engine/test_faults.py)
        elif (url := engine_url(item.path)) != DEFAULT_ENGINE:
            lane = INSTANCE_LANES[url][0]
        elif tier == "engine" or default:
            lane = "default-engine"
        else:
            lane = "platform-engine"
        item.add_marker(pytest.mark.xdist_group(lane))


@functools.cache
def _answers(url: str) -> bool:
    """Whether the engine at ``url`` answers; where an instance does not, its modules build on the default engine."""
    import docker

    try:
        client = docker.DockerClient(base_url=url, timeout=5)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:  # noqa: BLE001 - no engine there: its lane joins the default one
        return False


def engine_url(path: Path) -> str:
    """The engine a test module's tests build on: an instance's for its lane's modules, where it answers."""
    if path.parent.name == "engine":
        for url, (_lane, modules) in INSTANCE_LANES.items():
            if path.name in modules and _answers(url):
                return url
    return DEFAULT_ENGINE


@dataclass(frozen=True, slots=True)
class EngineState:
    """What an engine holds: top-level images (with their tags) and containers."""

    images: dict[str, tuple[str, ...]]
    containers: dict[str, str]


def engine_state(url: str) -> EngineState | None:
    """The images and containers of the engine at ``url``; None where no engine answers there."""
    import docker  # only sessions that reach engines pay for the SDK

    try:
        client = docker.DockerClient(base_url=url, timeout=30)
        images = client.api.images()
        containers = client.api.containers(all=True)
    except Exception:  # noqa: BLE001 - an engine that is not there holds nothing of ours
        return None
    return EngineState(
        images={i["Id"]: tuple(t for t in i.get("RepoTags") or () if t != "<none>:<none>") for i in images},
        # Containers another run of the tool or of this suite started (labelled with its run ID) are its own.
        containers={c["Id"]: f"{(c.get('Names') or ['?'])[0].lstrip('/')} ({c.get('Image')}, {c.get('Status')})"
                    for c in containers
                    if (c.get("Labels") or {}).get(RUN_LABEL, RUN_PREFIX).startswith(RUN_PREFIX)},
    )


def leftovers(url: str, before: EngineState) -> list[str]:
    """What the engine at ``url`` holds now and did not before the session: images, tags, containers."""
    after = engine_state(url)
    if after is None:
        return [f"{url}: the engine no longer answers"]
    out = []
    for image_id, tags in sorted(after.images.items()):
        new_tags = [t for t in tags if t not in before.images.get(image_id, ())
                    and not t.startswith(tuple(f"{r}:" for r in KEPT_REPOSITORIES))
                    # A test name without this run's token is another run's (engines may be shared).
                    and not (TEST_NAMES.match(t) and RUN_TOKEN not in t)]
        if image_id not in before.images and not tags:
            out.append(f"{url}: untagged image {image_id}")
        elif new_tags:
            out.append(f"{url}: tag {', '.join(new_tags)} on {image_id}")
    out += [f"{url}: container {cid[:12]} {what}" for cid, what in sorted(after.containers.items())
            if cid not in before.containers]
    return out


def _reaches_engines(config: pytest.Config) -> bool:
    """Whether the run's paths reach beyond the tiers that see no engine (ENGINELESS)."""
    here = Path(__file__).resolve().parent
    paths = [Path(str(a).split("::")[0]).resolve() for a in config.args] or [here]
    for path in paths:
        try:
            rel = path.relative_to(here).parts
        except ValueError:
            return True
        if not rel or rel[0] not in ENGINELESS:
            return True
    return False


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    """Before the first test: what each engine holds, where the run reaches any engine at all.

    Taken once per run: by the process that starts the workers, or by the
    only process. Workers leave it to that one, which compares after they end.
    """
    if WORKER or not _reaches_engines(session.config):
        return
    states = {url: engine_state(url) for url in ENGINES}
    session.config.stash[ENGINES_BEFORE] = {url: s for url, s in states.items() if s is not None}


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The session fails if it left an image, tag or container on any engine it used."""
    before = session.config.stash.get(ENGINES_BEFORE, {})
    left = [line for url, state in before.items() for line in leftovers(url, state)]
    session.config.stash[LEFT] = left
    if left:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session) -> Iterator[object]:
    """No garbage collection while the test modules are imported, and what they leave alive (every module the
    tests import, every test item) is kept out of the collector's sight afterwards: it lives as long as the
    run. Each unit worker spent a second of its CPU on ten full collections while it imported them, and more
    in every later one."""
    gc.disable()
    try:
        return (yield)
    finally:
        gc.collect()  # what collecting made and dropped goes first: only what lives is kept aside
        gc.freeze()
        gc.enable()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    left = terminalreporter.config.stash.get(LEFT, [])
    if left:
        terminalreporter.section("left behind on the engines", sep="=", red=True, bold=True)
        for line in left:
            terminalreporter.write_line(line)


SESSION_START = int(time.time()) - 1
ENGINES_BEFORE = pytest.StashKey[dict[str, EngineState]]()
LEFT = pytest.StashKey[list[str]]()


# What `make test` exports to the suite that is about make itself, not about a test: the tool's hints name make's
# variables under VLLM_HOTFIX_VIA_MAKE, and a make a test runs would join the outer make's jobs through MAKEFLAGS.
OUTER_MAKE = ("VLLM_HOTFIX_VIA_MAKE", "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")


@pytest.fixture(autouse=True)
def not_under_make(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test, and what it runs, sees the environment of a shell, whether pytest ran from `make test` or not."""
    for name in OUTER_MAKE:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def unit_tier_reaches_nothing(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unit tests, and the CLIs they spawn, see no engine and no package index."""
    if any(request.node.get_closest_marker(tier) is not None for tier in ENGINELESS):
        monkeypatch.setenv("DOCKER_HOST", NO_ENGINE)
        monkeypatch.setenv("PIP_INDEX_URL", NO_INDEX)
        monkeypatch.setenv("PIP_RETRIES", "0")
        monkeypatch.setenv("PIP_TIMEOUT", "2")


class Lanes:
    """Per session, each lane's engine and the stand-ins made on it (one engine per lane, see ENGINES)."""

    def __init__(self) -> None:
        self.engines: dict[str, Engine] = {}
        self.standins: dict[tuple[str, str], str] = {}
        self.built: dict[str, tuple[Path, str, str]] = {}  # the session's patched image (built_once)

    def engine(self, url: str) -> Engine:
        if url not in self.engines:
            self.engines[url] = Engine.connect(base_url=url)
        return self.engines[url]

    def standin(self, url: str, version: str) -> str:
        if (url, version) not in self.standins:
            self.standins[url, version] = make_standin(self.engine(url), version)
        return self.standins[url, version]


@pytest.fixture(scope="session")
def lanes() -> Iterator[Lanes]:
    made = Lanes()
    yield made
    for url, (_project, ref, _id) in made.built.items():
        made.engines[url].remove_image(ref)
    for eng in made.engines.values():
        drop_standins(eng)


@pytest.fixture(scope="module")
def engine(request: pytest.FixtureRequest, lanes: Lanes) -> Engine:
    """The engine this module's tests build on (:func:`engine_url`)."""
    return lanes.engine(engine_url(request.path))


@pytest.fixture(autouse=True)
def lane_engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test in another instance's lane, and the CLIs it runs, reach that engine through DOCKER_HOST."""
    if request.node.get_closest_marker("engine") is not None:
        url = engine_url(request.path)
        if url != DEFAULT_ENGINE:
            monkeypatch.setenv("DOCKER_HOST", url)


def drop_standins(eng: Engine) -> None:
    """Untag the stand-ins this run tagged in its own namespace; their shared
    rootfs layer stays as the tool's cache (vllm-hotfix/standin-rootfs)."""
    for version in ("0.25.1", "0.26.0", "0.27.0"):
        info = eng.image(f"{STANDIN_REPO}:v{version}")
        if info is not None and standin.LABEL in info.labels:
            eng.untag(f"{STANDIN_REPO}:v{version}")
            eng.remove_untagged(info.id, force=False)
    # A stand-in step that another build of the session reused from the build cache outlives the stand-in
    # it was made for, untagged: this session made it, so this session removes it.
    for image in eng.sdk.api.images(filters={"dangling": True, "label": standin.LABEL}):
        if int(image.get("Created", 0)) >= SESSION_START:
            eng.remove_untagged(image["Id"], force=False)


def make_standin(engine: Engine, version: str, ref: str | None = None, sources: str | None = None) -> str:
    ref = ref or f"{STANDIN_REPO}:v{version}"
    return standin.make(engine, REPO, version, ref, lambda _l: None, sources_version=sources).id


@pytest.fixture(scope="module")
def base_v0251(request: pytest.FixtureRequest, lanes: Lanes) -> str:
    return lanes.standin(engine_url(request.path), "0.25.1")


@pytest.fixture(scope="module")
def base_v0260(request: pytest.FixtureRequest, lanes: Lanes) -> str:
    return lanes.standin(engine_url(request.path), "0.26.0")


@pytest.fixture(scope="module")
def base_v0270(request: pytest.FixtureRequest, lanes: Lanes) -> str:
    return lanes.standin(engine_url(request.path), "0.27.0")


def derive(engine: Engine, base: str, ref: str, dockerfile_body: str, files: dict[str, bytes] | None = None,
           modes: dict[str, int] | None = None) -> str:
    """Build ``FROM base`` + body and tag it ``ref`` (test fixtures only)."""
    ctx = dict(files or {})
    ctx["Dockerfile"] = f"FROM {base}\n{dockerfile_body}\n".encode()
    image_id = engine.build(tar_bytes(ctx, modes))
    engine.tag(image_id, ref)
    return image_id


class Product:
    """An odd base made from a stand-in, and the patch set built over it by the tool: an image that is its
    definition's product (its identity check passes), with whatever the base holds. Removed by :meth:`drop`."""

    def __init__(self, engine: Engine, base: str, project: Path, repo: str, body: str,
                 files: dict[str, bytes] | None = None, modes: dict[str, int] | None = None) -> None:
        self.engine, self.repo = engine, repo
        self.base_ref, self.ref = f"{repo}:v0.25.1", f"{repo}:out"
        self.base_id = derive(engine, base, self.base_ref, body, files, modes)
        r = cli("image", "--definition", "v0.25.1", "--base-repo", repo, "--tag", self.ref, "--pull", "never",
                "--no-smoke", root=project)
        assert r.rc == 0, r.err
        self.image_id = r.out.split()[-1]

    def drop(self) -> None:
        for ref in (self.ref, self.base_ref):
            self.engine.remove_image(ref)
        self.engine.remove_untagged(self.image_id)


def requests_layer(folder: str = "usr/lib/python3/dist-packages") -> dict[str, bytes]:
    """``requests`` and what it imports, from this Python, as build-context files under ``folder``.

    vLLM depends on requests, so real images have it; the stand-ins do not.
    The runner's serve sweep speaks HTTP through it, inside the image.
    """
    import importlib.util

    out: dict[str, bytes] = {}
    for name in ("requests", "urllib3", "idna", "certifi", "charset_normalizer"):
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        top = Path(list(spec.submodule_search_locations)[0])
        for path in sorted(top.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                out[f"{folder}/{name}/{path.relative_to(top)}"] = path.read_bytes()
    return out


def site_key(path: Path) -> Any:
    """A site's ECDSA P-256 private key written to ``path`` (PEM, PKCS8), readable by its owner alone (the tool
    refuses a signing key others may read); the key."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)
    return key


def unreachable_kubeconfig(path: Path) -> Path:
    """A kubeconfig at ``path`` naming one cluster on a loopback port nothing listens on (the discard port)."""
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:9"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
    }))
    return path


def key_pair(folder: Path, name: str = "site") -> tuple[Path, Path, Any]:
    """``NAME.key`` (:func:`site_key`) and its public key ``NAME.pub`` (PEM) in ``folder``; both paths and the key."""
    from cryptography.hazmat.primitives import serialization

    private, public = folder / f"{name}.key", folder / f"{name}.pub"
    key = site_key(private)
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public, key


@functools.cache
def requests_site() -> Path:
    """A folder holding ``requests`` and what it imports (links into this Python's site folder), and nothing else.

    The runner's stand-in for an image's site folder where a test runs it on this host: the test environment's
    own site folder would hand the runner's probes everything installed for the tests (PyTorch among them, whose
    import alone costs every probe two seconds of CPU), which no stand-in image holds.
    """
    folder = Path(tempfile.mkdtemp(prefix="vllm-hotfix-requests-site-"))
    atexit.register(shutil.rmtree, folder, True)
    for name in ("requests", "urllib3", "idna", "certifi", "charset_normalizer"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            (folder / name).symlink_to(list(spec.submodule_search_locations)[0], target_is_directory=True)
    return folder


@dataclass
class Result:
    rc: int
    out: str
    err: str

    @property
    def last_error(self) -> str:
        lines = [ln for ln in self.err.splitlines() if ln.startswith("error: ")]
        return lines[-1] if lines else ""


# The v0.25.1 patch set's topk-layout check (the SM100 set's is a link to it).
TOPK_CHECK = REPO / "patches" / "v0.25.1" / "checks" / "gpu_topk_layout.py"


def load_script(path: Path, name: str | None = None) -> types.ModuleType:
    """A script the project runs by path (a patch set's check, an in-image probe, a gpu-runs tool) as a fresh
    module, never put in ``sys.modules``: each caller gets its own copy to set attributes on."""
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fails(result: Result, *needles: str) -> None:
    """A failed command: non-zero exit and one `error:` line holding every needle."""
    assert result.rc != 0, result.err
    line = result.last_error
    assert line, f"no error line in:\n{result.err}"
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"


def cli(*args: str, root: Path | None = None, env: dict[str, str] | None = None, timeout: int = 600) -> Result:
    """Run `python build.py ...` as a user would."""
    argv = [*(["--root", str(root)] if root is not None else []), *args]
    full_env = dict(os.environ, **(env or {}))
    if _RUN_HERE and _may_run_here(env):
        rc, out, err = cli_here.run(REPO / "build.py", argv, full_env, timeout)
    elif _may_fork(env):
        rc, out, err = _forked(argv, full_env, timeout)
    else:
        proc = subprocess.run([sys.executable, str(REPO / "build.py"), *argv], capture_output=True, text=True,
                              env=full_env, timeout=timeout)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    # Whatever a test feeds the tool, it answers with its own words, never a Python error dump.
    assert "Traceback (most recent call last)" not in err, err
    return Result(rc, out, err)


# CLI runs of the unit tier run in the test's own process (tests/cli_here.py: set up as a fresh process would
# be, and put back afterwards); a fork still cost 30-40 ms a run there, a third of the tier's time. Elsewhere they
# fork from this process instead of starting an interpreter. Each fork is still a process of its own (its own
# environment, output and exit status, from build.py's entry point `run` on); what it skips is the
# interpreter's start and the tool's imports, 0.4 s of CPU a run, which made a fifth of the engine tier's CPU.
# VLLM_HOTFIX_TEST_FORK_CLI=0 starts an interpreter for every run instead, in every tier.
FORK_CLI = "VLLM_HOTFIX_TEST_FORK_CLI"
FRESH_WARNINGS = cli_here.FRESH_WARNINGS
# Whether the test now running is one whose CLI runs may run in its own process (set by cli_runs_here).
_RUN_HERE = False


@pytest.fixture(autouse=True)
def cli_runs_here(request: pytest.FixtureRequest) -> Iterator[None]:
    """A unit test's CLI runs run in its own process (tests/cli_here.py)."""
    global _RUN_HERE
    _RUN_HERE = request.node.get_closest_marker("unit") is not None
    try:
        yield
    finally:
        _RUN_HERE = False


def _asks_for_an_interpreter(env: dict[str, str] | None) -> bool:
    """Whether ``env`` holds an interpreter setting (PYTHON*, read as an interpreter starts) of its own."""
    return any(k.startswith("PYTHON") and os.environ.get(k) != v for k, v in (env or {}).items())


def _may_run_here(env: dict[str, str] | None) -> bool:
    return os.environ.get(FORK_CLI, "1") == "1" and not _asks_for_an_interpreter(env)


def _may_fork(env: dict[str, str] | None) -> bool:
    """Fork only where a fresh interpreter would behave the same: no interpreter
    setting asked for (PYTHON*, read at start), and no other thread whose locks
    a fork could copy mid-use."""
    if os.environ.get(FORK_CLI, "1") != "1" or threading.active_count() != 1:
        return False
    return not _asks_for_an_interpreter(env)


NOT_PRELOADED = frozenset({"vllm_hotfix.golden.forward"})


@functools.cache
def _preloaded() -> types.ModuleType:
    """The CLI with every module a subcommand imports when it runs, imported once: each run forks from them."""
    import vllm_hotfix
    from vllm_hotfix import cli as entry

    for mod in pkgutil.walk_packages(vllm_hotfix.__path__, "vllm_hotfix."):
        # Not the scripts run inside images, nor entry scripts (importing one runs it), nor the golden forward,
        # which imports PyTorch (seconds, and hundreds of MB each fork would carry) and no command imports as it
        # starts: a run that needs it imports it itself.
        if not mod.name.startswith("vllm_hotfix.inimage.probes") and not mod.name.endswith("__main__") \
                and mod.name not in NOT_PRELOADED:
            importlib.import_module(mod.name)
    return entry


def _forked(argv: list[str], env: dict[str, str], timeout: int) -> tuple[int, str, str]:
    entry = _preloaded()

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the run's own process
            code = 1
            try:
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
                sys.stderr = open(2, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
                os.environ.clear()
                os.environ.update(env)
                sys.argv = [str(REPO / "build.py"), *argv]
                # As in a fresh interpreter: no handler (run() adds its own), no warning capture.
                logging.root.handlers.clear()
                logging.root.setLevel(logging.WARNING)
                warnings.resetwarnings()
                for action, category, module in reversed(FRESH_WARNINGS):
                    warnings.filterwarnings(action, category=category, module=module or "")
                code = entry.run(argv)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except BaseException:  # noqa: BLE001 - what an interpreter would print on its way out
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise subprocess.TimeoutExpired(argv, timeout)
            time.sleep(0.005)
        out.seek(0)
        err.seek(0)
        return (os.waitstatus_to_exitcode(status), out.read().decode("utf-8", "replace"),
                err.read().decode("utf-8", "replace"))


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A copy of images/ and patches/ that a test may break."""
    return project_copy(tmp_path / "project")


def project_copy(root: Path, source: Path = REPO) -> Path:
    """The project's own images/ and patches/ copied to ``root``, the definitions naming this run's stand-ins and
    without the [smoke] table a definition ships (the GPU record's server arguments, which the stand-ins' servers
    and the tests' reference answers are not made for): each test gives the settings it means. The shipped tables
    are tested as shipped (tests/unit/test_smoke_table.py)."""
    copy_tracked(source, ("images", "patches"), root)
    for toml in (root / "images").glob("*.toml"):
        text = toml.read_text().split("\n[smoke]", 1)[0]
        toml.write_text(text.replace('"vllm/vllm-openai"', f'"{STANDIN_REPO}"'))
    return root


def tracked(source: Path, folders: tuple[str, ...]) -> list[str]:
    """The files under ``folders`` that the checkout at ``source`` tracks (``git ls-files``), as relative paths.

    A user's own patch sets and definitions (``new-patchset`` writes them into
    the checkout, untracked) are not the project's: its tests never see them.
    A copy of the project without git history (an unpacked archive) holds
    nothing but the project's files, so there every file counts.
    """
    try:
        listed = _tracked_here(folders) if source == REPO else _ls_files(source, folders)
    except (OSError, subprocess.CalledProcessError):
        if (source / ".git").exists():
            raise  # a git checkout whose files git cannot list: never guess which are the project's
        return sorted(str(p.relative_to(source)) for f in folders for p in (source / f).rglob("*") if p.is_file())
    # A tracked file deleted in the working tree is not copied (git still lists it until the deletion is staged).
    return [name for name in listed.decode().split("\0") if name and (source / name).is_file()]


def _ls_files(source: Path, folders: tuple[str, ...]) -> bytes:
    return subprocess.run(["git", "-C", str(source), "ls-files", "-z", "--", *folders],
                          capture_output=True, check=True, timeout=60).stdout


@functools.cache
def _tracked_here(folders: tuple[str, ...]) -> bytes:
    """What this checkout tracks, asked of git once a process: no test stages a file in it, and the project
    fixture asked once a test (which files of them exist is still looked at each time)."""
    return _ls_files(REPO, folders)


def copy_tracked(source: Path, folders: tuple[str, ...], root: Path) -> None:
    """Copy the tracked files under ``folders`` of ``source`` to ``root``, keeping their paths and modes."""
    for folder in folders:
        (root / folder).mkdir(parents=True, exist_ok=True)
    for name in tracked(source, folders):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source / name, root / name)


@pytest.fixture
def fresh(project: Path) -> Path:
    """A project copy with no definition and no patch set for v0.25.1."""
    (project / "images/v0.25.1.toml").unlink()
    shutil.rmtree(project / "patches/v0.25.1")
    return project


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="session")
def api() -> Iterator[str]:
    """The GitHub API stand-in (tests/github_api.py), for the whole session."""
    with github_api.serve() as url:
        yield url


def unique_name() -> str:
    """A name part no other test or run uses; it carries the run's token, so the leftover check knows it."""
    return f"{RUN_TOKEN}-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def unique() -> str:
    return unique_name()


def _scratch_dirs() -> set[str]:
    """Scratch and runner staging folders of this test run (named with its run ID)."""
    tmp = tempfile.gettempdir()
    # One listing of the folder for both names (two globs, each listing it, cost a millisecond a test).
    ours = (f"vllm-hotfix-scratch-{RUN_ID}-", f"vllm-hotfix-runner-{RUN_ID}-")
    return {os.path.join(tmp, name) for name in os.listdir(tmp) if name.startswith(ours)}


@pytest.fixture(autouse=True)
def no_leftovers(request: pytest.FixtureRequest, lane_engine: None) -> Iterator[None]:
    """Every test must leave no container, scratch folder or reject file."""
    before_dirs = _scratch_dirs()
    uses_engine = "engine" in request.fixturenames or any(
        n.startswith("base_") for n in request.fixturenames
    )
    before_containers: set[str] = set()
    before_dangling: set[str] = set()
    if uses_engine:
        before_containers = set(Engine.connect().containers_with_role(RUN_ID))
        before_dangling = _dangling()
    yield
    assert _scratch_dirs() <= before_dirs, "scratch folders left behind"
    strays = _patch_strays()
    assert not strays, f"reject/backup files left behind: {strays}"
    if uses_engine:
        after = set(Engine.connect().containers_with_role(RUN_ID))
        assert after <= before_containers, f"containers left behind: {after - before_containers}"
        # An image a test made and then untagged (a rebuild that moved the tag on) is a leftover too;
        # named here, by the test that made it, and not only by the session's check at the end.
        made = _dangling() - before_dangling
        assert not made, f"untagged images left behind: {sorted(made)}"


_CACHE = str(REPO / "build" / "cache")


def _patch_strays() -> list[str]:
    """Reject and backup files (``*.rej``, ``*.orig``) anywhere in the checkout, hidden ones aside (as a glob).

    One walk of the tree after every test (two recursive globs took 6 ms, a
    quarter of the unit tier's time). The tool's download and base cache
    (``build/cache``) is left out: it holds only content-addressed archives
    the tool wrote whole, never a patch's output, and on a machine that has
    built a few images it is most of the tree (a thousand folders, walked
    after every test, doubled the unit tier's time).
    """
    found = []
    for top, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith(".") and os.path.join(top, d) != _CACHE]
        found += [os.path.join(top, f) for f in files if f.endswith((".rej", ".orig")) and not f.startswith(".")]
    return found


def _dangling() -> set[str]:
    """Untagged top-level images of the default engine."""
    return set(Engine.connect().sdk.api.images(filters={"dangling": True}, quiet=True))


def docker_cli(*args: str) -> str:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=True).stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Registry:
    """Debian's docker-registry on a free loopback port; with ``user``, behind htpasswd basic auth."""

    def __init__(self, tmp: Path, user: str | None = None, password: str | None = None) -> None:
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.config = tmp / "registry.yml"
        auth = ""
        if user is not None:
            htpasswd = tmp / "htpasswd"
            line = subprocess.run(["htpasswd", "-Bbn", user, password or ""], capture_output=True, text=True,
                                  check=True).stdout
            htpasswd.write_text(line)
            auth = f"auth: {{htpasswd: {{realm: hotfix-test, path: {htpasswd}}}}}\n"
        self.config.write_text(
            "version: 0.1\nlog: {level: error}\n"
            f"storage: {{filesystem: {{rootdirectory: {tmp / 'data'}}}}}\n"
            f"http: {{addr: {self.addr}}}\n" + auth
        )
        self.auth = (user, password) if user is not None else None
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        exe = shutil.which("docker-registry")
        assert exe, "docker-registry is not installed (apt-get install docker-registry)"
        self.proc = subprocess.Popen([exe, "serve", str(self.config)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                # Its port taken in the meantime (workers run side by side): another registry may answer there.
                raise RuntimeError(f"registry on {self.addr} exited at once (exit {self.proc.returncode})")
            try:
                if requests.get(f"http://{self.addr}/v2/", timeout=1).status_code in (200, 401):
                    if self.proc.poll() is None:
                        return
            except requests.RequestException:
                time.sleep(0.2)
        raise RuntimeError("registry did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None


@dataclass(frozen=True, slots=True)
class RegistryPlace:
    """A test's own namespace in its worker's registry.

    One registry serves a worker's whole session, so an image's layers that
    an earlier test pushed are mounted from there instead of compressed and
    uploaded again (about ten seconds for a stand-in); each test pushes under
    a namespace of its own and sees nothing of the others'.
    """

    addr: str  # HOST:PORT
    ns: str
    storage: Path  # the registry's files on disk, for tests that alter a blob

    @property
    def place(self) -> str:
        return f"{self.addr}/{self.ns}"

    def api(self, path: str) -> str:
        """The registry API's URL of ``path`` (e.g. ``ops/NAME/tags/list``) under this namespace."""
        return f"http://{self.addr}/v2/{self.ns}/{path}"


@pytest.fixture(scope="session")
def worker_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    reg = Registry(tmp_path_factory.mktemp("registry"))
    reg.start()
    yield reg
    reg.stop()


@pytest.fixture
def registry(worker_registry: Registry) -> RegistryPlace:
    return RegistryPlace(worker_registry.addr, f"t-{uuid.uuid4().hex[:8]}", worker_registry.config.parent / "data")


@pytest.fixture(scope="module")
def built_once(request: pytest.FixtureRequest, lanes: Lanes, base_v0251: str, tmp_path_factory: pytest.TempPathFactory
               ) -> tuple[Path, str, str]:
    """The patch set built and smoke-tested by the tool once per session and engine, in a project of its own."""
    url = engine_url(request.path)
    if url not in lanes.built:
        project = project_copy(tmp_path_factory.mktemp("built") / "project")
        ref = f"hotfix-test/smoke-{RUN_ID}:v0.25.1-m3patch"
        r = cli("image", "--definition", "v0.25.1", "--tag", ref, "--pull", "never", root=project,
                env={"DOCKER_HOST": url})
        assert r.rc == 0, r.err
        lanes.built[url] = (project, ref, r.out.split()[-1])
    return lanes.built[url]


@pytest.fixture
def built(engine: Engine, built_once: tuple[Path, str, str], tmp_path: Path) -> tuple[Path, str, str]:
    """A patched image built (and smoke-tested) by the tool, in a project copy of the test's own.

    One build and smoke per session, not one per test: the copy holds that
    build's records (a test may edit them or add verdicts without touching
    another's), and the tag is the session's, pointed back at the image
    should an earlier test have rebuilt under it.
    """
    template, ref, image_id = built_once
    project = tmp_path / "project"
    for folder in ("images", "patches", "build/records"):
        shutil.copytree(template / folder, project / folder)
    engine.tag(image_id, ref)
    return project, ref, image_id


class CountingOpens:
    """The real engine, counting which images' files are opened for reading (a seam: every call goes through)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.opened: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def files(self, image: str) -> Any:
        self.opened.append(image)
        return self.engine.files(image)
