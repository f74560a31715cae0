"""Fault tier: the engine dies under a real build, and the tool answers cleanly.

A private Docker engine (its own socket, data and exec roots, containerd
namespace) is started for this module, so killing it disturbs nothing else.
At three points of a real `image` run (probing the base, building, smoke) the
engine is killed with SIGKILL (and once stopped with SIGTERM, which removes its
socket file while containers are being removed); the run must end with one `error:` line and
the engine exit code, no Python error dump; after the engine is back, the next
run removes every container and image the dead run left.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from conftest import REPO, RUN_ID, STANDIN_REPO, RegistryPlace, cli, fails, site_key
from vllm_hotfix.building import standin
from vllm_hotfix.cli import _on_sigterm
from vllm_hotfix.engine import Engine, labels
from vllm_hotfix.engine.containers import EXEC_GRACE
from vllm_hotfix.errors import Terminated


class PrivateEngine:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.sock = root / "docker.sock"
        self.url = f"unix://{self.sock}"
        self.pidfile = root / "docker.pid"

    def start(self) -> Engine:
        exe = shutil.which("dockerd")
        assert exe, "dockerd is not installed"
        # A killed engine leaves its pid files behind, and its dead containerd may
        # linger as a zombie under the pid it names: start afresh from both.
        self.pidfile.unlink(missing_ok=True)
        (self.root / "exec" / "containerd" / "containerd.pid").unlink(missing_ok=True)
        with open(self.root / "dockerd.log", "ab") as log:
            subprocess.Popen(
                [exe, "--iptables=false", "--bridge=none", f"--host={self.url}", f"--data-root={self.root / 'data'}",
                 f"--exec-root={self.root / 'exec'}", f"--pidfile={self.pidfile}",
                 "--containerd-namespace=hotfix-fault", "--containerd-plugins-namespace=hotfix-fault-plugins"],
                stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
            )
        deadline = time.monotonic() + 60
        while True:
            try:
                return Engine.connect(timeout=30, base_url=self.url)
            except Exception as exc:
                if time.monotonic() > deadline:
                    log = (self.root / "dockerd.log").read_text(errors="replace").splitlines()[-15:]
                    raise AssertionError("the private engine did not start:\n" + "\n".join(log)) from exc
                time.sleep(0.3)

    def pid(self) -> int:
        return int(self.pidfile.read_text().strip())

    def processes(self) -> list[int]:
        """dockerd, its containerd and shims (found by their paths; a reaped or zombie process has none)."""
        pids = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if str(self.root) in cmdline:
                pids.append(int(proc.name))
        return pids

    def kill(self) -> None:
        """SIGKILL the whole engine: dockerd, then its containerd and shims."""
        os.kill(self.pid(), signal.SIGKILL)
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def stop(self) -> None:
        try:
            pid = self.pid()
            os.kill(pid, signal.SIGTERM)
            # Until it is gone; an exited dockerd nobody reaped yet (a zombie) counts as gone. One that
            # stops a running container first takes ten seconds and more: a restart before it is gone
            # would find the old one still answering on the socket, and lose the new one's pid file.
            for _ in range(300):
                if pid not in self.processes():
                    break
                time.sleep(0.1)
        except (OSError, ValueError):
            pass


@pytest.fixture(scope="module")
def private(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PrivateEngine, Engine]]:
    root = Path(tmp_path_factory.mktemp("engine", numbered=True))
    eng = PrivateEngine(root)
    engine = eng.start()
    standin.make(engine, REPO, "0.25.1", f"{STANDIN_REPO}:v0.25.1", lambda _l: None)
    yield eng, engine
    # A throwaway engine: killed rather than stopped (a clean stop takes it
    # ten seconds), its mounts and folders removed all the same.
    eng.kill()
    deadline = time.monotonic() + 10
    while eng.processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    # A mount the killed engine's children still hold is detached lazily: no mount outlives the session.
    if subprocess.run(["umount", "-R", str(root / "data")], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-R", "-l", str(root / "data")], capture_output=True)
    shutil.rmtree(root, ignore_errors=True)


def run_and_hit(eng: PrivateEngine, project: Path, out: str, point: str, hit: Callable[[subprocess.Popen[str]], None],
                env_extra: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> tuple[int, str]:
    """Run a real `image` against the private engine; call ``hit`` when its progress reaches ``point``.

    An empty ``point`` calls ``hit`` at once (it may wait itself).
    """
    env = dict(os.environ, DOCKER_HOST=eng.url, PYTHONUNBUFFERED="1", **(env_extra or {}))
    # A suite started in the background (`make test &`, nohup) hands its children SIGINT ignored, and a
    # process keeps an ignored SIGINT through exec: the tool is started with the default a terminal gives.
    with_default_sigint = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                           "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")
    proc = subprocess.Popen(
        [sys.executable, "-c", with_default_sigint, str(REPO / "build.py"), "--root", str(project), "image",
         "--definition", "v0.25.1", "--tag", out, "--pull", "never", "--rebuild", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    assert proc.stderr is not None
    seen: list[str] = []
    if not point:
        hit(proc)
    for line in proc.stderr if point else ():
        seen.append(line)
        if line.startswith(point):
            hit(proc)
            break
    _, rest = proc.communicate(timeout=300)
    err = "".join(seen) + rest
    assert "Traceback" not in err, err
    return proc.returncode, err


@pytest.mark.parametrize(("point", "how"), [("==> checking vllm in the base", "kill"), ("==> building", "kill"),
                                            ("==> smoke-testing", "kill"), ("==> smoke-testing", "term")])
def test_engine_killed_mid_run(private: tuple[PrivateEngine, Engine], project: Path, unique: str,
                               point: str, how: str) -> None:
    eng, engine = private
    before = engine.image_ids()
    out = f"hotfix-test/fault-{unique}:x"
    rc, err = run_and_hit(eng, project, out, point, lambda _proc: eng.kill() if how == "kill" else eng.stop())
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert lines, err
    assert "the Docker engine stopped answering" in lines[-1] or "incomplete" in lines[-1], err
    print(f"{point!r} ({how}): exit {rc}: {lines[-1]}")
    assert rc in (5, 11), err
    _next_run_cleans(eng, project, unique, out, before)


@pytest.mark.parametrize("point", ["==> building", "==> smoke-testing"])
def test_interrupt_leaves_no_image(private: tuple[PrivateEngine, Engine], project: Path, unique: str,
                                   point: str) -> None:
    eng, engine = private
    before = engine.image_ids()
    out = f"hotfix-test/interrupted-{unique}:x"
    rc, err = _signalled(eng, engine, project, out, point, signal.SIGINT)  # Ctrl-C
    assert rc == 130 and "error: interrupted" in err, err
    assert engine.image(out) is None
    assert engine.containers_by_owner() == {}
    assert engine.image_ids() - before == set(), "the interrupted run left images"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_engine_builds_leaves_no_image(private: tuple[PrivateEngine, Engine], project: Path,
                                                         unique: str, sig: signal.Signals) -> None:
    """Hit while the engine runs the COPY step: the run closes the build's stream (an open one goes on to the
    end and commits the whole image) and removes the steps the engine committed after its last report, at once,
    not on the next run."""
    eng, engine = private
    before = engine.image_ids()
    out = f"hotfix-test/mid-build-{unique}:x"
    rc, err = _signalled(eng, engine, project, out, "    Step 2/", sig)
    assert rc == (130 if sig == signal.SIGINT else 143), err
    time.sleep(3)  # what the engine might still commit after the run ended would show by now
    assert engine.image(out) is None
    assert engine.image_ids() - before == set(), "the interrupted build left images"


def test_interrupt_before_an_assembled_image_is_loaded_leaves_no_image(private: tuple[PrivateEngine, Engine],
                                                                       project: Path, unique: str) -> None:
    """Ctrl-C while the base is probed: the load the run opened ahead (engine/pending_load.py) is completed with
    an archive that loads nothing, and the run ends as any interrupted run does."""
    eng, engine = private
    before = engine.image_ids()
    out = f"hotfix-test/interrupted-assemble-{unique}:x"
    rc, err = _signalled(eng, engine, project, out, "==> checking vllm in the base", signal.SIGINT,
                         args=("--builder", "assemble", "--no-smoke"))
    assert rc == 130 and "error: interrupted" in err, err
    assert engine.image(out) is None
    assert engine.containers_by_owner() == {}
    assert engine.image_ids() - before == set(), "the interrupted run left images"


def _signalled(eng: PrivateEngine, engine: Engine, project: Path, out: str, point: str,
               sig: signal.Signals, args: tuple[str, ...] = ()) -> tuple[int, str]:
    """A run sent ``sig`` at ``point``: its exit code and stderr.

    A run (a few seconds in all) that finished before the signal reached it on a loaded machine was not
    signalled: what it made is removed and it is tried again, three times at most.
    """
    for _attempt in range(3):
        rc, err = run_and_hit(eng, project, out, point, lambda proc: proc.send_signal(sig), args=args)
        if rc != 0:
            break
        engine.remove_image(out)
    return rc, err


def _absent_smoke(eng: PrivateEngine, project: Path, unique: str) -> None:
    """The next run, whatever it is (here a smoke of an image the engine lacks): it first removes leftovers."""
    fails(cli("smoke", f"hotfix-test/absent-{unique}:x", root=project, env={"DOCKER_HOST": eng.url}),
          "not in the engine")


def test_sweep_follows_notes(engine: Engine, base_v0251: str, project: Path, unique: str) -> None:
    """A dead run's note under build/runs makes the next run remove its containers; no note, no sweep."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    owner = f"{socket.gethostname()}:{gone.pid}"  # a process of this host that is gone
    container = engine.sdk.containers.create(
        base_v0251, entrypoint=["true"], network_mode="none",
        labels={labels.ROLE: "probe", labels.OWNER: owner, labels.RUN: RUN_ID})
    try:
        # No note of that run: the next run does not look for its leftovers.
        fails(cli("smoke", f"hotfix-test/absent-{unique}:x", root=project), "not in the engine")
        assert container.id in engine.containers_by_owner().get(owner, [])
        note = project / "build" / "runs" / f"{owner.replace(':', '-')}.json"
        note.parent.mkdir(parents=True, exist_ok=True)
        note.write_text(json.dumps({"owner": owner, "images": [], "containers": 1}))
        r = cli("smoke", f"hotfix-test/absent-{unique}:x", root=project)
        fails(r, "not in the engine")
        assert "removed leftovers of interrupted runs: 1 container(s)" in r.err, r.err
        assert owner not in engine.containers_by_owner()
        assert not note.exists()
    finally:
        engine.remove_container(container.id)


def _one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


def _next_run_cleans(eng: PrivateEngine, project: Path, unique: str, out: str, before: set[str]) -> None:
    """After the engine is back, the next run removes every container and image the dead run left."""
    engine = eng.start()
    try:
        _absent_smoke(eng, project, unique)
        assert engine.containers_by_owner() == {}
        assert engine.image(out) is None
        assert engine.image_ids() - before == set(), "images of the dead run remain"
        assert not list((project / "build" / "runs").glob("*.json")), "notes remain"
    finally:
        engine.close()


@pytest.mark.parametrize("delay", [0.4, 1.4])
def test_engine_stopped_early_in_rebuild(private: tuple[PrivateEngine, Engine], project: Path, unique: str,
                                         delay: float) -> None:
    """The engine stopped the ordinary way (SIGTERM: its socket goes) 0.4 s and 1.4 s into `image --rebuild`."""
    eng, engine = private
    before = engine.image_ids()
    out = f"hotfix-test/early-{unique}:x"

    def stop_later(_proc: subprocess.Popen[str]) -> None:
        time.sleep(delay)
        eng.stop()

    rc, err = run_and_hit(eng, project, out, "", stop_later)
    line = _one_error_line(err)
    print(f"engine stopped at {delay} s: exit {rc}: {line}")
    # dockerd answers for a while as it shuts down, so the run may have reached
    # its smoke checks: those the engine could not run make the smoke incomplete (11).
    assert rc == 5 or (rc == 11 and "==> smoke-testing" in err), err
    assert "Docker engine" in line or "incomplete" in line, err
    _next_run_cleans(eng, project, unique, out, before)


def test_engine_stopped_while_probing(private: tuple[PrivateEngine, Engine], project: Path, unique: str) -> None:
    """SIGTERM to the engine while the probe container runs: its removal meets a gone engine; one line, exit 5."""
    eng, engine = private
    before = engine.image_ids()
    out = f"hotfix-test/probe-term-{unique}:x"
    rc, err = run_and_hit(eng, project, out, "==> checking", lambda _proc: eng.stop())
    line = _one_error_line(err)
    assert rc == 5 and "the Docker engine stopped answering" in line, err
    _next_run_cleans(eng, project, unique, out, before)


def test_frozen_engine_during_probe_ends_in_time(private: tuple[PrivateEngine, Engine], project: Path,
                                                 unique: str, tmp_path: Path) -> None:
    """SIGSTOP to the engine during the probe, probe timeout 10 s: one line, ended by that timeout, while the
    engine is still frozen.

    With a facts cache of its own: a cache that knows the base already starts no probe at all.
    """
    eng, engine = private
    before = engine.image_ids()
    out = f"hotfix-test/frozen-{unique}:x"
    _frozen_run(eng, project, out, tmp_path, 0)
    _next_run_cleans_after_the_freeze(eng, project, unique, out, before)


# The limit a call at a frozen engine ran out of, as the error line names it: the client's read timeout, or an
# exec's own limit. Under a probe timeout of 10 s none may exceed it plus EXEC_GRACE (the engine's default
# limit, 120 s, is what a run that ignored the probe timeout would name).
SAID_LIMIT = re.compile(r"\(read timeout=(\d+(?:\.\d+)?)\)|no answer within (\d+) s")


def _frozen_run(eng: PrivateEngine, project: Path, out: str, tmp_path: Path, delay: float,
                args: tuple[str, ...] = ()) -> None:
    """`image` with a probe timeout of 10 s and a facts cache of its own; SIGSTOP to the engine ``delay``
    seconds after "==> checking": one line, exit 5, ended by the probe's limit (the line names it) while the
    engine is still frozen: it is resumed only once the run has ended, so a run that waited for it never would.
    No clock is read: how long the limit takes on a loaded host is the host's business."""
    pid = eng.pid()

    def freeze(_proc: subprocess.Popen[str]) -> None:
        time.sleep(delay)
        os.kill(pid, signal.SIGSTOP)

    try:
        rc, err = run_and_hit(eng, project, out, "==> checking", freeze,
                              {"VLLM_HOTFIX_PROBE_TIMEOUT": "10", "VLLM_HOTFIX_CACHE": str(tmp_path / "cache")},
                              args)
    finally:
        os.kill(pid, signal.SIGCONT)
    line = _one_error_line(err)
    print(f"engine frozen {delay} s into the probe: exit {rc}: {line}")
    assert rc == 5 and "the Docker engine stopped answering" in line, err
    limit = SAID_LIMIT.search(line)
    assert limit is not None and float(limit.group(1) or limit.group(2)) <= 10 + EXEC_GRACE, line


def _next_run_cleans_after_the_freeze(eng: PrivateEngine, project: Path, unique: str, out: str,
                                      before: set[str]) -> None:
    """The engine a frozen run left, settled, then the next run: it removes what the dead run left.

    Resumed, the engine would go on with what the dead run had asked of it
    (a create, a removal) at its own pace, and a next run could look before
    or after; killed and started again, it holds on disk exactly what it had
    made, and the next run's sweep meets that, whatever the host's speed.
    """
    eng.kill()
    _next_run_cleans(eng, project, unique, out, before)


SLOW_PY = b"""#!/bin/sh
# The probe's Python, slow to answer: the engine is frozen while the probe's exec is in flight.
case "$2" in *time.sleep*) exec python3 "$@";; esac
sleep 6
exec python3 "$@"
"""


def test_frozen_engine_during_the_probes_exec_ends_in_time(private: tuple[PrivateEngine, Engine], project: Path,
                                                           unique: str, tmp_path: Path) -> None:
    """SIGSTOP to the engine while the probe runs in its container (no facts cached): the probe timeout holds.

    The SDK reads an exec's answer with an untimed poll: this run waited until the engine was resumed.
    """
    from conftest import derive

    eng, engine = private
    repo = f"hotfix-test/slow-python-{unique}"
    derive(engine, f"{STANDIN_REPO}:v0.25.1", f"{repo}:v0.25.1", "COPY slowpy /usr/local/bin/slowpy",
           {"slowpy": SLOW_PY}, {"slowpy": 0o755})
    toml = project / "images/v0.25.1.toml"
    toml.write_text(toml.read_text().replace('name = "vllm"', 'name = "vllm"\npython = "/usr/local/bin/slowpy"'))
    out = f"hotfix-test/frozen-exec-{unique}:x"
    before = engine.image_ids()
    _frozen_run(eng, project, out, tmp_path, 2, ("--base-repo", repo))
    _next_run_cleans_after_the_freeze(eng, project, unique, out, before)
    engine.remove_image(f"{repo}:v0.25.1")


@pytest.mark.parametrize(("point", "sig"), [("==> checking", signal.SIGTERM), ("==> building", signal.SIGTERM),
                                            ("==> smoke-testing", signal.SIGTERM), ("==> smoke 3/3", signal.SIGTERM),
                                            ("==> smoke 3/3", signal.SIGINT)])
def test_sigterm_to_the_tool_cleans_up(private: tuple[PrivateEngine, Engine], project: Path, unique: str,
                                       point: str, sig: signal.Signals) -> None:
    """SIGTERM (docker stop, systemd, CI) during probe, build or smoke: as Ctrl-C, one line, exit 143, nothing left.

    Just after "smoke 3/3" the runner's container is being created: a signal then left it `Created`.
    """
    eng, engine = private
    before = engine.image_ids()
    out = f"hotfix-test/terminated-{unique}:x"
    rc, err = _signalled(eng, engine, project, out, point, sig)
    said = "terminated" if sig == signal.SIGTERM else "interrupted"
    assert rc == 128 + sig and _one_error_line(err) == f"error: {said}", err
    assert engine.image(out) is None
    assert engine.containers_by_owner() == {}, "the terminated run left containers"
    assert engine.image_ids() - before == set(), "the terminated run left images"
    assert not list((project / "build" / "runs").glob("*.json")), "the terminated run left its note"


def test_smoke_reports_to_a_device_leave_the_device(built: tuple[Path, str, str], tmp_path: Path) -> None:
    """--report/--junit/--attestation naming a character device (a mknod copy of /dev/null): it stays a device."""
    import stat

    project, ref, _image_id = built
    nodes = {name: tmp_path / name for name in ("report", "junit", "attestation")}
    for node in nodes.values():
        try:
            os.mknod(node, 0o644 | stat.S_IFCHR, os.makedev(1, 3))
        except PermissionError as exc:
            pytest.skip(f"cannot make a device node here: {exc}")
    key = tmp_path / "key.pem"

    site_key(key)
    r = cli("smoke", ref, "--report", str(nodes["report"]), "--junit", str(nodes["junit"]),
            "--sign-key", str(key), "--attestation", str(nodes["attestation"]), root=project)
    assert r.rc == 0, r.err
    for name, node in nodes.items():
        st = node.stat()
        assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3), f"--{name}: {oct(st.st_mode)}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["attestation", "junit", "key.pem", "project", "report"]


def test_parallel_pushes_to_one_target_take_turns(engine: Engine, built: tuple[Path, str, str],
                                                  registry: RegistryPlace, unique: str) -> None:
    """Six runs push one image under one target at once: none loses the shared local tag to another's clean-up."""
    import threading

    from vllm_hotfix.release import push

    project, _ref, image_id = built
    info = engine.image(image_id)
    assert info is not None
    target = f"{registry.place}/parallel:{unique}"
    results: list[object] = []

    def one() -> None:
        try:
            results.append(push._push_one(Engine.connect(), project, info, target, 1, lambda _line: None))
        except Exception as exc:  # noqa: BLE001 - the failure itself is what the test reports
            results.append(exc)

    for _round in range(3):
        results.clear()
        threads = [threading.Thread(target=one) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert len(results) == 6 and all(isinstance(r, str) for r in results), results
        assert len(set(results)) == 1  # one image, one digest
        assert engine.image(target) is None  # put back as it was: absent


# Each case: the signal, the handler the run has for it, and what the run raises (None: it goes on). The handler
# is set here, whatever this test process inherited: a suite started in the background (`make test &`, nohup)
# inherits SIGINT ignored, and a test that leaves it so measures how it was started, not the tool.
CREATE_CASES = {
    "sigint": (signal.SIGINT, signal.default_int_handler, KeyboardInterrupt),  # a terminal's Ctrl-C, in Python
    "sigterm": (signal.SIGTERM, _on_sigterm, Terminated),  # the CLI's: SIGTERM raised as Terminated
    # Started with SIGINT ignored (a background job of a script): it stays ignored, the run goes on to its end.
    "sigint-ignored": (signal.SIGINT, signal.SIG_IGN, None),
}


@pytest.mark.parametrize("case", list(CREATE_CASES))
def test_a_signal_while_the_engine_creates_a_container_leaves_none(engine: Engine, base_v0251: str,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   case: str) -> None:
    """Ctrl-C or SIGTERM while the engine makes a container (the signal arrives after the engine made it, before
    its answer is read): the create is held through it, so the container's ID comes back, it is removed, and
    the interrupt is raised then. None is left `Created`. A SIGINT the run was started ignoring changes nothing."""
    import docker.models.containers

    signum, handler, raised = CREATE_CASES[case]
    real = docker.models.containers.ContainerCollection.create
    made: list[str] = []

    def create(self: object, *args: object, **kwargs: object) -> object:
        container = real(self, *args, **kwargs)  # the engine made it...
        made.append(container.id)
        signal.raise_signal(signum)  # ...and the signal comes before the tool has read the answer
        return container

    before = set(engine.containers_with_role(RUN_ID))
    monkeypatch.setattr(docker.models.containers.ContainerCollection, "create", create)
    previous = signal.signal(signum, handler)
    try:
        if raised is None:
            assert engine.run(base_v0251, ["true"], timeout=30).exit_code == 0
        else:
            with pytest.raises(raised):
                engine.run(base_v0251, ["true"], timeout=30)
    finally:
        signal.signal(signum, previous)
    monkeypatch.undo()
    assert made, "the engine was never asked for the container"
    assert set(engine.containers_with_role(RUN_ID)) <= before, "a container was left behind"


def test_killed_during_smoke_its_staging_folder_goes_with_the_next_run(private: tuple[PrivateEngine, Engine],
                                                                        project: Path, unique: str) -> None:
    """SIGKILL while the runner runs: its staging folder stays (nothing can remove it then); the next run does."""
    import glob
    import tempfile

    eng, engine = private
    before = engine.image_ids()
    out = f"hotfix-test/killed-smoke-{unique}:x"
    pids: list[int] = []

    def staged(pid: int) -> list[str]:
        return glob.glob(os.path.join(tempfile.gettempdir(), f"vllm-hotfix-runner-{RUN_ID}-{pid}-*"))

    def kill(proc: subprocess.Popen[str]) -> None:
        pids.append(proc.pid)
        deadline = time.monotonic() + 30
        while not staged(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        proc.kill()  # as the runner starts

    rc, _err = run_and_hit(eng, project, out, "==> smoke 3/3", kill)
    left = staged(pids[0])
    assert rc == -signal.SIGKILL and left, "the test did not kill the run while its runner was staged"
    _absent_smoke(eng, project, unique)
    assert not any(os.path.exists(p) for p in left), "the next run left the dead run's staging folder"
    assert engine.containers_by_owner() == {}
    assert engine.image(out) is None and engine.image_ids() - before == set()


def test_prune_removes_what_rollbacks_and_stand_ins_left_and_keeps_tagged_images(
        private: tuple[PrivateEngine, Engine], tmp_path: Path) -> None:
    """On an engine of the test's own: an untagged build (what a rollback leaves), the stand-ins' rootfs cache;
    a tagged build and the stand-in base stay. --dry-run removes nothing. Last in this module: the cache goes."""
    from vllm_hotfix.tarball import tar_bytes

    eng, engine = private
    base = f"{STANDIN_REPO}:v0.25.1"

    def build(tag: str, marker: str) -> str:
        dockerfile = f"FROM {base}\nLABEL {labels.DEFINITION}=v0.25.1 marker={marker}\n"
        image_id = engine.build(tar_bytes({"Dockerfile": dockerfile.encode()}))
        engine.tag(image_id, tag)
        return image_id

    kept = build("hotfix-test/prune-kept:1", "kept")
    left = build("hotfix-test/prune-left:1", "left")
    engine.tag(kept, "hotfix-test/prune-left:1")  # as a rollback does: the tag moved on, the image left untagged
    rootfs = engine.image(standin.ROOTFS_REF)
    assert rootfs is not None and engine.image(left) is not None
    env = {"DOCKER_HOST": eng.url}
    r = cli("prune", "--dry-run", root=tmp_path, env=env)
    assert r.rc == 0 and "would remove 2 image(s)" in r.out, r.err
    assert f"would remove {left[:19]}: untagged build" in r.err and standin.ROOTFS_REF in r.err
    assert engine.image(left) is not None and engine.image(standin.ROOTFS_REF) is not None
    r = cli("prune", root=tmp_path, env=env)
    assert r.rc == 0 and "removed 2 image(s)" in r.out, r.err
    assert engine.image(left) is None and engine.image(standin.ROOTFS_REF) is None
    assert engine.image(kept) is not None and engine.image(base) is not None
    assert cli("prune", root=tmp_path, env=env).out.startswith("removed 0 image(s)")
    engine.untag("hotfix-test/prune-left:1")
    engine.remove_image("hotfix-test/prune-kept:1")


@pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed (`.ci/services install`)")
def test_prune_removes_podmans_copies_of_the_tools_builds(private: tuple[PrivateEngine, Engine],
                                                          tmp_path: Path) -> None:
    """What smoke --launcher podman moved into podman's store, a store of the test's own here: removed by prune,
    the engine's tagged image kept (it was left there)."""
    from vllm_hotfix.tarball import tar_bytes

    eng, engine = private
    ref = "hotfix-test/prune-podman:1"
    dockerfile = f"FROM scratch\nCOPY fixed.py /fixed.py\nLABEL {labels.DEFINITION}=v0.25.1\n"
    image_id = engine.build(tar_bytes({"Dockerfile": dockerfile.encode(), "fixed.py": b"FIXED = True\n"}))
    engine.tag(image_id, ref)
    conf = tmp_path / "storage.conf"
    conf.write_text(f'[storage]\ndriver = "vfs"\ngraphroot = "{tmp_path / "graph"}"\n'
                    f'runroot = "{tmp_path / "run"}"\n')
    podman_env = dict(os.environ, CONTAINERS_STORAGE_CONF=str(conf))

    def in_podman() -> bool:
        return subprocess.run(["podman", "image", "exists", image_id.removeprefix("sha256:")],
                              env=podman_env, capture_output=True).returncode == 0

    try:
        saved = subprocess.run(["docker", "-H", eng.url, "save", ref], capture_output=True, check=True).stdout
        subprocess.run(["podman", "load"], input=saved, env=podman_env, capture_output=True, check=True)
        assert in_podman()
        env = {"DOCKER_HOST": eng.url, "CONTAINERS_STORAGE_CONF": str(conf)}
        r = cli("prune", "--dry-run", root=tmp_path, env=env)
        assert r.rc == 0 and f"would remove podman's localhost/{ref}: podman's copy of a build" in r.err, r.err
        assert in_podman()
        r = cli("prune", root=tmp_path, env=env)
        assert r.rc == 0 and f"removed podman's localhost/{ref}" in r.err, r.err
        assert not in_podman() and engine.image(ref) is not None
    finally:
        subprocess.run(["podman", "rmi", "--force", "--all"], env=podman_env, capture_output=True)
        engine.remove_image(ref)


class _Finalized:
    """An object whose finalizer gets Ctrl-C: Python runs the handler inside ``__del__``, where the interrupt it
    raises cannot propagate (it is "ignored", and the run goes on)."""

    def __del__(self) -> None:
        signal.raise_signal(signal.SIGINT)


def test_ctrl_c_lost_in_a_finalizer_still_stops_the_build_before_its_tag(
        private: tuple[PrivateEngine, Engine], project: Path, unique: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C half a second into `image --rebuild` was once ignored, and the build, smoke and tag move went on
    to exit 0: an interrupt raised in a finalizer is lost there. The seam: the run's Ctrl-C lands in a finalizer
    as the base is probed (the run forked from this process, the probe's entry wrapped). The run stops at its
    next step: one line, 130, nothing built or tagged, nothing left."""
    import threading

    from vllm_hotfix.building import pipeline

    eng, engine = private
    before = engine.image_ids()
    out = f"hotfix-test/lost-interrupt-{unique}:x"
    real = pipeline.prepare

    def prepare(*args: object, **kwargs: object) -> object:
        _Finalized()  # made and dropped: its finalizer runs here
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(pipeline, "prepare", prepare)
    # The run is forked from this process (so it has the seam), with Python's own Ctrl-C handler.
    assert threading.active_count() == 1
    sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        r = cli("image", "--definition", "v0.25.1", "--tag", out, "--pull", "never", "--rebuild", root=project,
                env={"DOCKER_HOST": eng.url})
    finally:
        signal.signal(signal.SIGINT, sigint)
    assert r.rc == 130 and _one_error_line(r.err) == "error: interrupted", r.err
    assert "==> checking" in r.err and "==> building" not in r.err, r.err
    assert engine.image(out) is None and engine.image_ids() - before == set()
    assert engine.containers_by_owner() == {}
    assert not list((project / "build" / "runs").glob("*.json"))
