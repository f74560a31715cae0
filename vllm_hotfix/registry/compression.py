"""A layer blob as the tar it holds, whatever it is compressed with.

The OCI image spec names a layer's compression in its media type
(``...tar+gzip``, ``...tar+zstd``, ``...tar``; Docker's
``...rootfs.diff.tar.gzip``). gzip and none are read by :mod:`tarfile`
itself; zstd, which BuildKit and registries produce, through the
``zstandard`` library (its streaming decompressor, every frame read). The
blob's own reader still sees every compressed byte, so its digest is checked
as before.
"""

from __future__ import annotations

import tarfile
import zlib
from typing import IO, Any, Literal

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

__all__ = ["STREAM_ERRORS", "is_zstd", "tar_stream"]


def is_zstd(media_type: str) -> bool:
    return media_type.endswith("+zstd") or media_type.endswith(".zstd")


def tar_stream(blob: IO[bytes] | Any, media_type: str) -> tuple[Any, Literal["r|", "r|*"]]:
    """(a reader of the layer's uncompressed tar, the :func:`tarfile.open` mode to stream it with). A damaged
    zstd stream raises one of :data:`STREAM_ERRORS` as it is read."""
    if is_zstd(media_type):
        try:
            import zstandard
        except ImportError:
            raise BaseImageError(f"a layer is compressed with zstd ({media_type}), and this Python lacks the "
                                 "zstandard package that reads it", hint="pip install zstandard") from None
        return zstandard.ZstdDecompressor().stream_reader(blob, read_across_frames=True, closefd=False), "r|"
    return blob, "r|*"
