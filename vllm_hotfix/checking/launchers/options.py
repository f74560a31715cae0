"""What a smoke run is asked to do, whichever launcher starts the runner: one typed value the launchers share."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ...inimage.reference import Reference
from ...inimage.sweep import DEFAULT_LEVELS
from ...trust.references import Signature

GPU_MODES = ("auto", "require", "off")


@dataclass(frozen=True, slots=True)
class SmokeOptions:
    gpu: str = "auto"  # one of GPU_MODES
    gpu_request: str = "auto"  # how containers ask for GPUs (--gpu-request words)
    definition: str | None = None  # judge by this definition's patch set instead of the one the labels name
    base_repo: str | None = None  # where the definition's base is, when no build record of the image names it
    serve_model: Path | None = None
    serve_args: Sequence[str] = ()
    levels: Sequence[int] = DEFAULT_LEVELS
    requests: int = 32
    min_tokens: int | None = None
    reference: Reference | None = None  # judge every reply against these answers
    record_reference: Path | None = None  # record answers here first (a trusted image), then judge against them
    accept_unsigned_reference: bool = False  # a --reference not signed with the site key is judged against anyway
    reference_signature: Signature | None = None  # what the host found of the reference's signature (smoke.run)
    python: str = "python3"
    probe_timeout: float = 600
    serve_timeout: float = 900
    keep_going: bool = False  # run every phase even after one failed
    compile_cache: bool = True  # keep compile caches between runs (see compile_cache)
    deadline: float | None = None  # seconds the runner may take in all (--deadline); None: plan.deadline's
