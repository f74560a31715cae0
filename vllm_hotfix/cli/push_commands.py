"""push and verify: through the gate to a registry, and a signed verdict checked from the registry alone."""

from __future__ import annotations

import re
from pathlib import Path

import click

from ..errors import UsageError
from .app import IMAGE, REFERENCE, Ctx, main, print_json, progress


@main.command()
@click.argument("image_ref", metavar="IMAGE", type=REFERENCE)
@click.option("--registry", required=True, help="HOST[:PORT]/PATH, e.g. 127.0.0.1:5000/ops.")
@click.option("--allow-gpu-unverified", is_flag=True, help="Push an image smoke-tested without GPU checks.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--platform", "platform_text", default=None, metavar="LIST|all",
              help="Push IMAGE-<machine> of each platform (all: every one `image` made) and an index over them "
                   "as IMAGE. Default: every platform `image` built for IMAGE (IMAGE alone after a "
                   "single-platform build).")
@click.option("--require-attestation", default=None, metavar="PUBKEY",
              help="Let the image through on a signed verdict that verifies with this public key (PEM file, or "
                   "env:NAME) instead of the local journal's verdict.")
@click.option("--attestation", "attestation_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="A signed verdict (DSSE envelope) made elsewhere, e.g. on the GPU host; "
                                 "attached beside the image.")
@click.pass_obj
def push(obj: Ctx, image_ref: str, registry: str, allow_gpu_unverified: bool, as_json: bool,
         platform_text: str | None, require_attestation: str | None, attestation_path: Path | None) -> None:
    """Push a smoke-tested IMAGE to REGISTRY and confirm the digest there."""
    from ..building import platforms
    from ..registry import refs
    from ..release import push as pushlib

    refs.check_registry(registry)
    policy = pushlib.Gate(allow_gpu_unverified, require_attestation, attestation_path)
    # Without --platform, push what `image` built for IMAGE: every platform of a multi-platform build.
    plats = platforms.parse(platform_text) if platform_text is not None else \
        pushlib.plain_selection(obj.engine, obj.root, image_ref)
    if platform_text is not None or plats is not None:
        index = pushlib.push_index(obj.engine, obj.root, image_ref, registry, plats, policy=policy,
                                   progress=progress)
        if as_json:
            print_json({"ref": index.ref, "digest": index.digest, "media_type": index.media_type,
                   "children": index.children})
            return
        for child in index.children:
            click.echo(f"pushed {child['ref']} {child['digest']} {child['platform']}")
        click.echo(f"pushed index {index.ref} {index.digest}")
        return
    pushed = pushlib.push(obj.engine, obj.root, image_ref, registry, policy=policy, progress=progress)
    if as_json:
        print_json({"ref": pushed.ref, "digest": pushed.digest, "image_id": pushed.image_id, "verdict": pushed.verdict,
               "attestations": list(pushed.attestations)})
        return
    click.echo(f"pushed {pushed.ref} {pushed.digest}")


@main.command()
@click.argument("ref", metavar="REF", type=IMAGE)
@click.option("--key", "key", required=True, metavar="PUBKEY",
              help="The public key the verdict must be signed with (PEM file, or env:NAME).")
@click.option("--require-gpu", "require_gpu", default="", metavar="NAME,...",
              help="GPU products the signed smoke run must have run on, e.g. H200 (matched in the device names).")
@click.option("--allow-gpu-unverified", is_flag=True, help="Accept a signed pass that was not GPU-verified.")
@click.option("--attestation", "attestation_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="Check this signed verdict file instead of the registry's; REF is then the "
                                 "image's ID (sha256:...), the subject it must name.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.pass_obj
def verify(obj: Ctx, ref: str, key: str, require_gpu: str, allow_gpu_unverified: bool,
           attestation_path: Path | None, as_json: bool) -> None:
    """Check the signed smoke verdict attached to REF in its registry (or given as a file)."""
    from ..trust import attest

    products = [p.strip() for p in require_gpu.split(",") if p.strip()]
    if attestation_path is not None:
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", ref):
            raise UsageError(f"verify --attestation: REF {ref!r} must be the image's ID (sha256:<64 hex>)")
        digest = ref
        accepted = attest.judge(attest.local_candidates(obj.root, ref, attestation_path), {ref}, ref, key,
                                gpu_verified=not allow_gpu_unverified, gpu_products=products)
    else:
        digest, accepted = attest.verify(obj.engine, ref, key, gpu_verified=not allow_gpu_unverified,
                                         gpu_products=products)
    devices = ", ".join(str(d) for d in (accepted.report.get("gpu") or {}).get("devices") or []) or "no GPU"
    if as_json:
        print_json({"ref": ref, "digest": digest, "key_id": accepted.key_id, "status": accepted.report.get("status"),
               "gpu_verified": accepted.gpu_verified, "devices": devices, "source": accepted.source})
        return
    click.echo(f"verified {ref} {digest}: signed pass by key {accepted.key_id[:12]} "
               f"({'GPU-verified' if accepted.gpu_verified else 'GPU-unverified'} on {devices})")
