"""A layer blob as the tar it holds, whatever it is compressed with.

The OCI image spec names a layer's compression in its media type
(``...tar+gzip``, ``...tar+zstd``, ``...tar``; Docker's
``...rootfs.diff.tar.gzip``). gzip and none are read by :mod:`tarfile`
itself; zstd, which BuildKit and registries produce, through the
``zstandard`` library (its streaming decompressor, every frame read). The
blob's own reader still sees every compressed byte, so its digest is checked
as before.

The media type is taken at its word, and the bytes must agree: a blob whose
first bytes are zstd's frame under a gzip media type (or gzip's under zstd,
or either under a plain tar's) is refused as it is read, naming both, where
the Docker engine and containerd would read it by its bytes alone. An image
whose manifest misnames its layers is malformed (a client that trusts the
media type fails on it), and the tool writes manifests from these
descriptors: it does not read one as if it were right. ``image
--in-registry`` also reads the first bytes of every base layer it does not
read (one it copies by digest below those it reads) and refuses the same
contradiction there (:func:`disagreement`).
"""

from __future__ import annotations

import gzip
import tarfile
import zlib
from typing import IO, Any, Literal, cast

from ..errors import BaseImageError

# What reading a layer's tar stream raises when the blob is not one: tarfile's, zlib's and the stream's own, and
# zstandard's where the library is installed (a Python without it, such as a GPU host's running the smokes, reads
# every other layer).
try:
    from zstandard import ZstdError

    _ZSTD: tuple[type[Exception], ...] = (ZstdError,)
except ImportError:
    _ZSTD = ()
STREAM_ERRORS: tuple[type[Exception], ...] = (tarfile.TarError, EOFError, OSError, ValueError, zlib.error, *_ZSTD)

__all__ = ["HEAD", "STREAM_ERRORS", "compression_of", "disagreement", "is_zstd", "tar_stream", "uncompressed"]


def is_zstd(media_type: str) -> bool:
    return media_type.endswith("+zstd") or media_type.endswith(".zstd")


_MAGIC = {b"\x1f\x8b": "gzip", b"\x28\xb5\x2f\xfd": "zstd"}
HEAD = 4  # bytes of a blob that tell its compression (zstd's frame magic is the longest)


def compression_of(media_type: str) -> str:
    """What a layer's media type says its bytes are compressed with: gzip, zstd or none."""
    if is_zstd(media_type):
        return "zstd"
    return "gzip" if media_type.endswith(("+gzip", ".gzip", ".tar.gz")) else "none"


def disagreement(head: bytes, media_type: str) -> str | None:
    """How a blob whose first (up to :data:`HEAD`) bytes are ``head`` contradicts ``media_type``; None where they
    agree (or the blob is empty)."""
    said, found = compression_of(media_type), next((n for m, n in _MAGIC.items() if head.startswith(m)), "none")
    if not head or said == found:
        return None
    return (f"its bytes are {'not compressed' if found == 'none' else found + '-compressed'}, but its media type "
            f"{media_type} says {'uncompressed' if said == 'none' else said}")


class _Agreeing:
    """A blob whose first bytes are checked against its media type when they are first read.

    Checked as they stream by, never ahead: the error comes out of the read
    that would have taken them, one of :data:`STREAM_ERRORS`, inside the
    reader's own handling that names the layer.
    """

    def __init__(self, blob: IO[bytes] | Any, media_type: str) -> None:
        self._blob: Any = blob
        self._media_type = media_type
        self._head: bytes | None = None

    def _check(self) -> bytes:
        head = b""
        while len(head) < HEAD:
            got = self._blob.read(HEAD - len(head))
            if not got:
                break
            head += got
        problem = disagreement(head, self._media_type)
        if problem:
            raise tarfile.ReadError(problem)
        return head

    def read(self, size: int | None = -1) -> bytes:
        if self._head is None:
            self._head = self._check()
        if not self._head:
            return bytes(self._blob.read(size))
        if size is None or size < 0:
            out, self._head = self._head + self._blob.read(), b""
            return out
        out, self._head = self._head[:size], self._head[size:]
        return out if len(out) == size else out + self._blob.read(size - len(out))


def tar_stream(blob: IO[bytes] | Any, media_type: str) -> tuple[Any, Literal["r|", "r|*"]]:
    """(a reader of the layer's uncompressed tar, the :func:`tarfile.open` mode to stream it with). A damaged
    zstd stream, or bytes another compression than the media type names, raise one of :data:`STREAM_ERRORS` as
    they are read."""
    blob = cast(IO[bytes], _Agreeing(blob, media_type))  # read() is all either reader asks of it
    if is_zstd(media_type):
        try:
            import zstandard
        except ImportError:
            raise BaseImageError(f"a layer is compressed with zstd ({media_type}), and this Python lacks the "
                                 "zstandard package that reads it", hint="pip install zstandard") from None
        return zstandard.ZstdDecompressor().stream_reader(blob, read_across_frames=True, closefd=False), "r|"
    return blob, "r|*"


def uncompressed(blob: IO[bytes] | Any, media_type: str) -> Any:
    """A reader of the layer's uncompressed tar bytes (what its diff ID hashes): decompressed as its media type
    says, the bytes checked against it as :func:`tar_stream` checks them."""
    source, _mode = tar_stream(blob, media_type)
    return gzip.GzipFile(fileobj=source, mode="rb") if compression_of(media_type) == "gzip" else source
