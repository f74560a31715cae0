"""Errors that end with the runbook's next step as a `hint:` line (issue 54 item 7): a hunk that does not apply,
a journal that cannot be written, a verdict signed with another key or not a pass, an unknown platform, a rollback
to an ID no build has, a definition named without its "v"."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import REPO, cli, copy_tracked
from vllm_hotfix.building import patches
from vllm_hotfix.errors import AttestationMismatch, AttestationWrongKey, PatchConflict, RecordError
from vllm_hotfix.journal import records
from vllm_hotfix.trust import signing

from .test_definitions_patches import NEW, OLD, _patch_file, _tree
from .test_signing import IMAGE_ID, REPORT, _key, _public, _signed


def _hint(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("hint: ")]
    assert lines, f"no hint line in:\n{err}"
    return lines[-1]


def test_a_hunk_that_does_not_apply_says_what_to_run(tmp_path: Path) -> None:
    p = _patch_file(tmp_path, OLD, NEW)
    other = OLD.replace("line 9\n", "nine\n").replace("line 10\n", "ten!\n").replace("line 11\n", "eleven\n")
    with pytest.raises(PatchConflict) as err:
        patches.apply_series([p], _tree(tmp_path, other))
    assert "does not apply" in str(err.value)
    assert err.value.hint and "check-upstream" in err.value.hint and "new-patchset" in err.value.hint


def test_a_journal_that_cannot_be_written_says_what_to_do(tmp_path: Path) -> None:
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "records").write_text("a file where the journal's folder belongs")
    with pytest.raises(RecordError) as err:
        records.ensure_writable(tmp_path)
    assert err.value.hint and "writable" in err.value.hint and "--root" in err.value.hint


def test_verify_with_another_key_or_a_failed_verdict_says_what_to_do(tmp_path: Path) -> None:
    site, other = _key(), _key()
    envelope = tmp_path / "v.dsse.json"
    envelope.write_bytes(_signed(site))
    lone = _public(tmp_path / "other.pub", other)
    r = cli("verify", "--definition", "v0.25.1",
            IMAGE_ID, "--attestation", str(envelope), "--key", str(lone), root=tmp_path)
    assert r.rc == 22 and "--key" in _hint(r.err), r.err
    with pytest.raises(AttestationWrongKey) as wrong:
        signing.open_envelope(_signed(site), other.public_key(), "v")
    assert wrong.value.hint
    found = signing.open_envelope(_signed(site, {**REPORT, "status": "fail"}), site.public_key(), "v")
    pub = str(_public(tmp_path / "site.pub", site))
    # The verification policy's refusals: each names its next step.
    for report, args, needle in (({**REPORT, "status": "fail"}, (), "smoke it again"),
                                 ({**REPORT, "gpu_verified": False}, (), "--allow-gpu-unverified"),
                                 (REPORT, ("--require-gpu", "NVIDIA B200"), "B200")):
        envelope.write_bytes(_signed(site, report))
        r = cli("verify", "--definition", "v0.25.1",
                IMAGE_ID, "--attestation", str(envelope), "--key", pub, *args, root=tmp_path)
        assert r.rc == 24 and needle in _hint(r.err), r.err
    with pytest.raises(AttestationMismatch) as other_image:
        signing.require_subject(found, {"sha256:" + "ef" * 32}, "img", "v")
    assert other_image.value.hint and "this image" in other_image.value.hint


def test_an_unknown_platform_names_the_ones_there_are(tmp_path: Path) -> None:
    copy_tracked(REPO, ("images", "patches"), tmp_path)
    r = cli("image", "--definition", "v0.25.1", "--platform", "linux/s390x", root=tmp_path)
    assert r.rc == 64 and "linux/s390x" in r.last_error, r.err
    assert "linux/amd64" in _hint(r.err) and "all" in _hint(r.err)


def test_rollback_to_an_id_no_build_has_points_at_list(tmp_path: Path) -> None:
    """Answered from the journal alone: no engine is asked (none answers in this tier)."""
    copy_tracked(REPO, ("images", "patches"), tmp_path)
    records.append(tmp_path, "build", {"image_id": IMAGE_ID, "inputs": {"definition": "v0.25.1"},
                                       "output_ref": "vllm/vllm-openai:v0.25.1-m3patch"})
    r = cli("rollback", "--definition", "v0.25.1", "--to", "sha256:" + "cd" * 32, root=tmp_path)
    assert r.rc == 1 and "no build record of v0.25.1 has that image ID" in r.last_error, r.err
    assert "list" in _hint(r.err)


@pytest.mark.parametrize(("given", "meant"), [("0.25.1", "v0.25.1"), ("vv0.25.1", "v0.25.1"), ("0.25.9", None)])
def test_a_definition_named_without_its_v_is_pointed_at(tmp_path: Path, given: str, meant: str | None) -> None:
    copy_tracked(REPO, ("images", "patches"), tmp_path)
    r = cli("render", "--definition", given, root=tmp_path, env={"VLLM_HOTFIX_VIA_MAKE": ""})
    assert r.rc == 2, r.err
    hint = _hint(r.err)
    if meant:
        assert f"did you mean {meant}?" in hint and ".toml" not in hint
    else:
        assert "did you mean" not in hint and f"add {given}.toml" in hint

