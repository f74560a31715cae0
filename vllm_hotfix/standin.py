"""Stand-in vLLM base images, for machines that cannot pull the real one.

A Debian bookworm root file system (mmdebstrap, ``python3``) with the real
vLLM wheel's Python sources and dist-info unpacked where the upstream image
has them (``/usr/local/lib/python3.12/dist-packages``), a ``.pth`` file that
puts that folder on Debian's Python 3.11 path, and the upstream image's
``ENTRYPOINT ["vllm", "serve"]``. ``importlib.metadata.version("vllm")`` and
``find_spec("vllm")`` answer as in the real image; importing vllm does not
(no torch), and nothing here needs it to.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

from .engine import Engine, ImageInfo, tar_bytes
from .errors import BaseImageError, UpstreamError

log = logging.getLogger(__name__)

ROOTFS_REF = "vllm-hotfix/standin-rootfs:bookworm"
SITE_DIR = "/usr/local/lib/python3.12/dist-packages"
LABEL = "io.vllm-hotfix.standin"


def cache_dir(root: Path) -> Path:
    return Path(os.environ.get("VLLM_HOTFIX_CACHE", root / "build" / "cache"))


def wheel(root: Path, version: str, progress: Callable[[str], None]) -> Path:
    """The real vLLM wheel from PyPI, downloaded once into the cache."""
    folder = cache_dir(root) / "wheels"
    found = sorted(folder.glob(f"vllm-{version}-*.whl"))
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    progress(f"downloading vllm=={version} wheel from PyPI (about 250-310 MB)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(folder), f"vllm=={version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(folder.glob(f"vllm-{version}-*.whl"))
    if proc.returncode != 0 or not found:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise UpstreamError(f"cannot download vllm=={version} from PyPI: {last}",
                            hint="check the release exists (pip index versions vllm) and PyPI is reachable")
    return found[0]


def rootfs(engine: Engine, root: Path, progress: Callable[[str], None]) -> ImageInfo:
    """The bookworm+python3 root image, made once with mmdebstrap."""
    info = engine.image(ROOTFS_REF)
    if info is not None:
        return info
    if shutil.which("mmdebstrap") is None:
        raise BaseImageError("mmdebstrap is not installed", hint="apt-get install -y mmdebstrap")
    folder = cache_dir(root)
    folder.mkdir(parents=True, exist_ok=True)
    tar = folder / "rootfs-bookworm.tar"
    if not tar.exists():
        progress("making a Debian bookworm root file system with python3 (mmdebstrap, ~20-60 s)")
        part = tar.with_suffix(".part.tar")
        proc = subprocess.run(
            ["mmdebstrap", "--quiet", "--variant=essential", "--include=python3", "bookworm", str(part)],
            capture_output=True, text=True,
        )
        if proc.returncode != 0:
            part.unlink(missing_ok=True)
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise BaseImageError(f"mmdebstrap failed: {last}")
        part.rename(tar)
    progress(f"importing {tar.name} as {ROOTFS_REF}")
    return engine.import_rootfs(str(tar), ROOTFS_REF)


def wheel_sources(path: Path, version: str) -> dict[str, bytes]:
    """vllm/**/*.py and the dist-info of a wheel, by path inside it."""
    out: dict[str, bytes] = {}
    with zipfile.ZipFile(path) as zf:
        for name in zf.namelist():
            if (name.startswith("vllm/") and name.endswith(".py")) or name.startswith(
                f"vllm-{version}.dist-info/"
            ):
                out[name] = zf.read(name)
    return out


def make(
    engine: Engine,
    root: Path,
    version: str,
    ref: str,
    progress: Callable[[str], None] | None = None,
    *,
    sources_version: str | None = None,
) -> ImageInfo:
    """Build a stand-in of vLLM ``version`` and tag it ``ref``.

    ``sources_version`` builds from another release's wheel (a base whose
    installed vLLM differs from its tag, for tests).
    """
    say = progress or log.info
    src_version = sources_version or version
    existing = engine.image(ref)
    if existing is not None and existing.labels.get(LABEL) == src_version:
        say(f"stand-in {ref} (vllm {src_version}) already present: {existing.id}")
        return existing
    if existing is not None and LABEL not in existing.labels:
        raise BaseImageError(
            f"{ref} is {existing.id[:19]}, which is not a stand-in; refusing to replace it",
            hint="give the stand-in another name with --ref",
        )
    base = rootfs(engine, root, say)
    whl = wheel(root, src_version, say)
    files = {f"site/{k}": v for k, v in wheel_sources(whl, src_version).items()}
    files["vllm-standin.pth"] = (SITE_DIR + "\n").encode()
    files["Dockerfile"] = (
        f"FROM {base.id}\n"
        f"COPY site/ {SITE_DIR}/\n"
        "COPY vllm-standin.pth /usr/lib/python3/dist-packages/\n"
        f'LABEL {LABEL}="{src_version}"\n'
        'ENTRYPOINT ["vllm", "serve"]\n'
    ).encode()
    say(f"building stand-in {ref} from the vllm {src_version} wheel ({len(files)} files)")
    image_id = engine.build(tar_bytes(files))
    engine.tag(image_id, ref)
    info = engine.image(ref)
    assert info is not None
    return info
