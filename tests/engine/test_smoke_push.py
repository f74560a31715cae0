"""Smoke inside built images, the serve sweep through an image's entrypoint, the push gate.

Real engine, real registry (Debian's docker-registry on a loopback port the
test picks), real stand-in images. A stand-in has no vLLM server (no torch), so
the sweep runs against tests/fake_openai.py as the image's own `vllm`
entrypoint, healthy and dying at concurrency 2 as the bug did.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import xml.etree.ElementTree as ET
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import requests

from conftest import REPO, Product, RegistryPlace, cli, derive, fails, requests_layer, site_key
from vllm_hotfix.checking import compile_cache
from vllm_hotfix.engine import Engine
from vllm_hotfix.engine.registry_errors import NO_NAME, REFUSED
from vllm_hotfix.journal import records
from vllm_hotfix.verdicts import Status

SITE = "/usr/local/lib/python3.12/dist-packages"
INDEXER = "vllm/models/minimax_m3/common/indexer.py"
FAKE = REPO / "tests" / "fake_openai.py"


def test_image_runs_smoke_and_records_it(built: tuple[Path, str, str]) -> None:
    project, ref, image_id = built
    [build] = records.builds_of_image(project, image_id)
    [verdict] = records.verdicts(project, image_id)
    assert verdict.verdict.status is Status.PASS
    names = {c.name: c.status for c in verdict.verdict.checks}
    assert names["patch-landed"] is Status.PASS
    assert names["integrity"] is Status.PASS
    assert names["gpu"] is Status.SKIP  # the test engine offers no GPU
    assert verdict.verdict.gpu_verified is False
    assert verdict.verdict.expected_from.startswith("this build: patches/v0.25.1 applied to base")
    assert verdict.verdict.host["engine_version"]
    assert build.data["inputs"]["patches"]
    # Written before the tag moved.
    [tag] = records.tags(project, ref)
    assert tag.image_id == image_id and tag.seq > build.seq > verdict.seq


def test_unchanged_rebuild_reuses_the_recorded_image(engine: Engine, built: tuple[Path, str, str]) -> None:
    project, ref, image_id = built
    r = cli("image", "--definition", "v0.25.1", "--tag", ref, "--pull", "never", root=project)
    assert r.rc == 0, r.err
    assert r.out.strip() == f"reused {ref} {image_id}"
    assert "inputs unchanged" in r.err
    r = cli("image", "--definition", "v0.25.1", "--tag", ref, "--pull", "never", "--no-smoke", "--rebuild",
            root=project)
    assert r.rc == 0 and r.out.startswith("built "), r.err
    # --rebuild takes no build cache: a new image, which the session's image is given its tag back from.
    rebuilt = r.out.split()[-1]
    assert rebuilt != image_id
    engine.tag(image_id, ref)
    engine.remove_image(rebuilt)


def test_reuse_of_an_unsmoked_build_runs_smoke_first(engine: Engine, base_v0251: str, project: Path,
                                                     unique: str) -> None:
    ref = f"hotfix-test/nosmoke-{unique}:x"
    r = cli("image", "--definition", "v0.25.1", "--tag", ref, "--pull", "never", "--no-smoke", root=project)
    assert r.rc == 0, r.err
    image_id = r.out.split()[-1]
    try:
        assert records.verdicts(project, image_id) == []
        r = cli("image", "--definition", "v0.25.1", "--tag", ref, "--pull", "never", root=project)
        assert r.rc == 0 and r.out.strip() == f"reused {ref} {image_id}", r.err
        assert "no smoke verdict on it yet" in r.err
        [verdict] = records.verdicts(project, image_id)
        assert verdict.verdict.status is Status.PASS
        # Smoke standing alone recomputes the hashes from the patch set and the base.
        assert verdict.verdict.expected_from.startswith("patches/v0.25.1 applied to base")
    finally:
        engine.remove_image(ref)


def test_smoke_reports_and_tampered_image_fails(engine: Engine, built: tuple[Path, str, str], tmp_path: Path,
                                                unique: str) -> None:
    project, ref, image_id = built
    ok = cli("smoke", ref, "--report", str(tmp_path / "ok.json"), "--junit", str(tmp_path / "ok.xml"), "--html",
             str(tmp_path / "ok.html"), root=project)
    assert ok.rc == 0, ok.err
    assert "GPU-unverified" in ok.out
    report = json.loads((tmp_path / "ok.json").read_text())
    assert report["status"] == "pass" and report["image_id"] == image_id
    # The same report as a page: its verdict first, the phases drawn with their table (no sweep here).
    page = (tmp_path / "ok.html").read_text()
    assert f"{ref}: pass" in page and '<figure id="phases"' in page and "<svg" in page
    assert '<figure id="outcomes"' not in page and page.count("<td>layer-identity</td>") == 1
    assert report["environment"]["packages"]["vllm"] == "0.25.1"
    suite = ET.parse(tmp_path / "ok.xml").getroot()
    assert int(suite.get("tests", "0")) == len(report["checks"]) and suite.get("failures") == "0"

    tampered = f"hotfix-test/tampered-{unique}:x"
    derive(engine, image_id, tampered, f"RUN echo '# edited by hand' >> {SITE}/{INDEXER}")
    try:
        bad = cli("smoke", tampered, "--report", str(tmp_path / "bad.json"), "--junit", str(tmp_path / "bad.xml"),
                  root=project)
        # An edit after the build is not the builder's: refused before any check runs (exit 14).
        assert bad.rc == 14, bad.err
        assert "not the product of definition v0.25.1" in bad.last_error and tampered in bad.last_error
        report = json.loads((tmp_path / "bad.json").read_text())
        [identity] = report["checks"]
        assert identity["name"] == "layer-identity" and identity["status"] == "fail"
        assert identity["data"]["first_difference"] == \
            "2 layer(s) over the base; the builder writes 1 (the patch layer)"
        suite = ET.parse(tmp_path / "bad.xml").getroot()
        failed = [tc.get("name") for tc in suite if tc.find("failure") is not None]
        assert failed == ["layer-identity"]
    finally:
        engine.remove_image(tampered)


def test_stale_bytecode_fails_smoke(engine: Engine, built: tuple[Path, str, str], unique: str) -> None:
    project, ref, image_id = built
    stale = f"hotfix-test/stale-{unique}:x"
    # An unchecked pyc compiled from other source: Python would serve it.
    derive(engine, image_id, stale, (
        "RUN python3 -c \"import py_compile, importlib.util as u; "
        f"p='{SITE}/{INDEXER}'; open('/tmp/o.py','w').write('x = 1\\n'); "
        "py_compile.compile('/tmp/o.py', cfile=u.cache_from_source(p), "
        "invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)\""
    ))
    try:
        r = cli("smoke", stale, root=project)
        # Bytecode the builder did not write (Python would serve it): refused before any check runs.
        assert r.rc == 14 and "not the product of definition v0.25.1" in r.last_error, r.err
    finally:
        engine.remove_image(stale)


def test_gpu_require_without_gpu_is_incomplete_not_a_failure(built: tuple[Path, str, str], registry: RegistryPlace
                                                             ) -> None:
    project, ref, image_id = built
    r = cli("smoke", ref, "--gpu", "require", root=project)
    assert r.rc == 11, r.err
    assert "incomplete, neither pass nor fail" in r.last_error
    assert "--gpu require: no GPU request gave a container of this image a GPU" in r.last_error
    # Docker's words said as what the host lacks (was the raw 'could not select device driver "" with ...').
    assert "gpus: this engine has no GPU device driver for --gpus (could not select device driver): the NVIDIA " \
        "Container Toolkit is not installed or not set up for it" in r.last_error, r.last_error
    assert 'driver ""' not in r.err
    assert "no NVIDIA runtime registered" in r.last_error
    newest = records.verdicts(project, image_id)[0]
    assert newest.verdict.status is Status.INCOMPLETE
    # The earlier passing verdict still stands: list shows it, push takes it.
    rows = json.loads(cli("list", "--json", root=project).out)
    [build] = [b for b in rows[0]["builds"] if b["image_id"] == image_id]
    assert build["verdict"] == "pass" and build["incomplete_runs"] == 1
    r = cli("push", ref, "--registry", f"{registry.place}/ops", "--allow-gpu-unverified", root=project)
    assert r.rc == 0, r.err
    # And the next `image` reuses it instead of rebuilding.
    r = cli("image", "--definition", "v0.25.1", "--tag", ref, "--pull", "never", root=project)
    assert r.rc == 0 and r.out.strip() == f"reused {ref} {image_id}", r.err


def test_an_untrusted_run_reads_the_base_cache_and_writes_only_its_private_layer(
        engine: Engine, base_v0251: str, tmp_path: Path) -> None:
    """The overlay the engine mounts: the container reads the shared folder's kernels, and what it writes or
    changes (a planted kernel, one overwritten) lands in its private layer, removed with the run."""
    shared = compile_cache.folder(tmp_path, "sha256:" + "e" * 64, base_v0251, ["NVIDIA H200"])
    (shared.host / "triton").mkdir()
    (shared.host / "triton" / "kernel.cubin").write_text("the base's kernel")
    layered = replace(shared, access=compile_cache.LAYERED)
    with compile_cache.given(engine, layered) as mounted:
        assert mounted.mount[0] != str(shared.host)
        done = engine.run(base_v0251, ["sh", "-c", "cat /root/.cache/triton/kernel.cubin; echo; "
                                                   "echo planted > /root/.cache/triton/kernel.cubin; "
                                                   "echo new > /root/.cache/triton/other.cubin; "
                                                   "cat /root/.cache/triton/kernel.cubin"],
                          writable=[mounted.mount], timeout=60)
        assert done.exit_code == 0 and done.stdout.split() == ["the", "base's", "kernel", "planted"], done
        volume = mounted.mount[0]
    assert (shared.host / "triton" / "kernel.cubin").read_text() == "the base's kernel"
    assert sorted(p.name for p in (shared.host / "triton").iterdir()) == ["kernel.cubin"]
    assert not list((tmp_path / "compile" / "private").iterdir())
    assert not engine.sdk.volumes.list(filters={"name": volume})
    # A run that ``keep`` says met the default policy (compile_cache.trusted_by, asked once it ended): what it
    # wrote is adopted into the shared folder, and its private layer goes all the same.
    with compile_cache.given(engine, layered, keep=lambda: True) as mounted:
        done = engine.run(base_v0251, ["sh", "-c", "echo mine > /root/.cache/triton/trusted.cubin"],
                          writable=[mounted.mount], timeout=60)
        assert done.exit_code == 0, done
    assert (shared.host / "triton" / "trusted.cubin").read_text() == "mine\n"
    assert not list((tmp_path / "compile" / "private").iterdir())


@pytest.mark.parametrize("die", [False, True])
def test_smoke_serve_sweep_uses_the_image_entrypoint(
    engine: Engine, base_v0251: str, project: Path, tmp_path: Path, unique: str, die: bool
) -> None:
    # The base's own `vllm` is the fake server; the runner's sweep needs requests in the image, as vLLM's has. The
    # patch set built over it by the tool: the image is its definition's product.
    product = Product(engine, base_v0251, project, f"hotfix-test/served-{unique}",
                      "COPY vllm /usr/local/bin/vllm\nCOPY usr/ /usr/", {"vllm": FAKE.read_bytes(), **requests_layer()},
                      {"vllm": 0o755})
    served, image_id = product.ref, product.image_id
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    args = ["--serve-arg=--die-at-concurrency", "--serve-arg=2"] if die else []
    try:
        r = cli("smoke", served, "--serve-model", str(model), *args, "--concurrency", "1,2,4", "--requests", "6",
                "--report", str(tmp_path / "r.json"), root=project)
        report = json.loads((tmp_path / "r.json").read_text())
        sweep_check = next(c for c in report["checks"] if c["name"] == "serve-sweep")
        if die:
            assert r.rc != 0
            assert sweep_check["status"] == "fail"
            assert "concurrency 2" in sweep_check["detail"]
            assert any("illegal memory access" in ln for ln in sweep_check["data"]["server_log"])
            # A run that failed, of an image whose layers the run proved (the tool built it over its base from this
            # checkout's patch set): its code is the base's and the patch set's, so it writes the base's folder in
            # place, as the base itself does, and nothing is left private.
            cache = report["environment"]["compile_cache"]
            assert cache["access"] == "shared" and "written in place (its layers proven)" in r.err
            assert (Path(cache["host"]) / "vllm" / "fake-openai-starts").exists()
            private = Path(cache["host"]).parent.parent / "private"
            assert not private.exists() or not list(private.iterdir())
        else:
            assert r.rc == 0, r.err
            assert sweep_check["status"] == "pass"
            assert [lv["successes"] for lv in report["sweep"]["levels"]] == [6, 6, 6]
            # One server start, its phases timed; the compile cache of the base mounted and written.
            assert set(report["phases"]) == {"identity", "files", "gpu_access", "checks", "gpu_checks",
                                             "server_start", "sweep"}
            assert all(v >= 0 for v in report["phases"].values())
            cache = report["environment"]["compile_cache"]
            base_id = engine.image(image_id).labels["io.vllm-hotfix.base.id"]  # type: ignore[union-attr]
            assert cache["base_id"] == base_id.removeprefix("sha256:") and cache["gpu"] == "no-gpu"
            assert Path(cache["host"]).parts[-3:] == ("compile", cache["base_id"], "no-gpu")
            # Its first run: no verdict here meets the default policy yet, but the run proved its layers, so it
            # writes the base's cache in place (its next image of that base starts warm), whatever its verdict.
            assert cache["access"] == "shared" and "written in place (its layers proven)" in r.err
            starts = Path(cache["host"]) / "vllm" / "fake-openai-starts"
            assert starts.read_text().count("started") == 1
            private = Path(cache["host"]).parent.parent / "private"
            assert not private.exists() or not list(private.iterdir())
            # Its next run: the same.
            r = cli("smoke", served, "--serve-model", str(model), "--concurrency", "1", "--requests", "2",
                    "--report", str(tmp_path / "r2.json"), root=project)
            assert r.rc == 0, r.err
            assert json.loads((tmp_path / "r2.json").read_text())["environment"]["compile_cache"]["access"] == \
                "shared"
            assert starts.read_text().count("started") == 2
            # The base itself writes its cache in place (the unpatched base fails patch-landed; --keep-going starts
            # its server all the same).
            r = cli("smoke", product.base_ref, "--definition", "v0.25.1", "--base-repo", product.repo,
                    "--serve-model", str(model), "--concurrency", "1", "--requests", "2", "--keep-going", "--report",
                    str(tmp_path / "base.json"), root=project)
            assert r.rc == 7 and "written in place" in r.err, r.err
            assert json.loads((tmp_path / "base.json").read_text())["environment"]["compile_cache"] == cache | {
                "access": "shared"}
            assert starts.read_text().count("started") == 3
            # The oracle's settings reached the server: prefix caching off, batch-invariant mode on.
            assert "started prefix_caching=False VLLM_BATCH_INVARIANT=1" in starts.read_text()
            shared_after = starts.read_text()
            # Recording from this image: its server answers, but a stand-in has no engine (no torch) for the
            # per-level answers under fixed batches, so the run fails on exact-levels and nothing is written.
            answers = tmp_path / "answers.json"
            site_key(tmp_path / "site.key"), site_key(tmp_path / "other.key")
            site, other = str(tmp_path / "site.key"), str(tmp_path / "other.key")
            r = cli("smoke", served, "--gpu", "auto", "--serve-model", str(model), "--record-reference",
                    str(answers), "--concurrency", "1,2", "--requests", "6", "--report", str(tmp_path / "rec.json"),
                    "--sign-key", site, root=project)
            assert r.rc == 7 and "no per-level answers under fixed batches came back" in r.err, r.err
            # Nothing to sign, and the recording's own (failing) verdict is kept beside nothing.
            assert not answers.exists() and not (tmp_path / "answers.dsse.json").exists()
            assert not (tmp_path / "answers.verdict.dsse.json").exists()
            # A recording reads no cache: a folder of its own, removed after the run. Its image's layers were
            # proven, so what it wrote there (its server's one start) is moved into the base's folder after it.
            assert json.loads((tmp_path / "rec.json").read_text())["environment"]["compile_cache"]["access"] == \
                "private"
            assert shared_after.count("started") == 3 and starts.read_text().count("started") == 1
            assert not list((Path(cache["host"]).parent.parent / "private").iterdir())
            checks = {c["name"]: c for c in json.loads((tmp_path / "rec.json").read_text())["checks"]}
            assert checks["serve-sweep"]["status"] == "pass"
            assert checks["exact-levels"]["status"] == "fail"
            assert "No module named 'torch'" in checks["exact-levels"]["detail"]
            # Answers with every level, recorded where an engine ran, under this run's settings: the HTTP sweep
            # passes against them, and the image's missing engine fails exact-levels, judged on the host.
            write_reference(answers, model, base_id, (1, 2, 4), 6, TRUSTED)
            r = cli("smoke", served, "--gpu", "auto", "--serve-model", str(model), "--reference", str(answers),
                    "--concurrency", "1,2,4", "--requests", "6", "--report", str(tmp_path / "ref.json"),
                    root=project)
            assert r.rc == 7, r.err
            report = json.loads((tmp_path / "ref.json").read_text())
            checks = {c["name"]: c for c in report["checks"]}
            assert "every reply at concurrency 1 bitwise the reference answer" in checks["serve-sweep"]["detail"]
            assert checks["serve-sweep"]["status"] == "pass"
            assert {ev["judged_by"] for lv in report["sweep"]["levels"] for ev in lv["per_request"]} == \
                {"exact", "form"}
            exact = checks["exact-levels"]
            assert exact["status"] == "fail" and exact["data"]["answered_by"] == "filesystem"
            assert exact["detail"].startswith("wrong under fixed batches from concurrency 1: no replies from "
                                              "concurrency 1 on: ModuleNotFoundError: No module named 'torch'")
            assert report["sweep"]["reference"]["sha256"] == json.loads(answers.read_text())["sha256"]
            assert checks["reference"]["status"] == "skip" and checks["reference"]["detail"].endswith(
                "its signature not checked (no --sign-key)")
            check_reference_provenance(served, image_id, base_id, model, answers, tmp_path, project, site, other)
            # Another model than the one recorded with: refused before the server starts, naming it (exit 64).
            (model / "config.json").write_text('{"other": 1}')
            r = cli("smoke", served, "--gpu", "auto", "--serve-model", str(model), "--reference", str(answers),
                    root=project)
            assert r.rc == 64 and "recorded under other settings (model '" in r.err
    finally:
        product.drop()


# The image test references are recorded from: another than any judged here (a trusted build the site keeps).
TRUSTED = "sha256:" + "7e" * 32


def check_reference_provenance(served: str, image_id: str, base_id: str, model: Path, answers: Path, tmp_path: Path,
                               project: Path, site: str, other: str) -> None:
    """Answers recorded from the judged image itself, or from its base, are refused before the run (exit 64);
    with --sign-key a reference must carry the site key's signature (checked before anything runs), unless the run
    accepts it unsigned, and the verdict names the reference, its image, its digest and its signature."""
    from dataclasses import replace

    from vllm_hotfix.inimage import reference
    from vllm_hotfix.trust import references

    def smoke(ref: Path, *extra: str) -> tuple[int, str, dict[str, dict]]:
        out = tmp_path / "prov.json"
        out.unlink(missing_ok=True)
        r = cli("smoke", served, "--gpu", "auto", "--serve-model", str(model), "--reference", str(ref),
                "--concurrency", "1,2,4", "--requests", "6", "--report", str(out), *extra, root=project)
        checks = {c["name"]: c for c in json.loads(out.read_text())["checks"]} if out.exists() else {}
        return r.rc, r.err, checks

    trusted = reference.load(answers)
    for recorded_from, said in ((image_id, f"recorded from {image_id}, the judged image itself"),
                                (base_id, f"recorded from {base_id}, the base of the judged image {image_id}")):
        mine = reference.write(replace(trusted, image_id=recorded_from), tmp_path / "mine.json")
        rc, err, checks = smoke(Path(mine.path))
        assert rc == 64 and said in err and not checks, err
    # Not signed: refused before anything runs (exit 21), naming the envelope it looked for.
    rc, err, checks = smoke(answers, "--sign-key", site)
    assert rc == 21 and f"--reference {answers}: not signed with the site key (no {tmp_path}/answers.dsse.json" \
        in err and not checks, err
    # Signed with the site key but naming no recording verdict (as an earlier version signed): nothing shows the
    # run that recorded it passed, so it is refused (21), unless accepted as unsigned (the verdict says so).
    references.sign(answers, trusted.sha256, {"image_id": TRUSTED}, site)
    rc, err, checks = smoke(answers, "--sign-key", site)
    assert rc == 21 and "its signature names no recording verdict" in err and not checks, err
    rc, err, checks = smoke(answers, "--sign-key", site, "--accept-unsigned-reference")
    assert rc == 7 and checks["reference"]["status"] == "skip", err
    assert checks["reference"]["detail"].endswith("its signature names no recording verdict (signed by an earlier "
                                                  "version), so nothing shows the run that recorded it passed: "
                                                  "accepted by --accept-unsigned-reference")
    # Signed by the host that recorded it after its passing recording (a GPU host that ran the golden, stood in
    # here by its signed verdict): checked, and the verdict says by which key and which recording.
    passed = recording_verdict(trusted, site, golden=Status.PASS, gpu_verified=True)
    references.envelope_path(answers).unlink()
    signed = references.sign(answers, trusted.sha256, {"image_id": TRUSTED}, site, recording=passed)
    report = tmp_path / "signed.json"
    r = cli("smoke", served, "--gpu", "auto", "--serve-model", str(model), "--reference", str(answers),
            "--concurrency", "1,2,4", "--requests", "6", "--sign-key", site, "--report", str(report), root=project)
    checks = {c["name"]: c for c in json.loads(report.read_text())["checks"]}
    # exact-levels fails (no engine in a stand-in), so the answers prove nothing; the reference is named all the same
    assert r.rc == 7 and checks["reference"]["status"] == "pass", r.err
    assert json.loads(report.read_text())["sweep"]["reference"]["proves"] is None
    assert checks["reference"]["detail"] == (f"{answers} (sha256 {trusted.sha256}) recorded from image {TRUSTED}, "
                                             f"neither the judged image nor its base; signed with the site key "
                                             f"{signed.key_id[:12]} ({tmp_path}/answers.dsse.json), recorded by a "
                                             f"passing run (its signed verdict {signed.recording[:19]})")
    assert checks["reference"]["data"]["signature"]["recording_verdict"] == signed.recording
    # Its recording verdict nowhere to be found (not beside it, not in this host's journal): refused (21).
    beside = references.verdict_path(answers)
    beside.rename(tmp_path / "elsewhere.dsse.json")
    rc, err, checks = smoke(answers, "--sign-key", site)
    assert rc == 21 and "the verdict of the run that recorded it" in err and not checks, err
    (tmp_path / "elsewhere.dsse.json").rename(beside)
    # Recorded by a run that did not pass (GPU-unverified, its golden skipped): refused whatever the flag (24).
    references.envelope_path(answers).unlink()
    references.sign(answers, trusted.sha256, {"image_id": TRUSTED}, site,
                    recording=recording_verdict(trusted, site, golden=Status.SKIP, gpu_verified=False))
    rc, err, checks = smoke(answers, "--sign-key", site, "--accept-unsigned-reference")
    assert rc == 24 and "recorded by a run that did not pass" in err and "golden check did not pass (skip" in err \
        and not checks, err
    references.envelope_path(answers).unlink()
    references.sign(answers, trusted.sha256, {"image_id": TRUSTED}, site, recording=passed)
    # Another key's signature: refused (22) unless accepted explicitly, and then the verdict says so.
    references.sign(answers, trusted.sha256, {"image_id": TRUSTED}, other)
    rc, err, checks = smoke(answers, "--sign-key", site)
    assert rc == 22 and "signed with another key" in err and not checks, err
    rc, err, checks = smoke(answers, "--sign-key", site, "--accept-unsigned-reference")
    assert rc == 7 and checks["reference"]["status"] == "skip", err
    assert "signed with another key than the site's" in checks["reference"]["detail"]
    assert checks["reference"]["detail"].endswith("accepted by --accept-unsigned-reference")
    # A signature of other content beside it is no missing signature but a wrong one: refused even so (24).
    references.sign(answers, "0" * 64, {"image_id": TRUSTED}, site)
    rc, err, checks = smoke(answers, "--sign-key", site, "--accept-unsigned-reference")
    assert rc == 24 and "vouches for other content" in err and not checks, err
    references.envelope_path(answers).unlink()


def recording_verdict(trusted: Any, key: str, *, golden: Status, gpu_verified: bool) -> bytes:
    """The signed verdict of the run that recorded ``trusted`` (reference answers of the image TRUSTED), as the GPU
    host that recorded them signs it with the site key ``key``: its golden check ``golden``, its GPU checks verified
    or not. This host has no GPU and no engine to record with; what it judges of the recording is this verdict."""
    from vllm_hotfix.trust import signing
    from vllm_hotfix.verdicts import Check, judge

    checks = [Check("gpu-torch", Status.PASS, "ran", ran_against="torch"),
              Check("golden", golden, "judged" if golden is Status.PASS else "no torch on this host")]
    verdict = judge("trusted:v0.25.1", TRUSTED, checks, gpu_verified=gpu_verified,
                    sweep={"recorded": {"file": "answers.json", "sha256": trusted.sha256, "image_id": TRUSTED}})
    statement = signing.statement({"trusted:v0.25.1": TRUSTED}, signing.predicate(verdict.to_dict(), {},
                                                                                  signing.now()))
    return signing.sign(statement, signing.load_private_key(key))


def write_reference(path: Path, model: Path, base_id: str, levels: tuple[int, ...], requests: int,
                    image_id: str = TRUSTED) -> None:
    """Reference answers as a trusted image with an engine gives them: tests/fake_openai.py's over HTTP and the
    stand-in engine's (tests/fake_vllm) under fixed batches, named with the settings of the smoke that uses them
    and the image they stand for (``image_id``)."""
    from dataclasses import replace

    from conftest import free_port
    from vllm_hotfix.inimage import oracle, recording, reference, sweep
    from vllm_hotfix.judges import fixed_batches

    port = free_port()
    proc = subprocess.Popen([sys.executable, str(FAKE), "serve", "m", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        sweep.wait_healthy(f"http://127.0.0.1:{port}", 20)
        made = recording.record(f"http://127.0.0.1:{port}")
    finally:
        proc.kill()
        proc.wait()
    settings = {"serve_args": list(oracle.SERVE_ARGS), "env": dict(oracle.SERVE_ENV), "base_image_id": base_id,
                "model": oracle.fingerprint(str(model)), "vllm": "0.25.1", "torch": "absent"}
    spec = fixed_batches.job_part(settings, levels, requests, made.prompts, made.max_tokens, recording=True)
    out = path.with_suffix(".jsonl")
    (path.parent / "spec.json").write_text(json.dumps({**spec, "out": str(out)}))
    probe = REPO / "vllm_hotfix" / "inimage" / "probes" / "batches.py"
    subprocess.run([sys.executable, str(probe), str(path.parent / "spec.json")], check=True, timeout=60,
                   env={"PYTHONPATH": str(REPO / "tests" / "fake_vllm")})
    run = fixed_batches.parse(json.dumps({"lines": [json.loads(ln) for ln in out.read_text().splitlines()]}).encode())
    section = fixed_batches.record(run, made.prompts, levels, requests, made.max_tokens)
    reference.write(replace(made, settings=settings, levels=section, image_id=image_id), path)


def test_push_gate_and_push(engine: Engine, built: tuple[Path, str, str], registry: RegistryPlace) -> None:
    project, ref, image_id = built
    dest = f"{registry.place}/ops"
    # GPU-unverified: refused without the flag.
    r = cli("push", ref, "--registry", dest, root=project)
    assert r.rc != 0 and "GPU-unverified" in r.last_error
    r = cli("push", ref, "--registry", dest, "--allow-gpu-unverified", root=project)
    assert r.rc == 0, r.err
    name = ref.split("/")[-1].split(":")[0]
    target = f"{dest}/{name}:v0.25.1-m3patch"
    line = r.out.strip().splitlines()[-1]
    assert line.startswith(f"pushed {target} sha256:")
    digest = line.split()[-1]
    resp = requests.get(
        registry.api(f"ops/{name}/manifests/v0.25.1-m3patch"),
        headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"}, timeout=10,
    )
    assert resp.status_code == 200 and resp.headers["Docker-Content-Digest"] == digest
    [pushed] = records.pushes(project, image_id)
    assert pushed.data["ref"] == target and pushed.data["digest"] == digest
    assert engine.image(target) is None  # the push tag is not left behind


def test_push_refuses_untested_image(engine: Engine, built: tuple[Path, str, str], registry: RegistryPlace,
                                     unique: str) -> None:
    project, ref, image_id = built
    untested = f"hotfix-test/untested-{unique}:x"
    derive(engine, image_id, untested, "LABEL extra=1")
    try:
        r = cli("push", untested, "--registry", f"{registry.place}/ops", "--allow-gpu-unverified", root=project)
        assert r.rc == 8 and "no passing smoke verdict" in r.last_error and untested in r.last_error
        assert requests.get(registry.api(f"ops/untested-{unique}/tags/list"), timeout=5).status_code == 404
    finally:
        engine.remove_image(untested)


class _Cutter:
    """A loopback port before the worker's registry that cuts every connection at once while ``cutting``
    (a registry restarting, or a proxy before it), then relays each one to the registry untouched."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.cutting = True
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port = int(self.listener.getsockname()[1])
        self._sockets: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        try:
            while True:
                conn = self.listener.accept()[0]
                if self.cutting:
                    conn.close()
                    continue
                up = socket.create_connection(("127.0.0.1", self.upstream))
                self._sockets += [conn, up]
                for a, b in ((conn, up), (up, conn)):
                    pipe = threading.Thread(target=self._pipe, args=(a, b), daemon=True)
                    pipe.start()
                    self._threads.append(pipe)
        except OSError:
            pass  # closed at the end of the test

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for end in (src, dst):
                try:
                    end.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        """Stop listening and end every relayed connection (the engine keeps idle ones open)."""
        for sock in [self.listener, *self._sockets]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in self._threads:
            thread.join(10)
        for sock in [self.listener, *self._sockets]:
            sock.close()


def test_push_retries_while_registry_cuts_connections(built: tuple[Path, str, str], registry: RegistryPlace) -> None:
    """The registry's port closes every connection at once (a registry restarting): tried again until it answers."""
    project, ref, _ = built
    cutter = _Cutter(int(registry.addr.rsplit(":", 1)[1]))
    place = f"127.0.0.1:{cutter.port}/{registry.ns}"
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "build.py"), "--root", str(project), "push", ref, "--registry",
         f"{place}/ops", "--allow-gpu-unverified"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stderr is not None
        err = []
        for line in proc.stderr:
            err.append(line)
            if "retrying" in line:
                cutter.cutting = False  # the registry answers again while the tool waits to retry
                break
        out, rest = proc.communicate(timeout=300)
        err.append(rest)
        assert proc.returncode == 0, "".join(err)
        # A cut connection reaches the engine as an EOF or as a reset, as the timing falls: both are retried.
        assert re.search(r"transient registry error \(connection (cut short \(EOF\)|reset)\)", "".join(err))
        assert out.startswith(f"pushed {place}/ops/")
    finally:
        proc.kill()
        proc.wait()
        cutter.close()


@pytest.mark.parametrize("where", ["refused", "no-name"])
def test_push_to_a_registry_that_cannot_be_reached_fails_at_once(built: tuple[Path, str, str], where: str) -> None:
    """Nothing listens at the address, or its name does not resolve: one attempt, one line, a hint (no retries)."""
    project, ref, _ = built
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed: nothing listens there
    host = f"127.0.0.1:{port}" if where == "refused" else "registry.invalid:5000"
    r = cli("push", ref, "--registry", f"{host}/ops", "--allow-gpu-unverified", root=project)
    # The push's first word with the registry is reading what the tag names now (--replace's question).
    fails(r, f"push of {host}/ops/", "(attempt 1/4)", REFUSED if where == "refused" else NO_NAME)
    assert r.rc == 8
    assert "(attempt 2/4)" not in r.err and "retrying" not in r.err, r.err
    assert f"check the registry address ({host})" in r.err, r.err


def test_verify_with_the_registry_down_is_a_registry_fault(engine: Engine, project: Path, tmp_path: Path) -> None:
    """A registry nobody answers at: verify cannot read the verdicts, and exits 8, as push and image do for a
    registry that is down (one code for one kind of fault), not 20 (keys and envelope files)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pub = tmp_path / "hotfix.pub"
    pub.write_bytes(ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    r = cli("verify", "--definition", "v0.25.1", f"127.0.0.1:{port}/ops/vllm:x", "--key", str(pub), root=project)
    assert r.rc == 8, r.err
    assert f"verify 127.0.0.1:{port}/ops/vllm:x: cannot read its signed verdicts" in r.err, r.err
    # The kind in words, not the HTTP library's message cut inside a word.
    assert f"cannot reach registry 127.0.0.1:{port}: nothing accepts connections at its address" in r.err, r.err


def test_smoke_of_a_registry_image_with_the_registry_down_says_so(engine: Engine, project: Path) -> None:
    """Not "build it with image": the engine lacks it and its registry could not be asked (exit 4, as a missing
    image)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = cli("smoke", f"127.0.0.1:{port}/staging/vllm:x", root=project)
    assert r.rc == 4, r.err
    assert f"its registry 127.0.0.1:{port} cannot be asked for it" in r.err and "build it with" not in r.err, r.err


def test_unknown_definition_for_patch_checks_is_an_error(engine: Engine, base_v0251: str, project: Path) -> None:
    r = cli("smoke", base_v0251, "--definition", "v9.9.9", root=project)
    # The definition is loaded (its [smoke] table too) before the smoke starts: the line names its file.
    assert r.rc != 0 and "images/v9.9.9.toml: no image definition" in r.last_error, r.err
    assert "==> smoke 1/5" not in r.err  # refused before any check ran
