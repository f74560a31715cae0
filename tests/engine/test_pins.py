"""Patch sets that pin Python distributions, built for real.

The SM100 example variant is built from real PyPI wheels on a stand-in that
carries vLLM 0.25.1's own nvidia-cutlass-dsl 4.5.2 sub-wheels and
quack-kernels 0.6.5, with every bad input: one `error:` line, nothing left.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import REPO, STANDIN_REPO, CountingOpens, RegistryPlace, Result, cli, fails
from vllm_hotfix.building import standin
from vllm_hotfix.checking.launchers import facts
from vllm_hotfix.engine import Engine
from vllm_hotfix.journal import records
from vllm_hotfix.judges import integrity
from vllm_hotfix.sitefacts import site as site_files

SM100 = "v0.25.1-sm100"
QUACK_HASH = "e77c5d1f1299b0b38487fe8737df6c6975daa16bca7f7eb883bd1a74d09e7e78"
RACE = f"{STANDIN_REPO}-sm100-race:v0.25.1"
SERIAL = f"{STANDIN_REPO}-sm100-serial:v0.25.1"


@pytest.fixture(scope="module", autouse=True)
def wheel_cache() -> Iterator[None]:
    """The pinned wheels are downloaded once into the repository's cache, not once per test's project."""
    saved = os.environ.get("VLLM_HOTFIX_CACHE")
    os.environ["VLLM_HOTFIX_CACHE"] = str(REPO / "build" / "cache")
    yield
    if saved is None:
        os.environ.pop("VLLM_HOTFIX_CACHE")
    else:
        os.environ["VLLM_HOTFIX_CACHE"] = saved


@pytest.fixture(scope="module")
def sm100_bases(engine: Engine) -> Iterator[dict[str, str]]:
    def make(mode: str, ref: str) -> str:
        # A connection of its own: one Engine's connection serves one thread.
        return standin.make(Engine.connect(), REPO, "0.25.1", ref, lambda _l: None, deps=mode).id

    try:
        # Side by side: each is mostly the engine installing the same wheels, the only difference the order.
        with ThreadPoolExecutor(2) as pool:
            race, serial = pool.submit(make, "race", RACE), pool.submit(make, "serial", SERIAL)
            made = {"race": race.result(), "serial": serial.result()}
        yield made
    finally:
        # Also when one of the two failed: the other's image goes.
        for ref in (RACE, SERIAL):
            info = engine.image(ref)
            if info is not None and standin.LABEL in info.labels:
                engine.untag(ref)
                engine.remove_untagged(info.id, force=False)


def _integrity(engine: Engine, image: str) -> dict:
    site = standin.SITE_DIR
    found = integrity.scan(site_files.read_site(engine, image, site), site, "vllm")
    return integrity.judge(found, "vllm", None).check


def test_integrity_fails_the_sub_wheel_race_and_passes_the_serial_install(engine: Engine,
                                                                        sm100_bases: dict[str, str]) -> None:
    race = _integrity(engine, sm100_bases["race"])
    assert race["status"] == "fail"
    assert "claimed with different content by nvidia-cutlass-dsl-libs-base and nvidia-cutlass-dsl-libs-cu13" \
        in race["detail"] and "are a mix" in race["detail"]
    serial = _integrity(engine, sm100_bases["serial"])
    assert serial["status"] == "pass", serial["detail"]
    assert "consistently hold nvidia-cutlass-dsl-libs-cu13's content" in serial["detail"]
    # vllm requires nvidia-cutlass-dsl[cu13]: the extra's sub-wheel is covered.
    assert "nvidia-cutlass-dsl-libs-cu13" in serial["data"]["distributions"]


def _inspect(ref: str) -> dict:  # type: ignore[type-arg]
    return json.loads(subprocess.run(["docker", "image", "inspect", ref], capture_output=True, text=True,
                                     check=True).stdout)[0]


def _added_layers(image: str, base: str) -> list[tuple[str, list[tuple[str, int, Callable[[], bytes]]]]]:
    """Each layer ``image`` has on top of ``base``: its name and its files (path, size, a reader of the bytes).

    Read from the engine's own overlay2 folders where this process can see
    them (a local engine: seconds), else from ``docker save`` of the whole
    image; either way without the tool.
    """
    info, below = _inspect(image), len(_inspect(base)["RootFS"]["Layers"])
    added = len(info["RootFS"]["Layers"]) - below
    driver = info.get("GraphDriver") or {}
    data = driver.get("Data") or {}
    # overlay2: UpperDir is the top layer, LowerDir the ones under it, nearest first.
    dirs = [data.get("UpperDir", ""), *(data.get("LowerDir") or "").split(":")][:added]
    if driver.get("Name") == "overlay2" and len(dirs) == added and all(os.path.isdir(d) for d in dirs):
        out = []
        for folder in reversed(dirs):
            paths = [f for f in Path(folder).rglob("*") if f.is_file() and not f.is_symlink()]
            out.append((folder, [(str(f.relative_to(folder)), f.stat().st_size, f.read_bytes) for f in paths]))
        return out
    saved = subprocess.run(["docker", "save", image], capture_output=True, check=True).stdout
    out = []
    with tarfile.open(fileobj=io.BytesIO(saved)) as outer:
        manifest = json.load(outer.extractfile("manifest.json"))  # type: ignore[arg-type]
        for name in manifest[0]["Layers"][below:]:
            layer = tarfile.open(fileobj=io.BytesIO(outer.extractfile(name).read()))  # type: ignore[union-attr]
            out.append((name, [(m.name, m.size, lambda m=m, layer=layer: layer.extractfile(m).read())  # type: ignore
                               for m in layer.getmembers() if m.isfile()]))
    return out


def test_sm100_variant_remedies_quack_and_leaves_no_wheel_in_any_layer(
        engine: Engine, sm100_bases: dict[str, str], project: Path, unique: str, registry: RegistryPlace) -> None:
    ref = f"hotfix-test/sm100-{unique}:v0.25.1-m3patch-sm100"
    base_repo = RACE.split(":")[0]
    r = cli("image", "--definition", SM100, "--base-repo", base_repo, "--tag", ref, "--pull", "never", root=project)
    assert r.rc == 0, r.err
    image_id = r.out.split()[-1]
    try:
        info = engine.image(ref)
        assert info is not None and info.id == image_id
        pinned = json.loads(info.labels["io.vllm-hotfix.pins"])
        assert pinned["quack-kernels"]["before"] == "0.6.5" and pinned["quack-kernels"]["after"] == "0.6.4"
        assert pinned["quack-kernels"]["sha256"] == QUACK_HASH
        assert pinned["nvidia-cutlass-dsl-libs-cu13"]["before"] == "4.5.2"
        assert json.loads(info.labels["io.vllm-hotfix.pins.accepted"])[0]["requirer"] == "vllm"

        build = records.builds_of_image(project, image_id)[0].data["pins"]
        assert build["pip_check"]["added"] == []
        assert [a["complaint"] for a in build["pip_check"]["accepted"]] == [
            "vllm 0.25.1 has requirement nvidia-cutlass-dsl[cu13]==4.5.2, but you have nvidia-cutlass-dsl 4.6.2."]
        verdict = records.judgement(project, image_id)
        assert verdict is not None and verdict.verdict.status == "pass"
        checks = {c["name"]: c for c in verdict.verdict.to_dict()["checks"]}
        assert checks["quack-activation-sub-packed-f32x2"]["status"] == "pass"
        assert checks["integrity"]["status"] == "pass"
        assert checks["pin:quack-kernels"]["status"] == "pass"
        assert "quack-kernels 0.6.4" in checks["env-report"]["detail"]

        # Independently of the tool: the old versions' files are gone, and pip
        # check names nothing missing that the base had, nor a new conflict
        # other than the accepted one.
        # (pip leaves the emptied folders; no file of the old versions stays.)
        gone = engine.run(image_id, ["sh", "-c", (
            "ls -d /usr/local/lib/python3*/dist-packages/*-0.6.5.dist-info "
            "/usr/local/lib/python3*/dist-packages/*-4.5.2.dist-info 2>/dev/null; "
            "find /usr/local/lib/python3*/dist-packages/nvidia_cutlass_dsl/python_packages -type f")])
        assert gone.stdout.strip() == ""

        def complaints(image: str) -> tuple[set[str], set[str]]:
            out = engine.run(image, ["python3", "-m", "pip", "check"]).stdout.splitlines()
            missing = {m.group(1) for ln in out if (m := re.match(r".* requires (\S+), which is not installed", ln))}
            conflicts = {re.sub(r", but you have .*", "", ln.split(" ", 2)[2]) + " " + ln.split()[0]
                         for ln in out if "has requirement" in ln}
            return missing, conflicts
        missing_before, conflicts_before = complaints(sm100_bases["race"])
        missing_after, conflicts_after = complaints(image_id)
        assert {re.sub(r"[-_.]+", "-", m).lower() for m in missing_after} <= \
            {re.sub(r"[-_.]+", "-", m).lower() for m in missing_before} | {"nvidia-cutlass-dsl"}, missing_after
        assert conflicts_after - conflicts_before == {"has requirement nvidia-cutlass-dsl[cu13]==4.5.2 vllm"}

        # No layer the build added holds a wheel, by name or by content.
        wheel_hashes = {w.get("sha256") for w in pinned.values()}
        layers = _added_layers(image_id, sm100_bases["race"])
        assert len(layers) == 2  # the pins' RUN and the patched files' COPY
        for name, files in layers:
            assert files, f"{name}: no file read"
            for path, size, read in files:
                assert not path.endswith(".whl"), f"{name}: {path}"
                if size > 4096:
                    assert hashlib.sha256(read()).hexdigest() not in wheel_hashes, f"{name}: {path}"

        # The push gate reads the pinned distributions from the image's layers: no container of the image starts
        # (its Python, configured as the image says, never answers for it; a container only created, never
        # started, is how the engine hands out an image's files).
        # The stand-in base has no torch, so the pins' import check of quack is skipped there (it needs a module no
        # installed distribution provides), which the policy counts even under --allow-gpu-unverified (it needs no
        # GPU). As on an image that has torch, it is taken as passed in the journal's entry here, so that the gate
        # goes on to the re-check of the pinned files this test is about.
        entry = records.verdicts(project, image_id)[0].path
        data = json.loads(entry.read_text())
        for check in data["checks"]:
            if check["name"] == "import:quack" and check["status"] == "skip":
                check["status"] = "pass"
        entry.write_text(json.dumps(data))
        since = time.time()
        pushed = cli("push", ref, "--registry", f"{registry.place}/ops", "--allow-gpu-unverified", root=project)
        assert pushed.rc == 0, pushed.err
        started = [e for e in engine.api.events(since=since, until=time.time() + 1, decode=True,
                                                filters={"type": "container", "event": "start"})
                   if (e.get("Actor") or {}).get("Attributes", {}).get("image") in (image_id, ref)]
        assert started == [], started
        # One pass over the image's facts (issue 63): its site folders are read once for the pins' judge and the
        # file checks alike (each read them again before: the image's files opened twice or more).
        counting = CountingOpens(engine)
        assert facts.landed_problem(counting, project, info) is None  # type: ignore[arg-type]
        assert counting.opened.count(image_id) == 1, counting.opened

        # What the pins must be is pins.txt's, read again at push time: once it
        # names another version, the image it no longer describes is not pushed.
        pin_file = project / "patches" / SM100 / "pins.txt"
        pin_file.write_text(pin_file.read_text().replace("quack-kernels==0.6.4", "quack-kernels==0.6.3"))
        refused = cli("push", ref, "--registry", f"{registry.place}/ops", "--allow-gpu-unverified", root=project)
        fails(refused, "refusing to push", "layer-identity", "pins.txt pins quack-kernels 0.6.3")
        assert refused.rc == 8
    finally:
        engine.remove_image(ref)
        engine.remove_untagged(image_id)


def test_render_shows_the_pin_step_without_a_loopback_address(engine: Engine, sm100_bases: dict[str, str],
                                                               project: Path) -> None:
    args = ("render", "--definition", SM100, "--base-repo", RACE.split(":")[0], "--pull", "never")
    first, again = cli(*args, root=project), cli(*args, root=project)
    assert first.rc == 0, first.err
    assert first.out == again.out
    text = first.out
    assert "ARG VLLM_HOTFIX_WHEELS" in text
    assert "#   quack-kernels 0.6.5 -> 0.6.4 (quack_kernels-0.6.4-py3-none-any.whl)" in text
    assert text.count("--no-deps --force-reinstall --require-hashes") == 7
    assert "127.0.0.1" not in text
    assert text.index("RUN ") < text.index("COPY files/")


def _one_pin_set(project: Path, text: str) -> None:
    (project / "patches" / SM100 / "pins.txt").write_text(text)


def _quack(hash_: str = QUACK_HASH, extra: str = "") -> str:
    return f"quack-kernels==0.6.4 \\\n    --hash=sha256:{hash_}\n{extra}"


def _nothing_left(engine: Engine, ref: str, err: str) -> None:
    assert engine.image(ref) is None, f"{ref} was tagged despite the failure"
    built = re.findall(r"Successfully built ([0-9a-f]{12})", err)
    for image_id in built:
        assert engine.image(image_id) is None, f"image {image_id} of the failed build is still there"


def test_a_wrong_hash_is_named_before_anything_is_built(engine: Engine, sm100_bases: dict[str, str],
                                                        project: Path, unique: str) -> None:
    _one_pin_set(project, _quack("0" * 64))
    ref = f"hotfix-test/pins-bad-{unique}:x"
    r = cli("image", "--definition", SM100, "--base-repo", RACE.split(":")[0], "--tag", ref, "--pull", "never",
            root=project)
    fails(r, "pins.txt", "line 1: quack-kernels==0.6.4", "has sha256 " + QUACK_HASH, "not one the pin lists")
    assert r.rc == 12
    assert "Step 1/" not in r.err
    _nothing_left(engine, ref, r.err)


def test_the_assemble_builder_refuses_a_pinned_set_before_any_work(engine: Engine, sm100_bases: dict[str, str],
                                                                   project: Path, unique: str) -> None:
    _one_pin_set(project, _quack())
    ref = f"hotfix-test/pins-asm-{unique}:x"
    r = cli("image", "--definition", SM100, "--base-repo", RACE.split(":")[0], "--tag", ref, "--pull", "never",
            "--builder", "assemble", root=project)
    fails(r, "pins.txt", "--builder assemble cannot")
    assert "resolving base" not in r.err
    _nothing_left(engine, ref, r.err)


def test_a_missing_wheel_is_named(engine: Engine, sm100_bases: dict[str, str], project: Path, unique: str,
                                  tmp_path: Path) -> None:
    _one_pin_set(project, _quack())
    house = tmp_path / "wheels"
    house.mkdir()
    ref = f"hotfix-test/pins-bad-{unique}:x"
    r = cli("image", "--definition", SM100, "--base-repo", RACE.split(":")[0], "--tag", ref, "--pull", "never",
            "--wheelhouse", str(house), root=project)
    fails(r, "line 1: quack-kernels==0.6.4", f"no wheel in {house}")
    assert r.rc == 12
    _nothing_left(engine, ref, r.err)


def test_a_wheel_for_another_python_is_refused(engine: Engine, sm100_bases: dict[str, str], project: Path,
                                               unique: str, tmp_path: Path) -> None:
    house = tmp_path / "wheels"
    # The real wheel for CPython 3.12: the stand-in's Python is 3.11.
    got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
                          "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312",
                          "--platform", "manylinux_2_28_x86_64", "-d", str(house),
                          "nvidia-cutlass-dsl-libs-base==4.6.2"], capture_output=True, text=True)
    assert got.returncode == 0, got.stderr
    example = (REPO / "patches" / SM100 / "pins.txt").read_text()
    block = re.search(r"^nvidia-cutlass-dsl-libs-base==4\.6\.2(?: \\\n\s+--hash=sha256:[0-9a-f]{64})+", example,
                      re.M)
    assert block is not None
    _one_pin_set(project, block.group(0) + "\n")
    ref = f"hotfix-test/pins-bad-{unique}:x"
    r = cli("image", "--definition", SM100, "--base-repo", RACE.split(":")[0], "--tag", ref, "--pull", "never",
            "--wheelhouse", str(house), root=project)
    fails(r, "nvidia-cutlass-dsl-libs-base==4.6.2", "no wheel fits the image (Python 3.11",
          "nvidia_cutlass_dsl_libs_base-4.6.2-cp312-cp312-manylinux_2_28_x86_64.whl")
    assert r.rc == 12
    _nothing_left(engine, ref, r.err)


def test_a_pin_that_breaks_a_requirement_fails_unless_accepted(engine: Engine, sm100_bases: dict[str, str],
                                                               project: Path, unique: str) -> None:
    # quack-kernels 0.6.4 alone needs nvidia-cutlass-dsl 4.6.2; the base has 4.5.2.
    _one_pin_set(project, _quack())
    ref = f"hotfix-test/pins-bad-{unique}:x"
    base_repo = RACE.split(":")[0]
    r = cli("image", "--definition", SM100, "--base-repo", base_repo, "--tag", ref, "--pull", "never", "--no-smoke",
            root=project)
    fails(r, "pins.txt: the pins break a requirement",
          "quack-kernels 0.6.4 has requirement nvidia-cutlass-dsl==4.6.2, but you have nvidia-cutlass-dsl 4.5.2")
    assert r.rc == 12
    assert re.findall(r"Successfully built ([0-9a-f]{12})", r.err), "the check must run on a built image"
    _nothing_left(engine, ref, r.err)

    _one_pin_set(project, _quack(extra="# accept: quack-kernels -> nvidia-cutlass-dsl: tested together here\n"))
    ok = cli("image", "--definition", SM100, "--base-repo", base_repo, "--tag", ref, "--pull", "never", "--no-smoke",
             root=project)
    assert ok.rc == 0, ok.err
    try:
        accepted = json.loads(engine.image(ref).labels["io.vllm-hotfix.pins.accepted"])  # type: ignore[union-attr]
        assert accepted == [{"requirer": "quack-kernels", "requirement": "nvidia-cutlass-dsl",
                             "reason": "tested together here"}]
        assert "accepted by pins.txt: quack-kernels 0.6.4 has requirement" in ok.err
    finally:
        engine.remove_image(ref)
        engine.remove_untagged(ok.out.split()[-1])


def test_new_patchset_pin_writes_the_hash_of_the_wheel_that_fits(engine: Engine, sm100_bases: dict[str, str],
                                                                 project: Path) -> None:
    path = project / "patches" / SM100 / "pins.txt"
    path.unlink()
    r = cli("new-patchset", "--definition", SM100, "--base-repo", RACE.split(":")[0], "--pull", "never",
            "--pin", "quack-kernels==0.6.4", root=project)
    assert r.rc == 0, r.err
    assert "Python 3.11" in r.out
    assert path.read_text() == f"quack-kernels==0.6.4 \\\n    --hash=sha256:{QUACK_HASH}\n"
    again = cli("new-patchset", "--definition", SM100, "--base-repo", RACE.split(":")[0], "--pull", "never",
                "--pin", "quack-kernels==0.6.5", root=project)
    fails(again, "already pins it (line 1")
    assert path.read_text().count("quack-kernels") == 1


def test_check_upstream_says_a_newer_release_contradicts_the_pins(tmp_path: Path) -> None:
    r = cli("check-upstream", "--patches", SM100, "--base", "v0.27.0", "--from-wheel")
    _contradicts(r)


def test_check_upstream_reads_the_pins_verdicts_from_the_release_image(base_v0270: str, project: Path) -> None:
    r = cli("check-upstream", "--patches", SM100, "--base", "v0.27.0", "--pull", "never", "--json", root=project)
    assert r.rc == 12, r.err  # contradicting pins: the set still needs attention
    judged = {j["pin"]: j["verdict"] for j in json.loads(r.out)["pins"]}
    assert judged["quack-kernels==0.6.4"] == "contradicts"
    assert judged["nvidia-cutlass-dsl==4.6.2"] == "contradicts"
    assert judged["nvidia-cuda-nvdisasm==13.3.73"] == "unconstrained"


def _contradicts(r: Result) -> None:
    # The patch is included, but the pins contradict the release: not "needs no hotfix", and not exit 0.
    assert r.rc == 12, r.err
    fails(r, "quack-kernels==0.6.4", "the set still needs attention")
    assert "needs no hotfix" not in r.err
    assert "pin quack-kernels==0.6.4: contradicts (vllm 0.27.0 requires quack-kernels ==0.6.1)" in r.out
    assert "pin nvidia-cutlass-dsl==4.6.2: contradicts (vllm 0.27.0 requires nvidia-cutlass-dsl ==4.6.0)" in r.out
    assert "0001-minimax-m3-topk-buffer-layout.patch: included" in r.out
