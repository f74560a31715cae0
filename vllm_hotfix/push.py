"""Push a smoke-tested image to the internal registry, and prove it landed.

The gate: only an image whose exact ID has a passing smoke record may be
pushed, and a GPU-unverified one only when the caller says so. After the push
the registry's v2 API must resolve the tag to the digest the engine reported.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import requests

from . import records
from .engine import Engine, split_reference
from .errors import PushError

log = logging.getLogger(__name__)

ATTEMPTS = 4
MANIFEST_TYPES = ", ".join([
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.oci.image.index.v1+json",
])


@dataclass(frozen=True)
class Pushed:
    ref: str
    digest: str
    image_id: str


def target_ref(image_ref: str, registry: str) -> str:
    """HOST[:PORT]/PATH + the last part of the image's repository + its tag."""
    repo, tag = split_reference(image_ref)
    registry = registry.rstrip("/")
    if not registry or registry.startswith(("http://", "https://")):
        raise PushError(f"--registry {registry!r}: expected HOST[:PORT]/PATH, without a scheme")
    return f"{registry}/{repo.rsplit('/', 1)[-1]}:{tag}"


def gate(root: Path, image_id: str, image_ref: str, allow_gpu_unverified: bool) -> records.Record:
    passing = [r for r in records.find_by_image(root, image_id) if r.data.get("smoke_status") == "pass"]
    if not passing:
        raise PushError(
            f"{image_ref} ({image_id[:19]}) has no passing smoke record; refusing to push an untested image",
            hint=f"run: python build.py smoke {image_ref}",
        )
    rec = passing[0]
    if not (rec.data.get("smoke") or {}).get("gpu_verified") and not allow_gpu_unverified:
        raise PushError(
            f"{image_ref} passed smoke without GPU checks (GPU-unverified); refusing to push",
            hint="smoke-test it on a GPU host, or pass --allow-gpu-unverified",
        )
    return rec


def _scheme(host: str) -> str:
    name = host.split(":", 1)[0]
    return "http" if name in ("127.0.0.1", "localhost", "::1") else "https"


def registry_digest(ref: str, timeout: float = 15) -> str | None:
    """What the registry's v2 API says the tag resolves to."""
    repo, tag = split_reference(ref)
    host, _, name = repo.partition("/")
    url = f"{_scheme(host)}://{host}/v2/{name}/manifests/{tag}"
    try:
        resp = requests.head(url, headers={"Accept": MANIFEST_TYPES}, timeout=timeout)
    except requests.RequestException as exc:
        raise PushError(f"cannot ask {url}: {exc}") from exc
    if resp.status_code == 404:
        return None
    if resp.status_code != 200:
        raise PushError(f"{url} answered HTTP {resp.status_code}")
    return resp.headers.get("Docker-Content-Digest")


def push(
    engine: Engine,
    root: Path,
    image_ref: str,
    registry: str,
    *,
    allow_gpu_unverified: bool = False,
    attempts: int = ATTEMPTS,
    progress: Callable[[str], None] | None = None,
) -> Pushed:
    say = progress or (lambda _line: None)
    info = engine.image(image_ref)
    if info is None:
        raise PushError(f"image {image_ref} is not in the engine")
    rec = gate(root, info.id, image_ref, allow_gpu_unverified)
    target = target_ref(image_ref, registry)
    had_target = engine.image(target)
    engine.tag(info.id, target)
    try:
        digest = _push_with_retries(engine, target, attempts, say)
        seen = registry_digest(target)
        if seen != digest:
            raise PushError(f"registry resolves {target} to {seen}, not the pushed {digest}")
    finally:
        # The registry tag exists only to name the push; don't leave it behind
        # unless it was there before.
        if had_target is None:
            engine.untag(target)
    rec.data.setdefault("pushes", []).append(
        {"ref": target, "digest": digest, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    )
    rec.save()
    return Pushed(target, digest, info.id)


def _push_with_retries(engine: Engine, target: str, attempts: int, say: Callable[[str], None]) -> str:
    delay = 1.0
    for attempt in range(1, attempts + 1):
        try:
            say(f"==> pushing {target} (attempt {attempt}/{attempts})")
            return engine.push(target, lambda line: say("    " + line))
        except PushError as exc:
            if attempt == attempts or not _transient(str(exc)):
                raise
            say(f"    transient registry error, retrying in {delay:.0f} s: {exc}")
            time.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")


_TRANSIENT = ("connection refused", "connection reset", "timeout", "timed out", "eof",
              "503", "502", "504", "429", "temporarily", "no such host", "i/o")


def _transient(message: str) -> bool:
    low = message.lower()
    return any(word in low for word in _TRANSIENT)
