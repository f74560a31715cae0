"""The compile caches a smoke run keeps between runs, so the second image of a base starts warm.

Most of a GPU smoke's time is start-up work that is the same on every run:
Triton compiling kernels, torch's inductor, vLLM's own compile cache,
FlashInfer's JIT and the CUDA driver's PTX cache. All of them live under one
folder in the container (``/root/.cache``, the environment below points each
one there), which is a host folder kept under the tool's cache:

    <VLLM_HOTFIX_CACHE>/compile/<base image ID, hex>/<GPU model slug>/

Keyed by the *base* image's ID (the base the host proved by the image's
layers, :mod:`vllm_hotfix.judges.identity`, never a label the image carries; the image's own
ID for an unpatched base), so a patched image and its base share one folder
and an image cannot claim another base's folder; and by the GPU model, since compiled kernels are for
one architecture. Sharing is safe because every one of these caches keys its
entries by the source it compiled (Triton and inductor hash the kernel source
and options, vLLM hashes its config and the traced files): code the patch
changed compiles to new entries, it never reuses the base's.

The folders above the leaf are the invoking user's only (0700), so another
user of the host cannot reach the kernels; the leaf is writable by anyone
(0777) because the container's user may be mapped to another host user (a
user-namespaced engine), and Triton fails a server start on an unwritable
cache.

Triton's and inductor's artifacts are loaded as they are found, so the
folder is a write channel from one run to every later one: only a run that
is trusted writes it in place (``shared``): the base itself; an image
whose layers this run proved to be exactly what the builder writes for a
patch set of this checkout over that base (:mod:`vllm_hotfix.judges.identity`:
its code is the base's and the patch set's, nothing the image brought, and
every cache keys what it compiles by that source); or an image whose newest
verdict on this host meets the default verification policy
(:func:`trusted_by`: the definition's full smoke, as ``verify`` asks of a
signed verdict, answers judged included). Any other image (``layered``)
sees the folder read-only under a private writable layer (an overlay
volume the engine mounts: reads are the folder's, writes land in a private
folder removed after the run), so it starts as warm as before and leaves
nothing behind, unless its run meets that policy: then what it wrote is
moved into the folder, as a trusted image's writes are (so its next run
starts warm). A pass that judged no answers (no reference, no golden, no
GPU) is no such run: its writes are dropped.
A ``--record-reference`` run (``private``) gets an empty folder of its
own, removed after the run: the answers every later run is judged by come
from nothing another image wrote. Where the recording image's layers were
proven, what it compiled is moved into the shared folder after the run
(the first smoke of the patched image after a recording then starts warm).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from ..engine import Engine
from ..errors import PipelineError, SmokeError
from ..journal import leftovers
from ..verdicts import Verdict

log = logging.getLogger(__name__)

CONTAINER_ROOT = "/root/.cache"
# Each cache's own variable, all inside CONTAINER_ROOT (one mount holds them all).
ENVIRONMENT: Mapping[str, str] = {
    "XDG_CACHE_HOME": CONTAINER_ROOT,
    "TRITON_CACHE_DIR": f"{CONTAINER_ROOT}/triton",
    "TORCHINDUCTOR_CACHE_DIR": f"{CONTAINER_ROOT}/torchinductor",
    "VLLM_CACHE_ROOT": f"{CONTAINER_ROOT}/vllm",
    # FlashInfer's JIT writes under $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer.
    "FLASHINFER_WORKSPACE_BASE": "/root",
    "CUDA_CACHE_PATH": f"{CONTAINER_ROOT}/nv/ComputeCache",
}
NO_GPU = "no-gpu"
_IMAGE_ID = re.compile(r"^(?:sha256:)?([0-9a-f]{64})$")


# How a run gets the folder (see the module's doc).
SHARED = "shared"  # written in place: the base itself, an image whose layers this run proved, or one whose verdict
# here meets the default policy
LAYERED = "layered"  # read-only under a private writable layer, removed after the run: an image not yet trusted
PRIVATE = "private"  # an empty folder of its own, removed after the run: a recording


def trusted_by(verdict: Verdict) -> bool:
    """Whether this host's ``verdict`` meets the default verification policy (:func:`..trust.policy_file.build`
    with nothing given: the one ``verify`` asks of a signed verdict), read as its signed predicate would say it:
    the only runs whose compile-cache writes are kept, and the only images that write the cache in place."""
    import datetime as dt

    from ..trust import decide, policy, policy_file, signing

    predicate = signing.predicate(verdict.to_dict(), {}, signing.now(), verdict.started or None)
    try:
        results = policy_file.build().requirements().check(decide.facts(predicate, "this host's verdict"),
                                                           dt.datetime.now(dt.UTC))
    except PipelineError as exc:
        # The cache only saves time: a verdict the policy cannot be asked of is trusted with nothing.
        log.warning("compile cache: the default policy could not judge the verdict of %s (%s); its writes are not "
                    "kept", verdict.image_id[:19], exc)
        return False
    missed = [r.reason for r in results if isinstance(r, policy.Failure)]
    if missed:
        log.debug("compile cache: the verdict of %s does not meet the default policy: %s", verdict.image_id[:19],
                  "; ".join(missed))
    return not missed


def access(*, trusted: bool, recording: bool) -> str:
    """How a run gets the cache: a recording never reads a shared one; only a trusted image (the base, an image
    whose layers this run proved, an image whose verdict meets the default policy) writes the shared one."""
    if recording:
        return PRIVATE
    return SHARED if trusted else LAYERED


@dataclass(frozen=True, slots=True)
class CompileCache:
    """One cache folder: where it is on the host, what it is keyed by, and how a run gets it."""

    host: Path
    base_id: str  # hex, without "sha256:"
    gpu: str  # the GPU model slug
    access: str = SHARED
    source: str = ""  # what the container mounts: the folder itself, or the overlay volume's name (given())

    @property
    def env(self) -> dict[str, str]:
        return dict(ENVIRONMENT)

    @property
    def mount(self) -> tuple[str, str]:
        return (self.source or str(self.host), CONTAINER_ROOT)

    def to_dict(self) -> dict[str, str]:
        return {"host": str(self.host), "container": CONTAINER_ROOT, "base_id": self.base_id, "gpu": self.gpu,
                "access": self.access}


PRIVATE_DIR = "private"  # under compile/: the private layers and folders of runs, each removed after its run


def adopt(upper: Path, shared: Path) -> int:
    """Move what a run wrote in its private layer ``upper`` into the ``shared`` folder (the same file system: each
    a rename); how many files. Overlay whiteouts (a deletion in the layer) are left: the shared folder only gains.
    A file that cannot be moved stays behind (the next run compiles it again)."""
    moved = 0
    for folder, dirs, files in os.walk(upper):
        rel = Path(folder).relative_to(upper)
        target = shared / rel
        try:
            target.mkdir(mode=0o777, exist_ok=True)
        except OSError:
            dirs[:] = []
            continue
        for name in files:
            src, dst = Path(folder) / name, target / name
            try:
                mode = src.lstat().st_mode
                if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)) or dst.is_dir():
                    continue  # a whiteout (a character device), or a file where the shared folder has a folder
                os.replace(src, dst)
                moved += 1
            except OSError as exc:
                log.debug("compile cache entry %s not adopted: %s", src, exc)
    return moved


@contextmanager
def given(engine: Engine, cache: CompileCache, keep: Callable[[], bool] = lambda: False) -> Iterator[CompileCache]:
    """``cache`` as its run mounts it (:attr:`CompileCache.mount`): the shared folder itself; else a private
    folder beside it (the writable layer over it, or the recording's own), removed on leaving, with the shared
    folder only ever read while the run lasts. A layered run that ``keep`` says met the default policy
    (:func:`trusted_by`, asked once the volume is gone) has what it wrote moved into the shared folder then: its
    image is trusted from that verdict on, as if it had written in place. A killed run's private folder is
    removed by the next run that makes one."""
    if cache.access == SHARED:
        yield cache
        return
    scratch_root = cache.host.parent.parent / PRIVATE_DIR
    try:
        scratch_root.mkdir(mode=0o700, exist_ok=True)
        leftovers.sweep_staging(scratch_root)
        scratch = Path(tempfile.mkdtemp(prefix=leftovers.staging_prefix(), dir=scratch_root))
        upper, work = scratch / "upper", scratch / "work"
        upper.mkdir()
        work.mkdir()
        os.chmod(upper, 0o777)  # as the shared leaf: the container's user may be another host user
    except OSError as exc:
        raise SmokeError(f"cannot make a private compile cache folder in {scratch_root}: {exc.strerror or exc}",
                         hint="set VLLM_HOTFIX_CACHE to a folder this user can write") from exc
    try:
        if cache.access == PRIVATE:
            yield replace(cache, host=upper, source=str(upper))
            if keep():
                # A recording starts from nothing another image wrote; what it compiled, where ``keep`` says its
                # image may write the shared folder (its layers proven), warms the base's later runs.
                log.info("compile cache: %d file(s) of a recording adopted into %s", adopt(upper, cache.host),
                         cache.host)
        else:
            with engine.overlay_volume(cache.host, upper, work) as volume:
                yield replace(cache, source=volume)
            if keep():
                log.info("compile cache: %d file(s) of a run that met the default policy adopted into %s",
                         adopt(upper, cache.host),
                         cache.host)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def base_key(image_id: str, base_id: str | None) -> str:
    """The hex ID the cache is keyed by: the base's (the one the host proved the image is built on) or, for a
    base itself or an image whose base is unknown, the image's own.

    Anything that is not an image ID keys the cache by the image's own ID (no
    sharing, and no path outside the cache).
    """
    own = _IMAGE_ID.match(image_id)
    if own is None:
        raise SmokeError(f"image ID {image_id!r} is not a sha256 image ID: no compile cache folder for it")
    given = _IMAGE_ID.match(base_id or "")
    return given.group(1) if given else own.group(1)


def gpu_slug(devices: Iterable[str]) -> str:
    """The GPU model as a folder name: ``NVIDIA H200`` -> ``nvidia-h200``; mixed models joined by ``+``."""
    slugs = sorted({re.sub(r"[^a-z0-9]+", "-", d.lower()).strip("-")[:48] for d in devices} - {""})
    return "+".join(slugs)[:120] if slugs else NO_GPU


def folder(cache_root: Path, image_id: str, base_id: str | None, devices: Iterable[str]) -> CompileCache:
    """The cache folder of an image on the GPUs ``devices``, made if missing (see the module's doc)."""
    base, gpu = base_key(image_id, base_id), gpu_slug(devices)
    top = cache_root / "compile"
    leaf = top / base / gpu
    try:
        for path in (top, top / base):
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        leaf.mkdir(exist_ok=True)
        # mkdir's mode passes through the umask: set the leaf's bits as meant.
        os.chmod(leaf, 0o777)
    except OSError as exc:
        raise SmokeError(f"cannot make the compile cache folder {leaf}: {exc.strerror or exc}",
                         hint="set VLLM_HOTFIX_CACHE to a folder this user can write") from exc
    return CompileCache(leaf, base, gpu)
