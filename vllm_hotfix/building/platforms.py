"""Platforms: which CPU architectures an image is built for, from which base, and whether this host can run them.

Upstream publishes ``vX.Y.Z-x86_64`` and ``vX.Y.Z-aarch64`` and makes
``vX.Y.Z`` an index over both. The tool builds one hotfix image per platform
of the base, each from that platform's base image, probed, patched and
compiled by that platform's own Python; a platform other than the engine's
runs under emulation (qemu registered in the host's ``binfmt_misc``).
:func:`bases` reads the base's index to find each platform's base image.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..engine import Engine, ImageInfo, split_reference
from ..errors import BaseImageError, EngineError, PipelineError, UsageError
from ..registry import refs


@dataclass(frozen=True, slots=True)
class Platform:
    os: str
    architecture: str  # the OCI name: amd64, arm64
    variant: str = ""

    def __str__(self) -> str:
        return f"{self.os}/{self.architecture}" + (f"/{self.variant}" if self.variant else "")

    @property
    def machine(self) -> str:
        """``uname -m`` inside such a container; also upstream's tag suffix (x86_64, aarch64)."""
        return _KNOWN[self.architecture][0]

    @property
    def suffix(self) -> str:
        return self.machine

    @property
    def debian_arch(self) -> str:
        return _KNOWN[self.architecture][1]

    @property
    def wheel_tag(self) -> str:
        """The manylinux platform tag of PyPI wheels for it."""
        return f"manylinux_2_28_{self.machine}"


# architecture -> (uname -m / upstream tag suffix, Debian architecture). The
# two upstream ships; another architecture is refused before any work.
_KNOWN = {"amd64": ("x86_64", "amd64"), "arm64": ("aarch64", "arm64")}
_ALIASES = {"x86_64": "amd64", "aarch64": "arm64", "arm64/v8": "arm64"}
ALL = "all"
PLATFORM_HINT = ("--platform linux/amd64, linux/arm64, both (linux/amd64,linux/arm64), or all (every platform "
                 "of the base's index); leave it out for the engine's own")


def parse_one(text: str) -> Platform:
    """``linux/amd64``, ``linux/arm64`` (or ``linux/arm64/v8``) -> Platform."""
    parts = text.strip().lower().split("/")
    if len(parts) < 2 or parts[0] != "linux":
        raise UsageError(f"--platform {text!r}: expected linux/amd64 or linux/arm64 (or a list of them, or all)",
                         hint=PLATFORM_HINT)
    arch = _ALIASES.get("/".join(parts[1:]), _ALIASES.get(parts[1], parts[1]))
    if arch not in _KNOWN:
        raise UsageError(f"--platform {text!r}: vLLM images exist for linux/amd64 and linux/arm64 only",
                         hint=PLATFORM_HINT)
    return Platform("linux", arch)


def parse(value: str | None) -> list[Platform] | None:
    """A comma-separated list of platforms; None for ``all`` (every platform of the base) or no value."""
    if value is None or value.strip().lower() == ALL:
        return None
    out: list[Platform] = []
    for item in value.split(","):
        if not item.strip():
            raise UsageError(f"--platform {value!r}: an empty item in the list")
        plat = parse_one(item)
        if plat not in out:
            out.append(plat)
    return out


def of(os_name: str, architecture: str, variant: str = "") -> Platform | None:
    """The platform an image config or index entry names, if it is one the tool builds for."""
    arch = _ALIASES.get(architecture, architecture)
    if os_name != "linux" or arch not in _KNOWN:
        return None
    return Platform("linux", arch)


def binfmt_dir() -> Path:
    """Where the host registers emulators for foreign binaries (VLLM_HOTFIX_BINFMT_DIR overrides)."""
    return Path(os.environ.get("VLLM_HOTFIX_BINFMT_DIR", "/proc/sys/fs/binfmt_misc"))


EMULATOR_HINT = ("register qemu for it (as root): mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc; "
                 "apt-get install qemu-user-static binfmt-support (or: .ci/services install)")


def emulator_registered(plat: Platform) -> bool:
    entry = binfmt_dir() / f"qemu-{plat.machine}"
    try:
        return entry.read_text().splitlines()[0].strip() == "enabled"
    except (OSError, IndexError):
        return False


def check_runnable(plat: Platform, engine_arch: str, engine_local: bool) -> None:
    """Refuse early a platform the engine's host cannot run: neither native nor emulated.

    Only a local engine's host can be inspected here; a remote engine's answer
    comes later, as an "exec format error" from the first container.
    """
    native = of("linux", engine_arch)
    if native == plat or not engine_local:
        return
    if not emulator_registered(plat):
        raise BaseImageError(
            f"{plat} images cannot run on this {engine_arch} host: no emulator for {plat.machine} is "
            f"registered in {binfmt_dir()}",
            hint=EMULATOR_HINT,
        )


# Docker 20.10 (API 1.41) records the engine's own platform for an imported
# image of another and asks a registry to run a local one; 26.1 (API 1.45)
# keeps both right. Older engines still serve the single-platform case.
MIN_API = (1, 45)


def require_engine(engine: Engine, plat: Platform) -> None:
    """Refuse, before any work, an engine or host that cannot handle ``plat`` correctly."""
    native = of("linux", engine.arch)
    if native == plat:
        return
    if engine.api_version < MIN_API:
        raise EngineError(
            f"the engine ({engine.version_text}) mishandles images of another platform ({plat}): "
            "it records its own platform for them and looks for them in a registry",
            hint="point DOCKER_HOST at a Docker 26.1 (API 1.45) or newer engine for other platforms",
        )
    check_runnable(plat, engine.arch, engine.local)


def native(engine: Engine) -> Platform:
    plat = of("linux", engine.arch)
    if plat is None:
        raise EngineError(f"the engine runs on {engine.arch}; vLLM images exist for amd64 and arm64 only")
    return plat


def child_ref(ref: str, plat: Platform) -> str:
    """Upstream's naming: ``TAG-x86_64`` / ``TAG-aarch64`` beside the index ``TAG``."""
    repo, tag = split_reference(ref)
    return refs.check_reference(f"{repo}:{tag}-{plat.suffix}", "platform tag", tag_only=True)


# A tag ending in one of these names the platform of its image: upstream's
# machine names, and the OCI names people also write.
_SUFFIXES = {"x86_64": "amd64", "aarch64": "arm64", "amd64": "amd64", "arm64": "arm64"}


def of_tag(ref: str) -> Platform | None:
    """The platform a reference's tag names by its suffix (``TAG-x86_64`` -> linux/amd64), if it names one."""
    _, tag = split_reference(ref)
    if tag.startswith("sha256:") or "-" not in tag:
        return None
    arch = _SUFFIXES.get(tag.rsplit("-", 1)[1].lower())
    return Platform("linux", arch) if arch else None


def parent_ref(ref: str) -> tuple[str, Platform] | None:
    """``TAG-<machine>`` -> (``TAG``, its platform): the inverse of :func:`child_ref`."""
    plat = of_tag(ref)
    if plat is None:
        return None
    repo, tag = split_reference(ref)
    stem, suffix = tag.rsplit("-", 1)
    if suffix != plat.suffix or not stem:
        return None
    return f"{repo}:{stem}", plat


# The variants an image of each architecture may carry and still be that
# platform: arm64 images say v8 or nothing; amd64 images say nothing (or a
# micro-architecture level every x86-64 host of a GPU node runs).
_VARIANTS = {"amd64": ("", "v1", "v2", "v3"), "arm64": ("", "v8")}


def mismatch(ref: str, os_name: str, architecture: str, variant: str = "",
             recorded: str | None = None) -> str | None:
    """Why the image under ``ref`` (of that OS, architecture and variant) must not go out under it; None if fine.

    The image's own config must be a platform the tool builds for; a tag
    suffix must name that platform; and the platform the journal recorded
    for the image's build (``recorded``, e.g. ``linux/arm64``) must be it too.
    """
    seen = f"{os_name}/{architecture}" + (f"/{variant}" if variant else "")
    plat = of(os_name, architecture, variant)
    if plat is None:
        return f"{ref} is a {seen or 'platform-less'} image; vLLM images are linux/amd64 or linux/arm64"
    if variant not in _VARIANTS[plat.architecture]:
        return f"{ref} is a {seen} image, a variant that is not {plat}"
    named = of_tag(ref)
    if named is not None and named != plat:
        return f"{ref} is a {seen} image, but its tag's suffix names {named}"
    if recorded is not None and recorded != str(plat):
        return f"{ref} is a {seen} image, but the journal recorded its build as {recorded}"
    return None


def bases(
    engine: Engine, base_ref: str, wanted: list[Platform] | None, pull: str, *, asked: bool,
    local: ImageInfo | None, progress: Callable[[str], None] | None = None,
) -> dict[Platform, str] | None:
    """Each platform's base, by digest in the base's index; None: the single-platform build of old.

    Without ``--platform`` (``asked`` False) a base already in the engine is
    built for the engine's platform alone, as before; otherwise the
    registry's answer decides: every platform of an index (or those
    ``wanted``), or the one image a plain manifest names. ``local``: the
    base as the engine has it (``engine.image``), None if it has not.
    """
    say = progress or (lambda _line: None)
    if not asked and (pull == "never" or (local is not None and pull != "always")):
        return None
    if not asked and engine.api_version < MIN_API:
        # An engine that loses other platforms still builds its own, as it always did.
        say(f"    the engine ({engine.version_text}) keeps no other platform's images: building for its own "
            "platform only (the base's other platforms need Docker 26.1 or newer)")
        return None
    # Every platform, or more than one: only the registry's index can say what they are, and getting
    # fewer than asked for is a failure, never a quiet single-platform build.
    several = asked and (wanted is None or len(wanted) > 1)
    asked_for = "--platform all" if wanted is None else f"--platform {','.join(map(str, wanted))}"
    if several and pull == "never":
        raise UsageError(f"{asked_for} reads the base's index from its registry; --pull never reads no registry",
                         hint="drop --pull never, or name the one platform the base in the engine has")
    from ..registry import client as registry  # here: an ordinary build never asks a registry (nor imports requests)

    try:
        found = registry.read_index(engine, base_ref) if pull != "never" else None
    except PipelineError as exc:
        if several or (asked and local is None):
            raise BaseImageError(f"{asked_for}: cannot read {base_ref} from its registry to find its "
                                 f"platforms: {exc}",
                                 hint="check the registry and your login (docker login), or build the "
                                      "platform the base in the engine has: --platform linux/<arch>") from exc
        say(f"    cannot read {base_ref} from its registry; building for one platform: {exc}")
        found = None
    if found is None and asked and wanted is None:
        # Its registry answered that it has no such manifest: which platforms "all" means is unknown, and one
        # quiet platform would be fewer than asked for.
        raise BaseImageError(f"{asked_for}: the registry of {base_ref} has no such manifest, so its platforms are "
                             "unknown", hint="check --base/--base-repo, or build the platform the base in the "
                                             "engine has: --platform linux/<arch>")
    if found is None or not found.is_index:
        return _single(base_ref, wanted, local, found is not None)
    repo, _ = split_reference(base_ref)
    offered: dict[Platform, str] = {}
    for child in registry.children(found):
        plat = of(child.os, child.architecture, child.variant)
        if plat is not None and plat not in offered:
            offered[plat] = f"{repo}@{child.digest}"
    chosen = wanted if wanted is not None else list(offered)
    lacking = [str(w) for w in chosen if w not in offered]
    if lacking:
        raise BaseImageError(f"base {base_ref} is an index over {', '.join(map(str, offered)) or 'nothing'}; "
                             f"it has no {', '.join(lacking)} image")
    say(f"    base {base_ref} is an index ({found.digest}); building for {', '.join(map(str, chosen))}")
    return {plat: offered[plat] for plat in chosen}


def _single(base_ref: str, wanted: list[Platform] | None, local: ImageInfo | None,
             in_registry: bool) -> dict[Platform, str] | None:
    """A base that is one image: build for its platform, if that is what was asked."""
    if wanted is None:
        return None
    if len(wanted) > 1:
        where = "a single image in its registry" if in_registry else "not an index in a registry"
        raise BaseImageError(f"base {base_ref} is {where}: it has no image for each of "
                             f"{', '.join(map(str, wanted))}",
                             hint="build one platform at a time from per-platform bases (--base-repo), "
                                  "or publish an index")
    if local is not None and of(local.os, local.architecture) != wanted[0]:
        raise BaseImageError(f"base {base_ref} in the engine is {local.os}/{local.architecture}, "
                             f"not {wanted[0]}")
    return {wanted[0]: base_ref}
