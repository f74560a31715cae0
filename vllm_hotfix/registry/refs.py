"""Image references and registry locations, checked before any work starts.

The grammar is the distribution project's (``reference/regexp.go``): an
optional registry host with port, lowercase path components, a tag of at most
128 word characters, dots and dashes, or a ``sha256:`` digest. Checking it
here means a bad ``--tag`` fails in a millisecond, not after a build and a
smoke run, and the engine never sees a value it would reject with a stack of
SDK errors.
"""

from __future__ import annotations

import re

from ..errors import UsageError

_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_HOST_PART = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_HOST = rf"(?:{_HOST_PART}(?:\.{_HOST_PART})*|\[[0-9a-fA-F:]+\])(?::[0-9]+)?"
_NAME = rf"(?:{_HOST}/)?{_COMPONENT}(?:/{_COMPONENT})*"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"sha256:[0-9a-f]{64}"

REFERENCE = re.compile(rf"^({_NAME})(?::({_TAG}))?(?:@({_DIGEST}))?\Z")
REGISTRY = re.compile(rf"^{_HOST}(?:/{_COMPONENT})*\Z")
IMAGE_ID = re.compile(r"^(?:sha256:)?[0-9a-f]{12,64}\Z")


def shown(value: str, limit: int = 200) -> str:
    """``value`` as it may appear in a one-line message: control characters escaped, long ones cut.

    Always quoted: a value ending in a newline (pasted from a file) must not
    split the error line in two, and an empty or spaced one must still show.
    """
    cut = value[:limit]
    return repr(cut) + (f" (+{len(value) - limit} more characters)" if len(value) > limit else "")


def _host_is_plain_name(name: str) -> bool:
    """True when the first path component of ``name`` is a lowercase name, not a registry host.

    The grammar lets a host hold capitals; the engine takes a first component
    for a host only if it has a dot or a port or is ``localhost``, so
    ``UPPER/repo`` is an uppercase repository name, which no registry accepts.
    """
    if "/" not in name:
        return True
    first = name.split("/", 1)[0]
    if "." in first or ":" in first or first == "localhost" or first.startswith("["):
        return True
    return first == first.lower()


def check_reference(value: str, what: str, *, tag_only: bool = False) -> str:
    """``value`` if it is a valid image reference; else a UsageError naming ``what``."""
    m = REFERENCE.match(value)
    if not m or len(m.group(1)) > 255 or not _host_is_plain_name(m.group(1)):
        raise UsageError(f"{what} {shown(value)}: not a valid image reference "
                         "(lowercase name[:tag], e.g. ops/vllm:v1)")
    if tag_only and m.group(3):
        raise UsageError(f"{what} {shown(value)}: a digest names content, it cannot be set; give name:tag")
    return value


def check_repository(value: str, what: str) -> str:
    """``value`` if it is a repository name (no tag, no digest); else a UsageError naming ``what``."""
    m = REFERENCE.match(value)
    if not m or len(m.group(1)) > 255 or not _host_is_plain_name(m.group(1)):
        raise UsageError(f"{what} {shown(value)}: not a valid image reference "
                         "(a lowercase repository name, e.g. vllm/vllm-openai)")
    if m.group(2) or m.group(3):
        raise UsageError(f"{what} {shown(value)}: a repository name takes no tag or digest "
                         "(e.g. vllm/vllm-openai)")
    return value


def check_image(value: str, what: str) -> str:
    """An image reference, or the ID of an image in the engine (``sha256:...`` or 12+ hex digits)."""
    if IMAGE_ID.match(value):
        return value
    return check_reference(value, what)


def check_registry(value: str) -> str:
    """A push location HOST[:PORT][/PATH]; never echoes credentials written into it."""
    stripped = value.strip().rstrip("/")
    host = stripped.split("://", 1)[-1].split("/", 1)[0]
    if "@" in host:
        # user:password@host: refuse without printing any of it.
        raise UsageError(
            "--registry holds credentials (USER[:PASSWORD]@HOST); refusing it without echoing it",
            hint="log in once with `docker login HOST`; the tool uses the stored credentials",
        )
    if "://" in stripped:
        scheme = stripped.split("://", 1)[0]
        raise UsageError(f"--registry {shown(stripped)}: expected HOST[:PORT]/PATH without a scheme ({shown(scheme)}://)")
    if not stripped or not REGISTRY.match(stripped) or "." not in host and ":" not in host and host != "localhost":
        raise UsageError(
            f"--registry {shown(stripped)}: expected HOST[:PORT]/PATH with a lowercase path, "
            "e.g. registry.internal:5000/ml"
        )
    return stripped
