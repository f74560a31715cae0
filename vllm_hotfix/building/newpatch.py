"""``new-patchset``: turn an upstream PR (or a diff file) into a patch of a set.

Fetch the PR's title and diff from the GitHub API (the base URL is
configurable, so tests serve a PR from a local HTTP server), keep only the
files under the package, check the result applies to the base's files with
zero fuzz on top of the set's existing patches, then write
``patches/<TAG>/NNNN-<slug>.patch`` with its header, its ``series`` line and
``images/<TAG>.toml`` when missing, pinning the base it read by image ID
(``[base.digests]``; from the wheel, nothing is pinned). A definition that
pins its base refuses a base found with another ID. Every check runs before
the first write, and a failed write undoes the others: nothing is left
half-written.
"""

from __future__ import annotations

import logging
import os
import re
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import requests
import unidiff

from ..engine import Engine
from ..errors import BaseImageError, PatchError, PinError, UpstreamError, UsageError
from ..journal.atomic import write_atomic
from ..registry.pulling import resolve
from . import base, definitions, sources, wheels
from . import patches as patchlib

log = logging.getLogger(__name__)

DEFAULT_API = "https://api.github.com"
DEFAULT_REPO = "vllm-project/vllm"
API_ENV = "VLLM_HOTFIX_GITHUB_API"
_PR_URL = re.compile(r"^https?://[^/]+/([^/]+/[^/]+)/pull/(\d+)(?:[/?#].*)?$")


@dataclass(frozen=True)
class Change:
    """An upstream change: where it came from, its title and its diff."""

    source: str  # PR page URL, or the file it was read from
    title: str
    diff: str
    number: int | None = None


@dataclass
class Created:
    patch: Path
    series: Path
    definition: Path | None
    dropped: list[str] = field(default_factory=list)
    where: str = ""


@dataclass(frozen=True, slots=True)
class Pinned:
    """What ``new-patchset --pin`` wrote: the pins file, and the image the wheels were chosen for."""

    path: Path
    image: str  # the Python and platform the wheels were chosen for


def add_pins(
    root: Path,
    base_tag: str,
    specs: Sequence[str],
    engine: Callable[[], Engine],
    *,
    base_repo: str | None = None,
    pull: str = "missing",
    wheelhouse: Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> Pinned:
    """Add ``NAME==VERSION`` lines, with the hashes of the wheels that fit the base, to the set's pins.txt."""
    from . import pins  # here: only --pin needs the pins machinery

    say = progress or (lambda _line: None)
    defn = definitions.load(root, base_tag)
    ref = defn.base_ref(base_repo)
    eng = engine()
    info = resolve(eng, ref, pull, say)
    state = pins.probe(eng, info.id, defn.python, [])
    if not state.tags:
        raise PinError(f"{ref} has no pip for {defn.python}: it cannot install pinned wheels")
    written = pins.add(root, defn.patch_set, defn.package, specs, state, wheelhouse, say)
    return Pinned(written, pins.describe_image(state))


def api_url(option: str | None = None) -> str:
    return (option or os.environ.get(API_ENV) or DEFAULT_API).rstrip("/")


def parse_pr(spec: str, repo: str = DEFAULT_REPO) -> tuple[str, int]:
    """``49149``, ``#49149`` or a PR page URL -> (owner/name, number)."""
    text = spec.strip().removeprefix("#")
    if text.isdigit():
        return repo, int(text)
    m = _PR_URL.match(text)
    if m:
        return m.group(1), int(m.group(2))
    raise UsageError(f"--from-pr {spec!r}: neither a PR number nor a pull request URL (…/OWNER/REPO/pull/N)")


def network_cause(exc: BaseException, url: str) -> str:
    """What went wrong reaching ``url``, in words: name resolution, refused, timed out, TLS.

    requests wraps the socket's error two or three levels down; the class name
    alone ("ConnectionError") does not tell a user whether to check DNS, a
    proxy or a firewall.
    """
    import socket
    from urllib.parse import urlsplit

    host = urlsplit(url).netloc or url
    seen: set[int] = set()
    chain: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo:
        cur = todo.pop()
        if cur is None or id(cur) in seen:
            continue
        seen.add(id(cur))
        chain.append(cur)
        todo += [cur.__cause__, cur.__context__, *(a for a in cur.args if isinstance(a, BaseException))]
        reason = getattr(cur, "reason", None)
        if isinstance(reason, BaseException):
            todo.append(reason)
    if any(isinstance(e, socket.gaierror) for e in chain) or any(
            "Name or service not known" in str(e) or "Temporary failure in name resolution" in str(e)
            or "nodename nor servname" in str(e) for e in chain):
        return f"cannot resolve the name of {host} (offline, or no DNS)"
    if any(isinstance(e, ConnectionRefusedError) for e in chain) or any("Connection refused" in str(e) for e in chain):
        return f"connection refused by {host} (nothing listens there)"
    if any(isinstance(e, requests.exceptions.Timeout) for e in chain):
        return f"{host} did not answer in time (timed out)"
    if any(isinstance(e, requests.exceptions.SSLError) for e in chain):
        return f"TLS with {host} failed: {' '.join(str(exc).split())[:160]}"
    if any(isinstance(e, requests.exceptions.ProxyError) for e in chain):
        return f"the proxy refused or failed on the way to {host}"
    if any(isinstance(e, OSError) and getattr(e, "errno", None) == 101 for e in chain) or any(
            "Network is unreachable" in str(e) for e in chain):
        return f"network unreachable on the way to {host}"
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"


def fetch_pr(spec: str, *, api: str | None = None, repo: str = DEFAULT_REPO, timeout: float = 30) -> Change:
    """The PR's title (JSON) and diff (the diff media type) from the GitHub API."""
    owner_repo, number = parse_pr(spec, repo)
    url = f"{api_url(api)}/repos/{owner_repo}/pulls/{number}"

    def get(accept: str) -> requests.Response:
        try:
            resp = requests.get(url, headers={"Accept": accept}, timeout=timeout)
        except requests.exceptions.RequestException as exc:
            raise UpstreamError(
                f"cannot fetch PR #{number} from {url}: {network_cause(exc, url)}",
                hint="offline? save the PR's diff elsewhere and use --from-file",
            ) from exc
        if resp.status_code != 200:
            raise UpstreamError(f"cannot fetch PR #{number} from {url}: HTTP {resp.status_code}")
        return resp

    try:
        meta = get("application/vnd.github+json").json()
    except ValueError as exc:
        raise UpstreamError(f"cannot fetch PR #{number} from {url}: the answer is not JSON") from exc
    diff = get("application/vnd.github.v3.diff").text
    title = " ".join(str(meta.get("title") or f"PR {number}").split())
    page = str(meta.get("html_url") or f"https://github.com/{owner_repo}/pull/{number}")
    return Change(page, title, diff, number)


def from_file(path: Path, title: str | None = None) -> Change:
    try:
        diff = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UpstreamError(f"{path}: cannot read the diff: {exc}") from exc
    return Change(str(path), title or re.sub(r"^\d+-", "", path.stem).replace("-", " "), diff)


def keep_package(change: Change, package: str) -> tuple[str, list[str]]:
    """The diff of the files under ``package``, and the paths left out."""
    try:
        parsed = unidiff.PatchSet(change.diff)
    except unidiff.UnidiffParseError as exc:
        raise UpstreamError(f"{change.source}: malformed diff: {exc}") from exc
    kept: list[unidiff.PatchedFile] = []
    dropped: list[unidiff.PatchedFile] = []
    for pf in parsed:
        (kept if pf.path.startswith(package + "/") else dropped).append(pf)
    if not kept:
        raise UpstreamError(
            f"{change.source}: touches no file under {package}/ "
            f"({', '.join(pf.path for pf in dropped) or 'empty diff'}); nothing to hotfix"
        )
    return "".join(str(pf) for pf in kept), [pf.path for pf in dropped]


def slug(title: str) -> str:
    words = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")
    cut = words[:48]
    if len(words) > 48 and "-" in cut:
        cut = cut.rsplit("-", 1)[0]
    return cut or "fix"


def _header(change: Change, tag: str, version: str, dropped: list[str], where: str) -> str:
    title = change.title
    if title.startswith(("diff ", "--- ", "+++ ", "@@")):
        title = "Upstream: " + title
    lines = [title, ""]
    if change.number is not None:
        lines += [f"Upstream-PR: {change.source}", f"Title: {title}"]
    else:
        lines += [f"Source: {os.path.basename(change.source)}", f"Title: {title}"]
    if dropped:
        lines.append(f"Dropped-from-PR: {', '.join(dropped)} (outside the package)")
    lines += [
        f"Applies-to: vllm {version} (patch -p1 --forward, zero fuzz, checked against {where})",
        "Shipped-in: unknown; ask `python build.py check-upstream "
        f"--patches {tag} --base NEWTAG --from-wheel`",
    ]
    return "\n".join(lines) + "\n\n"


def _next_number(folder: Path, names: list[str]) -> int:
    numbers = [
        int(m.group(1))
        for n in [*names, *(p.name for p in folder.glob("*.patch"))]
        if (m := re.match(r"^(\d+)-", n))
    ]
    return max(numbers, default=0) + 1


def _definition_text(tag: str, version: str, repository: str, suffix: str,
                     pinned: dict[str, str] | None = None) -> str:
    """A new definition; ``pinned``: the base read (platform -> image ID), pinned so that a moved tag is refused."""
    pins = "".join(f'"{plat}" = "{digest}"\n' for plat, digest in sorted((pinned or {}).items()))
    return (
        f"# {repository}:{tag} with upstream fixes (patch set {tag}); made by new-patchset.\n\n"
        f'[base]\nrepository = "{repository}"\ntag = "{tag}"\n\n'
        + (f"# The base new-patchset read, by image ID: a base found with another is refused.\n"
           f"[base.digests]\n{pins}\n" if pins else "")
        + f'[package]\nname = "vllm"\nversion = "{version}"\n\n'
        f'[patches]\nset = "{tag}"\n\n'
        f'[output]\nsuffix = "{suffix}"\n'
    )


def create(
    root: Path,
    tag: str,
    change: Change,
    *,
    engine: Callable[[], Engine] | None = None,
    base_repo: str | None = None,
    pull: str = "missing",
    from_wheel: bool = False,
    suffix: str = "hotfix",
    progress: Callable[[str], None] | None = None,
) -> Created:
    say = progress or log.info
    defn_path = definitions.definition_path(root, tag)
    defn = definitions.load(root, tag) if defn_path.is_file() else None
    package = defn.package if defn else "vllm"
    set_name = defn.patch_set if defn else tag
    version = defn.package_version if defn else definitions.version_from_tag(tag)
    repository = base_repo or (defn.base_repository if defn else definitions.DEFAULT_REPOSITORY)
    set_dir = root / "patches" / set_name
    series = patchlib.series_path(root, set_name)
    existing = patchlib.load_series(root, set_name, package) if series.is_file() else []

    diff, dropped = keep_package(change, package)
    if dropped:
        say(f"    leaving out {len(dropped)} file(s) outside {package}/: {', '.join(dropped)}")
    number = _next_number(set_dir, [p.name for p in existing])
    name = f"{number:04d}-{slug(change.title)}.patch"

    # Validate the patch as the pipeline will (paths, package, no new files).
    files, _hunks = patchlib.validate(diff, name, package)
    rels = list(dict.fromkeys([*base.touched_files(existing), *files]))
    pinned: dict[str, str] = {}
    if from_wheel:
        whl = wheels.release(root, version, say)
        found, contents = sources.wheel_files(whl, package, rels)
        where = f"the {package} {version} wheel"
    else:
        if engine is None:
            raise UpstreamError("new-patchset needs a Docker engine unless --from-wheel")
        ref = f"{repository}:{tag}"
        eng = engine()
        info = resolve(eng, ref, pull, say)
        if defn is not None:
            defn.check_base(info.id, definitions.platform_text(info.os, info.architecture, info.variant), ref)
        pinned = {definitions.platform_text(info.os, info.architecture, info.variant): info.id}
        facts, contents = sources.image_files(eng, package, defn.python if defn else "python3", ref, info, rels,
                                              sources.cache_dir(root))
        found, where = facts.version, ref
    if found != version:
        raise BaseImageError(f"{where}: installed {package} is {found or 'unknown'}, not {version}")

    # The tree under tree/, the staged patch beside it (never inside what it patches).
    with sources.scratch_tree({f"tree/{rel}": data for rel, data in contents.items()}) as tmp:
        work = tmp / "tree"
        work.mkdir(exist_ok=True)
        text = _header(change, set_name, version, dropped, where) + diff
        staged = tmp / name
        staged.write_text(text, encoding="utf-8")
        patch = patchlib.load_patch(staged, package)
        missing = [rel for rel in patch.files if contents.get(rel) is None]
        if missing:
            raise PatchError(
                f"{name}: {where} has no regular file {', '.join(missing)}", patch=name, file=missing[0]
            )
        if existing:
            # Does the set already hold this change? Judge against the bare base first.
            if patchlib.classify(patch, work)[0] != patchlib.INCLUDED:
                # A base that carries the whole set so far is left as it is: the new patch is judged alone.
                patchlib.apply_series(existing, work, skip_included=True)
                if patchlib.classify(patch, work)[0] == patchlib.INCLUDED:
                    raise UpstreamError(
                        f"{change.source}: patch set {set_name} already holds this change; nothing added",
                        hint=f"see {series}",
                    )
        verdict, out = patchlib.classify(patch, work)
        if verdict == patchlib.INCLUDED:
            raise UpstreamError(
                f"{change.source}: {where} already carries this change; {tag} needs no patch for it",
                hint="check-upstream tells which release first ships a fix",
            )
        if verdict == patchlib.CONFLICTS:
            raise patchlib.explain_failure(patch, work, out)

    definition_text = None
    if defn is None:
        definition_text = _definition_text(tag, version, repository, suffix, pinned)
        definitions.parse(tomllib.loads(definition_text), defn_path, tag)
    return _write(root, set_dir, series, name, text, defn_path, definition_text, dropped, where)


def _write(
    root: Path,
    set_dir: Path,
    series: Path,
    name: str,
    text: str,
    defn_path: Path,
    definition_text: str | None,
    dropped: list[str],
    where: str,
) -> Created:
    """Write the patch, its series line and the definition; undo all on failure."""
    made_dirs = [d for d in (set_dir.parent, set_dir, defn_path.parent) if not d.exists()]
    old_series = series.read_text(encoding="utf-8") if series.is_file() else None
    written: list[Path] = []
    try:
        for d in made_dirs:
            d.mkdir(parents=True, exist_ok=True)
        patch_path = set_dir / name
        with patch_path.open("x", encoding="utf-8") as fh:
            written.append(patch_path)
            fh.write(text)
        # Whole or not at all (write_atomic): a series cut short by a full disk or a kill would name half a patch.
        if old_series is None:
            head = f"# Patch set {set_dir.name}, applied in order with patch -p1 --forward --fuzz=0.\n"
            write_atomic(series, head + name + "\n")
            written.append(series)
        else:
            sep = "" if old_series.endswith("\n") or not old_series else "\n"
            write_atomic(series, old_series + sep + name + "\n")
        if definition_text is not None:
            with defn_path.open("x", encoding="utf-8") as fh:
                written.append(defn_path)
                fh.write(definition_text)
    except BaseException as exc:
        for path in written:
            path.unlink(missing_ok=True)
        if old_series is not None:
            write_atomic(series, old_series)
        for d in reversed(made_dirs):
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()
        if isinstance(exc, OSError):
            raise UpstreamError(f"cannot write the patch set under {root}: {exc}") from exc
        raise
    return Created(patch_path, series, defn_path if definition_text is not None else None, dropped, where)
