"""The tool's tar archives: the same entries give the same bytes, on every run and every Python.

The digests below are of the archives the tool wrote before it used
``tarfile`` (its own ustar and pax writer): an assembled image's ID is the
hash of a config naming its layer's digest, so a change in these bytes
changes every assembled image's ID. A Python whose ``tarfile`` writes other
bytes fails here.
"""

from __future__ import annotations

import hashlib
import io
import random
import tarfile

from vllm_hotfix import tarball

E = tarball.Entry

# A layer's kinds of member: folders with their own owners and times, long, 100-byte and non-ASCII names,
# set-user-ID and read-only modes, empty and binary files, and a time past 2038.
FIXED = [
    E("usr", None, 0o755), E("usr/local", None, 0o755, 0, 50, 1_600_000_000),
    E("usr/local/lib/python3.12/dist-packages/vllm/model_executor/layers/fused_moe/configs/" + "n" * 40 + ".json",
      b'{"a": 1}\n', 0o644, 0, 0, 1_700_000_000),
    E("usr/local/lib/python3.12/dist-packages/vllm/__init__.py", b"__version__ = '0.25.1'\n", 0o644),
    E("usr/local/lib/python3.12/dist-packages/vllm/__pycache__/__init__.cpython-312.pyc", bytes(range(256)) * 3,
      0o644, 0, 0, 1_700_000_001),
    E("usr/local/bin/tool", b"#!/bin/sh\nexit 0\n", 0o4755, 1000, 1000, 1),
    E("opt/ünï/çødé.py", b"x = 1\n", 0o600, 65534, 65534, 2**32),
    E("opt/empty", b"", 0o444),
    E("d" * 99, None, 0o700, 1000, 1000, 1_700_000_000),
    E("x" * 100, b"", 0o644), E("y" * 101, b"abc", 0o600),
]
FIXED_SHA256 = "50b82fb09f79fa4a35b98b9f22ef099d4acf828118bda4e672db03bfcbf8621c"
SEEDS_SHA256 = "ae3eab9e330c2c190aa1d7a5d992f1122e0dcbcdc86f35be6cb68041fe9991d5"
TAR_BYTES_SHA256 = "003fcf33b274d86e5ada34568eb01695db2ec4f43764fb8784c6ac4206006aa4"


def _entries(seed: int) -> list[tarball.Entry]:
    """Random members of every kind the tool writes, after four at the edges of the ustar name field."""
    rng = random.Random(seed)
    out = [E("x" * 100, b"", 0o644), E("y" * 101, b"abc", 0o600), E("d" * 99, None, 0o700, 1000, 1000, 1_700_000_000),
           E("ünï/çødé.py", b"data", 0o644)]
    for _ in range(rng.randint(1, 8)):
        name = "/".join("".join(rng.choice("abcü_.-") for _ in range(rng.randint(1, 60)))
                        for _ in range(rng.randint(1, 5)))
        data = None if rng.random() < 0.3 else bytes(rng.randrange(256) for _ in range(rng.randint(0, 1500)))
        out.append(E(name, data, rng.choice([0o755, 0o644, 0o600, 0o4755]), rng.randint(0, 70000),
                     rng.randint(0, 70000), rng.randint(0, 2**33 - 1)))
    return out


def test_a_fixed_tree_gives_a_fixed_archive() -> None:
    data = tarball.write(FIXED)
    assert hashlib.sha256(data).hexdigest() == FIXED_SHA256
    assert len(data) % (20 * 512) == 0  # padded to whole records, as tar writes them
    # The order given does not matter: parents before children, sorted by path.
    assert tarball.write(reversed(FIXED)) == data


def test_random_trees_give_the_archives_they_always_gave() -> None:
    digest = hashlib.sha256()
    for seed in range(40):
        digest.update(tarball.write(_entries(seed)))
    assert digest.hexdigest() == SEEDS_SHA256


def test_files_with_their_folders() -> None:
    data = tarball.tar_bytes({"a/b/c.txt": b"c", "a/d.bin": b"\0" * 600, "e": b"e"}, {"e": 0o755})
    assert hashlib.sha256(data).hexdigest() == TAR_BYTES_SHA256


def test_what_is_written_reads_back_with_nothing_of_the_host() -> None:
    for entries in (FIXED, *(_entries(seed) for seed in range(5))):
        with tarfile.open(fileobj=io.BytesIO(tarball.write(entries))) as tar:
            members = tar.getmembers()
            back = {m.name: (m.isdir(), m.mode, m.uid, m.gid, m.mtime, m.uname, m.gname,
                             tar.extractfile(m).read() if m.isfile() else None)  # type: ignore[union-attr]
                    for m in members}
        assert back == {e.name: (e.data is None, e.mode, e.uid, e.gid, e.mtime, "", "", e.data) for e in entries}
