"""Integrity relative to the base: a hotfix answers for its own deviations only.

Real engine, real stand-in base, real pipeline: a base that already differs
from its RECORD (as upstream images do for certifi's cacert.pem) must not fail
every hotfix of it; a deviation the hotfix brings must; an inherited deviation
of a known-bad kind (two distributions claiming one path with different
content) must too.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from conftest import cli, derive
from vllm_hotfix.engine import Engine

SITE = "/usr/local/lib/python3.12/dist-packages"
UNTOUCHED = "vllm/envs.py"  # in RECORD, not touched by the patch set


def integrity(report_path: Path) -> dict[str, object]:
    report = json.loads(report_path.read_text())
    return next(c for c in report["checks"] if c["name"] == "integrity")


Build = Callable[[str, Path], tuple[str, Path]]


@pytest.fixture
def hotfix_of(engine: Engine, base_v0251: str, project: Path, unique: str) -> Iterator[Build]:
    """Build the patch set over a base made from the stand-in by ``body``; yield (ref, report path)."""
    made: list[str] = []

    def build(body: str, tmp: Path) -> tuple[str, Path]:
        repo = f"hotfix-test/devbase-{unique}-{len(made)}"
        made.append(f"{repo}:v0.25.1")
        derive(engine, base_v0251, f"{repo}:v0.25.1", body)
        out = f"hotfix-test/devfix-{unique}-{len(made)}:x"
        made.append(out)
        r = cli("image", "--definition", "v0.25.1", "--base-repo", repo, "--tag", out, "--pull", "never", "--no-smoke",
                root=project)
        assert r.rc == 0, r.err
        report = tmp / f"smoke-{len(made)}.json"
        return out, report

    yield build
    for ref in reversed(made):
        engine.remove_image(ref)


def test_base_deviation_is_the_bases(hotfix_of: Build, project: Path, tmp_path: Path, engine: Engine,
                                     unique: str) -> None:
    ref, report = hotfix_of(f"RUN echo '# local edit in the base' >> {SITE}/{UNTOUCHED}", tmp_path)
    r = cli("smoke", ref, "--report", str(report), root=project)
    assert r.rc == 0, r.err
    check = integrity(report)
    assert check["status"] == "pass"
    assert f"the base's, not the hotfix's: 1 file(s) differ from RECORD already in the base, e.g. vllm: {UNTOUCHED}" \
        in str(check["detail"])

    # The same deviation made by the image itself is not the builder's: refused before any check (exit 14).
    own = f"hotfix-test/devown-{unique}:x"
    image_id = engine.image(ref)
    assert image_id is not None
    derive(engine, image_id.id, own, f"RUN echo 'x = 1' >> {SITE}/vllm/logger.py")
    try:
        r = cli("smoke", own, "--report", str(tmp_path / "own.json"), root=project)
        assert r.rc == 14 and "not the product of definition v0.25.1" in r.last_error, r.err
        assert [c["name"] for c in json.loads((tmp_path / "own.json").read_text())["checks"]] == ["layer-identity"]
    finally:
        engine.remove_image(own)


def test_inherited_conflicting_claims_still_fail(hotfix_of: Build, project: Path, tmp_path: Path) -> None:
    # A second distribution (one vLLM requires) claiming a vLLM file with other content.
    record = f"{UNTOUCHED},sha256=AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA,1\\n"
    body = (f"RUN mkdir -p {SITE}/regex-2099.1.dist-info && cd {SITE}/regex-2099.1.dist-info && "
            "printf 'Metadata-Version: 2.1\\nName: regex\\nVersion: 2099.1\\n' > METADATA && "
            f"printf '{record}' > RECORD")
    ref, report = hotfix_of(body, tmp_path)
    r = cli("smoke", ref, "--report", str(report), root=project)
    assert r.rc != 0 and "integrity" in r.last_error
    check = integrity(report)
    assert "inherited from the base but known-bad: 1 path(s) claimed with different content, e.g. envs.py " \
        "claimed by regex and vllm" in str(check["detail"]), check["detail"]
