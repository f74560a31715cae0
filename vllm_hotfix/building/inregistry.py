"""``image --in-registry``: the hotfix image written into the registry that holds the base; no engine, no pull.

For each platform of the base: its manifest and config are read from the
registry; the package's folder and the touched files from the layer blobs,
newest layer first, stopping once they are known (:mod:`.layerscan`); the
patch set is applied with GNU patch as always (:func:`.base.apply_in_scratch`);
the patch layer is the assemble builder's (:func:`.assemble.layer_entries`,
same files, modes and labels), its bytecode compiled on this host by a
Python of the image's version or the stale pycs whited out
(:mod:`.bytecode`); the config is the assemble builder's
(:func:`.assemble.image_config`) over the base's, so where the inputs are
the same the image ID is too. Then the layer, the config and the base's
layers (mounted, or copied registry to registry) go into the target
repository, the manifest by digest (and the index over the platforms), the
build into the journal, and the tags last (:mod:`vllm_hotfix.registry.write`): a run that
dies earlier leaves no tag on anything partial.

The image is not smoke-tested here (nothing here can run it): ``smoke``
pulls it by digest where an engine and GPUs are, and ``push`` lets it
through on that verdict, as for a local build.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ..engine import labels, registry_of, split_reference
from ..errors import BaseImageError, PinError, PushError, Refused, UsageError
from ..journal import records
from ..registry import client as registry
from ..registry.layercache import LayerMemory
from ..registry.layerscan import Located, layer_refs, locate
from ..registry.remote import Base, check_layer_heads, read_base, read_blob, repo_of
from ..registry.remote import opener as opener_for
from ..registry.write import Repo, Writer, check_size
from ..tarball import Entry, write
from . import definitions, platforms, render
from . import patches as patchlib
from .assemble import image_config, layer_entries
from .base import PatchedFile, apply_in_scratch, check_targets, check_version, touched_files
from .bytecode import Choice, choose, compile_here, levels, version_of
from .platforms import Platform, child_ref
from .sources import BaseFacts, cache_dir

log = logging.getLogger(__name__)

BUILDER = "registry"
GZIP_LAYER = {registry.DOCKER_MANIFEST: "application/vnd.docker.image.rootfs.diff.tar.gzip",
              registry.OCI_MANIFEST: "application/vnd.oci.image.layer.v1.tar+gzip"}


@dataclass(frozen=True, slots=True)
class Options:
    rebuild: bool = False
    skip_included: bool = False
    force: bool = False
    bytecode: str = "auto"
    progress: Callable[[str], None] = lambda _line: None


@dataclass(frozen=True)
class Made:
    """One platform's image, in the target repository by digest (and under ``ref`` once tagged)."""

    ref: str
    digest: str  # the manifest's
    image_id: str  # the config's digest: the image ID an engine that pulls it gives
    platform: str
    reused: bool
    record: records.Entry
    bytecode: str = ""
    read: dict[str, int] = field(default_factory=dict)  # bytes and layers read from the base's registry
    blobs: dict[str, int] = field(default_factory=dict)  # base layers present, mounted, copied


@dataclass(frozen=True)
class Result:
    ref: str
    digest: str  # the manifest's, or the index's over the platforms
    images: list[Made]
    index: bool


def platform_of(base: Base) -> Platform | None:
    return platforms.of(*base.os_arch)


def bases(base_ref: str, wanted: list[Platform] | None, asked: bool, say: Callable[[str], None]
          ) -> tuple[dict[Platform | None, Base], registry.Manifest]:
    """Each platform's base (None: the one image a plain manifest names, built under the plain tag)."""
    repo, tag = repo_of(base_ref)
    say(f"==> reading base {base_ref} from {repo.client.host}")
    top = repo.client.manifest(repo.path, tag)
    if top is None:
        raise BaseImageError(f"registry {repo.client.host} has no {base_ref}",
                             hint="check --base/--base-repo, or push the base there first")
    name, _ = split_reference(base_ref)
    if not top.is_index:
        one = read_base(repo, base_ref, top)
        if not asked:
            return {None: one}, top
        plat = platform_of(one)
        if wanted is not None and (len(wanted) != 1 or wanted[0] != plat):
            raise BaseImageError(f"base {base_ref} is one {one.config.get('os')}/{one.config.get('architecture')} "
                                 f"image, not an index over {', '.join(map(str, wanted))}")
        return {plat: one}, top
    offered: dict[Platform, str] = {}
    for kid in registry.children(top):
        plat = platforms.of(kid.os, kid.architecture, kid.variant)
        if plat is not None and plat not in offered:
            offered[plat] = kid.digest
    chosen = wanted if wanted is not None else list(offered)
    lacking = [str(w) for w in chosen if w not in offered]
    if lacking:
        raise BaseImageError(f"base {base_ref} is an index over {', '.join(map(str, offered)) or 'nothing'}; "
                             f"it has no {', '.join(lacking)} image")
    say(f"    base {base_ref} is an index ({top.digest}); building for {', '.join(map(str, chosen))}")
    out: dict[Platform | None, Base] = {}
    for plat in chosen:
        found = repo.client.manifest(repo.path, offered[plat])
        if found is None or found.is_index:
            raise BaseImageError(f"{name}@{offered[plat]} ({plat}) is not an image in {repo.client.host}")
        out[plat] = read_base(repo, f"{name}@{offered[plat]}", found)
        if platform_of(out[plat]) != plat:
            raise BaseImageError(f"{name}@{offered[plat]} is listed as {plat} but its config says otherwise")
    return out, top


# -- the parts of one platform's image ----------------------------------------------


def _unix(created: object) -> int:
    """An RFC 3339 time as the engine's history gives it (whole seconds)."""
    if not isinstance(created, str) or not created:
        return 0
    try:
        return int(datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp())
    except ValueError:
        return 0


def config_for(base: Base, diff_id: str, label_items: list[tuple[str, str]], description: str) -> bytes:
    """The assemble builder's config, over the base's as its registry holds it (the engine's view of it)."""
    conf = base.config
    inspect_like = {"Id": base.config_digest, "Config": conf.get("config") or {},
                    "RootFS": {"Layers": (conf.get("rootfs") or {}).get("diff_ids") or []},
                    "Created": conf.get("created"), "Architecture": conf.get("architecture"),
                    "Os": conf.get("os"), "Variant": conf.get("variant"), "OsVersion": conf.get("os.version"),
                    "Author": conf.get("author")}
    # The engine's history: oldest first, whole seconds, a size that tells a layer from a config change.
    history = [{"Created": _unix(h.get("created")), "CreatedBy": h.get("created_by") or "",
                "Comment": h.get("comment") or "", "Size": 0 if h.get("empty_layer") else 1}
               for h in conf.get("history") or [] if isinstance(h, dict)]
    return image_config(inspect_like, history, diff_id, label_items, description)


def _facts(base: Base, defn: definitions.ImageDefinition, where: Located, choice_tag: str) -> BaseFacts:
    plat = platform_of(base)
    return BaseFacts(ref=base.ref, image=base.info(), python=defn.python, python_version=version_of(choice_tag),
                     cache_tag=choice_tag, site_dir=where.site_dir, package_dir=where.package_dir,
                     version=where.version, machine=plat.machine if plat else "",
                     folders=tuple(where.folders))


@dataclass
class Prepared:
    base: Base
    facts: BaseFacts
    files: list[PatchedFile]
    applied: list[patchlib.Patch]
    choice: Choice
    layer: bytes
    config: bytes
    located: Located


def prepare(p: Any, base: Base, opts: Options) -> Prepared | None:
    """Read, patch, compile and write one platform's layer and config; None: the base carries every patch."""
    say = opts.progress
    defn = p.definition
    os_name, arch, variant = base.os_arch
    defn.check_base(base.config_digest, definitions.platform_text(os_name, arch, variant), base.ref)
    check_layer_heads(base)
    rels = touched_files(p.patches)
    opener = opener_for(base.repo)
    # What earlier builds learnt of these layers, by digest: a repeat build reads none of them again.
    memory = LayerMemory(cache_dir(p.root))
    where = locate([*layer_refs(base.layers)], opener, defn.package, rels, base.repo.name, say, memory)
    say(f"    {defn.package} {where.version} in {where.site_dir} (read {where.layers_read} of {len(base.layers)} "
        f"layer(s), {where.bytes_read} bytes)")
    unlisted = [note for note in where.notes if "is not listed in" in note]
    if unlisted:
        # The installed distribution does not own the file the patch changes: not the vLLM the definition means.
        raise BaseImageError(f"{base.repo.name}: {unlisted[0]}", hint="the base's vLLM is not installed as its wheel "
                                                                     "installs it; build from the engine instead")
    for note in where.notes:
        say(f"    note: {note}")
    facts = _facts(base, defn, where, "")
    check_version(facts, defn)
    check_targets(where.files, p.patches, base.ref, where.site_dir)
    originals = {rel: where.files[rel]["data"] for rel in rels}
    missing = [rel for rel, data in originals.items() if data is None]
    if missing:
        raise BaseImageError(f"{where.site_dir}/{missing[0]} in {base.ref} could not be read from its layers")
    patched, included = apply_in_scratch(p.patches, originals, skip_included=opts.skip_included)
    applied = [pt for pt in p.patches if pt not in included]
    if p.patches and not applied:
        return None
    changed = [rel for rel in rels if patched[rel] != originals[rel]]
    choice = choose(opts.bytecode, {rel: where.pycs[rel] for rel in changed}, where.hint_pyc)
    say(f"    bytecode: {choice.why}")
    compiled: dict[str, dict[str, bytes]] = {}
    if choice.mode == "compiled":
        owner = {rel: next(pt.name for pt in applied if rel in pt.files) for rel in changed}
        compiled = compile_here(choice.python, {rel: patched[rel] for rel in changed},
                                {rel: levels(where.pycs[rel], choice.cache_tag) for rel in changed}, owner)
    facts = _facts(base, defn, where, choice.cache_tag)
    files = [PatchedFile(rel, patched[rel], int(where.files[rel]["mode"]) & 0o7777,
                         patchlib.sha256_bytes(originals[rel]), tuple(sorted(compiled.get(rel, {}).items())))
             for rel in changed]
    # Each path once (a folder both name is the patch layer's): a layer naming a path twice is refused on reading.
    entries = list({e.name: e for e in [*_whiteouts(facts.site_dir, choice.whiteouts),
                                        *layer_entries(facts, files)]}.values())
    layer = write(entries)
    label_items = render.labels(defn, facts, files, applied)
    description = f"vllm-hotfix: {defn.tag} patched files and bytecode into {facts.site_dir}"
    config = config_for(base, "sha256:" + hashlib.sha256(layer).hexdigest(), label_items, description)
    return Prepared(base, facts, files, applied, choice, layer, config, where)


def _whiteouts(site: str, stale: tuple[str, ...]) -> list[Entry]:
    out: dict[str, Entry] = {}
    for rel in stale:
        folder, name = rel.rsplit("/", 1)
        out.setdefault(folder, Entry(f"{site.strip('/')}/{folder}", None, 0o755))
        out[rel] = Entry(f"{site.strip('/')}/{folder}/.wh.{name}", b"", 0o644)
    return list(out.values())


def manifest_for(base: Base, config: bytes, gz: bytes) -> tuple[str, bytes]:
    """The new image's manifest: the base's layers and ours, in the base's manifest format."""
    media = base.manifest.media_type if base.manifest.media_type in GZIP_LAYER else registry.DOCKER_MANIFEST
    doc = base.manifest.json()
    config_media = str((doc.get("config") or {}).get("mediaType") or
                       ("application/vnd.oci.image.config.v1+json" if media == registry.OCI_MANIFEST
                        else "application/vnd.docker.container.image.v1+json"))
    body = {"schemaVersion": 2, "mediaType": media,
            "config": {"mediaType": config_media, "size": len(config), "digest": registry.sha256(config)},
            "layers": [*base.layers, {"mediaType": GZIP_LAYER[media], "size": len(gz), "digest": registry.sha256(gz)}]}
    return media, json.dumps(body, indent=3).encode() + b"\n"


# -- the whole run ------------------------------------------------------------------


def target_of(p: Any) -> tuple[Repo, str]:
    ref = p.output_ref
    if registry_of(ref) != "docker.io" or ref.startswith("docker.io/"):
        try:
            return repo_of(ref)
        except PushError:
            pass
    raise UsageError(f"--in-registry writes the image into a registry: {ref} names none",
                     hint="give --tag HOST[:PORT]/PATH:TAG (or a --base-repo on your registry)")


def _key_inputs(p: Any, base: Base, plat: Platform | None, opts: Options) -> dict[str, Any]:
    from .pipeline import inputs  # here: the one place a build's inputs are written down

    got = inputs(p, base.config_digest, f"{split_reference(base.ref)[0]}@{base.manifest.digest}")
    if plat is not None:
        got["platform"] = str(plat)
    if opts.skip_included:
        got["skip_included"] = True
    got["builder"] = BUILDER
    if opts.bytecode != "auto":
        got["bytecode"] = opts.bytecode
    return got


def check_tag(writer: Writer, tag: str, base_digests: set[str], force: bool, root: Any) -> None:
    """Refuse to move a tag of the target that names the base or an image this tool did not make."""
    t = writer.target
    found = t.client.manifest(t.path, tag)
    if found is None or force:
        return
    if found.digest in base_digests:
        raise Refused(f"--tag {t.name}:{tag} names the base itself; refusing to move it",
                      hint="choose another --tag (or --force)")
    doc = found.json()
    if found.is_index:
        kids = registry.children(found)
        doc = (t.client.manifest(t.path, kids[0].digest) or found).json() if kids else {}
    config = str((doc.get("config") or {}).get("digest") or "")
    ours = config in records.known_images(root)
    if not ours and config.startswith("sha256:"):
        raw = read_blob(t, config, "config")
        ours = labels.DEFINITION in ((json.loads(raw).get("config") or {}).get("Labels") or {})
    if not ours:
        raise Refused(f"--tag {t.name}:{tag} names {found.digest[:19]}, which this tool did not build; "
                      "refusing to move it", hint="choose another --tag, or pass --force to move it anyway")


@contextmanager
def reading(ref: str) -> Iterator[None]:
    """The base's registry refusing a read (a login, an outage) is a base that cannot be had (exit 4)."""
    try:
        yield
    except PushError as exc:
        raise BaseImageError(f"cannot read base {ref}: {exc}", hint=exc.hint) from exc


@dataclass
class _Pushed:
    """One platform's manifest, in the target by digest, not yet tagged."""

    digest: str
    media_type: str
    size: int
    image_id: str
    platform: str
    meta: dict[str, Any]
    record: records.Entry | None = None  # a reused build's own entry
    bytecode: str = ""
    read: dict[str, int] = field(default_factory=dict)
    blobs: dict[str, int] = field(default_factory=dict)


def build(p: Any, wanted: list[Platform] | None, asked: bool, opts: Options) -> Result | Any:
    """Make, push and tag the hotfix image(s) of plan ``p`` in the registry; a NoHotfix when none is needed."""
    from .pipeline import NoHotfix

    say = opts.progress
    if p.pinset is not None:
        raise PinError(f"{p.pinset.path}: patch set {p.pinset.patch_set} pins {len(p.pinset.pins)} "
                       "distribution(s), which needs pip to run in the image; --in-registry runs nothing",
                       hint="build this definition from the engine (--builder dockerfile)")
    target, tag = target_of(p)
    records.ensure_writable(p.root)
    with reading(p.base_ref):
        found, top = bases(p.base_ref, wanted, asked, say)
    multi = None not in found
    writer = Writer(target, say)
    base_digests = {top.digest, *(b.manifest.digest for b in found.values())}
    refs = [child_ref(p.output_ref, plat) for plat in found if plat is not None] + [p.output_ref]
    for ref in refs:
        check_tag(writer, split_reference(ref)[1], base_digests, opts.force, p.root)
    made: list[tuple[Platform | None, _Pushed]] = []
    for plat, base in found.items():
        if plat is not None:
            say(f"==> platform {plat}")
        one = _one(p, plat, base, writer, opts)
        if one is None:
            return NoHotfix(p.base_ref, p.definition.patch_set, tuple(pt.name for pt in p.patches))
        made.append((plat, one))
    index_digest = None
    if multi:
        kids = [registry.Child(m.digest, m.media_type, m.size, plat.os, plat.architecture, plat.variant)
                for plat, m in made if plat is not None]
        media, body = registry.index_body(kids)
        index_digest = writer.put_manifest(registry.sha256(body), media, body)
        say(f"==> index {index_digest} over {', '.join(str(plat) for plat, _ in made)}")
    images = []
    for plat, m in made:
        ref = child_ref(p.output_ref, plat) if plat is not None else p.output_ref
        entry = m.record or records.append(p.root, "build", {**m.meta, "output_ref": ref,
                                                             "registry": {**m.meta["registry"], "ref": ref}})
        images.append(Made(ref, m.digest, m.image_id, m.platform, m.record is not None, entry, m.bytecode, m.read,
                           m.blobs))
    # Tags last: each names a whole image (or the index over whole images) that is already in.

    def guard(tag: str) -> None:  # a tag that moved since it was checked is checked again before it is written
        check_tag(writer, tag, base_digests, opts.force, p.root)

    if multi:
        for image in images:
            _tag(p, writer, image.ref, image.digest, say, guard, image_id=image.image_id)
    digest = index_digest or images[0].digest
    if multi:
        _tag(p, writer, p.output_ref, digest, say, guard, image_ids=[i.image_id for i in images])
    else:
        _tag(p, writer, p.output_ref, digest, say, guard, image_id=images[0].image_id)
    return Result(p.output_ref, digest, images, multi)


def _tag(p: Any, writer: Writer, ref: str, digest: str, say: Callable[[str], None],
         guard: Callable[[str], None], *, image_id: str | None = None, image_ids: list[str] | None = None) -> None:
    """Put the tag (the manifest's own bytes under it), read it back, then journal it: the journal names only
    tags the registry holds. Right before the write the tag is looked at again: one moved meanwhile to an
    image this tool did not make is refused (``guard``), not overwritten."""
    t = writer.target
    tag = split_reference(ref)[1]
    found = t.client.manifest(t.path, digest)
    if found is None:
        raise PushError(f"registry {t.client.host} lost {t.path}@{digest} before it could be tagged {tag}")
    now = writer.resolve(tag)
    if now != digest:
        if now is not None:
            guard(tag)
        writer.put_manifest(tag, found.media_type, found.body)
    confirmed = writer.resolve(tag)
    if confirmed != digest:
        raise PushError(f"registry {t.client.host} resolves {ref} to {confirmed}, not {digest}")
    entry: dict[str, Any] = {"ref": ref, "digest": digest, "why": "built in the registry", "registry": t.client.host}
    if image_id is not None:
        entry["image_id"] = image_id
    if image_ids is not None:
        entry["image_ids"] = image_ids
    records.append(p.root, "tag", entry)
    say(f"    tagged {ref} ({digest})")


def _one(p: Any, plat: Platform | None, base: Base, writer: Writer, opts: Options) -> _Pushed | None:
    say = opts.progress
    key_inputs = _key_inputs(p, base, plat, opts)
    key = records.inputs_key(key_inputs)
    if not opts.rebuild:
        for rec in records.builds_with_inputs(p.root, key):
            digest = str((rec.data.get("registry") or {}).get("digest") or "")
            kept = writer.target.client.manifest(writer.target.path, digest) if digest else None
            if kept is not None:
                say(f"==> inputs unchanged since {rec.path.name}: reusing {digest} (--rebuild forces a build)")
                return _Pushed(digest, kept.media_type, kept.size, rec.image_id, str(rec.data.get("platform") or ""),
                               {}, rec)
    with reading(base.ref):
        made = prepare(p, base, opts)
    if made is None:
        return None
    gz = gzip.compress(made.layer, compresslevel=6, mtime=0)
    media, body = manifest_for(base, made.config, gz)
    check_size(body, f"{writer.target.name}@{registry.sha256(body)}")  # before anything is written
    say(f"==> writing into {writer.target.name}: layer {len(made.layer)} bytes ({len(gz)} gzipped), "
        f"config {len(made.config)} bytes, {len(base.layers)} base layer(s)")
    counts: dict[str, int] = {}
    for d in base.layers:
        how = writer.bring(d, base.repo)
        counts[how] = counts.get(how, 0) + 1
    writer.put_blob(gz, "the hotfix layer")
    image_id = writer.put_blob(made.config, "the image config")
    digest = writer.put_manifest(registry.sha256(body), media, body)
    say(f"    {image_id[:19]} as {writer.target.name}@{digest} (base layers: "
        f"{', '.join(f'{v} {k}' for k, v in sorted(counts.items()))})")
    read = {"bytes": base.bytes_read + made.located.bytes_read, "layers": made.located.layers_read,
            "of_layers": len(base.layers)}
    meta = _meta(p, made, key_inputs, key, image_id, digest, plat, writer.target.name)
    meta["registry"].update(read=read, base_layers=counts)
    return _Pushed(digest, media, len(body), image_id, meta["platform"], meta, None, made.choice.why, read, counts)


def _meta(p: Any, made: Prepared, key_inputs: dict[str, Any], key: str, image_id: str, digest: str,
          plat: Platform | None, repository: str) -> dict[str, Any]:
    """The journal's build entry: a local build's, with where the image lives and how it was made."""
    facts, base = made.facts, made.base
    conf = base.config
    shown = f"{conf.get('os')}/{conf.get('architecture')}"
    return {
        "builder": BUILDER,
        "inputs": key_inputs,
        "inputs_key": key,
        "image_id": image_id,
        "base": {"ref": base.ref, "id": base.config_digest, "digest": facts.image.digest, "site_dir": facts.site_dir,
                 "python": facts.python_version, "machine": facts.machine, "package_version": facts.version,
                 "platform": shown},
        "platform": str(plat) if plat else shown,
        "files": {f.rel: {"sha256": f.sha256, "original_sha256": f.original_sha256} for f in made.files},
        "patches_applied": {pt.name: pt.sha256 for pt in made.applied},
        "patches_included_upstream": [pt.name for pt in p.patches if pt not in made.applied],
        "registry": {"digest": digest, "repository": repository, "bytecode": made.choice.mode,
                     "bytecode_why": made.choice.why},
    }
