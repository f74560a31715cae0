"""Integration tier: `build.py image` and `render` against a real engine.

Every bad input must give a non-zero exit, one `error:` line naming what is at
fault, and leave no tagged output, container, scratch folder or reject file.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest

from conftest import REPO, STANDIN_REPO, cli, derive, fails, make_standin
from vllm_hotfix.engine import Engine

PATCH = "0001-minimax-m3-topk-buffer-layout.patch"
INDEXER = "vllm/models/minimax_m3/common/indexer.py"
SITE = "/usr/local/lib/python3.12/dist-packages"


def _no_output(engine: Engine, ref: str) -> None:
    assert engine.image(ref) is None, f"{ref} was tagged despite the failure"


def test_image_builds_patched_files_where_python_imports_them(
    engine: Engine, base_v0251: str, project: Path, unique: str
) -> None:
    out = f"hotfix-test/ok:{unique}"
    r = cli("image", "--definition", "v0.25.1", "--tag", out, "--pull", "never", "--no-smoke", root=project)
    assert r.rc == 0, r.err
    last = r.out.strip().splitlines()[-1]
    assert last.startswith(f"built {out} sha256:")
    image_id = last.split()[-1]
    try:
        info = engine.image(out)
        assert info is not None and info.id == image_id
        base = engine.image(base_v0251)
        assert base is not None
        # The base's runtime contract is kept.
        assert (info.entrypoint, info.cmd, info.env, info.user) == (base.entrypoint, base.cmd, base.env, base.user)
        labels = info.labels
        assert labels["org.opencontainers.image.base.name"] == f"{STANDIN_REPO}:v0.25.1"
        assert labels["io.vllm-hotfix.base.id"] == base.id
        patch_sha = hashlib.sha256((REPO / "patches/v0.25.1" / PATCH).read_bytes()).hexdigest()
        assert json.loads(labels["io.vllm-hotfix.patches"]) == {PATCH: patch_sha}
        # What the image's Python imports is the patched text, and its bytecode is fresh.
        check = engine.run(
            image_id,
            ["python3", "-c", (
                "import importlib.util as u, hashlib, json, os\n"
                "spec = u.find_spec('vllm')\n"
                "p = os.path.join(os.path.dirname(list(spec.submodule_search_locations)[0]), "
                f"'{INDEXER}')\n"
                "pyc = u.cache_from_source(p)\n"
                "data = open(p, 'rb').read()\n"
                "hdr = open(pyc, 'rb').read(16)\n"
                "print(json.dumps({'path': p, 'sha': hashlib.sha256(data).hexdigest(),"
                " 'htk': data.count(b'buf_htk'), 'flags': int.from_bytes(hdr[4:8], 'little'),"
                " 'hash': hdr[8:16].hex(), 'src_hash': u.source_hash(data).hex()}))\n"
            )],
        )
        assert check.exit_code == 0, check.stderr
        seen = json.loads(check.stdout)
        assert seen["path"] == f"{SITE}/{INDEXER}"
        assert seen["sha"] == json.loads(labels["io.vllm-hotfix.files"])[INDEXER]
        assert seen["htk"] == 4
        assert seen["flags"] == 3 and seen["hash"] == seen["src_hash"]  # checked-hash pyc of this source
        # The patched file equals upstream's fixed lines: 0.27.0 has the same hunks.
        assert "buf_htk = (" in (REPO / "patches/v0.25.1" / PATCH).read_text()
    finally:
        engine.remove_image(out)


def test_render_prints_dockerfile_and_builds_nothing(engine: Engine, base_v0251: str, project: Path) -> None:
    before = {i for i in _image_ids()}
    r1 = cli("render", "--definition", "v0.25.1", "--pull", "never", root=project)
    r2 = cli("render", "--definition", "v0.25.1", "--pull", "never", root=project)
    assert r1.rc == 0, r1.err
    assert r1.out == r2.out  # deterministic
    assert r1.out.count("\nCOPY ") == 1  # one layer for every patched file and its bytecode
    assert f"FROM {base_v0251}" in r1.out
    assert f"{SITE}/vllm/models/minimax_m3/common/" in r1.out
    instructions = {ln.split()[0] for ln in r1.out.splitlines() if ln and not ln.startswith(("#", " "))}
    assert instructions == {"FROM", "COPY", "LABEL"}
    assert {i for i in _image_ids()} == before


def _image_ids() -> list[str]:
    from conftest import docker_cli

    return docker_cli("images", "-aq", "--no-trunc").split()


def _edit_patch(project: Path, old: str, new: str) -> None:
    path = project / "patches/v0.25.1" / PATCH
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def test_hunk_that_does_not_apply(engine: Engine, base_v0251: str, project: Path, unique: str) -> None:
    _edit_patch(project, "             )\n         if index_md.num_prefills > 0:",
                "             ))\n         if index_md.num_prefill_tokens > 0:")
    out = f"hotfix-test/bad:{unique}"
    r = cli("image", "--definition", "v0.25.1", "--tag", out, "--pull", "never", "--no-smoke", root=project)
    fails(r, PATCH, "hunk #2 (@@ -441,7 +444,7 @@)", INDEXER, "does not apply")
    _no_output(engine, out)


def test_hunk_that_needs_fuzz(engine: Engine, base_v0251: str, project: Path, unique: str) -> None:
    _edit_patch(project, " # (decode at [:, :nd], prefill", " # (DECODE at [:, :nd], prefill")
    out = f"hotfix-test/bad:{unique}"
    r = cli("image", "--definition", "v0.25.1", "--tag", out, "--pull", "never", "--no-smoke", root=project)
    fails(r, PATCH, "hunk #1", INDEXER, "applies only with fuzz")
    _no_output(engine, out)


def test_patch_already_in_base(engine: Engine, base_v0251: str, project: Path, unique: str) -> None:
    # A v0.25.1 base that already carries the fix: our own patched image. It
    # carries the whole (one-patch) set, so it needs no hotfix: exit 0, nothing
    # built. A base carrying only part of a set: tests/test_upstream.py.
    carrying = f"hotfix-test/carrying-{unique}"
    r = cli("image", "--definition", "v0.25.1", "--tag", f"{carrying}:v0.25.1", "--pull", "never", "--no-smoke",
            root=project)
    assert r.rc == 0, r.err
    out = f"hotfix-test/bad:{unique}"
    try:
        r = cli("image", "--definition", "v0.25.1", "--base-repo", carrying, "--tag", out, "--pull", "never",
                "--no-smoke", root=project)
        assert r.rc == 0 and not r.last_error, r.err
        assert "needs no hotfix" in r.out and PATCH in r.out
        _no_output(engine, out)
    finally:
        engine.remove_image(f"{carrying}:v0.25.1")


def test_patch_for_a_file_the_image_lacks(engine: Engine, base_v0251: str, project: Path, unique: str) -> None:
    text = (project / "patches/v0.25.1" / PATCH).read_text().replace("common/indexer.py", "common/indexer_v2.py")
    (project / "patches/v0.25.1" / PATCH).write_text(text)
    out = f"hotfix-test/bad:{unique}"
    r = cli("image", "--definition", "v0.25.1", "--tag", out, "--pull", "never", "--no-smoke", root=project)
    fails(r, PATCH, "has no file", "indexer_v2.py")
    _no_output(engine, out)


@pytest.mark.parametrize(
    "body, word",
    [
        (f"RUN rm {SITE}/{INDEXER} && ln -s /etc/hostname {SITE}/{INDEXER}", "symlink"),
        (f"RUN rm {SITE}/{INDEXER} && mkdir {SITE}/{INDEXER}", "dir"),
        # A folder on the way that is a link also redirects a COPY.
        (f"RUN mv {SITE}/vllm/models/minimax_m3/common /opt/common && "
         f"ln -s /opt/common {SITE}/vllm/models/minimax_m3/common", "through a symlink"),
    ],
)
def test_target_that_is_not_a_regular_file(
    engine: Engine, base_v0251: str, project: Path, unique: str, body: str, word: str
) -> None:
    repo = f"hotfix-test/odd-{unique}"
    derive(engine, base_v0251, f"{repo}:v0.25.1", body)
    out = f"hotfix-test/bad:{unique}"
    try:
        before = Path("/etc/hostname").read_bytes()
        r = cli("image", "--definition", "v0.25.1", "--base-repo", repo, "--tag", out, "--pull", "never",
                "--no-smoke", root=project)
        fails(r, PATCH, word, "refusing to patch")
        assert Path("/etc/hostname").read_bytes() == before
        _no_output(engine, out)
    finally:
        engine.remove_image(f"{repo}:v0.25.1")


def test_base_missing_with_pull_never(engine: Engine, project: Path, unique: str) -> None:
    r = cli("image", "--definition", "v0.25.1", "--base-repo", f"hotfix-test/absent-{unique}", "--pull", "never",
            "--no-smoke", root=project)
    fails(r, f"hotfix-test/absent-{unique}:v0.25.1", "--pull never")


def test_unreachable_base_fails_fast(engine: Engine, project: Path, unique: str) -> None:
    start = time.monotonic()
    r = cli("image", "--definition", "v0.25.1", "--base-repo", f"registry.invalid/absent-{unique}", "--no-smoke",
            root=project, timeout=120)
    fails(r, f"registry.invalid/absent-{unique}:v0.25.1", "cannot pull")
    # Not a speed target: a hang would hit the 120 s subprocess timeout above.
    assert time.monotonic() - start < 120


def test_base_whose_vllm_differs_from_its_tag(engine: Engine, project: Path, unique: str) -> None:
    repo = f"hotfix-test/wrongver-{unique}"
    make_standin(engine, "0.25.1", f"{repo}:v0.25.1", sources="0.26.0")
    out = f"hotfix-test/bad:{unique}"
    try:
        r = cli("image", "--definition", "v0.25.1", "--base-repo", repo, "--tag", out, "--pull", "never",
                "--no-smoke", root=project)
        fails(r, f"{repo}:v0.25.1", "installed vllm is 0.26.0", "0.25.1")
        _no_output(engine, out)
    finally:
        engine.remove_image(f"{repo}:v0.25.1")
