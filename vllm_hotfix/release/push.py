"""Push a smoke-tested image to the internal registry, and prove it landed.

What lets an image through is the push gate's (:mod:`.gate`: the journal's
newest verdict, or signed verdicts under ``--require-attestation``). Then,
right before the push, the image's files are judged again, read from its
layers (nothing of it runs, so its own interpreter cannot vouch for it): the
patched files against hashes recomputed from the patch set and the base
(never from the image), and the whole installed distribution against its
RECORD relative to the base, so an edited journal can hide neither wrong
patched files nor a failed integrity. A tag that names another image with a
signed pass moves only with ``--replace``. After the push, the engine asks
the registry (with the same credentials and scheme) which digest the tag
resolves to, and the signed verdicts found are attached beside it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..building import platforms
from ..building.platforms import Platform, child_ref
from ..checking.launchers import facts
from ..engine import Engine, ImageInfo, registry_errors, registry_of, split_reference
from ..errors import BaseImageError, PushError, RecordError, Refused, StorageError
from ..journal import leftovers, records
from ..registry import client as registry
from ..registry import refs, write
from ..trust import attest, travel
from .gate import Gate, landed_refusal

log = logging.getLogger(__name__)

ATTEMPTS = 4


@dataclass(frozen=True, slots=True)
class Pushed:
    ref: str
    digest: str
    image_id: str
    verdict: str  # the journal entry (or signed verdict) that let it through
    attestations: tuple[str, ...] = ()  # digests of the signed verdicts attached beside it
    dry_run: bool = False  # nothing was pushed: ``digest`` is empty, ``attestations`` where each one it would
    # attach was found
    gpu_verified: bool = False
    replaced: str = ""  # what the tag named before, where that had a signed pass (--replace)


def travelling(policy: Gate, root: Path, info: ImageInfo, carried: list[tuple[str, bytes]]) -> tuple[str, ...]:
    """Where each signed verdict a push would attach beside the image was found, once each (what
    :meth:`Gate.attach` attaches: the journal's, those given, and those ``carried`` from its other registry
    copies), for a dry run to name: a promotion's dry run counts the staging copy's verdicts too."""
    local = [(path.name, attest.read_envelope(path)) for path in policy.would_attach(root, info)]
    return tuple(where for where, _data in travel.unique([*local, *carried]))


def target_ref(image_ref: str, registry: str) -> str:
    """HOST[:PORT]/PATH + the last part of the image's repository + its tag."""
    registry = refs.check_registry(registry)
    repo, tag = split_reference(image_ref)
    if tag.startswith("sha256:"):
        raise PushError(f"{image_ref}: push a tagged reference, not a digest")
    return refs.check_reference(f"{registry}/{repo.rsplit('/', 1)[-1]}:{tag}", "push target", tag_only=True)


def recorded_platforms(root: Path, image_id: str) -> set[str]:
    """The platforms the journal's build entries give for this image (empty: built before they were kept)."""
    return {str(e.data["platform"]) for e in records.builds_of_image(root, image_id) if e.data.get("platform")}


def check_platform(root: Path, info: ImageInfo, ref: str, expected: Platform | None = None) -> None:
    """Refuse (before anything is pushed) an image whose platform its tag or its build record contradicts.

    The image's own config is the truth a node pulling it gets: its OS,
    architecture and variant must be what the tag's suffix names
    (``-x86_64``: amd64, ``-aarch64``: arm64), what the journal recorded for
    its build, and (for one platform's image of an index) ``expected``.
    """
    recorded: list[str | None] = [*sorted(recorded_platforms(root, info.id))] or [None]
    problem = None
    for rec in recorded:
        problem = problem or platforms.mismatch(ref, info.os, info.architecture, info.variant, rec)
    if problem is None and expected is not None and platforms.of(info.os, info.architecture) != expected:
        problem = f"{ref} is a {info.os}/{info.architecture} image, not {expected}"
    if problem is not None:
        raise Refused(f"refusing to push {info.id[:19]}: {problem}",
                      hint="tag each platform's image under its own suffix (python build.py list shows the builds)")


@dataclass(frozen=True, slots=True)
class Child:
    """One platform's image that `image` built under ``TAG-<machine>``, as the engine and journal have it."""

    platform: Platform
    ref: str
    image_id: str
    family: str  # the definition and the inputs every platform of one build shares


_FAMILY = ("definition", "definition_sha256", "patches", "template_sha256", "pins_sha256")


def family(inputs: object) -> str:
    """What ties the platforms of one build together: its inputs less each platform's own base."""
    got = inputs if isinstance(inputs, dict) else {}
    return records.inputs_key({k: got.get(k) for k in _FAMILY})


def built_children(engine: Engine, root: Path, image_ref: str) -> list[Child]:
    """Each ``TAG-<machine>`` in the engine whose image the journal says this tool built under that name."""
    found = []
    for plat in (Platform("linux", "amd64"), Platform("linux", "arm64")):
        ref = child_ref(image_ref, plat)
        info = engine.image(ref)
        if info is None:
            continue
        made = [e for e in records.builds_of_image(root, info.id)
                if e.data.get("output_ref") == ref and e.data.get("platform") in (None, str(plat))]
        if made:
            found.append(Child(plat, ref, info.id, family(made[0].data.get("inputs"))))
    return found


def plain_platforms(image_ref: str, tag_image: str | None, children: list[Child]) -> list[Platform] | None:
    """What a push without ``--platform`` pushes: the platforms `image` built for TAG, or None for TAG alone.

    A multi-platform build leaves ``TAG-<machine>`` per platform and TAG on
    one of them (or on none, when it built one other platform): those
    children, and an index over them, are what was built. TAG on an image
    that is none of them (a later single-platform build) is pushed alone.
    """
    if not children:
        return None
    ids = {c.image_id: c for c in children}
    if tag_image is not None and tag_image not in ids:
        return None
    if tag_image is not None:
        anchor = ids[tag_image].family
    else:
        families = {c.family for c in children}
        if len(families) > 1:
            raise PushError(f"{', '.join(c.ref for c in children)} were built from different definitions or "
                            f"inputs, and {image_ref} names none of them",
                            hint="name the platforms to push with --platform")
        anchor = families.pop()
    return [c.platform for c in children if c.family == anchor]


def plain_selection(engine: Engine, root: Path, image_ref: str) -> list[Platform] | None:
    """The platforms a plain ``push IMAGE`` pushes (see :func:`plain_platforms`); None: IMAGE alone."""
    if platforms.parent_ref(image_ref) is not None:
        return None  # one platform's own tag: that image alone
    children = built_children(engine, root, image_ref)
    info = engine.image(image_ref)
    chosen = plain_platforms(image_ref, info.id if info is not None else None, children)
    if chosen is None and children:
        log.warning("%s names an image that is none of %s; pushing %s alone", image_ref,
                    ", ".join(c.ref for c in children), image_ref)
    return chosen


def signed_pass_under(engine: Engine, target: str, image_ids: set[str]) -> str | None:
    """What ``target`` names in its registry, where that is another image than ``image_ids`` (one image's ID, or
    an index's platform images) and it carries a signed verdict saying pass; None otherwise.

    Replacing such an image under its tag takes a word from the user (``--replace``): deployments that pull
    the tag would get another image than the one that passed. Read without a key (it is not trusted here, only
    a reason to ask).
    """
    client, path, manifest = registry.look_up(engine, target)
    if manifest is None:
        return None
    images: dict[str, str] = {}  # manifest digest -> image ID (config digest)
    if manifest.is_index:
        for child in registry.children(manifest):
            found = client.manifest(path, child.digest)
            if found is not None:
                images[child.digest] = str((found.json().get("config") or {}).get("digest") or "")
    else:
        images[manifest.digest] = str((manifest.json().get("config") or {}).get("digest") or "")
    if set(images.values()) == image_ids:
        return None
    passes = sum(1 for digest in dict.fromkeys([manifest.digest, *images]) for _where, data in
                 attest.registry_candidates(client, path, digest) if attest.claimed_status(data) == "pass")
    if not passes:
        return None
    named = ", ".join(sorted(i[:19] for i in images.values() if i)) or "no image"
    return f"{target} ({manifest.digest[:19]}, image {named}: {passes} signed verdict(s) saying pass)"


def _check_replace(engine: Engine, target: str, image_ids: set[str], replace: bool,
                   say: Callable[[str], None], attempts: int = 1) -> str | None:
    """Refuse to move ``target`` off an image with a signed pass unless ``replace``; what is replaced.

    Reading what the tag names is the push's first word with the registry, so it is tried as the push is
    (:func:`_push_with_retries`): again after a transient failure, at once never again after any other, and a
    failure is named as the push's."""
    delay = 1.0
    for attempt in range(1, attempts + 1):
        try:
            held = signed_pass_under(engine, target, image_ids)
            break
        except PushError as exc:
            failure = registry_errors.classify(exc)
            if attempt == attempts or not failure.transient:
                raise PushError(f"push of {target} (attempt {attempt}/{attempts}): cannot read what the tag names "
                                f"now: {exc}", hint=exc.hint) from exc
            say(f"    transient registry error ({failure.why}) reading {target}, retrying in {delay:.0f} s: {exc}")
            time.sleep(delay)
            delay *= 2
    if held is None:
        return None
    if not replace:
        raise Refused(f"refusing to push over {held}: the tag would name another image",
                      hint="give --replace to move the tag (the replaced image stays in the registry by digest)")
    say(f"    replacing {held} (--replace)")
    return held


def push(
    engine: Engine,
    root: Path,
    image_ref: str,
    registry: str,
    *,
    policy: Gate | None = None,
    attempts: int = ATTEMPTS,
    progress: Callable[[str], None] | None = None,
    dry_run: bool = False,
    replace: bool = False,
) -> Pushed:
    """Gate, re-check the landed files, push, confirm the digest, attach signed verdicts, record the push.

    ``dry_run``: the gate and the re-check only (both read, neither writes); what would be pushed and attached is
    returned, and nothing is tagged, pushed, attached or recorded."""
    say = progress or (lambda _line: None)
    policy = policy or Gate()
    target = target_ref(image_ref, registry)
    info = engine.image(image_ref)
    if info is None:
        # Nothing to push, and no gate refused it: the image is missing (exit 4), as under smoke.
        raise BaseImageError(f"image {image_ref!r} is not in the engine",
                             hint="build it with `image` (which smoke-tests it), or pull it first")
    check_platform(root, info, image_ref)
    policy.given_are_about([info.id], image_ref)
    carried = policy.carried(engine, root, info, image_ref, say)
    verdict = policy.clear(engine, root, info, image_ref, target, carried)
    records.ensure_writable(root)
    say(f"==> re-checking the files of {info.id[:19]} (read from its layers) before the push")
    problem = facts.landed_problem(engine, root, info, say, gpu_claimed=verdict.gpu_verified)
    if problem is not None:
        raise landed_refusal(f"{image_ref} ({info.id[:19]})", problem)
    replaced = _check_replace(engine, target, {info.id}, replace, say, attempts)
    if dry_run:
        return Pushed(target, "", info.id, verdict.source, travelling(policy, root, info, carried), dry_run=True,
                      gpu_verified=verdict.gpu_verified)
    digest = _push_one(engine, root, info, target, attempts, say)
    attached = policy.attach(engine, root, info, target, digest, say, carried)
    try:
        records.append(root, "push", {
            "image_id": info.id, "image": image_ref, "ref": target, "digest": digest,
            "registry": registry_of(target), "verdict": verdict.source,
            "gpu_verified": verdict.gpu_verified, "attestations": attached,
            **({"replaced": replaced} if replaced else {}),
        })
    except RecordError as exc:
        raise RecordError(
            f"{target} landed in the registry as {digest}, but the push could not be recorded: {exc}",
            hint="free or fix the records folder; the registry already holds the image",
        ) from exc
    return Pushed(target, digest, info.id, verdict.source, tuple(attached), gpu_verified=verdict.gpu_verified,
                  replaced=replaced or "")


def _push_one(engine: Engine, root: Path, info: ImageInfo, target: str, attempts: int,
              say: Callable[[str], None]) -> str:
    """Push one image under ``target`` and confirm the registry resolves it to the pushed digest.

    The local ``target`` tag exists only to name the push. It is noted
    before it is made, so that a run killed mid-push has the next run remove
    it, and afterwards it is put back as it was: removed, or pointed again
    at the image it named before. A tag found there is never taken as the
    pushed image: the push always re-tags ``info`` first. Runs on this host
    pushing to the same target take turns (:func:`_one_push`): one run's
    clean-up never takes the tag away from under another's push, nor puts
    another image under it.
    """
    with _one_push(target, say):
        had = engine.image(target)
        before = had.id if had is not None else None
        note = leftovers.pending(root)
        if before != info.id:
            note.tag(target, info.id)
        engine.tag(info.id, target)
        try:
            digest = _push_with_retries(engine, target, attempts, say)
            seen = engine.registry_digest(target)
            if seen != digest:
                raise PushError(f"registry resolves {target} to {seen}, not the pushed {digest}")
        finally:
            if before is None:
                engine.untag(target)
            elif before != info.id:
                engine.tag(before, target)
            note.untag(target)
    return digest


@contextmanager
def _one_push(target: str, say: Callable[[str], None]) -> Iterator[None]:
    """Hold this host's lock for ``target`` (a file under the temporary folder, named by its hash)."""
    import fcntl
    import hashlib
    import os
    import tempfile

    path = Path(tempfile.gettempdir()) / f"vllm-hotfix-push-locks-{os.getuid()}" / (
        hashlib.sha256(target.encode()).hexdigest()[:32] + ".lock")
    try:
        path.parent.mkdir(mode=0o700, exist_ok=True)
        fh = open(path, "a")  # noqa: SIM115 - held open for the lock's whole life
    except OSError as exc:
        raise StorageError(f"cannot make the push lock {path}: {exc.strerror or exc}") from exc
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"    another run is pushing {target} from this host; waiting for it")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@dataclass(frozen=True, slots=True)
class PushedIndex:
    ref: str
    digest: str
    media_type: str
    children: list[dict[str, str]]  # platform, image_id, ref, digest, verdict


def platform_images(engine: Engine, root: Path, image_ref: str, plats: list[Platform] | None
                    ) -> list[tuple[Platform, ImageInfo]]:
    """Each platform's image, ``IMAGE-<machine>`` as `image --platform` tagged it (None: every one present)."""
    repo, tag = split_reference(image_ref)
    if tag.startswith("sha256:"):
        raise PushError(f"{image_ref}: push a tagged reference, not a digest")
    every = [platforms.Platform("linux", a) for a in ("amd64", "arm64")]
    # "all": every platform `image` built under this name (the journal's builds of IMAGE-<machine>), each of
    # which must be here; where the journal names none, the ones present.
    built = {str(e.data.get("output_ref")) for e in records.load(root, "build")}
    made = [plat for plat in every if child_ref(image_ref, plat) in built]
    wanted = plats if plats is not None else made or every
    strict = plats is not None or bool(made)
    found: list[tuple[Platform, ImageInfo]] = []
    for plat in wanted:
        ref = child_ref(image_ref, plat)
        info = engine.image(ref)
        if info is None:
            if not strict:
                continue
            why = "" if plats is not None else " (image built it under this name: the journal says so)"
            raise BaseImageError(f"no {plat} image {ref} in the engine{why}",
                            hint=f"build it: python build.py image --definition TAG "
                                 f"--platform {plat} --tag {image_ref}")
        check_platform(root, info, ref, plat)
        found.append((plat, info))
    if not found:
        raise BaseImageError(f"no per-platform images {repo}:{tag}-<machine> in the engine",
                        hint="build them with: python build.py image --definition TAG --platform all")
    return found


def push_index(
    engine: Engine,
    root: Path,
    image_ref: str,
    registry_path: str,
    plats: list[Platform] | None,
    *,
    policy: Gate | None = None,
    attempts: int = ATTEMPTS,
    progress: Callable[[str], None] | None = None,
    dry_run: bool = False,
    replace: bool = False,
) -> PushedIndex:
    """Push each platform's image as ``TAG-<machine>`` and one index over them as ``TAG``.

    ``dry_run``: every gate and re-check, then what would be pushed; nothing is tagged, pushed or recorded.

    Every platform's image must pass the gate (and the landed re-check)
    before anything is pushed: an index is never put over an untested image.
    """
    say = progress or (lambda _line: None)
    policy = policy or Gate()
    target = target_ref(image_ref, registry_path)
    found = platform_images(engine, root, image_ref, plats)
    policy.given_are_about([info.id for _plat, info in found], f"any platform's image of {image_ref}")
    verdicts, carried = {}, {}
    for plat, info in found:
        carried[plat] = policy.carried(engine, root, info, child_ref(image_ref, plat), say)
        verdicts[plat] = policy.clear(engine, root, info, f"{child_ref(image_ref, plat)} ({plat})",
                                      child_ref(target, plat), carried[plat])
    records.ensure_writable(root)
    for plat, info in found:
        say(f"==> re-checking the files of {info.id[:19]} ({plat}, read from its layers) before the push")
        problem = facts.landed_problem(engine, root, info, say, gpu_claimed=verdicts[plat].gpu_verified)
        if problem is not None:
            raise landed_refusal(f"{child_ref(image_ref, plat)} ({info.id[:19]}, {plat})", problem)
    _check_replace(engine, target, {info.id for _plat, info in found}, replace, say, attempts)
    for plat, info in found:
        _check_replace(engine, child_ref(target, plat), {info.id}, replace, say, attempts)
    repo, _ = split_reference(target)
    children: list[dict[str, str]] = []
    entries: list[tuple[str, str, str, str]] = []
    if dry_run:
        children = [{"platform": str(plat), "image_id": info.id, "ref": child_ref(target, plat), "digest": "",
                     "verdict": verdicts[plat].source, "gpu_verified": str(verdicts[plat].gpu_verified).lower(),
                     "attestations": ",".join(travelling(policy, root, info, carried[plat]))}
                    for plat, info in found]
        return PushedIndex(target, "", "", children)
    for plat, info in found:
        child_target = child_ref(target, plat)
        digest = _push_one(engine, root, info, child_target, attempts, say)
        attached = policy.attach(engine, root, info, child_target, digest, say, carried[plat])
        children.append({"platform": str(plat), "image_id": info.id, "ref": child_target, "digest": digest,
                         "verdict": verdicts[plat].source,
                         "gpu_verified": str(verdicts[plat].gpu_verified).lower(),
                         "attestations": ",".join(attached)})
        entries.append((plat.os, plat.architecture, plat.variant, f"{repo}@{digest}"))
    say(f"==> putting the index {target} over {', '.join(c['platform'] for c in children)}")
    index_digest, index = write.put_index(engine, target, entries)
    seen = engine.registry_digest(target)
    if seen != index_digest:
        raise PushError(f"registry resolves {target} to {seen}, not the index put there ({index_digest})")
    try:
        records.append(root, "push", {
            "image": image_ref, "ref": target, "digest": index_digest, "media_type": index.media_type,
            "registry": registry_of(target), "children": children,
            "image_ids": [c["image_id"] for c in children],
        })
    except RecordError as exc:
        raise RecordError(
            f"{target} landed in the registry as index {index_digest}, but the push could not be recorded: {exc}",
            hint="free or fix the records folder; the registry already holds the images and the index",
        ) from exc
    return PushedIndex(target, index_digest, index.media_type, children)


def _push_with_retries(engine: Engine, target: str, attempts: int, say: Callable[[str], None]) -> str:
    """Push, trying again after a transient registry failure (HTTP 429 or 5xx, a timeout, a cut connection).

    Any other failure ends the push at once: a refusal is the registry's
    answer, and a registry whose name does not resolve or that refuses
    connections is at a wrong address or not running, which waiting does not mend.
    """
    delay = 1.0
    for attempt in range(1, attempts + 1):
        try:
            say(f"==> pushing {target} (attempt {attempt}/{attempts})")
            return engine.push(target, lambda line: say("    " + line))
        except PushError as exc:
            failure = registry_errors.classify(exc)
            if attempt == attempts or not failure.transient:
                raise
            say(f"    transient registry error ({failure.why}), retrying in {delay:.0f} s: {exc}")
            time.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")
