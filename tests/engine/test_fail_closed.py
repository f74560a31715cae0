"""Integration tier: the journal and the facts cache fail closed.

Each test replays one way, measured before, that got an image pushed by
someone with write access to the build folder: a truncated newest verdict, a
smoke run whose clock was a day behind, a poisoned facts cache. Real engine,
real stand-in base, real registry.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from conftest import RegistryPlace, cli, fails
from vllm_hotfix.engine import Engine
from vllm_hotfix.journal import records
from vllm_hotfix.verdicts import Check, Status, judge

INDEXER = "vllm/models/minimax_m3/common/indexer.py"


def _list(project: Path, image_id: str) -> dict[str, object]:
    r = cli("list", "--json", root=project)
    assert r.rc == 0, r.err
    return next(b for row in json.loads(r.out) for b in row["builds"] if b["image_id"] == image_id)


def test_attack_2_a_truncated_newest_verdict_stops_the_push(built: tuple[Path, str, str],
                                                            registry: RegistryPlace) -> None:
    project, ref, image_id = built
    # A later run of the same image failed (written as smoke writes it), then its entry was cut short.
    failed = records.append_verdict(project, judge(ref, image_id, [Check("patch-landed", Status.FAIL, "edited")],
                                                   gpu_verified=False))
    failed.path.write_bytes(failed.path.read_bytes()[:100])
    r = cli("push", ref, "--registry", f"{registry.place}/ops", "--allow-gpu-unverified", root=project)
    fails(r, str(failed.path), "not a whole JSON entry")
    assert r.rc == 10 and "move it out of" in r.err
    assert records.pushes(project, image_id) == []
    # `list` names the file and goes on; its verdict is not shown as the older pass.
    build = _list(project, image_id)
    assert build["verdict"] == "unreadable" and build["unreadable"] == [str(failed.path)]
    # Renamed so that its name tells no image: still refused (it may be this image's newest).
    hidden = failed.path.with_name(f"{failed.seq:020d}-0123456789ab.json")
    failed.path.rename(hidden)
    r = cli("push", ref, "--registry", f"{registry.place}/ops", "--allow-gpu-unverified", root=project)
    fails(r, str(hidden))
    assert r.rc == 10


def test_attack_3_a_smoke_run_with_its_clock_a_day_behind_is_still_the_newest(
    built: tuple[Path, str, str], registry: RegistryPlace, tmp_path: Path
) -> None:
    project, ref, image_id = built
    [passed] = records.verdicts(project, image_id)
    # Every clock the tool's Python reads, a day behind.
    shim = tmp_path / "clock"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        "import time\n"
        "_ns, _t, _gm = time.time_ns, time.time, time.gmtime\n"
        "time.time_ns = lambda: _ns() - 86400 * 10**9\n"
        "time.time = lambda: _t() - 86400\n"
        "time.gmtime = lambda secs=None: _gm(_t() - 86400 if secs is None else secs)\n"
    )
    model = tmp_path / "model"
    model.mkdir()
    path = os.pathsep.join(p for p in (str(shim), os.environ.get("PYTHONPATH", "")) if p)
    r = cli("smoke", ref, "--serve-model", str(model), "--concurrency", "1", "--requests", "1", root=project,
            env={"PYTHONPATH": path})
    assert r.rc == 7, r.err  # the stand-in has no `vllm serve`: a real failing run
    failed = records.verdicts(project, image_id)[0]
    assert failed.verdict.status is Status.FAIL and failed.path != passed.path
    assert failed.created < passed.created and failed.seq > passed.seq  # a day "older", yet the newest
    r = cli("push", ref, "--registry", f"{registry.place}/ops", "--allow-gpu-unverified", root=project)
    fails(r, "failed its newest smoke run")
    assert r.rc == 8
    assert _list(project, image_id)["verdict"] == "fail"


def test_attack_4_a_poisoned_facts_cache_never_reaches_the_image(
    engine: Engine, base_v0251: str, project: Path, unique: str, tmp_path: Path, registry: RegistryPlace
) -> None:
    ref = f"hotfix-test/poison-{unique}:v0.25.1-m3patch"
    env = {"VLLM_HOTFIX_CACHE": str(tmp_path / "cache"), "XDG_STATE_HOME": str(tmp_path / "state")}
    # The assemble builder: the same inputs give the same image ID, also with --rebuild (no build cache).
    r = cli("image", "--definition", "v0.25.1", "--tag", ref, "--pull", "never", "--no-smoke", "--builder", "assemble",
            root=project, env=env)
    assert r.rc == 0, r.err
    image_id = r.out.split()[-1]
    try:
        [index] = (tmp_path / "cache" / "bases").glob("*/index/facts-*.json")
        outer = json.loads(index.read_text())
        body = json.loads(outer["body"])
        real = body["files"][INDEXER]["sha256"]
        blobs = index.parent.parent / "blobs"
        # One more line in the cached indexer.py, stored under its own hash, and the index pointed at it.
        poisoned = (blobs / real).read_bytes() + b"import os; os.system('id > /tmp/pwned')\n"
        digest = hashlib.sha256(poisoned).hexdigest()
        (blobs / digest).write_bytes(poisoned)
        body["files"][INDEXER]["sha256"] = digest
        outer["body"] = json.dumps(body, sort_keys=True, separators=(",", ":"))
        index.write_text(json.dumps(outer))

        r = cli("image", "--definition", "v0.25.1", "--tag", ref, "--pull", "never", "--rebuild", "--builder",
                "assemble",
                root=project, env=env)
        assert r.rc == 0, r.err
        warnings = [ln for ln in r.err.splitlines() if ln.startswith("WARNING") and "facts cache" in ln]
        assert len(warnings) == 1 and str(index) in warnings[0], r.err
        # The base was read again: the same bytes, so the same image, carrying no extra line.
        assert r.out.split()[-1] == image_id
        originals = {v["original_sha256"] for v in records.builds_of_image(project, image_id)[0].data["files"].values()}
        assert real in originals and digest not in originals
        r = cli("push", ref, "--registry", f"{registry.place}/ops", "--allow-gpu-unverified", root=project, env=env)
        assert r.rc == 0, r.err
    finally:
        engine.remove_image(ref)
