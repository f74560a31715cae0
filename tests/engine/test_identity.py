"""Layer identity: an image is what its patch set makes of its base, or nothing of it runs.

Each hostile image is made the way the assemble builder makes an image (one
layer over the base, the builder's labels), with one thing more: a compiled
module beside the patched source and an edited RECORD, a ``.pth`` hook, a
``sitecustomize.py``, an ``ENV PYTHONPATH`` to an old copy of vLLM, a Python
that answers the runner itself, or a decoy base under the labels of the real
one. Each is refused by ``smoke`` before any check runs (exit 14, the first
difference named), and the signed failing verdict is refused by ``verify``
(exit 24) and by ``push --require-attestation`` (exit 24). The honest images of
the same forge and of the tool's builders still pass.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from conftest import STANDIN_REPO, RegistryPlace, cli, derive, key_pair
from vllm_hotfix.building import assemble, definitions, render
from vllm_hotfix.building import base as baselib
from vllm_hotfix.building import patches as patchlib
from vllm_hotfix.engine import Engine
from vllm_hotfix.engine import labels as L
from vllm_hotfix.tarball import Entry, write
from vllm_hotfix.trust import attest, policy_file

SITE = "usr/local/lib/python3.12/dist-packages"
INDEXER = "vllm/models/minimax_m3/common/indexer"
RECORD = f"{SITE}/vllm-0.25.1.dist-info/RECORD"
ANSWERING_PY = b"""#!/bin/sh
# Prints a passing report for any question, as a Python that answers the runner itself would.
echo '@@vllm-hotfix-runner:report@@ eyJzdGF0dXMiOiAicGFzcyJ9'
"""


def forge(engine: Engine, project: Path, base_ref: str, ref: str, *, extra: Sequence[Entry] = (),
          env: Sequence[str] | None = None, labels: dict[str, str] | None = None) -> str:
    """What the assemble builder writes over ``base_ref``, plus ``extra`` entries, another ``env`` and ``labels``
    over the builder's: loaded, tagged ``ref``; its ID."""
    defn = definitions.load(project, "v0.25.1")
    base = engine.image(base_ref)
    assert base is not None
    patches = patchlib.load_series(project, defn.patch_set, defn.package)
    facts, files, applied = baselib.prepare(engine, defn, base_ref, base, patches, skip_included=True)
    layer = write([*assemble.layer_entries(facts, files), *extra])
    attrs = dict(base.attrs)
    if env is not None:
        attrs["Config"] = {**dict(attrs.get("Config") or {}), "Env": list(env)}
    items = dict(render.labels(defn, facts, files, applied))
    items.update(labels or {})
    config = assemble.image_config(attrs, engine.history(base.id), "sha256:" + hashlib.sha256(layer).hexdigest(),
                                   sorted(items.items()), "forged")
    image_id, data = assemble.archive(config, list((base.attrs.get("RootFS") or {}).get("Layers") or []), layer)
    engine.load(data)
    engine.tag(image_id, ref)
    return image_id


@pytest.fixture
def forged(engine: Engine, base_v0251: str, unique: str) -> Iterator[list[str]]:
    """Refs made by a test, removed after it."""
    made: list[str] = []
    yield made
    for ref in reversed(made):
        # By name: the engine removes the untagged steps a derived image was built from with it.
        engine.remove_image(ref)


def _refused_everywhere(project: Path, ref: str, tmp_path: Path, registry: RegistryPlace, *needles: str) -> None:
    """smoke refuses it (14), naming ``needles``; verify and push --require-attestation refuse its signed verdict
    (24)."""
    key, pub, _ = key_pair(tmp_path)
    envelope, report = tmp_path / "v.dsse.json", tmp_path / "r.json"
    r = cli("smoke", ref, "--gpu", "off", "--sign-key", str(key), "--attestation", str(envelope), "--report",
            str(report), root=project)
    assert r.rc == 14, r.err
    for needle in needles:
        assert needle in r.last_error, r.err
    checks = json.loads(report.read_text())["checks"]
    # Refused before anything ran: the identity check alone, the host's.
    assert [c["name"] for c in checks] == ["layer-identity"] and checks[0]["status"] == "fail", checks
    # The signed fail names what it was judged against, so that it is never taken for a fail of another definition.
    predicate = json.loads(base64.b64decode(json.loads(envelope.read_text())["payload"]))["predicate"]
    assert predicate["definition"] == "v0.25.1", predicate["definition"]
    assert predicate["patch_set_digest"] == policy_file.pinned(project, "v0.25.1").patch_set_digest != ""
    assert checks[0]["data"]["answered_by"] == "filesystem"
    assert "smoke 3/3" not in r.err and "runner" not in r.err
    image_id = json.loads(report.read_text())["image_id"]
    v = cli("verify", "--definition", "v0.25.1",
            image_id, "--attestation", str(envelope), "--key", str(pub), "--allow-gpu-unverified",
            root=project)
    assert v.rc == 24 and "not a pass: layer-identity" in v.last_error, v.err
    p = cli("push", "--definition", "v0.25.1",
            ref, "--registry", f"{registry.place}/ops", "--require-attestation", str(pub),
            "--allow-gpu-unverified", root=project)
    assert p.rc == 24 and "not a pass: layer-identity" in p.last_error, p.err


def test_the_forge_without_extras_is_the_assemble_builders_image_and_passes(
        engine: Engine, base_v0251: str, project: Path, unique: str, forged: list[str]) -> None:
    ref = f"hotfix-test/forge-honest-{unique}:x"
    forged.append(ref)
    image_id = forge(engine, project, base_v0251, ref)
    r = cli("smoke", ref, "--gpu", "off", root=project)
    assert r.rc == 0, r.err
    assert "pass layer-identity: its 1 layer(s) over base" in r.err and image_id in r.out
    # Found by the definition's base reference in the engine, not by the labels (no build record here).
    assert f"definition v0.25.1: {STANDIN_REPO}:v0.25.1 in the engine" in r.err


@pytest.mark.parametrize("what, extra, needle", [
    ("so-beside-with-record", [Entry(f"{SITE}/vllm-0.25.1.dist-info", None, 0o755),
                               Entry(RECORD, b"vllm/models/minimax_m3/common/indexer.cpython-311-x86_64-linux-gnu.so,"
                                             b"sha256=AAAA,4\n", 0o644),
                               Entry(f"{SITE}/{INDEXER}.cpython-311-x86_64-linux-gnu.so", b"\x7fELF", 0o755)],
     f"/{SITE}/vllm-0.25.1.dist-info is not the builder's"),
    ("pth-hook", [Entry(f"{SITE}/zz.pth", b"import os; os.environ['HIJACKED'] = '1'\n", 0o644)],
     f"/{SITE}/zz.pth is not the builder's"),
    ("sitecustomize", [Entry(f"{SITE}/sitecustomize.py", b"import sys\n", 0o644)],
     f"/{SITE}/sitecustomize.py is not the builder's"),
    ("python-that-answers", [Entry("usr/local/bin", None, 0o755), Entry("usr/local/bin/python3", ANSWERING_PY, 0o755)],
     "/usr/local/bin is not the builder's"),
])
def test_a_file_the_builder_does_not_write_is_refused_before_any_check(
        engine: Engine, base_v0251: str, project: Path, unique: str, forged: list[str], tmp_path: Path,
        registry: RegistryPlace, what: str, extra: list[Entry], needle: str) -> None:
    ref = f"hotfix-test/forge-{what}-{unique}:x"
    forged.append(ref)
    forge(engine, project, base_v0251, ref, extra=extra)
    _refused_everywhere(project, ref, tmp_path, registry, "not the product of definition v0.25.1", needle)


def test_an_env_pythonpath_to_an_old_copy_is_refused(engine: Engine, base_v0251: str, project: Path, unique: str,
                                                       forged: list[str], tmp_path: Path,
                                                       registry: RegistryPlace) -> None:
    ref = f"hotfix-test/forge-pythonpath-{unique}:x"
    forged.append(ref)
    base = engine.image(base_v0251)
    assert base is not None
    old = [Entry("opt", None, 0o755), Entry("opt/old", None, 0o755), Entry("opt/old/vllm", None, 0o755),
           Entry("opt/old/vllm/__init__.py", b"", 0o644)]
    forge(engine, project, base_v0251, ref, extra=old, env=[*base.env, "PYTHONPATH=/opt/old"])
    _refused_everywhere(project, ref, tmp_path, registry, "config Env", "PYTHONPATH=/opt/old")


def test_a_decoy_base_named_by_the_labels_of_the_real_one_is_refused(
        engine: Engine, base_v0251: str, project: Path, unique: str, forged: list[str], tmp_path: Path,
        registry: RegistryPlace) -> None:
    decoy = f"hotfix-test/decoy-{unique}:v0.25.1"
    derive(engine, base_v0251, decoy, f"COPY zz.pth /{SITE}/zz.pth", {"zz.pth": b"import os\n"})
    forged.append(decoy)
    ref = f"hotfix-test/forge-decoy-{unique}:x"
    forged.append(ref)
    real = engine.image(base_v0251)
    assert real is not None
    # Built over the decoy, labelled as if over the real base: the labels choose nothing.
    forge(engine, project, decoy, ref, labels={L.BASE_ID: real.id, L.OCI_BASE_DIGEST: real.id,
                                               L.OCI_BASE_NAME: f"{STANDIN_REPO}:v0.25.1"})
    _refused_everywhere(project, ref, tmp_path, registry, "2 layer(s) over the base; the builder writes 1")


def test_a_run_where_the_definition_names_no_base_this_host_has_is_incomplete(
        engine: Engine, base_v0251: str, project: Path, unique: str, forged: list[str]) -> None:
    """No base to compare with is the host's shortcoming, not a fact about the image: incomplete (11), not a fail
    that would stand against the image's pass from a host that has the base."""
    ref = f"hotfix-test/forge-nobase-{unique}:x"
    forged.append(ref)
    forge(engine, project, base_v0251, ref)
    r = cli("smoke", ref, "--gpu", "off", "--base-repo", f"hotfix-test/nowhere-{unique}", root=project)
    assert r.rc == 11 and f"hotfix-test/nowhere-{unique}:v0.25.1 (definition v0.25.1) is not in the engine" in \
        r.last_error, r.err
    assert "incomplete layer-identity" in r.err


def test_a_checkout_that_lacks_the_images_definition_leaves_the_run_incomplete_and_unsigned(
        engine: Engine, base_v0251: str, project: Path, unique: str, forged: list[str], tmp_path: Path) -> None:
    """The definition the image is judged against (here the one its labels name: no build record on this host) is
    not in this checkout: nothing is known of the image, so the run is incomplete (11) and nothing is signed, never a
    signed fail "no base to compare it with" standing against the image's pass from a checkout that has it."""
    ref = f"hotfix-test/forge-nodefinition-{unique}:x"
    forged.append(ref)
    image_id = forge(engine, project, base_v0251, ref)
    elsewhere = tmp_path / "elsewhere"
    for folder in ("images", "patches"):
        shutil.copytree(project / folder, elsewhere / folder)
    (elsewhere / "images" / "v0.25.1.toml").unlink()
    key, _pub, _ = key_pair(tmp_path)
    r = cli("smoke", ref, "--gpu", "off", "--sign-key", str(key), "--report", str(tmp_path / "r.json"),
            root=elsewhere)
    assert r.rc == 11 and "definition v0.25.1, which the image is judged against, is not one this checkout can " \
        "load" in r.last_error, r.err
    assert "incomplete layer-identity" in r.err and "signed verdict" not in r.err
    assert not attest.kept(elsewhere, image_id)
    assert json.loads((tmp_path / "r.json").read_text())["status"] == "incomplete"


def _pin(project: Path, image_id: str, platform: str = "linux/amd64") -> None:
    """Pin the project copy's v0.25.1 definition to ``image_id``, as new-patchset writes it."""
    path = project / "images" / "v0.25.1.toml"
    text = path.read_text().replace("\n[package]", f'\n[base.digests]\n"{platform}" = "{image_id}"\n\n[package]', 1)
    path.write_text(text)
    assert definitions.load(project, "v0.25.1").base_digests == {platform: image_id}


def test_a_pinned_base_is_found_by_digest_and_a_journal_line_naming_another_is_not_taken(
        engine: Engine, base_v0251: str, project: Path, unique: str, forged: list[str]) -> None:
    """Built over a decoy base found under the definition's tag (a mirror's other build), the image is that decoy's
    product, and its build line says so. Unpinned, the host takes the journal's word and the tag's; pinned, the build
    is refused naming both IDs, and the journal's line is not taken for the base: the pinned base, found by its ID,
    is what the image is compared with, and the decoy's layer shows (exit 14)."""
    repo = f"hotfix-test/decoy-{unique}"
    decoy = derive(engine, base_v0251, f"{repo}:v0.25.1", f"COPY zz.pth /{SITE}/zz.pth", {"zz.pth": b"import os\n"})
    forged.append(f"{repo}:v0.25.1")
    out = f"hotfix-test/over-decoy-{unique}:x"
    forged.append(out)
    r = cli("image", "--base", "v0.25.1", "--base-repo", repo, "--tag", out, "--no-smoke", root=project)
    assert r.rc == 0, r.err
    r = cli("smoke", out, "--gpu", "off", root=project)
    assert r.rc == 0 and "definition v0.25.1 pins no base digest" in r.err, r.err

    standin = engine.image(base_v0251)
    assert standin is not None and decoy != standin.id
    _pin(project, standin.id, f"{standin.os}/{standin.architecture}")
    r = cli("smoke", out, "--gpu", "off", root=project)
    assert r.rc == 14, r.err
    assert f"pinned {standin.id[:19]}, found by digest" in r.err and "2 layer(s) over the base" in r.last_error, r.err
    r = cli("image", "--base", "v0.25.1", "--base-repo", repo, "--tag", f"{out}2", "--no-smoke", root=project)
    assert r.rc == 4, r.err
    assert (f"base {repo}:v0.25.1 is {decoy}; definition v0.25.1 pins {standin.id} for "
            f"{standin.os}/{standin.architecture}") in r.last_error, r.err
    assert engine.image(f"{out}2") is None
    # The honest build over the pinned base passes, its base found by the pin.
    honest = f"hotfix-test/over-pinned-{unique}:x"
    forged.append(honest)
    r = cli("image", "--base", "v0.25.1", "--tag", honest, root=project)
    assert r.rc == 0 and "pass layer-identity" in r.err and "pins no base digest" not in r.err, r.err


def test_a_tag_that_moved_off_the_pinned_base_leaves_the_run_incomplete(
        engine: Engine, base_v0251: str, project: Path, unique: str, forged: list[str]) -> None:
    """Another host whose engine has the definition's tag on another image, and not the pinned one: it cannot
    compare the image with its base, which says nothing of the image (11, nothing signed); the message names both."""
    ref = f"hotfix-test/forge-moved-{unique}:x"
    forged.append(ref)
    forge(engine, project, base_v0251, ref)
    _pin(project, "sha256:" + "0" * 64)
    r = cli("smoke", ref, "--gpu", "off", "--definition", "v0.25.1", root=project)
    assert r.rc == 11, r.err
    assert f"{STANDIN_REPO}:v0.25.1 is {base_v0251}; definition v0.25.1 pins sha256:{'0' * 64}" in r.last_error, r.err


def test_an_image_over_a_base_that_already_holds_every_patch_is_refused_in_one_line(
        engine: Engine, base_v0251: str, project: Path, unique: str, forged: list[str]) -> None:
    # The base holds the patched files already, so the patch set changes nothing and its builder writes no patch
    # layer; an image with a layer over that base is not its product (this was an IndexError, exit 70).
    repo = f"hotfix-test/forge-included-{unique}"
    forged.append(f"{repo}:v0.25.1")
    forge(engine, project, base_v0251, f"{repo}:v0.25.1")
    ref = f"{repo}:over"
    forged.append(ref)
    derive(engine, f"{repo}:v0.25.1", ref, "RUN touch /over")
    r = cli("smoke", ref, "--gpu", "off", "--base-repo", repo, root=project)
    assert r.rc == 14 and "changes no file of the base, so its builder writes no patch layer" in r.last_error, r.err
