"""File facts come from the image's layers: an edited journal and a lying interpreter cannot get an image pushed.

Real engine, real registry, real stand-in images. Journal entries are edited
here only the way a person with write access to build/records could edit them.
"""

from __future__ import annotations

import json
from pathlib import Path

import requests

from conftest import CountingOpens, RegistryPlace, cli, derive, fails
from vllm_hotfix.checking.launchers import facts
from vllm_hotfix.engine import Engine
from vllm_hotfix.journal import records

SITE = "/usr/local/lib/python3.12/dist-packages"
INDEXER = "vllm/models/minimax_m3/common/indexer.py"
UNTOUCHED = "vllm/envs.py"  # in RECORD, not touched by the patch set
# Answers every probe with a pass, whatever it was asked.
LIAR = "#!/bin/sh\necho '{\"checks\": [{\"name\": \"patch-landed\", \"status\": \"pass\", \"detail\": \"ok\"}]}'\n"


def forge_pass(project: Path, template: Path, image_id: str) -> Path:
    """A passing, GPU-verified verdict entry for ``image_id``, newer than any other."""
    data = json.loads(template.read_text())
    data.update(image_id=image_id, status="pass", gpu_verified=True, seq=99999999999999999999)
    forged = template.with_name("99999999999999999999-forged.json")
    forged.write_text(json.dumps(data))
    return forged


def not_pushed(registry: RegistryPlace, ref: str) -> None:
    name = ref.split("/")[1].split(":")[0]
    assert requests.get(registry.api(f"ops/{name}/tags/list"), timeout=5).status_code == 404


def test_unpatched_base_with_copied_labels_and_a_lying_python_is_refused(
    engine: Engine, built: tuple[Path, str, str], registry: RegistryPlace, unique: str
) -> None:
    project, _ref, image_id = built
    info = engine.image(image_id)
    assert info is not None
    base_id = info.labels["io.vllm-hotfix.base.id"]
    fake = f"hotfix-test/liar-{unique}:x"
    labels = "LABEL " + " ".join(f"{k}={json.dumps(v)}" for k, v in sorted(info.labels.items()))
    fake_id = derive(engine, base_id, fake, "COPY python3 /usr/local/bin/python3\n" + labels.replace("$", "\\$"),
                     files={"python3": LIAR.encode()}, modes={"python3": 0o755})
    try:
        # The image's own interpreter says pass to anything it is asked.
        said = engine.run(fake_id, ["python3", "-c", "print(1)"], timeout=60)
        assert '"status": "pass"' in said.stdout
        forge_pass(project, records.verdicts(project, image_id)[0].path, fake_id)
        # The forged entry is the built image's own CPU smoke: under --allow-gpu-unverified it meets the policy, so
        # the gate goes on to re-check the image's files, whatever the journal says.
        r = cli("push", fake, "--registry", f"{registry.place}/ops", "--allow-gpu-unverified", root=project)
        fails(r, "refusing to push", "layer-identity", "/usr/local/bin is not the builder's")
        assert r.rc == 8
        not_pushed(registry, fake)
    finally:
        engine.remove_image(fake)


def test_edited_verdict_of_a_file_changed_outside_the_patch_set_is_refused(
    engine: Engine, built: tuple[Path, str, str], registry: RegistryPlace, unique: str
) -> None:
    project, _ref, image_id = built
    changed = f"hotfix-test/outside-{unique}:x"
    changed_id = derive(engine, image_id, changed, f"RUN echo 'x = 1' >> {SITE}/{UNTOUCHED}")
    try:
        r = cli("smoke", changed, "--gpu", "off", root=project)
        fails(r, "not the product of definition v0.25.1")
        assert r.rc == 14
        [verdict] = records.verdicts(project, changed_id)
        data = json.loads(verdict.path.read_text())
        # Edited into a pass with the patched image's checks copied in, so that the journal's entry meets the
        # policy (under --allow-gpu-unverified) and the gate goes on to re-check the files.
        checks = json.loads(records.verdicts(project, image_id)[0].path.read_text())["checks"]
        data.update(status="pass", gpu_verified=True, checks=checks)
        verdict.path.write_text(json.dumps(data))
        r = cli("push", changed, "--registry", f"{registry.place}/ops", "--allow-gpu-unverified", root=project)
        # The push reads the layers again, whatever the journal says.
        fails(r, "refusing to push", "layer-identity", "2 layer(s) over the base")
        assert r.rc == 8
        not_pushed(registry, changed)
    finally:
        engine.remove_image(changed)


def test_file_checks_say_they_were_read_from_the_filesystem(built: tuple[Path, str, str]) -> None:
    project, _ref, image_id = built
    [verdict] = records.verdicts(project, image_id)
    answered = {c.name: (c.data or {}).get("answered_by") for c in verdict.verdict.checks}
    assert answered["patch-landed"] == answered["integrity"] == answered["package-version"] == "filesystem"
    assert answered["import-location"] == answered["env-report"] == "image-python"
    # The stand-in base holds vLLM's Python sources only: its compiled files are named, as the base's.
    compiled = next(c for c in verdict.verdict.checks if c.name == "compiled-files")
    assert "vllm/_C_stable_libtorch.abi3.so (the base's)" in compiled.detail
    assert verdict.verdict.gpu_verified is False


def test_the_push_gates_recheck_reads_the_images_files_in_one_pass(engine: Engine,
                                                                   built: tuple[Path, str, str]) -> None:
    """The re-check reads the image's site folders once and hands each judge what it needs (issue 63); an image
    without pins (the pinned one: test_pins)."""
    project, _ref, image_id = built
    info = engine.image(image_id)
    assert info is not None
    counting = CountingOpens(engine)
    lines: list[str] = []
    problem = facts.landed_problem(counting, project, info, lines.append)  # type: ignore[arg-type]
    assert problem is None, problem
    assert counting.opened.count(image_id) == 1, (counting.opened, lines)
