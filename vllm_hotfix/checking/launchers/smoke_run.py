"""A whole smoke run through a launcher: the job staged, the runner started, and what came back judged here.

:func:`smoke` builds the runner's job (:mod:`.plan`), stages the runner
folder in a temporary folder, starts it through the launcher, and hands
what came back to the host's judgement (:mod:`.judge_run`); a reference
recorded under other settings than the run reported is refused
(:mod:`vllm_hotfix.trust.reference_fit`).
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ...errors import RunnerFailed
from ...journal import leftovers, records
from ...trust import reference_fit
from .base import Launched, Launcher, stage
from .judge_run import HostFacts, Ran, judged
from .options import SmokeOptions
from .plan import Target, job, run_settings

log = logging.getLogger(__name__)


def smoke(launcher: Launcher, root: Path, target: Target, options: SmokeOptions, *, gpu_request: str | None,
          checks: Sequence[Mapping[str, Any]] = (), host: Mapping[str, Any] | None = None,
          say: Callable[[str], None] = lambda _l: None, expected_from: str = "",
          landed: Mapping[str, str] | None = None, gpu_unavailable: Mapping[str, str] | None = None,
          facts: HostFacts | None = None, echo: bool = True, python_path: Sequence[str] = ()) -> Ran:
    """Stage the runner for ``target``, start it through ``launcher``, and judge what it reported, here.

    The staged folder lives in a temporary folder removed before this
    returns. A runner that gives no report is the run's failing (incomplete
    when it ran out of time), as the host records it. ``echo``: say what
    starts and each check after the run (a launcher that followed the
    runner's progress has shown the runner's).
    """
    spec, extra = job(root, target, options, launcher=launcher.name, gpu_request=gpu_request, checks=checks,
                      host=host, expected_from=expected_from, landed=landed, gpu_unavailable=gpu_unavailable,
                      python_path=python_path)
    started, start = records.now_iso(), time.monotonic()
    # A killed run cannot remove its staging folder: the next run removes those of processes that are gone.
    leftovers.sweep_staging()
    with tempfile.TemporaryDirectory(prefix=leftovers.staging_prefix()) as tmp:
        folder = stage(Path(tmp) / "runner", spec, extra)
        if echo:
            say(f"==> smoke through {launcher.name}: the runner in {target.start} "
                f"(GPU request: {gpu_request or 'none'})")
        model = Path(options.serve_model).resolve() if options.serve_model is not None else None
        try:
            launched: Launched | RunnerFailed = launcher.launch(target.start, folder, spec, gpu_request, model)
        except RunnerFailed as exc:
            if exc.hint:
                say(exc.hint)
            launched = exc
    verdict, levels, noise = judged(spec, launched, facts, started=started, seconds=time.monotonic() - start,
                                    reference=options.reference, model=model, signature=options.reference_signature)
    if options.reference is not None and isinstance(launched, Launched):
        # What the host judged the run to have had (a GPU model only where it gave one), as the reference names it.
        reference_fit.refuse_other_settings(options.reference, run_settings(verdict))
    said = {(c.name, c.status, c.detail) for c in launched.report.checks} if isinstance(launched, Launched) else set()
    shown = {(c.get("name"), c.get("status"), c.get("detail")) for c in spec["checks"]}
    for c in verdict.checks:
        if echo or ((c.name, c.status, c.detail) not in said and (c.name, c.status.value, c.detail) not in shown):
            say(f"    {c.status.value:<4} {c.name}: {c.detail}" + ("" if echo else " (judged here)"))
    return Ran(verdict, spec, launched.answers if isinstance(launched, Launched) else None, levels, noise)
