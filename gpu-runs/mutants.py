"""Backports of #49149 onto v0.25.1 other than the real one, kept apart from the real patch sets: broken ones
(mutants) the GPU smoke must fail, correct ones written another way (variants) it must pass.

    python3 gpu-runs/mutants.py list
    python3 gpu-runs/mutants.py root NAME DEST
    python3 gpu-runs/mutants.py check VLLM_SRC

Each ``gpu-runs/mutants/NAME.patch`` replaces the real patch of
``patches/v0.25.1`` with a slip a person could make (its header says which,
what it breaks in the kernels, and at which batch composition it should
show). Each ``gpu-runs/variants/NAME.patch`` replaces it with a correct
backport written differently (its header says how, and why it is still
right). They are never definitions of the project: ``image`` offers only
``images/``. ``root`` writes a project root of its own under DEST (the real
``images/v0.25.1.toml``, the real series and checks, the mutant in the
patch's place), so ``build.py --root DEST image --definition v0.25.1`` builds it
exactly as the patched image is built and ``smoke --root DEST`` judges it by
that patch set (the files landed as the mutant made them, so only the GPU
checks, the exact judge and the sweep can fail it); the same for a variant.
``check`` applies every mutant and variant to a copy of vLLM 0.25.1's sources
with the tool's own patch step and refuses one that does not apply, lacks a
header field, leaves the files as the real patch does, or as another does.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MUTANTS = HERE / "mutants"
VARIANTS = HERE / "variants"
TAG = "v0.25.1"
FIELDS = ("Mutant", "Slip", "Breaks", "Shows", "Expected-first-level")
VARIANT_FIELDS = ("Variant", "Differs", "Why-correct", "Expected")


def names() -> list[str]:
    return sorted(p.stem for p in MUTANTS.glob("*.patch"))


def variant_names() -> list[str]:
    return sorted(p.stem for p in VARIANTS.glob("*.patch"))


def patch_file(name: str) -> Path:
    """The mutant's or variant's patch (one name space: ``check`` refuses a name in both folders)."""
    for folder in (MUTANTS, VARIANTS):
        if (folder / f"{name}.patch").is_file():
            return folder / f"{name}.patch"
    raise SystemExit(f"no mutant or variant {name!r} (mutants: {', '.join(names())}; "
                     f"variants: {', '.join(variant_names())})")


def header(name: str) -> dict[str, str]:
    """The mutant's or variant's header fields (text before its first ``---`` line), continuation lines joined."""
    path = patch_file(name)
    wanted = VARIANT_FIELDS if path.parent == VARIANTS else FIELDS
    fields: dict[str, str] = {}
    key = None
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("--- "):
            break
        head, sep, rest = line.partition(":")
        if sep and head in wanted:
            key = head
            fields[key] = rest.strip()
        elif key and line.startswith("  "):
            fields[key] += " " + line.strip()
    return fields


def root(name: str, dest: Path, source: Path = REPO) -> Path:
    """A project root under ``dest`` whose v0.25.1 patch set is the real one with mutant or variant ``name`` in
    its patch's place; the folder is made anew."""
    patch = patch_file(name)
    if dest.exists():
        shutil.rmtree(dest)
    (dest / "images").mkdir(parents=True)
    shutil.copy2(source / "images" / f"{TAG}.toml", dest / "images" / f"{TAG}.toml")
    real = source / "patches" / TAG
    shutil.copytree(real, dest / "patches" / TAG, ignore=shutil.ignore_patterns("*.patch", "__pycache__"))
    listed = [ln.strip() for ln in (real / "series").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    if len(listed) != 1:
        raise SystemExit(f"{real}/series names {len(listed)} patches; a mutant or variant replaces the one patch "
                         "of the set")
    shutil.copy2(patch, dest / "patches" / TAG / listed[0])
    return dest


def applied(project: Path, src: Path, work: Path) -> dict[str, bytes]:
    """The files the tool's patch step makes of ``src`` with ``project``'s v0.25.1 patch set."""
    sys.path.insert(0, str(REPO))
    from vllm_hotfix.building import definitions, patches

    defn = definitions.load(project, TAG)
    series = patches.load_series(project, defn.patch_set, defn.package)
    files = sorted({f for p in series for f in p.files})
    tree = work / "tree"
    if tree.exists():
        shutil.rmtree(tree)
    for f in files:
        (tree / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / f, tree / f)
    patches.apply_series(series, tree)
    leftovers = sorted(str(p.relative_to(tree)) for p in tree.rglob("*") if p.suffix in (".rej", ".orig"))
    if leftovers:
        raise SystemExit(f"{project}: the patch step left {', '.join(leftovers)}")
    return {f: (tree / f).read_bytes() for f in files}


def check(src: Path) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        real = applied(REPO, src, work)
        seen: dict[tuple[bytes, ...], str] = {tuple(real.values()): "the real patch"}
        both = sorted(set(names()) & set(variant_names()))
        if both:
            print(f"{', '.join(both)}: named both a mutant and a variant", file=sys.stderr)
            return 1
        for kind, listed, wanted in (("mutant", names(), FIELDS), ("variant", variant_names(), VARIANT_FIELDS)):
            for name in listed:
                fields = header(name)
                missing = [k for k in wanted if not fields.get(k)]
                if missing:
                    print(f"{name}: its header lacks {', '.join(missing)}", file=sys.stderr)
                    return 1
                got = applied(root(name, work / "root"), src, work)
                key = tuple(got.get(f, b"") for f in real)
                if key in seen:
                    print(f"{name}: leaves the files as {seen[key]} does", file=sys.stderr)
                    return 1
                seen[key] = name
                said = (f"first level expected {fields['Expected-first-level']}" if kind == "mutant"
                        else "correct, expected to pass")
                print(f"{kind} {name}: applies; {said}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list")
    r = sub.add_parser("root")
    r.add_argument("name")
    r.add_argument("dest", type=Path)
    c = sub.add_parser("check")
    c.add_argument("src", type=Path, help="the parent of vLLM 0.25.1's vllm/ package")
    args = ap.parse_args(argv)
    if args.cmd == "list":
        for name in names():
            print(f"mutant {name}")
        for name in variant_names():
            print(f"variant {name}")
        return 0
    if args.cmd == "root":
        print(root(args.name, args.dest))
        return 0
    return check(args.src)


if __name__ == "__main__":
    sys.exit(main())
