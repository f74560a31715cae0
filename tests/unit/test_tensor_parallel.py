"""A tensor-parallel server's smoke, without a GPU: its command lines, its container's /dev/shm, its reference.

What can be settled on CPUs alone: `--serve-arg --tensor-parallel-size N`
reaches the server's argv, the runner's container gets the shared memory NCCL
needs between N GPUs (docker's shm_size, podman's --shm-size), and a
reference recorded at another tensor-parallel size is refused before
anything runs. The runs on two and four GPUs are the GPU script's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_hotfix.checking.launchers import plan
from vllm_hotfix.checking.launchers.options import SmokeOptions
from vllm_hotfix.checking.launchers.podman import PodmanLauncher
from vllm_hotfix.engine.containers import extras
from vllm_hotfix.errors import UsageError
from vllm_hotfix.trust import reference_fit

IMAGE_ID = "sha256:" + "ab" * 32
TARGET = plan.Target("ops/vllm:fix", IMAGE_ID, IMAGE_ID, {})


@pytest.mark.parametrize("args, size", [
    ((), 1), (("--tensor-parallel-size", "2"), 2), (("--tensor-parallel-size=4",), 4), (("-tp", "2"), 2),
    (("--max-model-len", "4096"), 1),
])
def test_the_tensor_parallel_size_is_read_from_the_servers_arguments(args: tuple[str, ...], size: int) -> None:
    assert plan.tensor_parallel(args) == size


def test_a_size_that_is_no_number_is_one_line() -> None:
    with pytest.raises(UsageError, match="--tensor-parallel-size takes a whole number"):
        plan.tensor_parallel(["--tensor-parallel-size", "two"])


def test_a_tensor_parallel_server_gets_its_shared_memory_in_every_launcher(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    for args, shm in (((), None), (("--tensor-parallel-size", "2"), plan.TP_SHM)):
        options = SmokeOptions(gpu="off", serve_model=tmp_path / "model", serve_args=args)
        job, _ = plan.job(tmp_path, TARGET, options, launcher="docker", gpu_request=None)
        assert job["serve"]["argv"][:2] == ["vllm", "serve"] and all(a in job["serve"]["argv"] for a in args)
        assert plan.shm_size(job) == shm
        # The runner runs the patch set's GPU checks on each of the server's GPUs (tests/unit/test_runner.py).
        assert job["gpu"]["tensor_parallel"] == (2 if args else 1)
        # docker: the container's create arguments; podman: its command line.
        assert extras(None, shm_size=plan.shm_size(job)).get("shm_size") == shm
        line = PodmanLauncher(podman="podman").run_argv("img", tmp_path, None, None, "n", plan.shm_size(job))
        assert (["--shm-size", plan.TP_SHM] == line[line.index("--shm-size"):line.index("--shm-size") + 2]) \
            if shm else "--shm-size" not in line


def test_a_reference_recorded_at_another_tensor_parallel_size_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    one = plan.serve_settings(SmokeOptions(serve_model=tmp_path / "model"), TARGET)
    two = plan.serve_settings(SmokeOptions(serve_model=tmp_path / "model",
                                           serve_args=("--tensor-parallel-size", "2")), TARGET)
    difference = reference_fit.settings_difference(one, two)
    assert "serve_args" in difference and "'--tensor-parallel-size', '2'" in difference
