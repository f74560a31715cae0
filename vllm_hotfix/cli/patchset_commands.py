"""check-upstream and new-patchset: is a patch set still needed, and a new one from an upstream PR."""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import PinError, UsageError
from .app import Ctx, base_option, one_platform, progress, pull_option, repo_option


@click.command("check-upstream")
@click.option("--patches", "patch_set", required=True, help="Patch set to judge, e.g. v0.25.1.")
@click.option("--base", "base_tag", required=True, help="The newer release's tag, e.g. v0.27.0.")
@repo_option
@pull_option
@click.option("--from-wheel", is_flag=True, help="Read the release's PyPI wheel instead of its image.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of lines.")
@click.option("--platform", "platform_text", default=None, metavar="PLATFORM",
              help="Judge this platform's image (or wheel) of the release: linux/amd64 or linux/arm64.")
@click.pass_obj
def check_upstream(obj: Ctx, patch_set: str, base_tag: str, base_repo: str | None, pull: str,
                   from_wheel: bool, as_json: bool, platform_text: str | None) -> None:
    """Say per patch of a set whether release TAG still needs it: needed, included or conflicts."""
    import json

    from ..building import upstream

    report = upstream.check(obj.root, patch_set, base_tag, engine=lambda: obj.engine, base_repo=base_repo,
                            pull=pull, from_wheel=from_wheel, progress=progress,
                            platform=one_platform(platform_text))
    if as_json:
        click.echo(json.dumps(report.as_dict(), indent=2, sort_keys=True))
    else:
        for v in report.verdicts:
            click.echo(f"{v.patch}: {v.verdict} ({v.detail})")
        for judged in report.pins:
            click.echo(f"pin {judged['pin']}: {judged['verdict']} ({judged['detail']})")
    included = report.by_verdict("included")
    contradicting = report.pins_by_verdict("contradicts")
    if included and report.needs_hotfix:
        what = "every patch" if report.carries_every_patch else ", ".join(included)
        progress(f"{base_tag} carries {what} of {patch_set}: drop them from a set for {base_tag}, "
                 "or build with --skip-included")
    if contradicting:
        # The release's own requirements rule these versions out: building the set on it
        # would fail pip check, so the set is not done with, whatever its patches say.
        raise PinError(f"{base_tag} requires other versions than {patch_set}'s pins {', '.join(contradicting)}: "
                       f"the set still needs attention", pin=contradicting[0].split("==")[0],
                       hint=f"update or drop them in patches/{patch_set}/pins.txt for a set for {base_tag}")
    if not report.needs_hotfix:
        progress(f"{base_tag} carries every patch of {patch_set}"
                 f"{' and requires its pinned versions' if report.pins else ''}: it needs no hotfix")
    elif report.carries_every_patch:
        kept = [p["pin"] for p in report.pins if p.get("verdict") != "included"]
        progress(f"{base_tag} carries every patch of {patch_set} but not its pins {', '.join(kept)}: "
                 "a set for it would pin only")


@click.command("new-patchset")
@base_option
@click.option("--from-pr", "pr", default=None, metavar="N|URL", help="Upstream PR number or URL.")
@click.option("--from-file", "diff_file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="A diff saved on disk (offline).")
@click.option("--title", default=None, help="Patch title (default: the PR's, or the file's name).")
@click.option("--api-url", default=None,
              help="GitHub API base URL (default $VLLM_HOTFIX_GITHUB_API or GitHub).")
@click.option("--repo", "gh_repo", default="vllm-project/vllm", show_default=True,
              help="Repository of a bare PR number.")
@click.option("--suffix", default="hotfix", show_default=True,
              help="Output suffix if a definition is created.")
@repo_option
@pull_option
@click.option("--from-wheel", is_flag=True, help="Check against the release's PyPI wheel, not its image.")
@click.option("--pin", "pin_specs", multiple=True, metavar="NAME==VERSION",
              help="Add a line to the set's pins.txt with the hashes of the wheels that fit the image (repeatable).")
@click.option("--wheelhouse", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Take --pin wheels from this folder instead of downloading them.")
@click.pass_obj
def new_patchset(obj: Ctx, base_tag: str, pr: str | None, diff_file: Path | None, title: str | None,
                 api_url: str | None, gh_repo: str, suffix: str, base_repo: str | None, pull: str,
                 from_wheel: bool, pin_specs: tuple[str, ...], wheelhouse: Path | None) -> None:
    """Add an upstream PR (or a diff file) as the next patch of definition NAME's set (made for release NAME if
    missing), or pins with --pin."""
    from ..building import newpatch

    if pin_specs and (pr is not None or diff_file is not None):
        raise UsageError("--pin goes alone: add the patch and the pins in two runs")
    if (pr is None) == (diff_file is None) and not pin_specs:
        raise UsageError("give exactly one of --from-pr N|URL and --from-file FILE (or only --pin)")
    # Malformed values are usage errors, found before the network or the engine is asked anything.
    if pr is not None:
        newpatch.parse_pr(pr, gh_repo)
    for spec in pin_specs:
        from ..building import pinfile

        if pinfile.exact(spec.strip()) is None:
            raise UsageError(f"--pin {spec!r}: write NAME==VERSION (one exact version)")
    if pin_specs:
        pinned = newpatch.add_pins(obj.root, base_tag, pin_specs, lambda: obj.engine, base_repo=base_repo,
                                   pull=pull, wheelhouse=wheelhouse, progress=progress)
        click.echo(f"pinned {', '.join(pin_specs)} in {pinned.path} (wheels for {pinned.image})")
        return
    if pr is not None:
        change = newpatch.fetch_pr(pr, api=api_url, repo=gh_repo)
        if title:
            change = newpatch.Change(change.source, title, change.diff, change.number)
    else:
        assert diff_file is not None
        change = newpatch.from_file(diff_file, title)
    made = newpatch.create(obj.root, base_tag, change, engine=lambda: obj.engine, base_repo=base_repo,
                           pull=pull, from_wheel=from_wheel, suffix=suffix, progress=progress)
    click.echo(f"wrote {made.patch} (applies to {made.where} with zero fuzz)")
    click.echo(f"added {made.patch.name} to {made.series}")
    if made.definition is not None:
        click.echo(f"wrote {made.definition}")
