"""push and verify: through the gate to a registry, and a signed verdict checked from the registry alone."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..errors import UsageError
from .app import IMAGE, REFERENCE, Ctx, print_json, progress

if TYPE_CHECKING:
    from ..trust.policy import Policy


def policy_options(command: Callable[..., None]) -> Callable[..., None]:
    """The options that make up a verification policy, shared by verify and push --require-attestation."""
    for option in reversed((
        click.option("--policy", "policy_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
                     help="A verification policy (TOML, or JSON for *.json): what the signed verdict must show. "
                          "The flags below add to it. Default: the definition's full smoke, every check passed."),
        click.option("--require-check", "require_checks", multiple=True, metavar="NAME[=STATUS|STATUS]",
                     help="A check the signed run must have, with its status (default pass). Repeatable."),
        click.option("--definition", "definition", default="", metavar="TAG",
                     help="The definition the host must have proved the image the product of (and, where this "
                          "checkout has it, its patch set's digest and pinned base). Required: given here or by "
                          "--policy."),
        click.option("--patch-set-digest", default="", metavar="sha256:...",
                     help="The patch-set digest the host must have proved."),
        click.option("--base-digest", default="", metavar="sha256:...",
                     help="The base the host must have found (its image ID or a registry digest)."),
        click.option("--reference-digest", default="", metavar="sha256:...",
                     help="The reference the run's answers must have been judged against."),
        click.option("--max-age", default="", metavar="DURATION",
                     help="How long ago the signed run may have been made at most (90s, 15m, 12h, 7d, 2w)."),
        click.option("--max-skew", default="", metavar="DURATION",
                     help="How far ahead of this host's clock a verdict may be dated (default 5m); later: refused."),
        click.option("--require-gpu", "require_gpu", multiple=True, metavar="PRODUCT",
                     help="The GPU product the signed run ran on: its whole name or a run of its whole words "
                          "(e.g. 'H100' names 'NVIDIA H100 80GB HBM3', 'H10' does not). Several: any of them "
                          "(repeatable, or comma-separated)."),
        click.option("--tool-version", default="", metavar="VERSION",
                     help="The version of this tool that signed the verdict."),
        click.option("--allow-gpu-unverified", is_flag=True,
                     help="Accept a pass whose checks that need a GPU (GPU checks, server sweep, exact-levels, "
                          "golden, reference) did not run (a host without a GPU), and nothing else; the answer "
                          "says which did not run."),
    )):
        command = option(command)
    return command


def verification_policy(root: Path, policy_path: Path | None, require_checks: tuple[str, ...], definition: str,
                        patch_set_digest: str, base_digest: str, reference_digest: str, max_age: str,
                        max_skew: str, require_gpu: tuple[str, ...], tool_version: str,
                        allow_gpu_unverified: bool) -> Policy:
    """The verification policy of ``--policy`` and the flags (``root``: the checkout, for a definition's digest)."""
    from ..trust import policy_file

    flags = policy_file.Flags(checks=require_checks, allow_gpu_unverified=allow_gpu_unverified,
                              definition=definition, patch_set_digest=patch_set_digest, base_digest=base_digest,
                              reference_digest=reference_digest, tool_version=tool_version, max_age=max_age,
                              gpu_products=tuple(policy_file.products(require_gpu)), max_skew=max_skew)
    return policy_file.build(policy_path, flags, root)


def require_definition(root: Path, rules: Policy, command: str) -> None:
    """Refuse to decide without a definition (a signed pass of any definition, base or age would do otherwise);
    say in one line, on stderr, what the definition leaves unchecked here."""
    from ..building import definitions

    tag = rules.definition
    if not tag:
        raise UsageError(f"{command}: no definition named, so any signed pass of any definition would do; say what "
                         "the image is for",
                         hint="give --definition TAG (e.g. --definition v0.25.1), or a --policy file with "
                              "definition = \"TAG\"")
    if not definitions.definition_path(root, tag).is_file():
        click.echo(f"note: this checkout has no definition {tag}: its patch-set digest and base are not checked "
                   "here (give --patch-set-digest and --base-digest to check them)", err=True)
    elif not rules.base_pins:
        click.echo(f"note: definition {tag} pins no base digest ([base.digests] in images/{tag}.toml): the base "
                   "the host found is not checked against one (give --base-digest to check it)", err=True)


@click.command()
@click.argument("image_ref", metavar="IMAGE", type=REFERENCE)
@click.option("--registry", required=True, help="HOST[:PORT]/PATH, e.g. 127.0.0.1:5000/ops.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--platform", "platform_text", default=None, metavar="LIST|all",
              help="Push IMAGE-<machine> of each platform (all: every one `image` made) and an index over them "
                   "as IMAGE. Default: every platform `image` built for IMAGE (IMAGE alone after a "
                   "single-platform build).")
@click.option("--require-attestation", "require_attestation", multiple=True, metavar="PUBKEY",
              help="Let the image through on signed verdicts instead of the local journal's: of those found "
                   "(given with --attestation, kept in the journal, beside the image in the target registry) "
                   "that verify with one of these public keys, the newest that covers the verification policy "
                   "must meet it (see verify). A PEM file, a folder of them, or env:NAME; repeatable.")
@click.option("--attestation", "attestation_paths", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              multiple=True, help="A signed verdict (DSSE envelope) made elsewhere, e.g. on the GPU host; "
                                  "attached beside the image. Repeatable.")
@click.option("--dry-run", is_flag=True,
              help="Judge as a push does (the gate, the files re-read from the layers) and say what would be "
                   "pushed and attached; push, tag, attach and record nothing.")
@click.option("--replace", is_flag=True, help="Move the target tag even where it names another image with a signed "
                                              "pass (that image stays in the registry by digest).")
@policy_options
@click.pass_obj
def push(obj: Ctx, image_ref: str, registry: str, as_json: bool, platform_text: str | None,
         require_attestation: tuple[str, ...], attestation_paths: tuple[Path, ...], dry_run: bool, replace: bool,
         **rules: Any) -> None:
    """Push a smoke-tested IMAGE to REGISTRY and confirm the digest there."""
    from ..building import platforms
    from ..registry import refs
    from ..release import push as pushlib
    from ..release.gate import Gate

    refs.check_registry(registry)
    allow_gpu_unverified = bool(rules["allow_gpu_unverified"])
    required = None
    if require_attestation:
        required = verification_policy(obj.root, **rules)
        required.requirements()  # an empty policy is refused before anything is read or pushed
        require_definition(obj.root, required, "push --require-attestation")
    elif any(value for name, value in rules.items() if name != "allow_gpu_unverified"):
        raise UsageError("a verification policy (--policy, --require-check, --definition, ...) judges signed "
                         "verdicts: give --require-attestation PUBKEY")
    policy = Gate(allow_gpu_unverified, require_attestation, attestation_paths, required)
    # Without --platform, push what `image` built for IMAGE: every platform of a multi-platform build.
    plats = platforms.parse(platform_text) if platform_text is not None else \
        pushlib.plain_selection(obj.engine, obj.root, image_ref)
    if platform_text is not None or plats is not None:
        index = pushlib.push_index(obj.engine, obj.root, image_ref, registry, plats, policy=policy,
                                   progress=progress, dry_run=dry_run, replace=replace)
        if dry_run:
            _say_dry_run(as_json, {"ref": index.ref, "children": index.children})
            return
        if as_json:
            print_json({"ref": index.ref, "digest": index.digest, "media_type": index.media_type,
                   "children": index.children})
            return
        for child in index.children:
            click.echo(f"pushed {child['ref']} {child['digest']} {child['platform']}")
        click.echo(f"pushed index {index.ref} {index.digest}")
        return
    from ..journal.records import registry_digest
    from ..registry.pulling import pull_missing

    # Made in its registry (image --in-registry) and smoked elsewhere: pulled by digest (not in a dry run).
    if not dry_run:
        pull_missing(obj.engine, image_ref, registry_digest(obj.root, image_ref), progress, index=False)
    pushed = pushlib.push(obj.engine, obj.root, image_ref, registry, policy=policy, progress=progress,
                          dry_run=dry_run, replace=replace)
    if dry_run:
        _say_dry_run(as_json, {"ref": pushed.ref, "image_id": pushed.image_id, "verdict": pushed.verdict,
                               "gpu_verified": pushed.gpu_verified, "attestations": list(pushed.attestations)})
        return
    if as_json:
        print_json({"ref": pushed.ref, "digest": pushed.digest, "image_id": pushed.image_id, "verdict": pushed.verdict,
               "attestations": list(pushed.attestations), "replaced": pushed.replaced or None})
        return
    click.echo(f"pushed {pushed.ref} {pushed.digest}" + (f", replacing {pushed.replaced}" if pushed.replaced else ""))


def _say_dry_run(as_json: bool, plan: dict[str, Any]) -> None:
    """What a push would do, as the last lines (or one JSON object); it did none of it."""
    if as_json:
        print_json({"dry_run": True, **plan})
        return
    for one in plan.get("children") or [plan]:
        attached = one["attestations"]
        names = attached.split(",") if isinstance(attached, str) else attached
        gpu = one["gpu_verified"] in (True, "true")
        click.echo(f"would push {one['image_id']} as {one['ref']} (let through by {one['verdict']}, "
                   f"{'GPU-verified' if gpu else 'GPU-unverified'}) and attach "
                   f"{len([n for n in names if n])} signed verdict(s){': ' + ', '.join(names) if any(names) else ''}")
    if plan.get("children"):
        click.echo(f"would put an index over them at {plan['ref']}")
    click.echo("dry run: nothing was pushed, tagged, attached or recorded")


@click.command()
@click.argument("ref", metavar="REF", type=IMAGE)
@click.option("--key", "keys", required=True, multiple=True, metavar="PUBKEY",
              help="A public key the verdict may be signed with: a PEM file, a folder of PEM files (*.pem, *.pub), "
                   "or env:NAME. Repeatable; the answer names the key that signed.")
@policy_options
@click.option("--attestation", "attestation_paths", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              multiple=True, help="A signed verdict file to judge with those in the registry (repeatable). With "
                                  "REF the image's ID (sha256:...), the files alone are judged.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: what was required and what was found.")
@click.pass_obj
def verify(obj: Ctx, ref: str, keys: tuple[str, ...], attestation_paths: tuple[Path, ...], as_json: bool,
           **rules: Any) -> None:
    """Check the signed smoke verdicts of REF against a verification policy: the newest one that covers it
    must meet it."""
    from ..errors import AttestationError
    from ..trust import attest

    required = verification_policy(obj.root, **rules)
    required.requirements()  # an empty policy is refused before any key or registry is read
    require_definition(obj.root, required, "verify")
    try:
        digest, accepted = attest.check(lambda: obj.engine, ref, keys, required, attestation_paths)
    except AttestationError as exc:
        if as_json and exc.evidence is not None:
            # What was required and found, with the refusal: a deployment gate reads why, not only the code.
            print_json({"ref": ref, "status": "refused", "exit_code": exc.exit_code, "error": str(exc),
                        **exc.evidence})
        raise
    devices = ", ".join(str(d) for d in (accepted.report.get("gpu") or {}).get("devices") or []) or "no GPU"
    # Every check the policy counts that the run did not run is named, whatever its GPU said.
    not_run = f"{', '.join(accepted.not_run)} not run" if accepted.not_run else ""
    unverified = (f"GPU-unverified, accepted under --allow-gpu-unverified: {not_run or 'every check ran'}"
                  if not accepted.gpu_verified else not_run)
    if as_json:
        print_json({"ref": ref, "digest": digest, "key_id": accepted.key_id, "key": accepted.key_name,
                    "status": accepted.report.get("status"), "gpu_verified": accepted.gpu_verified,
                    "devices": devices, "source": accepted.source, "signed_at": accepted.signed_at,
                    "gpu_unverified_accepted": unverified if not accepted.gpu_verified else "",
                    "not_run": accepted.not_run, **accepted.decision.to_dict()})
        return
    named = ref if digest == ref else f"{ref} {digest}"  # an image ID given as REF is its own digest here
    click.echo(f"verified {named}: signed pass by key {accepted.key_name} ({accepted.key_id[:12]}), signed "
               f"{accepted.signed_at} ({'GPU-verified' if accepted.gpu_verified else 'GPU-unverified'} on {devices})"
               f" meets {required.source}")
    if unverified:
        click.echo(f"    {unverified}")
