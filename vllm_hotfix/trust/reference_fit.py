"""Whether a reference may judge a run, and whether answers a runner recorded may be kept as one.

A reference proves something only about another image than the one judged,
recorded under the settings the run has: answers of the judged image prove
only that it repeats itself, the base's are the bug's, and answers recorded
under other settings (the server's arguments and environment, the GPU
model, vLLM's and torch's versions, the base, the model) judge other
numerics. So a run refuses, before anything starts, a reference recorded
from the judged image or its definition's base (:func:`refuse_judged_image`)
or under other settings (:func:`refuse_other_settings`), and again once the
run has said what it saw. A recording's answers come back from the image as
the file's bytes: :func:`keep` writes them only where the settings inside
are this run's, with the image they were recorded from as the host knows it.
The file format itself is :mod:`vllm_hotfix.inimage.reference`, which the
image's recording writes too; these decisions are made on the host.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import SmokeError, UsageError
from ..inimage.oracle import SETTING_KEYS
from ..inimage.reference import Reference, load, write
from ..journal.atomic import write_atomic

log = logging.getLogger(__name__)


def settings_difference(recorded: Mapping[str, Any] | None, here: Mapping[str, Any]) -> str | None:
    """The settings of ``here`` that differ from those the reference was recorded under, in words; None: same.

    Only the keys ``here`` gives are compared (a run knows the GPU model after
    it found the GPU, the versions after the image reported them).
    """
    recorded = recorded or {}
    differ = [f"{key} {recorded.get(key)!r} there, {here[key]!r} here" for key in SETTING_KEYS
              if key in here and recorded.get(key) != here[key]]
    return "; ".join(differ) or None


def refuse_other_settings(ref: Reference, here: dict[str, Any]) -> None:
    """UsageError, one line naming each difference, when ``here`` is not what ``ref`` was recorded under."""
    differ = settings_difference(ref.settings, here)
    if differ:
        raise UsageError(f"--reference {ref.path}: recorded under other settings ({differ}); record the reference "
                         "again under these settings, or judge under the ones it names")


def refuse_judged_image(ref: Reference, image_id: str, base_id: str = "") -> None:
    """UsageError, one line naming both, when ``ref`` was recorded from the judged image ``image_id`` itself or
    from its definition's base ``base_id`` (the base the host found by the image's layers): answers of the image
    under test prove only that it repeats itself, and the base's are the bug's. A reference that names no image
    is refused too: nothing shows it is another."""
    where = f"--reference {ref.path}"
    if not ref.image_id:
        raise UsageError(f"{where}: names no image it was recorded from (recorded by serve-check or an earlier "
                         "version), so nothing shows it is not the judged image; record it again with smoke "
                         "--record-reference from a trusted image")
    if ref.image_id == image_id:
        raise UsageError(f"{where}: recorded from {image_id}, the judged image itself: its answers prove only that "
                         "the image repeats itself; record the reference from another image the site trusts")
    if base_id and ref.image_id == base_id:
        raise UsageError(f"{where}: recorded from {base_id}, the base of the judged image {image_id} (its "
                         "definition's base, found by its layers): the unpatched base's answers are the bug's; "
                         "record the reference from a trusted patched image")


def keep(path: Path, data: bytes, settings: dict[str, Any], levels: dict[str, Any] | None = None,
         golden: dict[str, Any] | None = None, *, image_id: str = "") -> Reference:
    """The answers a runner recorded (the file's bytes, the settings inside) written to ``path``, read back and
    checked: their settings must be ``settings`` (what the host knows, and what the run reported), or the file
    is removed and the recording refused. ``levels``: the per-level answers the host took from the batch
    probe's replies (:func:`vllm_hotfix.judges.fixed_batches.record`), written into the same file; ``golden``
    the golden's envelope the host measured and the trusted image's noise against it
    (:func:`vllm_hotfix.golden.judge.recorded`);
    ``image_id``: the image recorded, as the host knows it (whatever the runner wrote is replaced)."""
    write_atomic(path, data)
    ref = load(path, "--record-reference")
    differ = settings_difference(ref.settings, settings)
    if differ:
        path.unlink()
        raise SmokeError(f"--record-reference {path}: the runner recorded other settings than this run's "
                         f"({differ}); nothing written")
    if levels or golden or image_id != ref.image_id:
        ref = write(replace(ref, levels=levels or ref.levels, golden=golden or ref.golden, image_id=image_id), path)
    return ref


def describe(settings: Mapping[str, Any]) -> str:
    """The settings a recording was made under, as a line names them."""
    return "recorded on " + ", ".join(f"{k} {settings.get(k)}" for k in ("gpu", "vllm", "torch"))
