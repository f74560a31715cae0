"""Unit tier: typed verdicts, their journal round trip, BuildOptions, and the exit table (no engine)."""

from __future__ import annotations

import ast
import itertools
import json
import re
from pathlib import Path

import pytest

from conftest import REPO
from vllm_hotfix import cli, errors
from vllm_hotfix.building import patches as patchlib
from vllm_hotfix.building import pipeline, upstream
from vllm_hotfix.building.builders import BUILDERS, AssembleBuilder, DockerfileBuilder, builder
from vllm_hotfix.errors import Malformed, PipelineError, RecordError, SmokeError, SmokeIncomplete, UsageError
from vllm_hotfix.journal import records
from vllm_hotfix.verdicts import Check, Status, Verdict, judge, require_pass

IMAGE_ID = "sha256:" + "ab" * 32


def _verdict(*checks: Check, gpu_verified: bool = True) -> Verdict:
    return judge("hotfix/x:y", IMAGE_ID, list(checks), gpu_verified=gpu_verified, platform="linux/amd64",
                 started="2026-12-03T10:00:00Z", seconds=12.3456, expected_from="this build",
                 gpu={"mode": "auto", "verified": gpu_verified}, host={"engine": "26.1"},
                 environment={"python": "3.12"})


# -- judge ----------------------------------------------------------------------


def test_judge_a_failed_check_fails_the_run_whatever_else_happened() -> None:
    v = _verdict(Check("a", Status.PASS), Check("b", Status.INCOMPLETE, "timed out"), Check("c", Status.FAIL, "x"))
    assert v.status is Status.FAIL and v.failed == ["c"] and v.judged and not v.passed


def test_judge_an_incomplete_check_neither_passes_nor_fails() -> None:
    v = _verdict(Check("a", Status.PASS), Check("gpu", Status.INCOMPLETE, "no GPU"), Check("s", Status.SKIP))
    assert v.status is Status.INCOMPLETE and not v.judged
    assert v.incomplete == ["gpu: no GPU"]


def test_judge_skips_and_passes_are_a_pass() -> None:
    v = _verdict(Check("a", Status.PASS), Check("serve-sweep", Status.SKIP, "no --serve-model given"))
    assert v.status is Status.PASS and v.passed and v.failed == [] and v.incomplete == []
    assert judge("i", IMAGE_ID, [], gpu_verified=False).status is Status.PASS


def test_require_pass_raises_the_error_of_each_outcome() -> None:
    with pytest.raises(SmokeError, match="smoke failed for img: c") as failed:
        require_pass(_verdict(Check("c", Status.FAIL)), "img", fail_hint="F", incomplete_hint="I")
    assert not isinstance(failed.value, SmokeIncomplete) and failed.value.hint == "F"
    with pytest.raises(SmokeIncomplete, match="incomplete") as incomplete:
        require_pass(_verdict(Check("g", Status.INCOMPLETE)), "img", fail_hint="F", incomplete_hint="I")
    assert incomplete.value.hint == "I"
    require_pass(_verdict(Check("a", Status.PASS)), "img", fail_hint="F", incomplete_hint="I")


def test_a_probes_malformed_check_is_a_failing_check() -> None:
    from vllm_hotfix.inimage.runner.probe_output import parse

    as_check = Check.reported
    assert as_check({"name": "x", "status": "pass", "detail": "ok"}, 0.5, "p") == \
        Check("x", Status.PASS, "ok", 0.5)
    for raw in ({"name": "x", "status": "maybe"}, {"name": "x", "status": "pass", "detail": 3},
                {"status": "pass"}, {"name": ["x"], "status": "pass"}):
        check = as_check(raw, 0, "landed.py")
        assert check.status is Status.FAIL and "malformed" in check.detail, raw
    checks, info = parse("landed.py", json.dumps({"checks": ["junk"], "info": 7}), "", 0)
    assert checks[0]["status"] == "fail" and info == {}


# -- the journal round trip -----------------------------------------------------------


def test_a_verdict_round_trips_through_the_journal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_HOTFIX_RECORDS", raising=False)
    v = _verdict(Check("patch-landed", Status.PASS, "2 files match", 0.25, {"files": {"a.py": "x"}}),
                 Check("gpu", Status.SKIP, "--gpu off"))
    written = records.append_verdict(tmp_path, v)
    [read] = records.verdicts(tmp_path, IMAGE_ID)
    assert read.verdict == v and read.path == written.path and read.seq == written.seq
    assert records.judgement(tmp_path, IMAGE_ID) == read
    # On disk: the report's shape, as entries were written before verdicts had types.
    data = json.loads(written.path.read_text())
    assert data["kind"] == "verdict" and data["status"] == "pass" and data["gpu_verified"] is True
    assert data["checks"][0] == {"name": "patch-landed", "status": "pass", "detail": "2 files match",
                                 "seconds": 0.25, "data": {"files": {"a.py": "x"}}}


def test_an_entry_written_before_typed_verdicts_still_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_HOTFIX_RECORDS", raising=False)
    folder = tmp_path / "build" / "records" / "verdict"
    folder.mkdir(parents=True)
    (folder / "00000000000000000001-aaaaaaaaaaaa.json").write_text(json.dumps({
        "kind": "verdict", "seq": 1, "created": "2026-01-01T00:00:00Z", "image": "x:y", "image_id": IMAGE_ID,
        "status": "incomplete", "incomplete": ["gpu: no GPU"], "gpu_verified": False, "sweep": None,
        "checks": [{"name": "gpu", "status": "incomplete", "detail": "no GPU"}],
    }))
    [entry] = records.verdicts(tmp_path, IMAGE_ID)
    assert entry.verdict.status is Status.INCOMPLETE and entry.verdict.checks[0].seconds == 0.0
    assert records.judgement(tmp_path, IMAGE_ID) is None


@pytest.mark.parametrize("field,value", [
    ("gpu_verified", "yes"),
    ("status", "passed"),
    ("status", "skip"),
    ("checks", {"name": "x"}),
    ("checks", [{"name": "x", "status": "pass", "seconds": "1"}]),
    ("image_id", 5),
    ("gpu", []),
    ("seq", "1"),
])
def test_a_wrong_typed_verdict_entry_is_an_error_naming_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, field: str, value: object
) -> None:
    monkeypatch.delenv("VLLM_HOTFIX_RECORDS", raising=False)
    entry = records.append_verdict(tmp_path, _verdict(Check("a", Status.PASS)))
    data = json.loads(entry.path.read_text())
    data[field] = value
    entry.path.write_text(json.dumps(data))
    with pytest.raises(RecordError, match=re.escape(str(entry.path))) as exc:
        records.verdicts(tmp_path, IMAGE_ID)
    assert exc.value.exit_code == 10 and "malformed" in str(exc.value)


def test_verdict_from_dict_names_what_is_wrong() -> None:
    good = _verdict(Check("a", Status.PASS)).to_dict()
    with pytest.raises(Malformed, match="'gpu_verified' is int"):
        Verdict.from_dict({**good, "gpu_verified": 1})
    with pytest.raises(Malformed, match="no image_id"):
        Verdict.from_dict({**good, "image_id": ""})


def test_verdicts_are_appended_only_through_append_verdict(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        records.append(tmp_path, "verdict", {"image_id": IMAGE_ID, "status": "pass"})


# -- BuildOptions and builders ----------------------------------------------------------


def test_build_options_are_a_frozen_value_checked_when_made() -> None:
    opts = pipeline.BuildOptions()
    assert (opts.pull, opts.builder, opts.rebuild, opts.smoke) == ("missing", "dockerfile", False, None)
    opts.say("said to nobody")
    with pytest.raises(AttributeError):
        opts.rebuild = True  # type: ignore[misc]
    with pytest.raises(UsageError, match="unknown builder 'kaniko'") as refused:
        pipeline.BuildOptions(builder="kaniko")
    assert refused.value.exit_code == 64  # as the CLI's own choice of --builder answers it
    with pytest.raises(UsageError):
        pipeline.BuildOptions(pull="sometimes")
    heard: list[str] = []
    assert pipeline.BuildOptions(builder="assemble", progress=heard.append).say("x") is None and heard == ["x"]


def test_builders_are_chosen_by_name_in_one_place() -> None:
    assert isinstance(builder("dockerfile"), DockerfileBuilder)
    assert isinstance(builder("assemble"), AssembleBuilder)
    assert [builder(name).name for name in BUILDERS] == list(BUILDERS)
    with pytest.raises(UsageError):
        builder("kaniko")


# -- no hotfix needed is a result ------------------------------------------------------


def test_a_tree_carrying_every_patch_is_a_result_not_an_error(tmp_path: Path) -> None:
    diff = ("--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -1,2 +1,2 @@\n a = 1\n-b = 2\n+b = 3\n")
    patch_file = tmp_path / "0001-x.patch"
    patch_file.write_text(diff)
    patch = patchlib.load_patch(patch_file, "vllm")
    tree = tmp_path / "tree"
    (tree / "vllm").mkdir(parents=True)
    (tree / "vllm" / "x.py").write_text("a = 1\nb = 3\n")
    assert patchlib.apply_series([patch], tree) == [patch]
    assert (tree / "vllm" / "x.py").read_text() == "a = 1\nb = 3\n"
    no = pipeline.NoHotfix("vllm/vllm-openai:v9", "v9", ("0001-x.patch",))
    assert "needs no hotfix" in no.message() and "0001-x.patch" in no.message()


def test_check_upstream_report_says_when_no_hotfix_is_needed() -> None:
    def report(*words: str) -> upstream.Report:
        return upstream.Report("s", "b", "wheel", "vllm", "1", tuple(upstream.Verdict(f"p{i}", w, ())
                                                                     for i, w in enumerate(words)))

    assert not report(patchlib.INCLUDED, patchlib.INCLUDED).needs_hotfix
    assert report(patchlib.INCLUDED, patchlib.NEEDED).needs_hotfix


# -- the exit table -------------------------------------------------------------------


def _readme_exit_codes() -> set[int]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    below = text[text.index("| exit | meaning |"):].splitlines()[2:]  # past the header and its rule
    return {int(line.split("|")[1]) for line in itertools.takewhile(lambda line: line.startswith("|"), below)}


def test_every_error_class_code_is_in_the_readme_table_and_help() -> None:
    readme = _readme_exit_codes()
    table = dict(errors.exit_table())
    for cls in errors.error_classes():
        assert cls.exit_code in readme, f"{cls.__name__} exits {cls.exit_code}, which README's table lacks"
        assert cls.exit_code in table, cls.__name__
    assert readme == set(table), "README's exit table and errors.exit_table() differ"
    for code, meaning in table.items():
        assert re.search(rf"^\s*{code}  {re.escape(meaning)}$", cli.EXIT_CODES, re.M), code


def test_no_code_raises_a_bare_pipeline_error_or_defines_errors_elsewhere() -> None:
    """Each raise names a class with its own code; every exception class lives in errors.py."""
    package = REPO / "vllm_hotfix"
    for path in sorted(package.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        # Only a file that names PipelineError or holds a class statement (each starts a line) can break a rule:
        # the others are not parsed (all of them took most of a second).
        if "PipelineError" not in text and not re.search(r"^[ \t\f]*class\s", text, re.M):
            continue
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                assert getattr(node.exc.func, "id", None) != "PipelineError", f"{path.name}:{node.lineno}"
            if isinstance(node, ast.ClassDef) and path.name != "errors.py":
                bases = {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
                assert not any(b.endswith(("Error", "Exception")) or b in {"PipelineError"} for b in bases), \
                    f"{path.name}: class {node.name}"
    assert PipelineError.exit_code not in {cls.exit_code for cls in errors.error_classes()[1:]}


def test_the_cli_maps_errors_to_exit_codes_and_keeps_running(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert cli._run(["--help"], "build.py") == 0
    assert "Exit codes:" in capsys.readouterr().out
    assert cli._run(["image", "--no-such-flag"], "build.py") == 64
    err = capsys.readouterr().err
    assert "error: no such option" in err and "hint: build.py image --help" in err
    # A library error becomes its one line and its code, from _run alone (no engine is reached).
    assert cli._run(["--root", str(tmp_path), "image", "--definition", "v9.9.9"], "build.py") == 2
    assert capsys.readouterr().err.startswith("error: ")
