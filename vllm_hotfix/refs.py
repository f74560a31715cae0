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

from .errors import UsageError

_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_HOST_PART = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_HOST = rf"(?:{_HOST_PART}(?:\.{_HOST_PART})*|\[[0-9a-fA-F:]+\])(?::[0-9]+)?"
_NAME = rf"(?:{_HOST}/)?{_COMPONENT}(?:/{_COMPONENT})*"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"sha256:[0-9a-f]{64}"

REFERENCE = re.compile(rf"^({_NAME})(?::({_TAG}))?(?:@({_DIGEST}))?$")
REGISTRY = re.compile(rf"^{_HOST}(?:/{_COMPONENT})*$")
IMAGE_ID = re.compile(r"^(?:sha256:)?[0-9a-f]{12,64}$")


def check_reference(value: str, what: str, *, tag_only: bool = False) -> str:
    """``value`` if it is a valid image reference; else a UsageError naming ``what``."""
    shown = value if len(value) <= 200 and value.isprintable() else repr(value[:200])
    m = REFERENCE.match(value)
    if not m or len(m.group(1)) > 255:
        raise UsageError(f"{what} {shown}: not a valid image reference (lowercase name[:tag], e.g. ops/vllm:v1)")
    if tag_only and m.group(3):
        raise UsageError(f"{what} {shown}: a digest names content, it cannot be set; give name:tag")
    return value


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
        raise UsageError(f"--registry {stripped}: expected HOST[:PORT]/PATH without a scheme ({scheme}://)")
    if not stripped or not REGISTRY.match(stripped) or "." not in host and ":" not in host and host != "localhost":
        raise UsageError(
            f"--registry {stripped!r}: expected HOST[:PORT]/PATH with a lowercase path, "
            "e.g. registry.internal:5000/ml"
        )
    return stripped
