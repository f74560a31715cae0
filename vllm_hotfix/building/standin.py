"""Stand-in vLLM base images, for machines that cannot pull the real one.

A Debian bookworm root file system (mmdebstrap, ``python3``) with the real
vLLM wheel's Python sources and dist-info unpacked where the upstream image
has them (``/usr/local/lib/python3.12/dist-packages``), a ``.pth`` file that
puts that folder on Debian's Python 3.11 path, and the upstream image's
``ENTRYPOINT ["vllm", "serve"]``. ``importlib.metadata.version("vllm")`` and
``find_spec("vllm")`` answer as in the real image; importing vllm does not
(no torch), and nothing here needs it to. Debian's pip is there too, as pip
is in the upstream image, so that pinned distributions can be installed.

With ``deps`` the stand-in also carries what the upstream 0.25.1 image ships
for the SM100 attention path, from the real wheels: nvidia-cutlass-dsl 4.5.2
with its two sub-wheels (``-libs-base`` and ``-libs-cu13``, which claim 180
paths in common, 99 of them with different content) and quack-kernels 0.6.5
(whose ``quack.activation`` lacks ``sub_packed_f32x2``). ``deps="serial"``
unpacks the sub-wheels one after the other, ``-libs-cu13`` last, as upstream's
workaround did; ``deps="race"`` leaves the shared paths as two unpacks running
at once can: some with one sub-wheel's content, some with the other's.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import zipfile
from collections.abc import Callable
from pathlib import Path

from ..engine import Engine, ImageInfo, labels, split_reference
from ..errors import BaseImageError, PushError, UpstreamError
from ..journal.atomic import one_writer
from ..registry import client as registry
from ..registry import write
from ..tarball import tar_bytes
from . import platforms, wheels
from .platforms import Platform
from .sources import cache_dir

log = logging.getLogger(__name__)

# The root file system carries Debian's pip; a new name, so that a cached one
# without pip (made before) is never reused for it.
ROOTFS = "bookworm-pip"
ROOTFS_REF = f"vllm-hotfix/standin-rootfs:{ROOTFS}"
ROOTFS_PACKAGES = "python3,python3-pip"
# What the essential variant brings that a stand-in of another architecture needs beside them: a shell, the
# usual tools, the users.
FOREIGN_EXTRA = "dash,coreutils,base-passwd"
SITE_DIR = "/usr/local/lib/python3.12/dist-packages"
LABEL, LABEL_ROOTFS, LABEL_DEPS = labels.STANDIN, labels.STANDIN_ROOTFS, labels.STANDIN_DEPS
DEPS_MODES = ("race", "serial")
# (name, version) in the order they are unpacked; the two sub-wheels share paths.
SM100_DEPS = (
    ("nvidia-cutlass-dsl-libs-base", "4.5.2"),
    ("nvidia-cutlass-dsl-libs-cu13", "4.5.2"),
    ("nvidia-cutlass-dsl", "4.5.2"),
    ("quack-kernels", "0.6.5"),
)


def rootfs(engine: Engine, root: Path, progress: Callable[[str], None], plat: Platform | None = None) -> ImageInfo:
    """The bookworm+python3 root image (of ``plat``; default the engine's own), made once with mmdebstrap.

    The root file system tar is cached per Debian architecture; another
    architecture's is unpacked without running its packages' scripts (seconds,
    where running them under emulation took minutes).
    """
    ref = ROOTFS_REF if plat is None else f"{ROOTFS_REF}-{plat.debian_arch}"

    def made() -> ImageInfo | None:
        info = engine.image(ref)
        return info if info is not None and (plat is None or info.architecture == plat.architecture) else None

    if (info := made()) is not None:
        return info
    if shutil.which("mmdebstrap") is None:
        raise BaseImageError("mmdebstrap is not installed", hint="apt-get install -y mmdebstrap")
    folder = cache_dir(root)
    folder.mkdir(parents=True, exist_ok=True)
    tar = folder / f"rootfs-{ROOTFS}.tar"
    cmd = ["mmdebstrap", "--quiet", "--variant=essential", f"--include={ROOTFS_PACKAGES}"]
    if plat is not None:
        # The tar made without --architectures is this machine's own.
        own = plat.machine == wheels.host_machine() and tar.exists()
        tar = tar if own else folder / f"rootfs-{ROOTFS}-{plat.debian_arch}.tar"
        cmd.append(f"--architectures={plat.debian_arch}")
        if plat.machine != wheels.host_machine():
            # Another architecture: its packages unpacked with their dependencies, none of their scripts run
            # (running them is what takes minutes under emulation). Python, pip and a shell work so; the users
            # base-passwd's scripts would write are copied from its masters.
            cmd = ["mmdebstrap", "--quiet", "--variant=extract", f"--include={ROOTFS_PACKAGES},{FOREIGN_EXTRA}",
                   f"--architectures={plat.debian_arch}",
                   '--customize-hook=cp "$1/usr/share/base-passwd/passwd.master" "$1/etc/passwd"; '
                   'cp "$1/usr/share/base-passwd/group.master" "$1/etc/group"']
    with one_writer(tar):
        # Imported under the lock too: a second process made to wait here finds the image, not only the tar
        # (importing it again would leave the first import untagged).
        if (info := made()) is not None:
            return info
        if not tar.exists():
            foreign = plat is not None and plat.machine != wheels.host_machine()
            arch = f" {plat.debian_arch}" if plat else ""
            progress(f"making a Debian bookworm{arch} root file system with python3 "
                     f"and pip (mmdebstrap, {'its packages unpacked, no scripts run' if foreign else '~30-90 s'})")
            part = tar.with_suffix(".part.tar")
            proc = subprocess.run([*cmd, "bookworm", str(part)], capture_output=True, text=True)
            if proc.returncode != 0:
                part.unlink(missing_ok=True)
                last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                raise BaseImageError(f"mmdebstrap failed: {last}")
            part.rename(tar)
        progress(f"importing {tar.name} as {ref}")
        return engine.import_rootfs(str(tar), ref, str(plat) if plat is not None else None)


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


def dep_wheel(root: Path, name: str, version: str, progress: Callable[[str], None], machine: str) -> Path:
    """A dependency's real wheel for the stand-in's Python (3.11) on ``machine``, cached."""
    folder = cache_dir(root) / "wheels"
    target = wheels.Target("3.11", "cp", ("abi3", "cp311", "none"), (f"manylinux_2_28_{machine}",))
    # Under the lock, as wheels.release: two stand-ins made side by side share the cache.
    with one_writer(folder / f"{name}-{version}-{machine}"):
        found = wheels.for_machine(wheels.find(folder, name, version), machine)
        if not found:
            progress(f"downloading {name}=={version} from PyPI")
            found = wheels.for_machine(wheels.download(name, version, folder, target), machine)
    if not found:
        raise UpstreamError(f"pip download {name}=={version} gave no wheel for {target.describe()} in {folder}")
    return found[0]


def unpack_deps(root: Path, mode: str, progress: Callable[[str], None], plat: Platform | None = None
                ) -> dict[str, bytes]:
    """The SM100 dependencies unpacked as ``mode`` says, by path under the site dir."""
    if mode not in DEPS_MODES:
        raise BaseImageError(f"unknown stand-in deps mode {mode!r} (one of {', '.join(DEPS_MODES)})")
    out: dict[str, bytes] = {}
    owner: dict[str, bytes] = {}  # first unpack of a shared path, for the race
    shared: list[str] = []
    for name, version in SM100_DEPS:
        machine = plat.machine if plat is not None else wheels.host_machine()
        with zipfile.ZipFile(dep_wheel(root, name, version, progress, machine)) as zf:
            for item in zf.namelist():
                if item.endswith("/"):
                    continue
                data = zf.read(item)
                if item in out and out[item] != data:
                    shared.append(item)
                    owner.setdefault(item, out[item])
                out[item] = data
    if mode == "race":
        # Two unpacks at once: which one wrote a shared path last is a coin
        # toss per file; every other one here, so the outcome is the same each time.
        for item in sorted(shared)[::2]:
            out[item] = owner[item]
    return out


def is_standin(engine: Engine, info: ImageInfo) -> bool:
    """Whether ``info`` is itself a stand-in: the build that set the stand-in label made its top layer.

    An image built on a stand-in inherits the label, so the label alone does
    not say it; its history does. Newest first, the stand-in's own steps that
    make no layer (the label, the entrypoint) come before its top layer; an
    image built on it has a layer of its own before any of them.
    """
    if LABEL not in info.labels:
        return False
    for step in reversed(engine.history(info.id)):
        if f"{LABEL}=" in str(step.get("CreatedBy") or ""):
            return True
        if int(step.get("Size") or 0) > 0:
            return False
    return False


def make(
    engine: Engine,
    root: Path,
    version: str,
    ref: str,
    progress: Callable[[str], None] | None = None,
    *,
    sources_version: str | None = None,
    deps: str | None = None,
    plat: Platform | None = None,
) -> ImageInfo:
    """Build a stand-in of vLLM ``version`` and tag it ``ref``.

    ``sources_version`` builds from another release's wheel (a base whose
    installed vLLM differs from its tag, for tests); ``deps`` adds the SM100
    dependencies (see the module's docstring). ``plat`` builds one of another
    platform, from that architecture's Debian, vLLM wheel and dependencies.
    """
    say = progress or log.info
    src_version = sources_version or version
    if plat is not None:
        platforms.require_engine(engine, plat)
    existing = engine.image(ref)
    if existing is not None and not is_standin(engine, existing):
        built_on = " (it is built on one and carries its labels)" if LABEL in existing.labels else ""
        raise BaseImageError(
            f"{ref} is {existing.id[:19]}, which is not a stand-in{built_on}; refusing to replace it",
            hint="give the stand-in another name with --ref",
        )
    same_platform = existing is not None and (plat is None or existing.architecture == plat.architecture)
    if (existing is not None and existing.labels.get(LABEL) == src_version and same_platform
            and existing.labels.get(LABEL_ROOTFS) == ROOTFS and existing.labels.get(LABEL_DEPS, "") == (deps or "")):
        say(f"stand-in {ref} (vllm {src_version}) already present: {existing.id}")
        return existing
    base = rootfs(engine, root, say, plat)
    whl = wheels.release(root, src_version, say, plat)
    files = {f"site/{k}": v for k, v in wheel_sources(whl, src_version).items()}
    if deps is not None:
        files.update({f"site/{k}": v for k, v in unpack_deps(root, deps, say, plat).items()})
    files["vllm-standin.pth"] = (SITE_DIR + "\n").encode()
    files["Dockerfile"] = (
        f"FROM {base.id}\n"
        f"COPY site/ {SITE_DIR}/\n"
        "COPY vllm-standin.pth /usr/lib/python3/dist-packages/\n"
        f'LABEL {LABEL}="{src_version}" {LABEL_ROOTFS}="{ROOTFS}"'
        + (f' {LABEL_DEPS}="{deps}"' if deps else "") + "\n"
        'ENTRYPOINT ["vllm", "serve"]\n'
    ).encode()
    say(f"building stand-in {ref} from the vllm {src_version} wheel ({len(files)} files)")
    image_id = engine.build(tar_bytes(files))
    engine.tag(image_id, ref)
    info = engine.image(ref)
    assert info is not None
    if plat is not None and info.architecture != plat.architecture:
        raise BaseImageError(f"stand-in {ref} came out {info.os}/{info.architecture}, not {plat}: "
                             f"the engine ({engine.version_text}) lost the base's platform")
    return info


def publish(
    engine: Engine,
    root: Path,
    version: str,
    target: str,
    plats: list[Platform],
    progress: Callable[[str], None] | None = None,
) -> tuple[str, dict[str, str]]:
    """Publish stand-ins of ``version`` as an index over ``plats`` at ``target`` (HOST[:PORT]/PATH:TAG).

    As upstream does: each platform's image under ``TAG-<machine>``, then the
    index under ``TAG``. Returns the index digest and each platform's digest.
    """
    say = progress or log.info
    repo, tag = split_reference(target)
    registry.split_repo(repo)
    local_repo = repo.split("/", 1)[1]
    entries: list[tuple[str, str, str, str]] = []
    digests: dict[str, str] = {}
    for plat in plats:
        local = f"{local_repo}:{tag}-{plat.suffix}"
        info = make(engine, root, version, local, say, plat=plat)
        child = f"{repo}:{tag}-{plat.suffix}"
        had = engine.image(child)
        engine.tag(info.id, child)
        try:
            say(f"==> pushing {child}")
            digest = engine.push(child)
        finally:
            if had is None:
                engine.untag(child)
        entries.append((plat.os, plat.architecture, plat.variant, f"{repo}@{digest}"))
        digests[str(plat)] = digest
    if not entries:
        raise PushError("no platform to publish")
    index_digest, _ = write.put_index(engine, f"{repo}:{tag}", entries)
    say(f"==> {repo}:{tag} is an index over {', '.join(digests)}: {index_digest}")
    return index_digest, digests
