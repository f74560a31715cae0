"""Faults that need no engine: SIGTERM, damaged journal entries, a missing credential helper, a full disk.

Each must end in one `error:` line naming what is at fault and its documented
exit code, with no Python error dump (``cli`` asserts that) and nothing left.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import REPO, cli
from vllm_hotfix.errors import EXIT_TERMINATED, RecordError, StorageError, exit_table
from vllm_hotfix.journal import records
from vllm_hotfix.journal.atomic import write_atomic


def test_sigterm_ends_like_ctrl_c_with_one_line() -> None:
    """SIGTERM while the tool waits (here for a server's /health): `error: terminated`, exit 143."""
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "build.py"), "serve-check", "--url", "http://127.0.0.1:9", "--wait", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.stderr is not None
    first = proc.stderr.readline()
    assert first.startswith("==> waiting"), first
    proc.send_signal(signal.SIGTERM)
    _out, rest = proc.communicate(timeout=30)
    assert proc.returncode == EXIT_TERMINATED, rest
    assert "Traceback" not in rest, rest
    assert [ln for ln in rest.splitlines() if ln.startswith("error:")] == ["error: terminated"], rest
    assert EXIT_TERMINATED in dict(exit_table())


def _entry(project: Path, kind: str, data: dict[str, object]) -> Path:
    folder = project / "build" / "records" / kind
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{'0' * 19}1-bad.json"
    path.write_text(json.dumps({"kind": kind, **data}))
    return path


WRONG = [
    ("build", {"seq": "abc", "image_id": "sha256:" + "a" * 64}, "'seq'"),
    ("build", {"seq": 1, "inputs": "oops"}, "'inputs'"),
    ("build", {"seq": 1, "image_id": 7}, "'image_id'"),
    ("build", {"seq": 1, "files": {"a.py": "nohash"}}, "'files'"),
    ("build", {"seq": True}, "'seq'"),
    ("push", {"seq": 1, "image_ids": "oops"}, "'image_ids'"),
    ("push", {"seq": 1, "ref": ["x"]}, "'ref'"),
    ("push", {"seq": "abc"}, "'seq'"),
    ("tag", {"seq": 1, "ref": {"a": 1}}, "'ref'"),
    ("tag", {"seq": [1]}, "'seq'"),
]


@pytest.mark.parametrize(("kind", "data", "field"), WRONG)
def test_wrong_typed_entry_is_named(tmp_path: Path, kind: str, data: dict[str, object], field: str) -> None:
    path = _entry(tmp_path, kind, data)
    found, damaged = records.scan(tmp_path, kind)
    assert found == [] and [d.path for d in damaged] == [path]
    # The gate refuses every image such an entry may be about, naming the file.
    with pytest.raises(RecordError) as caught:
        records.require_readable(tmp_path, "sha256:" + "a" * 64)
    assert str(path) in str(caught.value) and "malformed" in str(caught.value)
    if "seq" not in field:
        assert field.strip("'") in str(caught.value)


@pytest.mark.parametrize("data", [{"seq": "abc"}, {"seq": 1, "inputs": "oops"}])
def test_list_names_a_wrong_typed_build_entry(project: Path, data: dict[str, object]) -> None:
    path = _entry(project, "build", data)
    r = cli("list", root=project)
    # list reports what it can read and names what it cannot, without a dump.
    assert r.rc == 0 and str(path) in r.err and "malformed" in r.err, r.err


def test_list_names_a_wrong_typed_push_entry(project: Path) -> None:
    _entry(project, "build", {"seq": 1, "image_id": "sha256:" + "a" * 64, "inputs": {"definition": "v0.25.1"}})
    path = _entry(project, "push", {"seq": "abc", "image_id": "sha256:" + "a" * 64})
    r = cli("list", root=project)
    assert r.rc == 0 and str(path) in r.err and "malformed" in r.err, r.err


def test_list_names_each_damaged_entry_once_and_each_push_once(project: Path) -> None:
    """One warning per damaged file (it was said once per definition read), one line per ref@digest pushed."""
    image = "sha256:" + "a" * 64
    records.append(project, "build", {"image_id": image, "output_ref": "r/x:v1", "inputs": {"definition": "v0.25.1"}})
    for _ in range(3):
        records.append(project, "push", {"image_id": image, "ref": "reg:5000/ops/x:v1", "digest": "sha256:" + "d" * 64})
    verdict = _entry(project, "verdict", {"seq": "abc", "image_id": image})
    push = project / "build" / "records" / "push" / f"{'0' * 19}9-bad.json"
    push.write_text("{not json")
    r = cli("list", root=project)
    assert r.rc == 0, r.err
    assert r.err.count(str(verdict)) == 1 and r.err.count(str(push)) == 1, r.err
    assert r.out.count("reg:5000/ops/x:v1@sha256:" + "d" * 64) == 1 and "(3 pushes)" in r.out, r.out
    assert len(json.loads(cli("list", "--json", root=project).out)[0]["builds"][0]["pushes"]) == 3


# -- a credential helper named in the docker config that is not installed ------


def _docker_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: dict[str, object]) -> Path:
    folder = tmp_path / "docker-config"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    monkeypatch.setenv("DOCKER_CONFIG", str(folder))
    return folder / "config.json"


@pytest.mark.parametrize(("config", "host", "helper"), [
    ({"credHelpers": {"registry.internal:5000": "nohelper"}}, "registry.internal:5000", "docker-credential-nohelper"),
    ({"credsStore": "nostore"}, "registry.internal:5000", "docker-credential-nostore"),
    ({"credsStore": "nostore"}, "docker.io", "docker-credential-nostore"),
])
def test_missing_credential_helper_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            config: dict[str, object], host: str, helper: str) -> None:
    from vllm_hotfix.engine import dockerconfig
    from vllm_hotfix.errors import PushError

    path = _docker_config(tmp_path, monkeypatch, config)
    with pytest.raises(PushError) as caught:
        dockerconfig.registry_credentials(host)
    assert caught.value.exit_code == 8
    assert helper in str(caught.value) and str(path) in str(caught.value) and "not installed" in str(caught.value)


@pytest.mark.parametrize("operation", ["push of r.internal/x:1", "pulling r.internal/x:1", "asking r.internal"])
def test_sdk_credential_helper_error_maps_to_exit_8(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    operation: str) -> None:
    """What the SDK raises from any call that needs a login (push, pull, a digest lookup): exit 8, helper named."""
    import docker.errors

    from vllm_hotfix.engine.mapping import translating
    from vllm_hotfix.errors import PushError

    _docker_config(tmp_path, monkeypatch, {"credsStore": "gone"})
    raised = docker.errors.DockerException(
        "Credentials store error: StoreError('docker-credential-gone not installed or not available in PATH')")
    with pytest.raises(PushError) as caught, translating(operation, refused=lambda m: PushError(m)):
        raise raised
    assert "docker-credential-gone" in str(caught.value) and caught.value.exit_code == 8


def test_failing_credential_helper_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import docker.errors

    from vllm_hotfix.engine.mapping import translate
    from vllm_hotfix.errors import PushError

    path = _docker_config(tmp_path, monkeypatch, {"credsStore": "broken"})
    mapped = translate("push of r.internal/x:1",
                       docker.errors.DockerException("Credentials store error: StoreError('exit status 1')"))
    assert isinstance(mapped, PushError) and "credential helper" in str(mapped) and str(path) in str(mapped)


# -- a full disk: the scratch folder (TMPDIR), the cache, reports ---------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs (mounting needs root; skipped where it is not allowed)."""
    where = tmp_path / "small"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip("cannot mount a tmpfs here: " + done.stderr.decode(errors="replace").strip())
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _fill(disk: Path, leave: int) -> None:
    """Fill ``disk`` until about ``leave`` bytes are free."""
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    (disk / "filler").write_bytes(b"\0" * max(0, free - leave))


def _scratch_under(disk: Path) -> list[Path]:
    return [p for p in disk.iterdir() if p.name.startswith("vllm-hotfix-scratch")]


def test_scratch_tree_on_a_full_tmpdir(small_disk: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    from vllm_hotfix.building import sources
    from vllm_hotfix.errors import StorageError

    monkeypatch.setattr(tempfile, "tempdir", str(small_disk))
    with pytest.raises(StorageError) as caught, sources.scratch_tree({"vllm/m.py": b"x" * 1_000_000}):
        pass
    assert "scratch folder" in str(caught.value) and "disk is full" in str(caught.value)
    assert caught.value.exit_code == 10
    assert not _scratch_under(small_disk)


def test_patching_on_a_full_tmpdir_is_not_blamed_on_the_patch(small_disk: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The files fit in the scratch folder, patch's own copy of them does not: a full disk, not a conflict."""
    import tempfile

    from vllm_hotfix.building import base, patches
    from vllm_hotfix.errors import PatchError, StorageError

    old = "".join(f"line {i}\n" for i in range(1, 21)) + "# pad\n" * 12_000  # ~72 KiB
    a, b = tmp_path / "a" / "vllm", tmp_path / "b" / "vllm"
    a.mkdir(parents=True)
    b.mkdir(parents=True)
    (a / "m.py").write_text(old)
    (b / "m.py").write_text(old.replace("line 10\n", "line ten\n"))
    diff = subprocess.run(["diff", "-u", "a/vllm/m.py", "b/vllm/m.py"], cwd=tmp_path, capture_output=True, text=True)
    (tmp_path / "0001-m.patch").write_text(diff.stdout)
    patch = patches.load_patch(tmp_path / "0001-m.patch", "vllm")
    monkeypatch.setattr(tempfile, "tempdir", str(small_disk))
    monkeypatch.setenv("TMPDIR", str(small_disk))
    _fill(small_disk, 100_000)
    with pytest.raises(StorageError) as caught:
        base.apply_in_scratch([patch], {"vllm/m.py": old.encode()})
    assert not isinstance(caught.value, PatchError)
    assert "0001-m.patch: cannot patch: a disk is full" in str(caught.value), caught.value
    assert "patch writes in the scratch folder" in str(caught.value)  # TMPDIR holds it: named once
    assert "disk is full" in str(caught.value) and "does not apply" not in str(caught.value)
    assert not _scratch_under(small_disk)


@pytest.mark.parametrize("what", ["index", "blob"])
def test_cache_on_a_full_disk(small_disk: Path, what: str, monkeypatch: pytest.MonkeyPatch,
                              tmp_path: Path) -> None:
    from vllm_hotfix.errors import StorageError
    from vllm_hotfix.journal import cache

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    store = cache.Store.open(small_disk, "sha256:" + "ab" * 32)
    assert store is not None
    _fill(small_disk, 4_000)
    with pytest.raises(StorageError) as caught:
        if what == "index":
            store.write("facts", {"files": {"x": "y" * 50_000}})
        else:
            store.put(b"y" * 50_000)
    assert "disk is full" in str(caught.value) and str(small_disk) in str(caught.value)
    assert caught.value.exit_code == 10
    assert not [p for p in small_disk.rglob("*") if p.is_file() and p.name != "filler"]


@pytest.mark.parametrize("kind", ["json", "junit"])
def test_report_on_a_full_disk(small_disk: Path, kind: str) -> None:
    """--report / --junit on a full disk: one line naming the file, exit 10, no half-written report."""
    from vllm_hotfix.checking import smoke
    from vllm_hotfix.errors import StorageError
    from vllm_hotfix.verdicts import Check, Status, Verdict

    verdict = Verdict(image="x:1", image_id="sha256:" + "a" * 64, status=Status.FAIL, gpu_verified=False,
                      checks=(Check("c", Status.FAIL, "d" * 40_000, 0.1),))
    _fill(small_disk, 2_000)
    path = small_disk / f"report.{kind}"
    write = smoke.write_json if kind == "json" else smoke.write_junit
    with pytest.raises(StorageError) as caught:
        write(verdict, path)
    assert "disk is full" in str(caught.value) and str(path) in str(caught.value)
    assert caught.value.exit_code == 10
    assert not path.exists() and [p.name for p in small_disk.iterdir()] == ["filler"]


# -- reports written to what is not a regular file: in place or refused, never renamed over ----------


@pytest.fixture
def null_copy(tmp_path: Path) -> Path:
    """A copy of /dev/null made by mknod in a temporary folder (needs the right to make device nodes)."""
    node = tmp_path / "null"
    try:
        os.mknod(node, 0o644 | stat.S_IFCHR, os.makedev(1, 3))
    except PermissionError as exc:
        pytest.skip(f"cannot make a device node here: {exc}")
    return node


@pytest.mark.parametrize("kind", ["json", "junit", "attestation"])
def test_report_to_a_device_writes_through_it(null_copy: Path, kind: str) -> None:
    """--report / --junit / --attestation /dev/null: the node stays a device (it was replaced by a regular file)."""
    from vllm_hotfix.checking import smoke
    from vllm_hotfix.errors import AttestationError
    from vllm_hotfix.journal.atomic import write_atomic
    from vllm_hotfix.verdicts import Check, Status, Verdict

    verdict = Verdict(image="x:1", image_id="sha256:" + "a" * 64, status=Status.PASS, gpu_verified=False,
                      checks=(Check("c", Status.PASS, "d" * 4_000, 0.1),))
    before = null_copy.stat()
    if kind == "attestation":
        write_atomic(null_copy, b"{}" * 5_000, error=AttestationError)
    else:
        (smoke.write_json if kind == "json" else smoke.write_junit)(verdict, null_copy)
    after = null_copy.stat()
    assert stat.S_ISCHR(after.st_mode) and after.st_rdev == before.st_rdev and after.st_ino == before.st_ino
    assert [p.name for p in null_copy.parent.iterdir()] == ["null"]


def test_report_to_a_full_device_is_one_line(tmp_path: Path) -> None:
    """/dev/full (a copy): the device says no space; one line naming it, the node left as it was."""
    node = tmp_path / "full"
    try:
        os.mknod(node, 0o644 | stat.S_IFCHR, os.makedev(1, 7))
    except PermissionError as exc:
        pytest.skip(f"cannot make a device node here: {exc}")
    with pytest.raises(StorageError) as caught:
        write_atomic(node, "x" * 100)
    assert str(node) in str(caught.value) and "no space" in str(caught.value)
    assert stat.S_ISCHR(node.stat().st_mode) and [p.name for p in tmp_path.iterdir()] == ["full"]


def test_report_to_a_fifo_goes_to_its_reader(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    # The reader must have the FIFO open before the write, or the write (rightly) finds nobody reading.
    deadline = time.monotonic() + 10
    while True:
        try:
            write_atomic(fifo, "through the pipe\n")
            break
        except StorageError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    reader.join(10)
    assert got == [b"through the pipe\n"] and stat.S_ISFIFO(fifo.stat().st_mode)


def test_report_to_a_fifo_nobody_reads_fails_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    started = time.monotonic()
    with pytest.raises(StorageError) as caught:
        write_atomic(fifo, "x")
    assert time.monotonic() - started < 5
    assert str(fifo) in str(caught.value) and "no process is reading" in str(caught.value)
    assert stat.S_ISFIFO(fifo.stat().st_mode) and [p.name for p in tmp_path.iterdir()] == ["pipe"]


def test_report_to_a_socket_is_refused(tmp_path: Path) -> None:
    import socket

    path = tmp_path / "sock"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
        with pytest.raises(StorageError) as caught:
            write_atomic(path, "x")
    assert "is a socket" in str(caught.value) and stat.S_ISSOCK(path.stat().st_mode)


# -- a push's local target tag: noted, put back, removed by the next run ---------


class TagEngine:
    """Just what a push's tag handling asks of an engine: tags, a push that may fail, the registry's digest."""

    def __init__(self, tags: dict[str, str], fail: BaseException | None = None) -> None:
        self.tags = dict(tags)
        self.fail = fail
        self.pushed: list[str] = []

    def image(self, ref: str) -> object:
        from types import SimpleNamespace

        found = self.tags.get(ref, ref if ref.startswith("sha256:") else None)
        return SimpleNamespace(id=found) if found else None

    def tag(self, image_id: str, ref: str) -> None:
        self.tags[ref] = image_id

    def untag(self, ref: str) -> None:
        self.tags.pop(ref, None)

    def push(self, ref: str, _progress: object = None) -> str:
        if self.fail is not None:
            raise self.fail
        self.pushed.append(self.tags[ref])
        return "sha256:" + "d" * 64

    def registry_digest(self, _ref: str) -> str:
        return "sha256:" + "d" * 64


NEW_ID, OLD_ID = "sha256:" + "1" * 64, "sha256:" + "2" * 64
TARGET = "registry.internal:5000/ops/vllm-openai:v1"


def _one(engine: TagEngine, root: Path) -> str:
    from types import SimpleNamespace

    from vllm_hotfix.release import push

    return push._push_one(engine, root, SimpleNamespace(id=NEW_ID), TARGET, 1, lambda _l: None)  # type: ignore[arg-type]


def _notes(root: Path) -> list[dict[str, object]]:
    return [json.loads(p.read_text()) for p in (root / "build" / "runs").glob("*.json")]


def test_push_removes_its_target_tag_and_leaves_no_note(tmp_path: Path) -> None:
    engine = TagEngine({})
    _one(engine, tmp_path)
    assert TARGET not in engine.tags and engine.pushed == [NEW_ID] and _notes(tmp_path) == []


def test_stale_target_tag_is_not_taken_as_the_image(tmp_path: Path) -> None:
    """A target tag left on another image: the push pushes the right image, then puts the old tag back."""
    engine = TagEngine({TARGET: OLD_ID})
    _one(engine, tmp_path)
    assert engine.pushed == [NEW_ID] and engine.tags[TARGET] == OLD_ID and _notes(tmp_path) == []


@pytest.mark.parametrize("fault", ["engine", "tool"])
def test_killed_push_leaves_a_note_the_next_run_follows(tmp_path: Path, fault: str) -> None:
    """The engine lost mid-push (or the tool killed, its note never settled): the next run removes the tag."""
    from vllm_hotfix.errors import EngineLost
    from vllm_hotfix.journal import leftovers

    class Killed(BaseException):
        pass

    # A lost engine fails the push and the untag after it; a killed tool runs neither to the end.
    stop: BaseException = EngineLost("the Docker engine stopped answering") if fault == "engine" else Killed()
    engine = TagEngine({}, fail=stop)

    def cannot_untag(_ref: str) -> None:
        raise stop

    engine.untag = cannot_untag  # type: ignore[method-assign]
    with pytest.raises((EngineLost, Killed)):
        _one(engine, tmp_path)
    engine.untag = TagEngine.untag.__get__(engine)  # type: ignore[method-assign]
    assert engine.tags[TARGET] == NEW_ID  # the tag outlived the run...
    notes = _notes(tmp_path)
    assert notes and notes[0]["tags"] == [[TARGET, NEW_ID]]  # ...and its note says so
    gone = subprocess.Popen(["true"])
    gone.wait()
    note = next((tmp_path / "build" / "runs").glob("*.json"))
    data = json.loads(note.read_text())
    data["owner"] = f"{data['owner'].rpartition(':')[0]}:{gone.pid}"  # as if its process were dead
    note.write_text(json.dumps(data))
    said: list[str] = []
    leftovers.sweep(engine, tmp_path, said.append)  # type: ignore[arg-type]
    assert TARGET not in engine.tags and not note.exists()
    assert said and "1 push tag(s)" in said[0]


def test_sweep_leaves_a_noted_tag_moved_since(tmp_path: Path) -> None:
    """A noted target tag that names another image now (someone moved it) is not the dead run's to remove."""
    from vllm_hotfix.journal import leftovers

    gone = subprocess.Popen(["true"])
    gone.wait()
    import socket

    runs = tmp_path / "build" / "runs"
    runs.mkdir(parents=True)
    (runs / "x.json").write_text(json.dumps({"owner": f"{socket.gethostname()}:{gone.pid}", "images": [],
                                             "containers": 0, "tags": [[TARGET, NEW_ID]]}))
    engine = TagEngine({TARGET: OLD_ID})
    leftovers.sweep(engine, tmp_path)  # type: ignore[arg-type]
    assert engine.tags[TARGET] == OLD_ID and not (runs / "x.json").exists()


class OwnerEngine:
    """Just what the sweep of dead runs' containers asks of an engine: containers by owner (each listing the
    next of ``listings``, the last one again once they run out), their removal."""

    def __init__(self, listings: list[dict[str, list[str]]]) -> None:
        self.listings = listings
        self.asked = 0
        self.removed: list[str] = []

    def containers_by_owner(self) -> dict[str, list[str]]:
        self.asked += 1
        return self.listings[min(self.asked, len(self.listings)) - 1]

    def remove_container(self, cid: str) -> None:
        self.removed.append(cid)


def _dead_note(tmp_path: Path, containers: int) -> str:
    import socket

    gone = subprocess.Popen(["true"])
    gone.wait()
    owner = f"{socket.gethostname()}:{gone.pid}"
    runs = tmp_path / "build" / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    (runs / "x.json").write_text(json.dumps({"owner": owner, "images": [], "containers": containers, "tags": []}))
    return owner


def test_a_container_still_in_the_making_is_waited_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dead run counted a container the engine had not made yet when the next run looked (its create was in
    flight when the engine froze): the sweep looks again and removes it once it is there, each container once
    (one the engine is still removing stays listed); one that never comes costs IN_THE_MAKING seconds."""
    from vllm_hotfix.journal import leftovers

    monkeypatch.setattr(leftovers, "LOOK_AGAIN", 0.01)
    owner = _dead_note(tmp_path, 2)
    engine = OwnerEngine([{}, {owner: ["c1"]}, {owner: ["c1"]}, {owner: ["c1", "c2"]}])
    assert leftovers.sweep(engine, tmp_path) == (2, 0)  # type: ignore[arg-type]
    assert engine.removed == ["c1", "c2"] and engine.asked == 4
    assert not list((tmp_path / "build" / "runs").glob("*.json"))
    monkeypatch.setattr(leftovers, "IN_THE_MAKING", 0.2)
    owner = _dead_note(tmp_path, 1)
    engine = OwnerEngine([{}])
    start = time.monotonic()
    assert leftovers.sweep(engine, tmp_path) == (0, 0)  # type: ignore[arg-type]
    assert 0.2 <= time.monotonic() - start < 2 and engine.asked >= 2
    assert not list((tmp_path / "build" / "runs").glob("*.json"))


def test_output_closed_under_the_tool_is_its_own_exit(project: Path) -> None:
    """`list | head` with the reader gone before the tool writes: exit 141 and one line (it was 1, silently)."""
    for n in range(40):  # enough lines that the output does not fit in what the pipe takes at once
        records.append(project, "build", {"image_id": "sha256:" + f"{n:064x}", "output_ref": f"r/x:v{n}",
                                          "inputs": {"definition": "v0.25.1"}})
    proc = subprocess.Popen([sys.executable, str(REPO / "build.py"), "--root", str(project), "list", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader goes away at once, as `head` does after its lines
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 141, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert [ln for ln in err.splitlines() if ln.startswith("error: ")] == [
        "error: output closed (what read it went away); the run stopped and cleaned up"], err


def test_an_interrupt_after_a_tag_was_journalled_says_what_stands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C right after `image --in-registry` wrote and journalled its tag: the run still says it was
    interrupted (130), and names the build and tag that stand, which the next run reuses."""
    import click

    from vllm_hotfix import cli as climod

    def interrupted(**_kw: object) -> None:
        records.append(tmp_path, "build", {"image_id": "sha256:" + "ab" * 32, "output_ref": "reg:5000/ops/v:t"})
        records.append(tmp_path, "tag", {"ref": "reg:5000/ops/v:t", "digest": "sha256:" + "cd" * 32})
        raise click.exceptions.Abort() from KeyboardInterrupt()

    monkeypatch.setattr(records, "WRITTEN", [])
    monkeypatch.setattr(climod.main, "main", interrupted)
    assert climod._run(["image"], "build.py") == 130
    err = capsys.readouterr().err
    assert "error: interrupted" in err
    assert "hint: finished and journalled before the interrupt, and standing: build reg:5000/ops/v:t" in err
    assert "tag reg:5000/ops/v:t sha256:" + "cd" * 32 in err
    # Nothing journalled: the plain line alone.
    monkeypatch.setattr(records, "WRITTEN", [])
    monkeypatch.setattr(climod.main, "main", lambda **_kw: (_ for _ in ()).throw(KeyboardInterrupt()))
    assert climod._run(["image"], "build.py") == 130
    assert "hint: finished" not in capsys.readouterr().err
