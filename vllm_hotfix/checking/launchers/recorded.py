"""A recording run's answers kept as a reference, on the host, only from a run whose verdict allows it.

``smoke --record-reference FILE`` (docker or podman): the runner sends the
answers it recorded back as the file's bytes; the host adds the per-level
answers it read from the batch probe and the golden's noise, checks the
settings inside against the run's (:func:`vllm_hotfix.trust.reference_fit.keep`)
and writes the file, naming it in the verdict.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from ...trust import reference_fit
from ...trust.references import unfit
from .judge_run import Ran, restamp
from .options import SmokeOptions
from .plan import Target, run_settings, serve_settings

log = logging.getLogger(__name__)


def keep_recorded(ran: Ran, options: SmokeOptions, target: Target, say: Callable[[str], None]) -> Ran:
    """A recording run (``--record-reference``, docker or podman): the answers the runner recorded written with
    their settings, the per-level answers the host read from the batch probe and the golden's noise measured on
    them, and the verdict naming the file; only from a passing recording (:func:`...trust.references.unfit`: a
    pass, its golden passed, GPU-verified). Nothing is written otherwise: without the per-level answers (the run
    fails on its exact-levels check, which says why), where the golden judged the trusted image wrong or did not
    run, or where no GPU verified the image."""
    if options.record_reference is None:
        return ran
    where = f"    --record-reference {options.record_reference}"
    if ran.answers is None:
        say(f"{where}: the runner recorded no answers (see the serve-sweep check); nothing written")
        return ran
    if not ran.levels:
        say(f"{where}: no per-level answers under fixed batches came back (see the exact-levels check); nothing "
            "written")
        return ran
    why = unfit(ran.verdict) or (None if ran.golden else "the golden measured no noise to keep")
    if why is not None:
        say(f"{where}: nothing written: {why}")
        return ran
    settings = {**serve_settings(options, target), **run_settings(ran.verdict)}
    # The image they were recorded from: its config digest, the host's fact.
    kept = reference_fit.keep(options.record_reference, ran.answers, settings, dict(ran.levels),
                        dict(ran.golden) if ran.golden else None, image_id=target.image_id)
    say(f"    wrote {kept.path} (sha256 {kept.sha256}; {reference_fit.describe(settings)}; answers at concurrency "
        f"{','.join(map(str, ran.levels['schedule']['levels']))} under fixed batches)")
    # The report names the file as written (its sweep was not judged against it).
    return replace(ran, verdict=restamp(ran.verdict, kept, recorded=True))
