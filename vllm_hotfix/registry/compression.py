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

from typing import IO, Any, Literal

try:
    from zstandard import ZstdError
except ImportError:  # a Python without it (a GPU host's, running the smokes) reads every other layer
    class ZstdError(Exception):  # type: ignore[no-redef]
        """zstandard's error, where the library is absent."""

__all__ = ["ZstdError", "is_zstd", "tar_stream"]


def is_zstd(media_type: str) -> bool:
    return media_type.endswith("+zstd") or media_type.endswith(".zstd")


def tar_stream(blob: IO[bytes] | Any, media_type: str) -> tuple[Any, Literal["r|", "r|*"]]:
    """(a reader of the layer's uncompressed tar, the :func:`tarfile.open` mode to stream it with). A damaged
    zstd stream raises :class:`ZstdError` as it is read."""
    if is_zstd(media_type):
        try:
            import zstandard
        except ImportError:
            raise ZstdError("a zstd layer needs the zstandard package, which this Python lacks") from None
        return zstandard.ZstdDecompressor().stream_reader(blob, read_across_frames=True, closefd=False), "r|"
    return blob, "r|*"
