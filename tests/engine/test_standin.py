"""Integration tier: stand-in bases made by two processes at once share one root image.

The stand-ins' root file system is the tool's cache in the engine
(``vllm-hotfix/standin-rootfs``). Two runs that find it missing at the same
time (two ``standin`` commands, two test workers) must import it once: a
second import moves the tag and leaves the first one untagged in the engine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO, docker_cli
from vllm_hotfix.building import standin
from vllm_hotfix.engine import Engine

MAKE_ROOTFS = (
    "import sys; from pathlib import Path; from vllm_hotfix.building import standin; "
    "from vllm_hotfix.engine import Engine; "
    "print(standin.rootfs(Engine.connect(), Path(sys.argv[1]), lambda _l: None).id)"
)


def test_two_processes_missing_the_root_image_import_it_once(engine: Engine, base_v0251: str,
                                                             tmp_path: Path) -> None:
    kept = engine.image(standin.ROOTFS_REF)
    assert kept is not None  # the session's stand-in made it
    # A cache of the test's own holding the root file system tar (the engine's image, exported), so that
    # the two processes import and do not run mmdebstrap.
    cache = tmp_path / "cache"
    cache.mkdir()
    box = docker_cli("create", kept.id, "true").strip()
    try:
        docker_cli("export", "-o", str(cache / f"rootfs-{standin.ROOTFS}.tar"), box)
    finally:
        docker_cli("rm", box)
    env = dict(os.environ, VLLM_HOTFIX_CACHE=str(cache))
    spare = f"{standin.ROOTFS_REF}-kept-by-test"
    engine.tag(kept.id, spare)
    engine.untag(standin.ROOTFS_REF)
    made: set[str] = set()
    try:
        procs = [subprocess.Popen([sys.executable, "-c", MAKE_ROOTFS, str(REPO)], cwd=REPO, text=True, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
        outs = [p.communicate(timeout=300) for p in procs]
        assert all(p.returncode == 0 for p in procs), [err for _out, err in outs]
        made = {out.strip() for out, _err in outs}
        now = engine.image(standin.ROOTFS_REF)
        assert now is not None and made == {now.id}, made  # one import, and both were given it
    finally:
        # The root image the session's stand-ins were made from gets its tag back; the imported one goes.
        engine.tag(kept.id, standin.ROOTFS_REF)
        engine.untag(spare)
        for image_id in made - {kept.id}:
            if engine.image(image_id) is not None:
                engine.remove_untagged(image_id, force=False)
