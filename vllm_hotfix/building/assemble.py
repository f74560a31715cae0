"""What the ``assemble`` builder does: write the image the Dockerfile would build, and load it.

From exactly the inputs :mod:`render` puts in the Dockerfile (the patched
files, their bytecode, the labels, the base pinned by ID) this writes

* the patch layer: a deterministic tar holding what ``COPY files/ <site dir>/``
  adds over the base: the folders from / down to the site dir as the base
  has them, the folders below it root-owned 0755, the files with the base's
  modes, every time 0 but the base's own;
* the image config: the base's runtime fields (ENTRYPOINT, CMD, ENV, USER,
  WORKDIR, ...), its labels plus ours, its layers plus ours, its history plus
  one entry, and the base's creation time as the image's;
* a ``docker save``-format archive of that config and the one new layer,
  whose manifest names the base's layers without carrying them: the engine
  already has them and skips them on load.

The image ID is the sha256 of the config, which holds nothing from the host
(no clock, no host name, no engine version): the same inputs give the same
image ID on every run and every machine.

Engines that keep images in containerd's store cannot load a manifest that
leaves out layers: when a load fails, :func:`supported` says whether that
is why (:class:`~vllm_hotfix.errors.AssembleUnsupported`), and the pipeline then builds from the
Dockerfile instead.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

from .. import __version__
from ..errors import AssembleUnsupported, BuildError
from ..tarball import Entry, write

if TYPE_CHECKING:
    from ..engine import Engine
    from .base import BaseFacts, PatchedFile

log = logging.getLogger(__name__)

# Fields of the base's runtime config an image carries (OCI image config and
# Docker's extensions). Anything else the engine reports (Hostname, Image,
# AttachStdin, ...) belongs to containers and differs by engine version.
CONFIG_FIELDS = (
    "User", "ExposedPorts", "Env", "Entrypoint", "Cmd", "Healthcheck", "ArgsEscaped", "Volumes",
    "WorkingDir", "Labels", "OnBuild", "StopSignal", "StopTimeout", "Shell",
)
# History entries whose instruction only changes the config, never the files.
_METADATA = {"ENV", "LABEL", "ARG", "CMD", "ENTRYPOINT", "EXPOSE", "USER", "VOLUME", "STOPSIGNAL",
             "HEALTHCHECK", "SHELL", "ONBUILD", "MAINTAINER"}


def supported(engine: Engine) -> str | None:
    """None if the engine can load an assembled image, else why not (one line)."""
    status = dict(tuple(pair) for pair in (engine.info().get("DriverStatus") or []) if len(pair) == 2)
    if "snapshotter" in str(status.get("driver-type", "")):
        return ("the engine keeps images in containerd's store, which cannot load an image "
                "whose base layers are left out")
    return None


def layer_entries(facts: BaseFacts, files: Sequence[PatchedFile]) -> list[Entry]:
    """What ``COPY files/ <site_dir>/`` of the build context adds over the base."""
    entries: dict[str, Entry] = {}
    for folder in facts.folders:
        name = folder.path.strip("/")
        entries[name] = Entry(name, None, folder.mode, folder.uid, folder.gid, folder.mtime)
    site = facts.site_dir.strip("/")
    for f in files:
        for rel, data, mode in [(f.rel, f.data, f.mode), *((pyc, b, 0o644) for pyc, b in f.bytecode)]:
            parts = PurePosixPath(rel).parts
            for i in range(1, len(parts)):
                name = f"{site}/{'/'.join(parts[:i])}"
                entries.setdefault(name, Entry(name, None, 0o755))
            name = f"{site}/{rel}"
            entries[name] = Entry(name, data, mode)
    missing = {str(p) for f in files for p in PurePosixPath(f"{site}/{f.rel}").parents} - set(entries) - {"."}
    if missing:
        # The probe lists every folder above the site dir; a cache from an
        # older probe may not. A layer without them would make them 0600.
        raise BuildError(f"no metadata for {', '.join(sorted(missing))} of {facts.ref}: "
                         "cannot assemble the layer (delete the facts cache of this base)")
    return list(entries.values())


def _iso(seconds: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def _metadata_only(created_by: str) -> bool:
    text = created_by.strip()
    if "#(nop)" in text:  # the classic builder: "/bin/sh -c #(nop)  ENV ..."
        text = text.split("#(nop)", 1)[1].strip()
    word = text.split(" ", 1)[0].upper() if text else ""
    return word in _METADATA


def base_history(history: Sequence[Mapping[str, Any]], layers: int, ref: str) -> list[dict[str, Any]]:
    """The base's history as an image config states it, from the engine's history.

    The engine reports each entry's size but not whether it made a layer; an
    entry with bytes did, one that only set config did not. What is left
    over must add up to the base's layer count, or this refuses.
    """
    sizes = [int(h.get("Size") or 0) for h in history]
    has_layer = [s > 0 for s in sizes]
    need = layers - sum(has_layer)
    if history and need:
        empty = [i for i, s in enumerate(sizes) if s == 0]
        maybe = [i for i in empty if not _metadata_only(str(history[i].get("CreatedBy") or ""))]
        pick = maybe if len(maybe) == need else empty if len(empty) == need else None
        if pick is None or need < 0:
            raise BuildError(
                f"{ref}: cannot tell which of its {len(history)} history entries made its {layers} layers; "
                "use --builder dockerfile for this base"
            )
        for i in pick:
            has_layer[i] = True
    out = []
    for h, layer in zip(history, has_layer, strict=True):
        entry: dict[str, Any] = {"created": _iso(int(h.get("Created") or 0))}
        if h.get("CreatedBy"):
            entry["created_by"] = h["CreatedBy"]
        if h.get("Comment"):
            entry["comment"] = h["Comment"]
        if not layer:
            entry["empty_layer"] = True
        out.append(entry)
    return out


def image_config(
    base: Mapping[str, Any],
    history: Sequence[Mapping[str, Any]],
    diff_id: str,
    labels: Sequence[tuple[str, str]],
    created_by: str,
) -> bytes:
    """The new image's config: canonical JSON, so equal inputs give equal bytes."""
    runtime = {
        k: v for k, v in (base.get("Config") or {}).items() if k in CONFIG_FIELDS and v not in (None, "", [], {}, False)
    }
    runtime["Labels"] = {**(runtime.get("Labels") or {}), **dict(labels)}
    layers = list((base.get("RootFS") or {}).get("Layers") or [])
    created = base.get("Created") or _iso(0)
    config: dict[str, Any] = {
        "architecture": base.get("Architecture") or "amd64",
        "os": base.get("Os") or "linux",
        "created": created,
        "config": runtime,
        "rootfs": {"type": "layers", "diff_ids": [*layers, diff_id]},
        "history": [*base_history(history, len(layers), str(base.get("Id"))),
                    {"created": created, "created_by": created_by, "comment": f"vllm-hotfix {__version__}"}],
    }
    for key, field in (("Variant", "variant"), ("OsVersion", "os.version"), ("Author", "author")):
        if base.get(key):
            config[field] = base[key]
    return json.dumps(config, sort_keys=True, separators=(",", ":")).encode()


def archive(config: bytes, base_layers: Sequence[str], layer: bytes) -> tuple[str, bytes]:
    """(image ID, a save-format archive holding the config and the new layer only).

    No tag in it: the pipeline tags the image once its record is written.
    """
    image_hex = hashlib.sha256(config).hexdigest()
    layer_hex = hashlib.sha256(layer).hexdigest()
    # Base layers are named but absent: the engine finds them by diff ID.
    paths = [f"{d.removeprefix('sha256:')}/layer.tar" for d in base_layers] + [f"{layer_hex}/layer.tar"]
    manifest = [{"Config": f"{image_hex}.json", "RepoTags": None, "Layers": paths}]
    entries = [
        Entry(f"{image_hex}.json", config, 0o644),
        Entry(layer_hex, None, 0o755),
        Entry(f"{layer_hex}/layer.tar", layer, 0o644),
        Entry("manifest.json", json.dumps(manifest, separators=(",", ":")).encode(), 0o644),
    ]
    return f"sha256:{image_hex}", write(entries)


def build(
    engine: Engine,
    facts: BaseFacts,
    files: Sequence[PatchedFile],
    labels: Sequence[tuple[str, str]],
    description: str,
    on_image: Callable[[str], None] | None = None,
) -> str:
    """Assemble and load the image, untagged; return its ID (the same for the same inputs).

    ``on_image`` hears the ID before the load, so a run that dies during it
    has noted what it may leave behind.
    """
    base = facts.image.attrs or engine.inspect(facts.image.id)
    if base is None:
        raise BuildError(f"base {facts.ref} ({facts.image.id}) is no longer in the engine")
    layer = write(layer_entries(facts, files))
    diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()
    config = image_config(base, facts.history or engine.history(facts.image.id), diff_id, labels, description)
    image_id, data = archive(config, (base.get("RootFS") or {}).get("Layers") or [], layer)
    log.info("loading %s (%d bytes: config %d, layer %d)", image_id, len(data), len(config), len(layer))
    if on_image is not None:
        on_image(image_id)
    try:
        loaded = engine.load(data)
        # The engine names what it loaded: our ID, or the load did not do what it should.
        if image_id not in loaded and engine.image(image_id) is None:
            raise BuildError(f"the engine loaded the assembled image but does not list {image_id}")
    except BuildError as exc:
        # Asked only now: describing itself is one of the engine's slower calls.
        why_not = supported(engine)
        if why_not:
            raise AssembleUnsupported(why_not) from exc
        raise
    return image_id
