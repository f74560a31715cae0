"""atomic.write_atomic: whole files or none, and a full disk as one line naming the file (no engine)."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_hotfix.errors import PipelineError, RecordError
from vllm_hotfix.journal import atomic
from vllm_hotfix.journal.atomic import write_atomic


def test_replaces_the_old_content_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "note.json"
    write_atomic(path, "first\n")
    write_atomic(path, b"second\n")
    assert path.read_bytes() == b"second\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["note.json"]


def test_exclusive_never_replaces(tmp_path: Path) -> None:
    path = tmp_path / "entry.json"
    write_atomic(path, "{}\n", exclusive=True, mode=0o600, error=RecordError)
    assert path.stat().st_mode & 0o777 == 0o600
    with pytest.raises(RecordError) as err:
        write_atomic(path, "other\n", exclusive=True, error=RecordError)
    assert str(path) in str(err.value) and path.read_text() == "{}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry.json"]


def test_a_full_disk_is_one_line_naming_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "facts.json"
    path.write_text("old\n")

    def full(fd: int, data: object) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(atomic.os, "write", full)
    with pytest.raises(PipelineError) as err:
        write_atomic(path, "new\n" * 1000)
    message = str(err.value)
    assert str(path) in message and "the disk is full" in message and "\n" not in message
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["facts.json"]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs (needs the right to mount; skipped without it)."""
    where = tmp_path / "small"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def test_a_really_full_disk_leaves_nothing_behind(small_disk: Path) -> None:
    (small_disk / "keep.json").write_text("kept\n")
    with pytest.raises(RecordError) as err:
        write_atomic(small_disk / "big.json", b"x" * (256 * 1024), exclusive=True, error=RecordError)
    assert f"cannot write {small_disk / 'big.json'}: the disk is full" in str(err.value)
    assert sorted(p.name for p in small_disk.iterdir()) == ["keep.json"]


def test_one_writer_makes_a_file_once_for_two_processes(tmp_path: Path) -> None:
    """Two processes wanting the same cached file: the second waits for the first, then finds it made."""
    import sys

    target, made = tmp_path / "rootfs.tar", tmp_path / "made.log"
    code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from vllm_hotfix.journal.atomic import one_writer\n"
        "target, made = Path(sys.argv[1]), Path(sys.argv[2])\n"
        "with one_writer(target):\n"
        "    if not target.exists():\n"
        "        time.sleep(0.5)\n"
        "        with open(made, 'a') as fh: fh.write('made\\n')\n"
        "        target.write_text('x')\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, str(target), str(made)]) for _ in range(2)]
    assert [p.wait(30) for p in procs] == [0, 0]
    assert made.read_text() == "made\n" and target.read_text() == "x"
