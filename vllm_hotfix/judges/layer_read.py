"""An image's top layers as the host reads them where the image is: its overlay folders, or an export of it.

What :mod:`.identity` compares: each path a layer adds, changes or removes
(:class:`~vllm_hotfix.layers.LayerEntry`), with the bytes of a small file in
a ``bin`` folder kept (a launcher pip writes, judged by :mod:`.pin_layer`).
Layers are read where the image is: the engine's overlay2 folders (podman's
overlay ones) where this host can read them, else a ``save`` export of the
image, every layer streaming past and the ones wanted told by their diff ID.
A folder whose opaque mark this host cannot read sends the whole read to the
export (never "not opaque"). A registry's blobs are read by
:meth:`vllm_hotfix.registry.blobs.RegistryFiles.top_layers`, each checked
against the config's diff ID.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Iterable
from typing import IO, Protocol

from ..engine import Engine, ImageInfo
from ..layers import Layer
from ..layers.read import from_export, from_folder
from ..sitefacts.layer_facts import layer_folders

SCRIPT_MAX = 1 << 16


class LayerSource(Protocol):
    """The top ``count`` layers of the image judged, bottom first."""

    def __call__(self, count: int) -> list[Layer]: ...


def small_script(path: str) -> bool:
    """Whether a file's bytes are kept with its layer: a launcher pip may write (a file in a ``bin`` folder, no
    larger than SCRIPT_MAX)."""
    return posixpath.basename(posixpath.dirname(path)) == "bin"


READ = {"keep": small_script, "keep_max": SCRIPT_MAX}


def diff_ids(image: ImageInfo) -> list[str]:
    return [str(d) for d in ((image.attrs or {}).get("RootFS") or {}).get("Layers") or []]


def _folders(folders: list[str], count: int) -> list[Layer] | None:
    """The top ``count`` overlay folders as layers; None where one holds an opaque mark this host cannot read."""
    out = []
    for folder in folders[len(folders) - count:]:
        layer = from_folder(folder, **READ)  # type: ignore[arg-type]
        if layer is None:
            return None
        out.append(layer)
    return out


def from_folders_or(export: Callable[[], Iterable[IO[bytes]]],
                    drivers: tuple[str, ...] = ("overlay2", "overlay")) -> Callable[[ImageInfo, int], list[Layer]]:
    """A reader of an image's top layers: its overlay folders where this host can read them (the Docker engine's
    overlay2, podman's overlay), else ``export`` (a ``save`` of the image, every layer streaming past)."""
    def read(image: ImageInfo, count: int) -> list[Layer]:
        folders = layer_folders(image, drivers)
        layers = _folders(folders, count) if folders is not None else None
        if layers is not None:
            return layers
        return from_export(export(), diff_ids(image), count, image.id[:19], **READ)
    return read


def layers_above(engine: Engine, image: ImageInfo, count: int) -> list[Layer]:
    """The top ``count`` layers of ``image`` in the Docker engine, bottom first."""
    return from_folders_or(lambda: engine.export_layers(image.id), ("overlay2",))(image, count)
