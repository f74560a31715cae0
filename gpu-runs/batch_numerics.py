"""Where a sequence's numbers start to depend on how many others share its step: measured module by module.

    python3 batch_numerics.py MODEL_DIR OUT.json [--sizes 1,2,3,4,5,6,7,8,16] [--prompt-tokens 200]

Run inside the GPU base image (vLLM installed, a GPU given), with the
settings the fixed-batch probe and the served smoke use
(``VLLM_BATCH_INVARIANT=1``, no prefix caching, eager mode, the engine core
in this process). For each batch size ``n`` it adds ``n`` requests of
``--prompt-tokens`` tokens each (request 0 the same in every size; the others
other token sequences of the same length) and runs two engine steps: one
prefill of all ``n`` together, then one decode step of all ``n``. A forward
hook on every module of vLLM's model keeps each module's output of both
steps. Request 0's rows (its prefill rows, then its decode row) are compared,
bitwise, with the same rows at size 1, module by module in the order the
modules ran: the first module whose rows differ while every module before it
agreed is where the step's size enters the numbers.

The result (``OUT.json``) names, per size and step, that module, its class,
the largest absolute difference there and how many modules differ in all; a
module whose output does not have one row per token of the step is not
compared (its rows cannot be told apart) and is counted as such. It measures
only; nothing in the tool reads it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any


def first_divergence(base: list[tuple[str, str, Any]], other: list[tuple[str, str, Any]],
                     rows_base: slice, rows_other: slice, tokens_base: int, tokens_other: int) -> dict[str, Any]:
    """Request 0's rows of every module output, at size 1 (``base``) against another size (``other``).

    Each capture is ``(module name, class name, tensor)`` in the order the modules ran; a tensor's first
    dimension must be the step's token count (``tokens_*``) for its rows to be compared.
    """
    result: dict[str, Any] = {"compared": 0, "not_row_aligned": 0, "differ": 0, "first": None,
                              "calls": [len(base), len(other)]}
    if [n for n, _, _ in base] != [n for n, _, _ in other]:
        result["error"] = "the modules ran in another order at this size"
        return result
    for (name, cls, a), (_, _, b) in zip(base, other, strict=True):
        if a.dim() == 0 or a.shape[0] != tokens_base or b.shape[0] != tokens_other or a.shape[1:] != b.shape[1:]:
            result["not_row_aligned"] += 1
            continue
        ra, rb = a[rows_base], b[rows_other]
        result["compared"] += 1
        same = bool(ra.shape == rb.shape and (ra.view(-1).eq(rb.view(-1)) | (ra.isnan() & rb.isnan()).view(-1)).all())
        if same:
            continue
        result["differ"] += 1
        if result["first"] is None:
            diff = (ra.float() - rb.float()).abs()
            result["first"] = {"module": name, "class": cls, "max_abs_diff": float(diff.max()),
                               "rows_differing": int((diff.reshape(diff.shape[0], -1).amax(dim=1) > 0).sum()),
                               "rows": int(ra.shape[0])}
    return result


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--sizes", default="1,2,3,4,5,6,7,8,16")
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--kv-bytes", type=int, default=4 << 30)
    args = ap.parse_args(argv)
    sizes = sorted({int(s) for s in args.sizes.split(",")} | {1})
    os.environ.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_BATCH_INVARIANT": "1",
                       "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION": "1"})
    start = time.monotonic()
    import torch
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    engine_args = EngineArgs(model=args.model, enforce_eager=True, max_model_len=8192,
                             enable_prefix_caching=False, gpu_memory_utilization=0.3,
                             kv_cache_memory_bytes=args.kv_bytes, max_num_seqs=max(sizes),
                             max_num_batched_tokens=max(8192, max(sizes) * args.prompt_tokens),
                             async_scheduling=False, disable_log_stats=True)
    engine = LLMEngine.from_engine_args(engine_args)
    ready = time.monotonic() - start
    capture: dict[str, Any] = {"on": False, "calls": []}

    def install(worker: Any) -> int:
        model = worker.model_runner.model

        def hook_for(name: str) -> Any:
            def hook(module: Any, inputs: Any, output: Any) -> None:
                if not capture["on"]:
                    return
                t = output[0] if isinstance(output, (tuple, list)) and output else output
                if isinstance(t, torch.Tensor):
                    capture["calls"].append((name, type(module).__name__, t.detach().float().cpu().clone()))
            return hook

        count = 0
        for name, module in model.named_modules():
            module.register_forward_hook(hook_for(name or "<model>"))
            count += 1
        return count

    hooked = engine.collective_rpc(install)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    gen = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(3, 256, (args.prompt_tokens,), generator=gen).tolist() for _ in range(max(sizes))]
    steps: dict[int, list[list[tuple[str, str, Any]]]] = {}
    for n in sizes:
        for i in range(n):
            engine.add_request(f"n{n}-{i}", {"prompt_token_ids": prompts[i]}, params)
        got: list[list[tuple[str, str, Any]]] = []
        while engine.has_unfinished_requests():
            capture["on"], capture["calls"] = len(got) < 2, []
            engine.step()
            if capture["on"]:
                got.append(capture["calls"])
        capture["on"] = False
        steps[n] = got
    base = steps[1]
    L = args.prompt_tokens
    results = []
    for n in sizes:
        if n == 1:
            continue
        row: dict[str, Any] = {"size": n}
        if len(steps[n]) < 2 or len(base) < 2:
            row["error"] = f"{len(steps[n])} steps captured (a prefill of all, then a decode of all, expected)"
        else:
            row["prefill"] = first_divergence(base[0], steps[n][0], slice(0, L), slice(0, L), L, n * L)
            row["decode"] = first_divergence(base[1], steps[n][1], slice(0, 1), slice(0, 1), 1, n)
        results.append(row)
        print(json.dumps(row), flush=True)
    doc = {"model": args.model, "sizes": sizes, "prompt_tokens": L, "modules_hooked": hooked,
           "engine_ready_seconds": round(ready, 1), "seconds": round(time.monotonic() - start, 1),
           "vllm_batch_invariant": os.environ.get("VLLM_BATCH_INVARIANT"), "gpu": torch.cuda.get_device_name(0),
           "torch": torch.__version__, "results": results}
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
