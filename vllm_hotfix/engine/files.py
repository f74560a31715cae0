"""Files of an image, read from its filesystem without running anything in it.

A container is created from the image and never started (its entrypoint,
its Python, nothing of the image runs), the engine streams a folder of it as
a tar (``GET /containers/{id}/archive``), and the container is removed
through :func:`.containers.lifetime` whatever happens. The tar is parsed as a
stream and each regular file hashed as it passes, so a package of a few GB
(vLLM with its compiled libraries) is never held in memory: only each file's
sha256, and the bytes of the few files the caller asks to keep.

Symbolic links are reported as links with their target, never followed: a
link in an image is a fact about the image, and following it could leave the
folder that was asked for.
"""

from __future__ import annotations

import io
import logging
import posixpath
import tarfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import IO, Any, cast

from ..errors import EngineError, PipelineError
from ..layers import LayerEntry
from ..layers.read import from_tar
from .containers import lifetime
from .mapping import status
from .model import Refused, Seam

log = logging.getLogger(__name__)

CHUNK = 1 << 20
# Create-time arguments that make the container inert even if it were started by someone else.
_INERT = {"entrypoint": ["/nonexistent-vllm-hotfix-never-started"], "command": [], "network_mode": "none"}


# One entry of an image's filesystem as its layers hold it: the layer model's entry (kinds file, link, hardlink,
# dir, other; paths absolute).
FileFact = LayerEntry


@dataclass(frozen=True, slots=True)
class Tree:
    """What was read under some folders of an image: every entry, and the bytes of those asked for."""

    entries: Mapping[str, FileFact]
    kept: Mapping[str, bytes] = field(default_factory=dict)
    missing: tuple[str, ...] = ()  # folders or files asked for that the image lacks

    def file(self, path: str) -> FileFact | None:
        return self.entries.get(posixpath.normpath(path))


class _Chunks(io.RawIOBase):
    """A readable stream over an iterator of byte chunks (what the engine streams)."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._it: Iterator[bytes] = iter(chunks)
        self._rest = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        while not self._rest:
            try:
                self._rest = next(self._it)
            except StopIteration:
                return 0
        n = min(len(buffer), len(self._rest))
        buffer[:n] = self._rest[:n]
        self._rest = self._rest[n:]
        return n


def scan_tar(stream: IO[bytes] | Iterable[bytes], parent: str, keep: Callable[[str], bool] = lambda _p: False,
             ) -> tuple[dict[str, FileFact], dict[str, bytes]]:
    """Every entry of an archive of a folder (names relative to ``parent``), in one pass
    (:func:`vllm_hotfix.layers.read.from_tar`: files hashed block by block, the bytes of those ``keep`` says yes
    to kept, a hard link given its target's hash)."""
    fileobj = (cast("IO[bytes]", stream) if hasattr(stream, "read")
               else io.BufferedReader(_Chunks(cast("Iterable[bytes]", stream))))
    layer = from_tar(fileobj, root=parent, keep=keep, markers=False, mode="r|", where=f"the archive of {parent}")
    return layer.entries, layer.kept


Found = tuple[dict[str, FileFact], dict[str, bytes]]


class FolderReader:
    """Reads folders of one created (never started) container of an image, one tar stream per path.

    What gives the stream is the subclass's :meth:`_one` (the Docker engine's
    archive endpoint here; ``podman cp`` for podman's store); both parse it
    with :func:`scan_tar`.
    """

    def __init__(self, image: str, through: str = "") -> None:
        self._image = image
        self._through = through  # said in the log: which store was read

    def read(self, paths: Sequence[str], keep: Callable[[str], bool] = lambda _p: False) -> Tree:
        """The entries under each of ``paths`` (folders or files); a path the image lacks is named in ``missing``."""
        entries: dict[str, FileFact] = {}
        kept: dict[str, bytes] = {}
        missing: list[str] = []
        for path in paths:
            path = posixpath.normpath(path)
            found = self._one(path, keep)
            if found is None:
                missing.append(path)
                continue
            entries.update(found[0])
            kept.update(found[1])
        log.info("read %d entries of %s under %s%s", len(entries), self._image[:19], ", ".join(paths),
                 f" ({self._through})" if self._through else "")
        return Tree(entries, kept, tuple(missing))

    def _one(self, path: str, keep: Callable[[str], bool]) -> Found | None:
        """The entries (and kept contents) under ``path``, None where the image lacks it."""
        raise NotImplementedError


class Reader(FolderReader):
    """Reads folders of one created (never started) container of the Docker engine."""

    def __init__(self, engine: Seam, image: str, container: Any) -> None:
        super().__init__(image)
        self._engine = engine
        self._container = container

    def _one(self, path: str, keep: Callable[[str], bool]) -> Found | None:
        image = self._image
        try:
            with self._engine.translating(f"reading {path} of {image}", _refused(image)):
                try:
                    chunks, _stat = self._container.get_archive(path, chunk_size=CHUNK)
                except Exception as exc:
                    if status(exc) == 404:
                        return None
                    raise
                return scan_tar(chunks, posixpath.dirname(path), keep)
        except tarfile.TarError as exc:
            raise EngineError(f"the engine's archive of {path} in {image} is not a readable tar: {exc}") from exc


def _refused(image: str) -> Refused:
    def refused(message: str) -> PipelineError:
        return EngineError(f"cannot read the files of {image}: {message}")

    return refused


@contextmanager
def opened(engine: Seam, image: str) -> Iterator[Reader]:
    """A :class:`Reader` of ``image``; its container is removed when the block ends, whatever happens."""
    with lifetime(engine, image, "read", f"reading files of {image}", _refused(image), **_INERT) as container:
        yield Reader(engine, image, container)


def read(engine: Seam, image: str, paths: Sequence[str], keep: Callable[[str], bool] = lambda _p: False) -> Tree:
    """:meth:`Reader.read` in a container of its own."""
    with opened(engine, image) as reader:
        return reader.read(paths, keep)


def exported_layers(chunks: Iterable[bytes]) -> Iterator[IO[bytes]]:
    """Each layer tar in an engine's ``save`` export (its stream of chunks), in the export's order (a reader
    valid until the next one is asked for). Other members (configs, manifests, an OCI layout's index) are
    passed by; so is any blob that is not a tar, by the caller's reading."""
    with tarfile.open(fileobj=io.BufferedReader(_Chunks(chunks)), mode="r|") as outer:
        for member in outer:
            if member.isfile() and (member.name.endswith("/layer.tar") or member.name.startswith("blobs/")):
                fh = outer.extractfile(member)
                if fh is not None:
                    yield fh
