"""Pin files (patches/<set>/pins.txt), pip check judging and wheel tags."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import REPO
from vllm_hotfix.building import definitions, pinfile, pins, wheels
from vllm_hotfix.engine import Engine
from vllm_hotfix.errors import DefinitionError, PinError

SM100 = "v0.25.1-sm100"
QUACK_HASH = "e77c5d1f1299b0b38487fe8737df6c6975daa16bca7f7eb883bd1a74d09e7e78"


def test_example_pin_file_loads_in_order_with_its_accepted_conflict() -> None:
    pinset = pins.load(REPO, SM100, "vllm")
    assert pinset is not None
    assert pinset.names[-2:] == ["nvidia-cutlass-dsl", "quack-kernels"]
    quack = pinset.pins[-1]
    assert (quack.version, quack.hashes) == ("0.6.4", (QUACK_HASH,))
    assert [(a.requirer, a.requirement) for a in pinset.accepts] == [("vllm", "nvidia-cutlass-dsl")]
    assert pins.load(REPO, "v0.25.1", "vllm") is None  # the default set pins nothing


@pytest.mark.parametrize("text, needle", [
    ("quack-kernels>=0.6.4 --hash=sha256:" + "a" * 64 + "\n", "line 1: 'quack-kernels>=0.6.4' is not NAME==VERSION"),
    ("quack-kernels==0.6.4\n", "line 1: quack-kernels==0.6.4 has no --hash"),
    ("quack-kernels==0.6.4 --hash=md5:abc\n", "unexpected '--hash=md5:abc'"),
    ("a==1 --hash=sha256:" + "a" * 64 + "\nA==2 --hash=sha256:" + "b" * 64 + "\n", "line 2: A is pinned twice"),
    ("# accept: vllm nvidia\na==1 --hash=sha256:" + "a" * 64 + "\n", "line 1: malformed accept comment"),
    ("# only a comment\n", "pins nothing"),
    ("a==1 --hash=sha256:" + "a" * 64 + "\r\n", "CR line endings"),
])
def test_bad_pin_files_name_the_line(tmp_path: Path, text: str, needle: str) -> None:
    with pytest.raises(PinError) as err:
        pinfile.parse(text, tmp_path / "pins.txt")
    assert needle in str(err.value) and str(tmp_path / "pins.txt") in str(err.value)
    assert "\n" not in str(err.value)


def test_pinning_the_patched_package_itself_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "patches" / "x"
    folder.mkdir(parents=True)
    (folder / "pins.txt").write_text("vllm==0.27.0 --hash=sha256:" + "a" * 64 + "\n")
    with pytest.raises(PinError, match="pins vllm itself"):
        pins.load(tmp_path, "x", "vllm")


def test_pip_check_complaints_old_new_and_accepted() -> None:
    before = [pins.parse_complaint(x) for x in (
        "vllm 0.25.1 requires torch, which is not installed.",
        "quack-kernels 0.6.5 has requirement nvidia-cutlass-dsl>=4.7, but you have nvidia-cutlass-dsl 4.5.2.",
    )]
    after = [pins.parse_complaint(x) for x in (
        "vllm 0.25.1 requires torch, which is not installed.",
        "quack-kernels 0.6.4 requires torch, which is not installed.",  # torch was missing already
        "vllm 0.25.1 has requirement nvidia-cutlass-dsl[cu13]==4.5.2, but you have nvidia-cutlass-dsl 4.6.2.",
        "quack-kernels 0.6.4 has requirement nvidia-cutlass-dsl==4.6.2, but you have nvidia-cutlass-dsl 4.5.2.",
        "foo 1.0 requires bar, which is not installed.",
    )]
    accepts = [pinfile.Accept("vllm", "nvidia-cutlass-dsl", "deliberate", 9)]
    out = pins.judge_complaints(before, after, accepts)
    assert len(out.base_only) == 2
    assert [c for c, _ in out.accepted] == [after[2].line]
    # A requirement stated anew is a new complaint, even if the same pair was unhappy before.
    assert list(out.added) == [after[3].line, after[4].line]


def test_wheel_tags_decide_what_fits() -> None:
    tags = ["cp311-cp311-manylinux_2_36_x86_64", "cp311-abi3-manylinux_2_28_x86_64",
            "py3-none-manylinux_2_17_x86_64", "py3-none-any"]
    parsed = wheels.parse("nvidia_cuda_nvdisasm-13.3.73-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl")
    assert parsed is not None
    name, version, found = parsed
    assert (name, str(version)) == ("nvidia-cuda-nvdisasm", "13.3.73") and "py3-none-manylinux_2_17_x86_64" in found
    assert wheels.matches("Nvidia.CUDA_nvdisasm-13.3.73.0-py3-none-any.whl", "nvidia-cuda-nvdisasm", "13.3.73")
    assert wheels.parse("not-a-wheel.tar.gz") is None and wheels.parse("x-notaversion-py3-none-any.whl") is None
    paths = [Path("x-1-cp312-cp312-manylinux_2_28_x86_64.whl"), Path("x-1-cp311-cp311-manylinux_2_28_aarch64.whl")]
    assert wheels.best_fit(paths, tags) is None
    assert wheels.best_fit([*paths, Path("x-1-py3-none-any.whl")], tags) == Path("x-1-py3-none-any.whl")
    assert wheels.best_fit([Path("x-1-py3-none-any.whl"), Path("x-1-cp311-abi3-manylinux_2_28_x86_64.whl")],
                           tags) == Path("x-1-cp311-abi3-manylinux_2_28_x86_64.whl")
    target = wheels.Target.of_tags("3.11", "cpython", tags)
    assert target.pip_args() == ["--python-version", "3.11", "--implementation", "cp", "--abi", "abi3",
                                 "--abi", "cp311", "--abi", "none", "--platform", "any",
                                 "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux_2_28_x86_64",
                                 "--platform", "manylinux_2_36_x86_64"]


def test_a_builder_that_cannot_run_pip_refuses_pins() -> None:
    pinset = pins.load(REPO, SM100, "vllm")
    pins.check_builder(pinset, "dockerfile")
    pins.check_builder(None, "assemble")
    with pytest.raises(PinError) as err:
        pins.check_builder(pinset, "assemble")
    assert "--builder assemble cannot" in str(err.value) and "pins.txt" in str(err.value)


def test_release_requirements_judge_each_pin() -> None:
    pinset = pinfile.parse("quack-kernels==0.6.4 --hash=sha256:" + "a" * 64 + "\n"
                        "nvidia-cutlass-dsl==4.6.0 --hash=sha256:" + "b" * 64 + "\n"
                        "einops==0.8.1 --hash=sha256:" + "c" * 64 + "\n"
                        "nvidia-cuda-nvdisasm==13.3.73 --hash=sha256:" + "d" * 64 + "\n", Path("pins.txt"))
    got = {j["pin"].split("==")[0]: j["verdict"] for j in pins.judge_release(pinset, [
        "quack-kernels==0.6.1", "nvidia-cutlass-dsl[cu13]==4.6.0", "einops>=0.8", "torch==2.13.0",
        'pytest; extra == "dev"'], "vllm 0.27.0")}
    assert got == {"quack-kernels": "contradicts", "nvidia-cutlass-dsl": "included", "einops": "allowed",
                   "nvidia-cuda-nvdisasm": "unconstrained"}


def test_pins_need_an_engine_on_this_machine() -> None:
    def engine_at(url: str) -> Engine:
        return Engine(base_url=url)

    assert engine_at("unix:///var/run/docker.sock").local
    assert engine_at("tcp://127.0.0.1:2375").local
    assert not engine_at("tcp://10.1.2.3:2376").local
    assert not engine_at("ssh://builder@10.1.2.3").local


def test_a_variant_file_must_be_named_for_its_base_and_variant(tmp_path: Path) -> None:
    text = (REPO / "images" / f"{SM100}.toml").read_text()
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "v0.25.1-blackwell.toml").write_text(text)
    with pytest.raises(DefinitionError, match="must be images/v0.25.1-sm100.toml"):
        definitions.load(tmp_path, "v0.25.1-blackwell")
    defn = definitions.load(REPO, SM100)
    assert (defn.base_tag, defn.variant, defn.patch_set) == ("v0.25.1", "sm100", SM100)
    assert defn.output_ref() == "vllm/vllm-openai:v0.25.1-m3patch-sm100"


def test_a_wheelhouses_wheel_is_kept_in_the_pin_cache_for_the_smoke(tmp_path: Path) -> None:
    """The smoke judges the pip layer against the pinned wheels in the pin cache, by hash: a build from
    --wheelhouse keeps its wheels there too (written whole, never half), and a kept copy is not written again."""
    import hashlib

    house, cache = tmp_path / "house", tmp_path / "cache" / "pin-wheels"
    house.mkdir()
    wheel = house / "quack_kernels-0.6.4-py3-none-any.whl"
    wheel.write_bytes(b"PK a wheel's bytes")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    pin = pinfile.Pin("quack-kernels", "0.6.4", (digest,), 1, "quack-kernels")
    pinset = pinfile.PinSet(tmp_path / "pins.txt", "x", (pin,), (), "0" * 64)
    state = pins.ImageState("3.11", "cp", "24.0", ("py3-none-any",), {})
    [chosen] = pins.find_wheels(pinset, state, house, cache, lambda _l: None)
    assert chosen.path == wheel and chosen.sha256 == digest
    kept = cache / wheel.name
    assert kept.read_bytes() == wheel.read_bytes() and not list(cache.glob(".*.part"))
    before = kept.stat().st_mtime_ns
    pins.find_wheels(pinset, state, house, cache, lambda _l: None)
    assert kept.stat().st_mtime_ns == before
