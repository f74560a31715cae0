"""Layer identity: whether an image is what its definition's builder makes of its base, judged on the host.

Every other check reads some files of the image and trusts that the rest
is the base's. A file beside the patched one (a compiled module Python
prefers, a ``.pth`` hook, ``sitecustomize.py``) or a changed ``ENV`` would
go unseen, because which files are checked is decided by the image's own
RECORD and Python. So before any check runs, the image is compared with what
the builder writes, from facts the host finds itself:

* **the base**, found by the host: where the definition pins it
  (``[base.digests]``), by that image ID, and a build record or a tag that
  names another base is not taken (a tag is refused by name); else the
  build record of this image (this
  host built it), else the definition's base reference (``--base-repo``
  may name another repository) in the engine, pulled by that name when the
  engine lacks it (the layers came with the image, so only its config
  travels). A base the build record names that the engine lacks (built in
  the registry, or removed since) is pulled as a second host pulls it.
  Never an image label: a label is data the image chose. A base this host
  cannot find, pull or read leaves the check incomplete (exit 11, nothing
  signed): that is the host's shortcoming, not a fact about the image. So
  does a definition this checkout lacks or cannot load (the one the image
  is judged against: ``--definition``, else the build record's, else the
  one its labels name), a patch set or pins.txt it cannot load, a pinned
  wheel its cache lacks, and a layer it cannot read or make.
* **the layers**: the image's diff IDs must begin with the base's, and the
  layers above are read whole where the image is started (:mod:`.layer_read`:
  the engine's or podman's overlay folders, a ``save`` export, a registry's
  blobs) and compared entry by entry (path, kind, mode, sha256, link target;
  owners and times are the builder's business) with what the builder writes
  for this patch set on this base: the patch layer of
  :func:`vllm_hotfix.building.assemble.layer_entries` (the Dockerfile's
  ``COPY`` adds the same entries; the in-registry builder the same, or
  whiteouts of every bytecode name of the patched files, or the sources
  alone); and below it, for a patch set with pins, the pip layer, whose
  entries are judged one by one as what pip may write from the pinned wheels
  (:mod:`.pin_layer`: a wheel member's bytes at its install path, pip's own
  dist-info files, script launchers, removals of what the base's copies own),
  not against one exact layer.
* **the config**: the runtime fields (entrypoint, command, environment,
  user, working folder, ...) must be the base's; labels may only be added
  under the tool's own keys and the OCI base keys; platform the base's.

The first difference, in path order, is the one named; nothing else runs
(exit 14, :class:`~vllm_hotfix.errors.NotItsProduct`). An image that *is*
the definition's base (the unpatched base smoked to show what the hotfix
fixes) has no layers above it and skips this check: its other checks judge it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..building import base as baselib
from ..building import definitions, pins, sources
from ..building import patches as patchlib
from ..building.assemble import CONFIG_FIELDS, layer_entries
from ..building.bytecode import every_name
from ..engine import Engine, ImageInfo
from ..engine import labels as L
from ..errors import BaseImageError, DefinitionError, PatchError, PinError, PipelineError, SmokeIncomplete
from ..journal import records
from ..layers import Layer, LayerEntry, in_words
from ..layers.read import from_entries
from ..tarball import Entry
from ..verdicts import IDENTITY
from . import pin_layer
from .difference import Difference
from .layer_read import LayerSource, layers_above

log = logging.getLogger(__name__)

CHECK = IDENTITY
# Labels an image may add over its base's: the tool's own provenance and the OCI base annotations.
OWN_LABELS = (f"{L.PREFIX}.",)
OCI_LABELS = (L.OCI_BASE_NAME, L.OCI_BASE_DIGEST)
RUNTIME_FIELDS = tuple(f for f in CONFIG_FIELDS if f != "Labels")


def same(found: LayerEntry, wanted: LayerEntry) -> bool:
    """Whether two layer entries agree on what identity compares (owners and times are the builder's business; a
    hard link is a file with its target's bytes)."""
    kind = "file" if found.kind == "hardlink" else found.kind
    if kind != wanted.kind:
        return False
    if kind == "file":
        return (found.sha256, found.mode) == (wanted.sha256, wanted.mode)
    if kind == "dir":
        return (found.mode, found.opaque) == (wanted.mode, wanted.opaque)
    if kind == "link":
        return found.target == wanted.target
    return kind == "whiteout"


def _field(found: LayerEntry, wanted: LayerEntry) -> tuple[str, str, str]:
    """The first field two entries at one path differ in: (field, expected, found)."""
    kind = "file" if found.kind == "hardlink" else found.kind
    if kind != wanted.kind:
        return "kind", wanted.kind, found.kind
    for name, want, got in (("sha256", wanted.sha256, found.sha256), ("mode", f"{wanted.mode:o}", f"{found.mode:o}"),
                            ("target", wanted.target, found.target),
                            ("opaque", str(wanted.opaque), str(found.opaque))):
        if want != got:
            return name, want, got
    return "kind", wanted.kind, found.kind


def first_difference(actual: Layer, expected: Layer) -> Difference | None:
    """The first path (in order) where the layer read differs from the one the builder writes."""
    found, wanted = actual.entries, expected.entries
    for path in sorted(set(found) | set(wanted)):
        a, e = found.get(path), wanted.get(path)
        if a is None and e is not None:
            return Difference(path, "entry", in_words(e), "", f"{path} is missing (the builder writes {in_words(e)})")
        if e is None and a is not None:
            return Difference(path, "entry", "", in_words(a), f"{path} is not the builder's ({in_words(a)})")
        if a is not None and e is not None and not same(a, e):
            return Difference(path, *_field(a, e), f"{path} is {in_words(a)}, the builder writes {in_words(e)}")
    return None


def _norm(value: object) -> object:
    return None if value in (None, "", [], {}, False) else value


def config_difference(base: Mapping[str, Any], image: Mapping[str, Any]) -> Difference | None:
    """Where the image's config differs from its base's other than by the labels a builder adds."""
    for key, field_name in (("Os", "os"), ("Architecture", "architecture"), ("Variant", "variant")):
        if _norm(base.get(key)) != _norm(image.get(key)):
            return Difference("platform", field_name, str(base.get(key) or ""), str(image.get(key) or ""),
                              f"platform {field_name} {image.get(key)!r}, the base's {base.get(key)!r}")
    bc, ic = base.get("Config") or {}, image.get("Config") or {}
    for key in RUNTIME_FIELDS:
        if _norm(bc.get(key)) != _norm(ic.get(key)):
            return Difference("config", key, repr(bc.get(key)), repr(ic.get(key)),
                              f"config {key} {ic.get(key)!r}, the base's {bc.get(key)!r}")
    bl, il = dict(bc.get("Labels") or {}), dict(ic.get("Labels") or {})
    for key in sorted(set(bl) | set(il)):
        if key.startswith(OWN_LABELS) or key in OCI_LABELS:
            continue
        if key in bl and il.get(key) != bl[key]:
            return Difference("label", key, bl[key], str(il.get(key) or ""),
                              f"label {key} {il.get(key)!r}, the base's {bl[key]!r}")
        if key not in bl:
            return Difference("label", key, "", il[key], f"label {key} added ({il[key]!r}): a builder adds only "
                                                         f"{L.PREFIX}.* and the OCI base labels")
    return None


@dataclass(frozen=True, slots=True)
class Base:
    """The base the host found for an image, and how."""

    info: ImageInfo
    ref: str
    how: str
    definition: definitions.ImageDefinition


@dataclass(frozen=True, slots=True)
class Outcome:
    """The identity check as the host settled it; ``base`` None where no base could be found."""

    status: str  # pass, fail, skip; incomplete where this host could not find, pull or read the base
    detail: str
    base: Base | None = None
    data: Mapping[str, Any] = field(default_factory=dict)
    python_path: tuple[str, ...] = ()  # the base's sys.path folders, given to every check started with -S
    difference: Difference | None = None  # where a fail names one: the path, field, expected and found

    @property
    def base_id(self) -> str:
        return self.base.info.id if self.base is not None else ""

    def check(self) -> dict[str, Any]:
        return {"name": CHECK, "status": self.status, "detail": self.detail,
                "data": {**dict(self.data), "answered_by": "filesystem"}}


def _names_registry(ref: str) -> bool:
    """Whether a reference names its registry (``host[:port]/...``): the only kind pulled to find a base."""
    first, slash, _rest = ref.partition("/")
    return bool(slash) and ("." in first or ":" in first or first == "localhost")


def _pulled(engine: Engine, refs: list[str], base_id: str) -> tuple[ImageInfo | None, list[str]]:
    """The base ``base_id`` pulled by the first of ``refs`` (each naming its registry) that gives it, as a
    second host finds it; with what each other reference gave."""
    tried: list[str] = []
    for ref in dict.fromkeys(r for r in refs if r and _names_registry(r)):
        try:
            engine.pull(ref)
        except PipelineError as exc:
            tried.append(f"{ref}: {str(exc).splitlines()[0]}")
            continue
        found = engine.image(base_id)
        if found is not None:
            return found, tried
        other = engine.image(ref)
        tried.append(f"{ref} is {other.id[:19] if other is not None else 'another image'}")
    return None, tried


def find_base(engine: Engine, root: Path, image: ImageInfo, definition: str | None, base_repo: str | None,
              built_on: str | None = None) -> Base:
    """The image's base as this host knows it: the build's (``built_on``, or this host's build record), else the
    definition's base reference in the engine, pulled by that name where missing. A base the build names that
    this engine lacks is pulled from its registry (by the digest the build read it by, else by its reference or
    the definition's), as a second host pulls it. Raises SmokeIncomplete where the base cannot be found, pulled
    or read (the host's shortcoming, never the image's), BaseImageError where the image cannot be placed."""
    entries = records.builds_of_image(root, image.id)
    tag = definition
    base_id = built_on or ""
    how = "this build"
    recorded: Mapping[str, Any] = dict(entries[0].data.get("base") or {}) if entries else {}
    if not base_id and entries:
        base_id = str(recorded.get("id", ""))
        how = f"build record {entries[0].path.name}"
        tag = tag or str((entries[0].data.get("inputs") or {}).get("definition", ""))
    # The definition the image claims chooses which patch set it must be the product of, never its base.
    tag = tag or image.labels.get(L.DEFINITION, "")
    if not tag:
        raise BaseImageError(f"no build record of {image.id[:19]} and no definition named: cannot tell what it is "
                            "the product of (give --definition TAG)")
    try:
        defn = definitions.load(root, tag)
    except DefinitionError as exc:
        # The checkout's shortcoming: without the definition nothing is known of the image, so nothing is signed.
        raise SmokeIncomplete(f"definition {tag}, which the image is judged against, is not one this checkout can "
                              f"load: {exc}", hint=f"smoke it from a checkout that holds images/{tag}.toml and its "
                                                   "patch set, or name another with --definition") from None
    ref = defn.base_ref(base_repo)
    platform = definitions.platform_text(image.os, image.architecture, image.variant)
    pinned = defn.base_digests.get(platform) or defn.base_digests.get(f"{image.os}/{image.architecture}")
    if base_id and defn.base_digests and base_id != pinned:
        # The journal is plain JSON: a build line is taken for the base only where it names the pinned one.
        log.info("%s names base %s, not the base definition %s pins: not taken", how, base_id[:19], tag)
        base_id, how = "", ""
    if pinned and not base_id:
        found = engine.image(pinned)
        if found is not None:
            return Base(found, ref, f"definition {tag}: pinned {pinned[:19]}, found by digest", defn)
    if base_id:
        found = engine.image(base_id)
        if found is not None:
            return Base(found, ref, how, defn)
        # Built here from a registry's base (image --in-registry), or the base removed since: pulled as a second
        # host pulls it, and taken only where the pull gave the very base the build read.
        where = [str(recorded.get("digest") or ""), str(recorded.get("ref") or "")] if recorded.get("id") == base_id \
            else []
        found, tried = _pulled(engine, [*where, ref], base_id)
        if found is None:
            raise SmokeIncomplete(f"base {base_id[:19]} ({how}) is not in the engine and was not pulled"
                                  + (f" ({'; '.join(tried)})" if tried else f": {ref} names no registry to pull from")
                                  + ": the image cannot be compared with it",
                                  hint="pull the base, or name the registry that holds it with --base-repo")
        return Base(found, ref, f"{how}, pulled from its registry", defn)
    found = engine.image(ref)
    if found is None and _names_registry(ref):
        try:
            engine.pull(ref)
        except PipelineError as exc:
            raise SmokeIncomplete(f"base {ref} (definition {tag}) is not in the engine and cannot be pulled: "
                                  f"{exc}", hint="pull the base, or name the registry that holds it with "
                                                 "--base-repo") from None
        found = engine.image(ref)
    if found is None:
        raise SmokeIncomplete(f"base {ref} (definition {tag}) is not in the engine: the image cannot be compared "
                              "with it (pull it, or name its repository with --base-repo)")
    problem = defn.base_problem(found.id, platform, ref)
    if problem is not None:
        # The host's base under that name is not the pinned one: nothing is known of the image against it.
        raise SmokeIncomplete(problem, hint="pull the pinned base (its tag may have moved)")
    return Base(found, ref, f"definition {tag}: {ref} in the engine", defn)


def expected_patch_layers(engine: Engine, root: Path, base: Base, patches: list[patchlib.Patch]
                          ) -> tuple[list[Layer], str]:
    """What the builders write over ``base`` for ``patches``: the patch layer with fresh bytecode (Dockerfile,
    assemble, in-registry compiling); where the base has stale pycs, with whiteouts of them instead (the
    in-registry builder without a Python to compile); and the patched sources alone (the in-registry builder
    that read no pyc in the layers it read); and the base's site folder."""
    defn = base.definition
    facts, files, _applied = baselib.prepare(engine, defn, base.ref, base.info, patches, skip_included=True,
                                             cache=sources.cache_dir(root))
    if not files:
        return [], facts.site_dir
    compiled = from_entries(layer_entries(facts, files))
    site = facts.site_dir.strip("/")
    # The in-registry builder whites out every name the image's Python could load for a patched file.
    stale = sorted({*(pyc for f in files for pyc, _data in f.bytecode),
                    *(name for f in files for name in every_name(f.rel, facts.cache_tag) if facts.cache_tag)})
    bare = [replace(f, bytecode=()) for f in files]
    whiteouts = {e.name: e for e in layer_entries(facts, bare)}
    for rel in stale:
        folder, name = rel.rsplit("/", 1)
        whiteouts.setdefault(f"{site}/{folder}", Entry(f"{site}/{folder}", None, 0o755))
        whiteouts[f"{site}/{folder}/.wh.{name}"] = Entry(f"{site}/{folder}/.wh.{name}", b"", 0o644)
    sources_only = from_entries(layer_entries(facts, bare))
    return ([compiled, from_entries(whiteouts.values()), sources_only] if stale else [compiled]), facts.site_dir


def prove(engine: Engine, root: Path, image: ImageInfo, *, definition: str | None = None,
          base_repo: str | None = None, built_on: str | None = None,
          say: Callable[[str], None] = lambda _l: None, read_layers: LayerSource | None = None) -> Outcome:
    """Whether ``image`` is its definition's product on the base the host finds (see the module's doc).

    ``engine`` holds the base (and, unless ``read_layers`` reads them from
    where the image is started, podman's store or a registry, the image)."""
    try:
        base = find_base(engine, root, image, definition, base_repo, built_on)
    except SmokeIncomplete as exc:
        # The host could not find, pull or read the base: nothing is known of the image, so nothing is signed.
        return Outcome("incomplete", f"no base to compare it with: {exc}")
    except PipelineError as exc:
        return Outcome("fail", f"no base to compare it with: {exc}", data={"first_difference": str(exc)})
    # What the host found and proved, which a signed verdict names (never the image's labels): the definition
    # it judged the image against, its base's reference and the registry digests the engine holds for that base;
    # and whether the definition pins its base (an unpinned one takes whatever its tag names here, and says so).
    data: dict[str, Any] = {"base_id": base.info.id, "base_found_by": base.how,
                            "base_pinned": bool(base.definition.base_digests), "definition": base.definition.tag,
                            "base_ref": base.ref,
                            "base_digests": sorted({d.partition("@")[2] for d in base.info.repo_digests
                                                    if "@sha256:" in d})}
    # The patch set the image is judged against, named in every verdict (a fail's too, so that it is never taken
    # for a fail of another); one that cannot be loaded leaves the check incomplete where it is needed.
    try:
        patches = patchlib.load_series(root, base.definition.patch_set, base.definition.package)
        pinset = pins.load(root, base.definition.patch_set, base.definition.package)
    except (PatchError, PinError) as exc:
        unloaded: PatchError | PinError | None = exc
    else:
        unloaded = None
        data["patch_set"] = base.definition.patch_set
        data["patch_set_digest"] = patchlib.set_digest(patches, pinset.sha256 if pinset is not None else None)
    try:
        with sources.ImageReader(engine, base.info, base.ref, base.definition.package, base.definition.python,
                                 sources.cache_dir(root)) as reader:
            located = reader.locate([])[0]
            python_path, scheme = located.sys_path, located.scheme
    except PipelineError as exc:
        return Outcome("incomplete", f"base {base.info.id[:19]} ({base.how}) cannot be read: {exc}", base, data)
    if base.info.id == image.id:
        return Outcome("skip", f"the image is the definition's base itself ({base.how}): nothing built over it",
                       base, data, python_path)
    base_layers = [str(d) for d in ((base.info.attrs or {}).get("RootFS") or {}).get("Layers") or []]
    layers = [str(d) for d in ((image.attrs or {}).get("RootFS") or {}).get("Layers") or []]

    def refused(why: str | Difference) -> Outcome:
        said = {"first_difference": str(why), **({"difference": why.as_dict()} if isinstance(why, Difference) else {})}
        return Outcome("fail", f"not the product of definition {base.definition.tag} on base "
                               f"{base.info.id[:19]} ({base.how}): {why}", base, {**data, **said}, python_path,
                       why if isinstance(why, Difference) else None)

    def unjudged(why: str) -> Outcome:
        # A patch set, a pinned wheel or a layer this host cannot read or make: nothing is known of the image.
        return Outcome("incomplete", f"cannot compare it with what the builder writes for definition "
                                     f"{base.definition.tag} on base {base.info.id[:19]} ({base.how}): {why}",
                       base, data, python_path)

    if layers[:len(base_layers)] != base_layers:
        at = next((i for i, (a, b) in enumerate(zip(layers, base_layers, strict=False)) if a != b),
                  min(len(layers), len(base_layers)))
        return refused(f"its layer {at + 1} is not the base's (its layers do not begin with the base's "
                       f"{len(base_layers)})")
    config = config_difference(base.info.attrs or {}, image.attrs or {})
    if config is not None:
        return refused(config)
    if unloaded is not None:
        return unjudged(f"patches/{base.definition.patch_set}: {unloaded}")
    data["patches"] = {patch.name: patch.sha256 for patch in patches}
    above = len(layers) - len(base_layers)
    want = 2 if pinset is not None else 1
    if above != want:
        return refused(f"{above} layer(s) over the base; the builder writes {want} "
                       f"({'the pip layer of the pins and ' if pinset is not None else ''}the patch layer)")
    say(f"    layer identity: base {base.info.id[:19]} ({base.how}), {above} layer(s) above it")
    try:
        choices, site_dir = expected_patch_layers(engine, root, base, patches)
        read = read_layers(above) if read_layers is not None else layers_above(engine, image, above)
    except PipelineError as exc:
        return unjudged(f"cannot read or make its layers: {exc}")
    data["layers_above"] = above
    if not choices:
        return refused(f"patches/{base.definition.patch_set} changes no file of the base, so its builder writes no "
                       f"patch layer, yet the image has {above} layer(s) above the base")
    differences = [first_difference(read[-1], c) for c in choices]
    if all(d is not None for d in differences):
        first = differences[0]
        assert first is not None
        return refused(replace(first, words=f"patch layer: {first}"))
    if pinset is not None:
        sites = [p for p in python_path if p.rstrip("/").endswith(("-packages", "site-packages"))]
        try:
            why = pin_layer.difference(read[0], root, pinset, scheme, [*sites, site_dir], base.info, engine,
                                       sources.cache_dir(root))
        except PinError as exc:
            return unjudged(f"pip layer: {exc}")
        if why is not None:
            return refused(replace(why, words=f"pip layer: {why}"))
    unpinned = "" if base.definition.base_digests else f"; definition {base.definition.tag} pins no base digest"
    return Outcome("pass", f"its {above} layer(s) over base {base.info.id[:19]} ({base.how}) are exactly what "
                           f"the builder writes for patches/{base.definition.patch_set}, its config the base's "
                           f"plus labels{unpinned}", base, data, python_path)

