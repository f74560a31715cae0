"""One exception tree for the whole pipeline.

Library code raises these; only the CLI turns them into a message and an exit
code. Each carries the context a person needs to act (the patch and hunk, the
image, the last lines of a build log).
"""

from __future__ import annotations

from collections.abc import Sequence


class PipelineError(Exception):
    """Base of every error the pipeline reports to its user."""

    exit_code = 1
    hint: str | None = None

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        if hint is not None:
            self.hint = hint


class DefinitionError(PipelineError):
    """An image definition (images/<tag>.toml) is missing or invalid."""

    exit_code = 2


class PatchError(PipelineError):
    """A patch is malformed, unsafe, or does not apply to the base's files."""

    exit_code = 3

    def __init__(
        self,
        message: str,
        *,
        patch: str | None = None,
        file: str | None = None,
        hunk: int | None = None,
        hint: str | None = None,
    ) -> None:
        super().__init__(message, hint=hint)
        self.patch = patch
        self.file = file
        self.hunk = hunk


class PatchAlreadyApplied(PatchError):
    """The base already carries this patch (upstream shipped it)."""


class NoHotfixNeeded(PipelineError):
    """Not a failure: the base already carries every patch of the set.

    Raised so that nothing is built; the CLI reports it and exits 0.
    """

    exit_code = 0

    def __init__(self, message: str, *, patches: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.patches = list(patches)


class PatchNeedsFuzz(PatchError):
    """A hunk applies only with fuzz; the pipeline insists on zero fuzz."""


class PatchConflict(PatchError):
    """A hunk does not apply at all."""


class BaseImageError(PipelineError):
    """The base image is missing, unreachable, or not what its tag claims."""

    exit_code = 4


class EngineError(PipelineError):
    """The Docker engine is unreachable or refused an operation."""

    exit_code = 5


class EngineLost(EngineError):
    """The engine stopped answering in the middle of an operation."""


class BuildError(PipelineError):
    """`docker build` failed; carries the last lines of its output."""

    exit_code = 6

    def __init__(self, message: str, *, log_tail: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.log_tail = list(log_tail)


class SmokeError(PipelineError):
    """A smoke check failed or could not run."""

    exit_code = 7


class PushError(PipelineError):
    """Pushing to the registry failed or was refused by the gate."""

    exit_code = 8


class UpstreamError(PipelineError):
    """Fetching or checking an upstream change failed."""

    exit_code = 9


class RecordError(PipelineError):
    """The journal under build/records cannot be written (or read)."""

    exit_code = 10


class SmokeIncomplete(SmokeError):
    """The host, not the image, stopped a smoke run (no usable GPU, engine lost)."""

    exit_code = 11


class PinError(PipelineError):
    """A patch set's pins.txt, its wheels, their hashes, or what installing them did to the image."""

    exit_code = 12

    def __init__(self, message: str, *, pin: str | None = None, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.pin = pin


class UsageError(PipelineError):
    """The command line itself is wrong: an unknown option, a bad value."""

    exit_code = 64


class AttestationError(PipelineError):
    """A signing or public key cannot be used, or a signed verdict cannot be read or written."""

    exit_code = 20


class AttestationMissing(AttestationError):
    """No signed verdict is attached to the image (or none was given)."""

    exit_code = 21


class AttestationWrongKey(AttestationError):
    """Signed verdicts exist, but none with the given key."""

    exit_code = 22


class AttestationTampered(AttestationError):
    """A signed verdict whose signature does not match its content, or which is malformed."""

    exit_code = 23


class AttestationMismatch(AttestationError):
    """A valid signed verdict about another image, or one that does not pass what was required."""

    exit_code = 24
