"""list, rollback and prune: every build with its verdicts and pushes, moving a tag back, and removing what
builds and rollbacks left untagged."""

from __future__ import annotations

from typing import Any

import click

from ..errors import UsageError
from .app import IMAGE_ID, REPOSITORY, TAG, Ctx, base_option, print_json, progress

registry_option = click.option(
    "--registry", "registry_repo", type=REPOSITORY, default=None, metavar="HOST[:PORT]/PATH/NAME",
    help="Read the builds and verdicts of this image repository from its registry (what every host pushed) "
         "instead of this host's journal.")
key_option = click.option(
    "--key", "keys", multiple=True, metavar="PUBKEY",
    help="--registry: a public key the signed verdicts may be made with (PEM file, folder, env:NAME; repeatable); "
         "without one, verdicts are counted, not checked.")


@click.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@registry_option
@key_option
@click.pass_obj
def list_cmd(obj: Ctx, as_json: bool, registry_repo: str | None, keys: tuple[str, ...]) -> None:
    """Each image definition, its patch set, and every build with its newest verdict and pushes."""
    import json

    from ..release import lifecycle

    if registry_repo is not None:
        _list_registry(obj, registry_repo, keys, as_json)
        return
    if keys:
        raise UsageError("--key checks verdicts read with --registry; the journal's are this host's own")
    rows = lifecycle.overview(obj.root)
    if as_json:
        click.echo(json.dumps(rows, indent=2, sort_keys=True))
        return
    for row in rows:
        made = f"{len(row['builds'])} build(s)" if row["builds"] else "never built"
        click.echo(f"{row['definition']}  base {row['base']}  patch set {row['patch_set']} "
                   f"({len(row['patches'])} patch(es))  {made}")
        for b in row["builds"]:
            verdict = b["verdict"] or "not judged"
            if b["verdict"] == "pass":
                verdict += " (GPU-verified)" if b["gpu_verified"] else " (GPU-unverified)"
            if b["incomplete_runs"]:
                verdict += f", {b['incomplete_runs']} later incomplete run(s)"
            pushes = _pushes_once(b["pushes"])
            click.echo(f"  {b['created']}  {b['image_id']}  {b['output_ref']}  smoke {verdict}  push {pushes}")


def _list_registry(obj: Ctx, repo: str, key_sources: tuple[str, ...], as_json: bool) -> None:
    from ..release import registry_history
    from ..trust import signing

    keys = signing.load_public_keys(key_sources) if key_sources else []
    found = registry_history.builds(obj.engine, obj.root, repo, keys, progress)
    if as_json:
        print_json({"repository": repo, "keys_given": bool(keys), "builds": [b.as_dict() for b in found]})
        return
    if not found:
        click.echo(f"{repo}: no image in its registry")
        return
    for b in found:
        if b.verdict is not None:
            verdict = f"{b.verdict.status}{' (GPU-verified)' if b.verdict.gpu_verified else ''}, signed " \
                      f"{b.verdict.signed_at} by {b.verdict.key_id[:16]}"
        elif b.verdicts_found and not keys:
            verdict = f"{b.verdicts_found} signed verdict(s), not checked (give --key)"
        elif b.verdicts_found:
            verdict = f"{b.verdicts_found} signed verdict(s), none verifies with the keys given"
        else:
            verdict = "no signed verdict"
        click.echo(f"{b.created}  {b.image_id}  {b.definition or '(no definition label)'}  {b.platform}  "
                   f"{repo}@{b.digest}  tags {', '.join(b.tags) or 'none'}  smoke {verdict}")


def _pushes_once(pushes: list[dict[str, str]]) -> str:
    """Each ref@digest once, newest first, with how often it was pushed (--json keeps every push)."""
    counts: dict[str, int] = {}
    for p in pushes:
        name = f"{p['ref']}@{p['digest']}"
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(name + (f" ({n} pushes)" if n > 1 else "") for name, n in counts.items()) or "none"


@click.command()
@base_option
@click.option("--to", "to_image", type=IMAGE_ID, default=None,
              help="Image ID of a recorded build (default: the one before the tag's current image).")
@click.option("--tag", "output_ref", type=TAG, default=None,
              help="Reference to move (default: the newest build's output reference).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@registry_option
@key_option
@click.pass_obj
def rollback(obj: Ctx, base_tag: str, to_image: str | None, output_ref: str | None, as_json: bool,
             registry_repo: str | None, keys: tuple[str, ...]) -> None:
    """Point definition NAME's output tag at the previous recorded build (or the one --to names).

    With --registry REPO: the tag in that repository, moved to the previous image of the definition there (by its
    label, same platform) whose newest verdict signed with --key is a pass."""
    from ..release import lifecycle

    if registry_repo is not None:
        _rollback_registry(obj, base_tag, registry_repo, keys, to_image, output_ref, as_json)
        return
    if keys:
        raise UsageError("--key checks verdicts read with --registry")

    moves = lifecycle.rollback(obj.engine, obj.root, base_tag, to_image, output_ref)
    rows = [{"ref": m.ref, "image_id": m.to.image_id, "was": m.was, "direction": m.direction,
             "platform": m.to.platform} for m in moves]
    if as_json:
        # One tag: the object as before; a multi-platform output: each tag moved, in one object.
        print_json({k: v for k, v in rows[0].items() if k != "platform"} if len(rows) == 1
              else {"ref": _rolled_output(moves), "moved": rows})
        return
    for moved in moves:
        target = moved.to
        if moved.direction == "unchanged":
            click.echo(f"{moved.ref} already points at {target.image_id}; nothing moved")
            continue
        verb = "rolled back" if moved.direction == "back" else "moved forward"
        click.echo(f"{verb} {moved.ref} to {target.image_id} (built {target.created}, "
                   f"smoke {target.verdict or 'not judged'}; was {moved.was or 'untagged'})")
    if any(m.direction != "unchanged" for m in moves):
        progress(f"push it to move the registry tag too: python build.py push {_rolled_output(moves)} "
                 "--registry HOST:PORT/PATH")


def _rolled_output(moves: Any) -> str:
    """The tag a rollback moved; for a multi-platform output, its plain TAG (a push of it pushes them all)."""
    from ..building import platforms

    if len(moves) == 1:
        return str(moves[0].ref)
    parents = {got[0] for m in moves if (got := platforms.parent_ref(m.ref)) is not None}
    return parents.pop() if len(parents) == 1 else str(moves[-1].ref)


@click.command()
@click.option("--dry-run", is_flag=True, help="List what would be removed; remove nothing.")
@click.pass_obj
def prune(obj: Ctx, dry_run: bool) -> None:
    """Remove from the engine what builds, rollbacks and stand-ins left: untagged builds and stand-ins, and the
    stand-ins' root file system cache (made again from build/cache when needed); and podman's copies of the
    tool's builds (smoke --launcher podman moves them again). Tagged images and the journal stay."""
    from ..release import prune as prunelib

    gone = prunelib.prune(obj.engine, progress, dry_run=dry_run)
    size = sum(item.size for item in gone) / 1e6
    click.echo(f"{'would remove' if dry_run else 'removed'} {len(gone)} image(s), {size:.0f} MB as the engine "
               "counts them (shared layers counted in each)")


def _rollback_registry(obj: Ctx, definition: str, repo: str, key_sources: tuple[str, ...], to_image: str | None,
                       output_ref: str | None, as_json: bool) -> None:
    from ..building import definitions
    from ..engine import split_reference
    from ..release import registry_history
    from ..trust import signing

    defn = definitions.load(obj.root, definition)
    tag = defn.output_tag
    if output_ref is not None:
        named, tag = split_reference(output_ref)
        if named != repo:
            raise UsageError(f"--tag {output_ref}: with --registry {repo}, give a tag of that repository")
    keys = signing.load_public_keys(key_sources) if key_sources else []
    moved = registry_history.rollback(obj.engine, obj.root, repo, defn.tag, tag, keys, to_image, progress)
    if as_json:
        print_json({"ref": moved.ref, "image_id": moved.to.image_id, "digest": moved.to.digest, "was": moved.was,
                    "direction": moved.direction})
        return
    if moved.direction == "unchanged":
        click.echo(f"{moved.ref} already names {moved.to.image_id} ({moved.to.digest}); nothing moved")
        return
    verb = "rolled back" if moved.direction == "back" else "moved forward"
    click.echo(f"{verb} {moved.ref} in its registry to {moved.to.image_id} ({moved.to.digest}, built "
               f"{moved.to.created}, signed pass {moved.to.verdict.signed_at if moved.to.verdict else ''}; "
               f"was {moved.was or 'untagged'})")
