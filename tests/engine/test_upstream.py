"""`check-upstream`, `image --skip-included` and the whole-set-included exit.

Against real stand-ins of 0.25.1, 0.26.0 and 0.27.0 (the real wheels' files)
and against the wheels themselves: both modes must give the same answers.
The fact under test: PR #49149 is NOT in 0.26.0 (an article says it is) and
IS in 0.27.0.
"""

from __future__ import annotations

import json
import subprocess
import zipfile
from pathlib import Path

import pytest

from conftest import REPO, Result, cli, fails
from vllm_hotfix.building import wheels
from vllm_hotfix.engine import Engine
from vllm_hotfix.journal import records

PATCH = "0001-minimax-m3-topk-buffer-layout.patch"
INDEXER = "vllm/models/minimax_m3/common/indexer.py"
SPARSE = "vllm/models/minimax_m3/common/sparse_attention.py"
# Tests may run with --root elsewhere; the wheels stay in the repository's cache.
CACHE = {"VLLM_HOTFIX_CACHE": str(REPO / "build" / "cache")}


def _verdicts(r: Result) -> dict[str, str]:
    assert r.rc == 0, r.err
    return {p["name"]: p["verdict"] for p in json.loads(r.out)["patches"]}


@pytest.mark.parametrize(
    "tag, fixture, expected",
    [
        ("v0.25.1", "base_v0251", "needed"),
        ("v0.26.0", "base_v0260", "needed"),
        ("v0.27.0", "base_v0270", "included"),
    ],
)
def test_check_upstream_image_and_wheel_agree(
    request: pytest.FixtureRequest, engine: Engine, project: Path, tag: str, fixture: str, expected: str
) -> None:
    request.getfixturevalue(fixture)
    base = ("check-upstream", "--patches", "v0.25.1", "--base", tag)
    from_image = cli(*base, "--pull", "never", "--json", root=project, env=CACHE)
    from_wheel = cli(*base, "--from-wheel", "--json", root=project, env=CACHE)
    assert _verdicts(from_image) == _verdicts(from_wheel) == {PATCH: expected}
    assert json.loads(from_image.out)["package_version"] == tag[1:]
    # The plain form: one line per patch, the word as the contract spells it.
    plain = cli(*base, "--from-wheel", root=project, env=CACHE)
    assert plain.rc == 0, plain.err
    assert plain.out.splitlines() == [line for line in plain.out.splitlines() if line.startswith(PATCH)]
    assert plain.out.startswith(f"{PATCH}: {expected} (")
    if expected == "included":
        assert "needs no hotfix" in plain.err


def test_the_gnu_patch_trap_would_have_said_included_for_0260(tmp_path: Path) -> None:
    """Why classify() matters: `patch -R --dry-run --batch` calls 0.26.0 patched."""
    whl = wheels.release(REPO, "0.26.0", lambda _l: None)
    with zipfile.ZipFile(whl) as zf:
        for rel in (INDEXER, SPARSE):
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / rel).write_bytes(zf.read(rel))
    trap = subprocess.run(
        [
            "patch",
            "-p1",
            "-R",
            "--dry-run",
            "--batch",
            "-d",
            str(tmp_path),
            "-i",
            str(REPO / "patches/v0.25.1" / PATCH),
        ],
        capture_output=True,
        text=True,
    )
    assert trap.returncode == 0  # the trap: exit 0 on files that lack the fix
    assert b"buf_htk" not in (tmp_path / INDEXER).read_bytes()  # 0.26.0 really lacks it


def _break_hunk_2(project: Path) -> None:
    path = project / "patches/v0.25.1" / PATCH
    text = path.read_text()
    old = "             )\n         if index_md.num_prefills > 0:"
    assert old in text
    path.write_text(text.replace(old, "             ))\n         if index_md.num_prefill_tokens > 0:", 1))


@pytest.mark.parametrize("tag, fixture", [("v0.25.1", "base_v0251"), ("v0.27.0", "base_v0270")])
def test_check_upstream_conflicts(
    request: pytest.FixtureRequest, engine: Engine, project: Path, tag: str, fixture: str
) -> None:
    request.getfixturevalue(fixture)
    _break_hunk_2(project)
    outs = []
    for mode in (("--pull", "never"), ("--from-wheel",)):
        r = cli("check-upstream", "--patches", "v0.25.1", "--base", tag, *mode, root=project, env=CACHE)
        assert r.rc == 0, r.err  # every patch got an answer
        assert r.out.startswith(
            f"{PATCH}: conflicts (hunk #2 (@@ -441,7 +444,7 @@) of {INDEXER} does not apply"
        )
        outs.append(r.out)
    if tag == "v0.27.0":  # the other hunks are the release's own lines: say so
        assert "other hunks are already present" in outs[0]


def _split_set(project: Path) -> tuple[str, str]:
    """Replace patch set v0.25.1 by two patches, one per file."""
    folder = project / "patches/v0.25.1"
    text = (folder / PATCH).read_text()
    cut = text.index(f"--- a/{SPARSE}")
    first = text[:cut]
    second = "Sparse-attention half of the MiniMax-M3 top-k layout fix\n\n" + text[cut:]
    names = ("0001-topk-indexer.patch", "0002-topk-sparse-attention.patch")
    (folder / PATCH).unlink()
    (folder / names[0]).write_text(first)
    (folder / names[1]).write_text(second)
    (folder / "series").write_text("\n".join(names) + "\n")
    return names


def test_check_upstream_two_patch_set_per_release(project: Path) -> None:
    names = _split_set(project)
    for tag, expected in (("v0.25.1", "needed"), ("v0.26.0", "needed"), ("v0.27.0", "included")):
        r = cli(
            "check-upstream",
            "--patches",
            "v0.25.1",
            "--base",
            tag,
            "--from-wheel",
            "--json",
            root=project,
            env=CACHE,
        )
        assert _verdicts(r) == {names[0]: expected, names[1]: expected}, tag


def test_check_upstream_missing_image(engine: Engine, project: Path, unique: str) -> None:
    r = cli(
        "check-upstream",
        "--patches",
        "v0.25.1",
        "--base",
        "v0.27.0",
        "--base-repo",
        f"hotfix-test/absent-{unique}",
        "--pull",
        "never",
        root=project,
    )
    fails(r, f"hotfix-test/absent-{unique}:v0.27.0", "--pull never")


def test_skip_included(engine: Engine, base_v0251: str, project: Path, tmp_path: Path, unique: str) -> None:
    # A 0.25.1 base that carries only the first patch: built with a set of it alone.
    only_first = tmp_path / "first"
    (only_first / "images").mkdir(parents=True)
    (only_first / "images/v0.25.1.toml").write_bytes((project / "images/v0.25.1.toml").read_bytes())
    names = _split_set(project)
    (only_first / "patches/v0.25.1").mkdir(parents=True)
    (only_first / "patches/v0.25.1" / names[0]).write_bytes(
        (project / "patches/v0.25.1" / names[0]).read_bytes()
    )
    (only_first / "patches/v0.25.1/series").write_text(names[0] + "\n")
    carrying = f"hotfix-test/carries-first-{unique}"
    r = cli(
        "image",
        "--definition",
        "v0.25.1",
        "--tag",
        f"{carrying}:v0.25.1",
        "--pull",
        "never",
        "--no-smoke",
        root=only_first,
    )
    assert r.rc == 0, r.err
    out = f"hotfix-test/skip:{unique}"
    try:
        r = cli(
            "image",
            "--definition",
            "v0.25.1",
            "--base-repo",
            carrying,
            "--tag",
            out,
            "--pull",
            "never",
            "--no-smoke",
            root=project,
        )
        fails(r, names[0], "already present in the base")
        assert names[1] not in r.last_error and "does not apply" not in r.last_error
        assert "--skip-included" in r.err  # the hint says how to go on
        assert engine.image(out) is None

        r = cli(
            "image",
            "--definition",
            "v0.25.1",
            "--base-repo",
            carrying,
            "--tag",
            out,
            "--pull",
            "never",
            "--no-smoke",
            "--skip-included",
            root=project,
        )
        assert r.rc == 0, r.err
        assert f"skipping {names[0]}" in r.err
        info = engine.image(out)
        assert info is not None
        assert list(json.loads(info.labels["io.vllm-hotfix.patches"])) == [names[1]]
        # (A per-patch label of names[0] may be inherited: this base was built with it.)
        assert f"io.vllm-hotfix.patch.{names[1]}" in info.labels
        assert list(json.loads(info.labels["io.vllm-hotfix.files"])) == [SPARSE]  # only what changed
        record = records.builds(project)[0].data
        assert list(record["patches_applied"]) == [names[1]]
        assert record["patches_included_upstream"] == [names[0]]
    finally:
        engine.remove_image(out)
        engine.remove_image(f"{carrying}:v0.25.1")


@pytest.mark.parametrize("flags", [(), ("--skip-included",)])
def test_base_carrying_the_whole_set_needs_no_hotfix(
    engine: Engine, base_v0251: str, project: Path, unique: str, flags: tuple[str, ...]
) -> None:
    carrying = f"hotfix-test/carries-all-{unique}"
    r = cli(
        "image",
        "--definition",
        "v0.25.1",
        "--tag",
        f"{carrying}:v0.25.1",
        "--pull",
        "never",
        "--no-smoke",
        root=project,
    )
    assert r.rc == 0, r.err
    out = f"hotfix-test/none:{unique}"
    try:
        records_before = len(list((project / "build/records").glob("*/*.json")))
        r = cli(
            "image",
            "--definition",
            "v0.25.1",
            "--base-repo",
            carrying,
            "--tag",
            out,
            "--pull",
            "never",
            "--no-smoke",
            *flags,
            root=project,
        )
        assert r.rc == 0, r.err
        assert "needs no hotfix" in r.out and PATCH in r.out
        assert "error" not in r.err
        assert engine.image(out) is None
        assert len(list((project / "build/records").glob("*/*.json"))) == records_before
    finally:
        engine.remove_image(f"{carrying}:v0.25.1")
