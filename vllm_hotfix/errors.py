"""One exception tree for the whole pipeline.

Library code raises these; only the CLI turns them into a message and an exit
code. Each carries the context a person needs to act (the patch and hunk, the
image, the last lines of a build log).

Each class that has an exit code of its own says in ``meaning`` what that
code stands for: :func:`exit_table` is built from them, and it is the table
``--help`` prints, so the two cannot drift apart.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

# Exits that are not errors of the pipeline.
EXIT_OK = 0
EXIT_INTERRUPTED = 130
EXIT_OUTPUT_CLOSED = 141  # 128 + SIGPIPE, what a shell reports for a writer whose reader went away
EXIT_TERMINATED = 143  # 128 + SIGTERM, what a shell reports for a process ended by it


class Terminated(KeyboardInterrupt):
    """The process got SIGTERM (docker stop, systemd, a CI runner cancelling the job).

    A KeyboardInterrupt, so that it unwinds exactly as Ctrl-C does: every
    cleanup that removes containers, scratch folders and notes runs.
    """


class PipelineError(Exception):
    """Base of every error the pipeline reports to its user.

    Raise one of its children: each has an exit code of its own. What reaches
    the CLI as no PipelineError at all is a bug and exits with this code.
    """

    exit_code = 70
    meaning = "internal error: a bug, printed with its traceback"
    hint: str | None = None

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        if hint is not None:
            self.hint = hint


class DefinitionError(PipelineError):
    """An image definition (images/<tag>.toml) is missing or invalid."""

    exit_code = 2
    meaning = "image definition (images/<tag>.toml)"


class PatchError(PipelineError):
    """A patch is malformed, unsafe, or does not apply to the base's files."""

    exit_code = 3
    meaning = "patch (malformed, unsafe, does not apply)"

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


class PatchNeedsFuzz(PatchError):
    """A hunk applies only with fuzz; the pipeline insists on zero fuzz."""


class PatchConflict(PatchError):
    """A hunk does not apply at all."""


class BaseImageError(PipelineError):
    """The base image is missing, unreachable, or not what its tag claims."""

    exit_code = 4
    meaning = ("base image (missing, unreachable, wrong vLLM version), or the image to smoke or push is not "
               "where it is run from (the engine, or podman's store)")


class EngineError(PipelineError):
    """The Docker engine is unreachable or refused an operation."""

    exit_code = 5
    meaning = "Docker engine (unreachable, refused, or lost mid-run)"


class EngineLost(EngineError):
    """The engine stopped answering in the middle of an operation."""


class BuildError(PipelineError):
    """`docker build` failed; carries the last lines of its output."""

    exit_code = 6
    meaning = "docker build (or loading an assembled image)"

    def __init__(self, message: str, *, log_tail: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.log_tail = list(log_tail)


class AssembleUnsupported(BuildError):
    """The engine cannot load an assembled image; the Dockerfile builder can still build it."""


class SmokeError(PipelineError):
    """A smoke check failed or could not run."""

    exit_code = 7
    meaning = "smoke check failed"


class RunnerFailed(SmokeError):
    """The runner in the image gave no verdict: it crashed, printed garbage, or (``incomplete``) ran out of time.

    The default smoke records it as the run's outcome (a failing check, or an
    incomplete one for a timeout) instead of ending without a verdict.
    """

    def __init__(self, message: str, *, hint: str | None = None, incomplete: bool = False) -> None:
        super().__init__(message, hint=hint)
        self.incomplete = incomplete


class PushError(PipelineError):
    """A registry could not be reached or refused (any command that reads or writes one), or the gate refused
    a push.

    One code for one kind of fault: a registry that is down, refuses the login
    or answers an error gives 8 whether ``push``, ``image --in-registry`` or
    ``verify`` asked it.
    """

    exit_code = 8
    meaning = ("registry (unreachable, refusing the login, answering an error: push, verify and every command "
               "that reads one), or a push refused by the gate")


class UpstreamError(PipelineError):
    """Fetching or checking an upstream change failed."""

    exit_code = 9
    meaning = "upstream (PR, wheel or release lookup)"


class StorageError(PipelineError):
    """A file the tool keeps (journal, facts cache, run notes, reports) cannot be written or read."""

    exit_code = 10
    meaning = ("storage (build/records, the cache or a report file: not writable, disk full, "
               "an entry of the wrong shape)")


class RecordError(StorageError):
    """The journal (build/records) cannot be written, or an entry is damaged."""


class SmokeIncomplete(SmokeError):
    """The host, not the image, stopped a smoke run (no usable GPU, engine lost)."""

    exit_code = 11
    meaning = "smoke incomplete (the host could not run a check; serve-check: no server answers at the URL)"


class PinError(PipelineError):
    """A patch set's pins.txt, its wheels, their hashes, or what installing them did to the image."""

    exit_code = 12
    meaning = "pins (pins.txt, its wheels and hashes, pip check after pinning)"

    def __init__(self, message: str, *, pin: str | None = None, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.pin = pin


class NotItsProduct(SmokeError):
    """The image is not what its definition's builder makes of its base: a layer, an entry or its config
    differs (the layer-identity check), so nothing else was checked."""

    exit_code = 14
    meaning = ("not its definition's product: a layer, file or config field differs from what the builder "
               "writes over the base (layer-identity; nothing else was checked)")


class UnknownExpectation(SmokeError):
    """The tool cannot tell what the image's patched files must be."""


class NothingToRollBack(PipelineError):
    """Rollback found no recorded build to move the tag to."""

    exit_code = 1
    meaning = "nothing to roll back to (list shows the builds)"


class Refused(PipelineError):
    """The tool will not do what was asked, by rule: not a fault of the inputs or the engine.

    A tag that names the base or an image the tool did not make, a builder it
    does not have, a rollback onto an image whose smoke failed.
    """

    exit_code = 13
    meaning = ("refused: a tag the tool must not move without --force (push: off an image with a signed pass, "
               "without --replace); a rollback onto an image whose smoke failed, of another platform, or (--to) "
               "onto one platform of a multi-platform output")


class UsageError(PipelineError):
    """The command line itself is wrong: an unknown option, a bad value."""

    exit_code = 64
    meaning = "usage (unknown option, malformed value such as an unknown --builder, click's own usage errors)"


class NotInstalled(PipelineError):
    """The Python running the tool lacks one of its dependencies (not the environment `make setup` made)."""

    exit_code = 69
    meaning = "the Python running the tool lacks one of its dependencies (`make setup` installs them into .venv)"


class AttestationError(PipelineError):
    """A signing or public key cannot be used, or a signed verdict cannot be read or written."""

    # What a verification policy required and found, and the verdicts it considered, where it got that far
    # (``verify --json`` prints it with a refusal too).
    evidence: dict[str, object] | None = None

    exit_code = 20
    meaning = ("signed verdicts: a signing or public key that cannot be used, or an attestation that cannot be "
               "read or written")


class AttestationMissing(AttestationError):
    """No signed verdict is attached to the image (or none was given)."""

    exit_code = 21
    meaning = "no signed verdict for the image (none attached in the registry, or none given)"


class AttestationWrongKey(AttestationError):
    """Signed verdicts exist, but none with the given key."""

    exit_code = 22
    meaning = "signed verdicts exist, but none made with the given key"


class AttestationTampered(AttestationError):
    """A signed verdict whose signature does not match its content, or which is malformed."""

    exit_code = 23
    meaning = "a signed verdict whose signature does not match its content (tampered), or malformed"


class AttestationMismatch(AttestationError):
    """The verification policy refused: the signed verdicts verify, but none that covers the policy meets it."""

    exit_code = 24
    meaning = ("the verification policy refused: the newest signed verdict that covers it is not a pass or "
               "misses a requirement (checks, definition, digests, age, GPU product, tool version), a newer "
               "fail blocks it, none covers it, one is dated in the future, or they are about another image")


class CannotCheck(AttestationError):
    """The signed verdicts could not be checked: nothing was judged, so nothing was refused either.

    A registry that cannot be read is the other "could not check", and keeps
    the registry's code (:class:`PushError`, 8), as every registry fault does.
    """

    exit_code = 25
    meaning = ("could not check the signed verdicts: they cannot be ordered (one carries no signed time, two "
               "newest end at the same instant); a registry that cannot be read is 8")


class NotRegular(OSError):
    """A path named to be read that is not a regular file (a FIFO, a device, a socket, a folder).

    Not a PipelineError: the reader turns it into one that names what the file was for.
    """


class Malformed(ValueError):
    """A value that does not have the shape of a smoke check or verdict (what is wrong, in words).

    Not a PipelineError: the reader turns it into one that names where the value came from.
    """


class ShortReply(Exception):
    """A sweep reply with fewer completion tokens than every reply must have (counted as a failed request)."""


def error_classes() -> list[type[PipelineError]]:
    """PipelineError and every class below it."""
    found: list[type[PipelineError]] = [PipelineError]
    for cls in found:
        found.extend(sub for sub in cls.__subclasses__() if sub not in found)
    return found


def exit_table() -> list[tuple[int, str]]:
    """Every exit code the CLI can end with and what it means, lowest first."""
    codes = {EXIT_OK: "done (also: the base needs no hotfix, nothing built)",
             EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
             EXIT_OUTPUT_CLOSED: "output closed: what read the tool's output went away (head, a pager); "
                                 "cleans up as Ctrl-C does",
             EXIT_TERMINATED: "terminated (SIGTERM: docker stop, systemd, a cancelled CI job); cleans up as "
                              "Ctrl-C does"}
    for cls in error_classes():
        if "meaning" in vars(cls):
            codes[cls.exit_code] = cls.meaning
    return sorted(codes.items())


def short(exc: BaseException | str | bytes) -> str:
    """One line of at most 400 characters from an error or an engine's answer, whose text can span many.

    The engine's JSON error bodies (``{"message": ...}``) give their message.
    """
    text = exc if isinstance(exc, (str, bytes)) else (getattr(exc, "explanation", None) or str(exc)
                                                        or type(exc).__name__)
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    try:
        text = json.loads(text).get("message", text)
    except (ValueError, AttributeError):
        pass
    return " ".join(str(text).split())[:400]
