"""How a container of the image under test gets the host's GPUs: tried, not guessed.

A Docker host can offer GPUs three ways, and what ``docker info`` shows does not
say which one works:

* ``cdi``: a CDI device such as ``nvidia.com/gpu=all``, defined by spec files
  (``nvidia-ctk cdi generate``) in folders the engine lists as ``CDISpecDirs``
  (API >= 1.44, the ``cdi`` feature; on by default from Docker 28.2).
* ``gpus``: the capability request of ``docker run --gpus all``, served when
  dockerd finds ``nvidia-container-runtime-hook``, registered runtime or not;
  the API does not show whether it will.
* ``runtime``: a registered OCI runtime, usually ``nvidia``.

``auto`` asks the engine what it offers, then confirms each candidate in turn
with one short container of the image under test that lists the GPUs the CUDA
driver shows it (``probes/gpu_list.py``), and keeps the first that sees one.
Every way considered is recorded with a one-line outcome, so a host where none
works says why instead of quietly skipping the GPU checks.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from ..engine import Engine, EngineFacts, GpuRequest
from ..errors import EngineError, SmokeError

log = logging.getLogger(__name__)

CDI_KIND = "nvidia.com/gpu"
DEFAULT_CDI_DEVICE = f"{CDI_KIND}=all"
DEFAULT_RUNTIME = "nvidia"
WAYS = ("auto", "cdi", "gpus", "runtime")
PROBE = "vllm-hotfix-probes/gpu_list.py"
CONFIRM_TIMEOUT = 120
_YAML_KIND = re.compile(r"^kind:\s*['\"]?([^'\"\s#]+)", re.M)
# A device's name sits at the list item's own level under the top-level `devices:`.
_YAML_DEVICE = re.compile(r"^(?:  )?(?:- |  )name:\s*['\"]?([^'\"\s#]+)")


@dataclass(frozen=True)
class Attempt:
    """One way considered: whether a container was started with it, and what came of it."""

    way: str
    tried: bool
    ok: bool
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {"way": self.way, "tried": self.tried, "ok": self.ok, "detail": self.detail}


@dataclass
class GpuAccess:
    """The outcome of choosing: the way that worked (if any) and every way considered."""

    requested: str
    chosen: GpuRequest | None = None
    devices: list[str] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)
    engine: dict[str, Any] = field(default_factory=dict)

    def why_none(self) -> str:
        """One line naming each way considered and why it gave no GPU."""
        if not self.attempts:
            return "no way to request a GPU was considered"
        return "; ".join(f"{a.way}: {a.detail}" for a in self.attempts if not a.ok)

    def to_dict(self) -> dict[str, Any]:
        return {
            "requested": self.requested,
            "way": str(self.chosen) if self.chosen else None,
            "devices": list(self.devices),
            "tried": [a.to_dict() for a in self.attempts],
            "engine": dict(self.engine),
        }


def parse_request(text: str) -> str:
    """Validate ``auto|cdi[:DEVICE]|gpus|runtime[:NAME]``; return it unchanged."""
    way, _, arg = text.partition(":")
    if way not in WAYS or (arg and way not in ("cdi", "runtime")) or (_ and not arg):
        raise SmokeError(
            f"--gpu-request {text!r}: expected auto, cdi[:DEVICE], gpus or runtime[:NAME]",
            hint="e.g. --gpu-request cdi:nvidia.com/gpu=all or --gpu-request runtime:nvidia",
        )
    if way == "cdi" and arg and "=" not in arg:
        raise SmokeError(f"--gpu-request {text!r}: a CDI device is VENDOR/CLASS=NAME, e.g. {DEFAULT_CDI_DEVICE}")
    return text


def _explicit(text: str) -> GpuRequest:
    way, _, arg = text.partition(":")
    if way == "cdi":
        return GpuRequest("cdi", device=arg or DEFAULT_CDI_DEVICE)
    if way == "runtime":
        return GpuRequest("runtime", runtime=arg or DEFAULT_RUNTIME)
    return GpuRequest("gpus")


def cdi_devices(spec_dirs: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """``nvidia.com/gpu`` device names the spec files define, and files that could not be read.

    nvidia-ctk writes YAML by default; the kind and the device names are
    top-level enough to read without a YAML library.
    """
    names: list[str] = []
    unreadable: list[str] = []
    for folder in spec_dirs:
        try:
            entries = sorted(os.listdir(folder))
        except OSError:
            unreadable.append(folder)
            continue
        for entry in entries:
            if not entry.endswith((".json", ".yaml", ".yml")):
                continue
            path = os.path.join(folder, entry)
            try:
                with open(path, encoding="utf-8") as fh:
                    text = fh.read()
            except OSError:
                unreadable.append(path)
                continue
            kind, devices = "", []
            if entry.endswith(".json"):
                try:
                    spec = json.loads(text)
                    kind = str(spec.get("kind", ""))
                    devices = [str(d.get("name", "")) for d in spec.get("devices") or []]
                except (ValueError, AttributeError):
                    unreadable.append(path)
                    continue
            else:
                found = _YAML_KIND.search(text)
                kind = found.group(1) if found else ""
                devices = _yaml_devices(text)
            if kind == CDI_KIND:
                names += [f"{CDI_KIND}={d}" for d in devices if d and f"{CDI_KIND}={d}" not in names]
    return names, unreadable


def _yaml_devices(text: str) -> list[str]:
    names: list[str] = []
    inside = False
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not line.startswith((" ", "-")):
            inside = line.startswith("devices:")
            continue
        found = _YAML_DEVICE.match(line) if inside else None
        if found:
            names.append(found.group(1))
    return names


def candidates(facts: EngineFacts) -> tuple[list[GpuRequest], list[Attempt]]:
    """The ways worth a container, in order, and those ruled out by what the engine says."""
    ways: list[GpuRequest] = []
    ruled_out: list[Attempt] = []
    if not facts.cdi_spec_dirs:
        ruled_out.append(Attempt("cdi", False, False,
                                 f"engine {facts.server_version} (API {facts.api_version}) lists no CDI spec "
                                 "folders (CDI needs API >= 1.44 with the cdi feature)"))
    else:
        names, unreadable = cdi_devices(facts.cdi_spec_dirs) if facts.local else ([], list(facts.cdi_spec_dirs))
        if DEFAULT_CDI_DEVICE in names or (not names and unreadable):
            # A remote engine's specs cannot be read from here: `all` is what nvidia-ctk defines.
            ways.append(GpuRequest("cdi", device=DEFAULT_CDI_DEVICE))
        elif names:
            ways.append(GpuRequest("cdi", device=",".join(names)))
        else:
            ruled_out.append(Attempt("cdi", False, False,
                                     f"no spec in {', '.join(facts.cdi_spec_dirs)} defines a {CDI_KIND} device "
                                     "(make one with `nvidia-ctk cdi generate`)"))
    # The hook that serves --gpus is invisible to the API: only a container tells.
    ways.append(GpuRequest("gpus"))
    nvidia = [r for r in facts.runtimes if "nvidia" in r]
    if nvidia:
        ways += [GpuRequest("runtime", runtime=r) for r in nvidia]
    else:
        ruled_out.append(Attempt(f"runtime:{DEFAULT_RUNTIME}", False, False,
                                 f"no NVIDIA runtime registered (runtimes: {', '.join(facts.runtimes) or 'none'})"))
    return ways, ruled_out


def _probe_bytes() -> bytes:
    return resources.files("vllm_hotfix.inimage.probes").joinpath("gpu_list.py").read_bytes()


def confirm(engine: Engine, image: str, request: GpuRequest, python: str = "python3") -> Attempt:
    """Start one short container of ``image`` with ``request``; ok when it sees a GPU."""
    try:
        res = engine.run(image, [python, f"/tmp/{PROBE}"], files={PROBE: _probe_bytes()}, gpu=request,
                         timeout=CONFIRM_TIMEOUT)
    except EngineError as exc:
        # The engine's own words, without the "cannot run ... in IMAGE" lead-in, in a person's words where known.
        return Attempt(str(request), True, False, engine_words(_one_line(str(exc).split(f" in {image}: ", 1)[-1])))
    data: dict[str, Any] = {}
    for line in reversed(res.stdout.strip().splitlines()):
        try:
            data = json.loads(line)
            break
        except ValueError:
            continue
    names = [str(n) for n in data.get("devices") or []]
    if res.exit_code == 0 and names:
        return Attempt(str(request), True, True, f"container sees {len(names)} GPU(s): {', '.join(names)}")
    why = data.get("error") or _one_line(res.stderr) or f"exit {res.exit_code}, no output"
    return Attempt(str(request), True, False, f"container started but sees no GPU: {_one_line(str(why))}")


def choose(
    engine: Engine,
    image: str,
    requested: str = "auto",
    python: str = "python3",
    progress: Callable[[str], None] | None = None,
) -> GpuAccess:
    """Find a way to give ``image``'s containers the GPUs; never raises for a host without one."""
    parse_request(requested)
    access = GpuAccess(requested)
    try:
        facts = engine.facts()
        access.engine = {"version": facts.server_version, "api": facts.api_version,
                         "cdi_spec_dirs": list(facts.cdi_spec_dirs), "runtimes": list(facts.runtimes)}
    except EngineError as exc:
        if requested == "auto":
            access.attempts.append(Attempt("auto", False, False, _one_line(str(exc))))
            return access
        facts = None
    if requested == "auto" and facts is not None:
        ways, ruled_out = candidates(facts)
    else:
        ways, ruled_out = [_explicit(requested)], []
    for request in ways:
        attempt = confirm(engine, image, request, python)
        access.attempts.append(attempt)
        if progress is not None:
            progress(f"    gpu request {attempt.way}: {attempt.detail}")
        if attempt.ok:
            access.chosen = request
            access.devices = attempt.detail.split(": ", 1)[1].split(", ")
            break
    # Ways ruled out by the engine's answer come last: they were never started.
    access.attempts += ruled_out
    return access


# What Docker says when no hook serves a device request, and what that means on the host.
_NO_DRIVER = re.compile(r'could not select device driver "[^"]*" with capabilities: \[\[[^\]]*\]\]')


def engine_words(text: str) -> str:
    """The engine's refusal of a GPU request, said as what the host lacks (Docker's is ``could not select device
    driver "" with capabilities: [[gpu]]``)."""
    if _NO_DRIVER.search(text):
        return ("this engine has no GPU device driver for --gpus (could not select device driver): the NVIDIA "
                "Container Toolkit is not installed or not set up for it")
    return text


def _one_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else "")[:300]
