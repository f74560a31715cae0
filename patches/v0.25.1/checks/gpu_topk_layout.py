"""GPU regression check for upstream vLLM PR #49149: what the image's INSTALLED attention computes.

The bug (vLLM 0.25.1): ``vllm/models/minimax_m3/nvidia/model.py`` allocates the
shared ``topk_indices_buffer`` token-major ``[T, H, K]`` (int32; T padded to a
multiple of 4), but the Triton indexer (``common/indexer.py``) hands it as
``out=`` to the index top-k kernels, which address it head-major ``[H, T, K]``,
and the Triton sparse attention (``common/sparse_attention.py``) reads it back
head-major too. With two or more sequences in a batch, or one prefill long
enough to span several rows, the kernels address rows they do not own: wrong
blocks are attended to, or the engine dies with an illegal memory access. The
fix transposes at both boundaries.

The check judges behaviour, not code shape: how the installed code hands the
buffer to the kernels (a view, a permute, a copy) is its own business; what
counts is whether the attention attends to the blocks a right top-k selects.

* It imports the installed ``vllm.models.minimax_m3.common.indexer`` and
  ``...sparse_attention``, allocates the buffer as ``nvidia/model.py`` does
  (filled with a sentinel, -2, so that a read of a slot nobody wrote hands the
  attention a block id no block table has), builds ``MiniMaxM3Indexer`` and the
  sparse-attention impl ``select_main_impl_cls`` picks, with the per-layer
  metadata vLLM's builders would produce for the batch, in a vLLM forward
  context, and calls ``indexer(index_query)`` then
  ``impl.forward(layer, query, kv_cache, output)``: vLLM's Triton kernels on
  the GPU, through the installed code, exactly as a model step does.
* The reference is computed without vLLM's kernels or its buffer, in float64
  torch from M3's definition: each block's index score (the max over the
  block's keys the token sees of index query . index key), the top-k (forced
  init and local blocks, then the best scores), and dense causal attention of
  every query head over the keys of the blocks its KV head chose.
* Per token, the relative error of the installed code's output against the
  reference (over all heads) must be at most REL_TOL. The same kernels fed the
  reference's blocks directly measure their own rounding against it (the
  floor, which must be under REL_TOL too, or nothing is concluded). A token
  whose right top-k has a near-tie (two scores within TIE_EPS) is left out:
  either choice is right there.

Scenarios (MiniMax-M3 sizes: 4 index heads of dim 128, 16 top-k blocks of 128
tokens, init 0, local 1, 64 query heads over 4 KV heads of dim 128), each a
batch of decodes followed by prefills (one with prior context): ``tp1`` (5
decodes), ``tp1-nd3`` (3 decodes) and ``tp4`` (1 index head, as at tensor
parallel 4 or 8). Each scenario runs in its own subprocess (the three side by
side), so an illegal memory access is captured there and cannot poison the
next one. ``--shapes small`` runs the same compositions cut down, and
``--device cpu`` runs the kernels in Triton's interpreter on CPU tensors
(float32): the check's own test without a GPU.

Each scenario reports its numbers (tokens, judged, tied, off, the largest
error, the floor, the first token off); its outcome is derived from those
numbers alone (:func:`scenario_ok`, :func:`outcome`), never from the worker's
word, so whoever reads the output can judge it again.

The path: this check drives the Triton indexer and the Triton sparse
attention, the path vLLM 0.25.1 takes everywhere but on Blackwell. On a CUDA
device of compute capability 10.x (SM100 family) with 4, 8, 16 or 32 top-k
blocks, vLLM's own selectors (``select_indexer_impl_cls`` in
``common/indexer.py``, ``select_main_impl_cls`` in ``common/sparse_attention.py``)
pick the MSA impls (``nvidia/indexer_msa.py``, ``nvidia/sparse_attention_msa.py``),
whose indexer asserts its own metadata type. Each scenario worker asks the
installed selectors which impls they pick on the GPU in use (the rule they
follow, :func:`path_for`, is kept beside the answer); when it is not the
Triton path, nothing runs and the check is ``skip`` with ``"ran_against":
"not-applicable"`` and the detail "not applicable on this GPU family", which
the smoke run never counts towards GPU-verified.

One check is printed, ``topk-layout``: ``pass`` when every scenario's
attention is right; ``fail`` with the tokens off, or the fault (illegal memory
access) and the stage that raised it. A scenario that times out, or whose
comparison cannot conclude, is neither a pass nor a caught bug: the check
fails as inconclusive. Without torch, CUDA or Triton it is ``skip``.

Stubs, only for what cannot load without vLLM's compiled extension, each
named in the output, and only when the real import fails. The check says
what it ran against: ``"ran_against": "vllm"`` when nothing stood in,
``"stub"`` otherwise, with ``stubs`` naming each stand-in and
``import_errors`` each real import that failed (module -> error). Its
``status`` is what the kernels did; whether that is evidence about the image
is for the reader to judge (the smoke run refuses a stub as GPU evidence):

1. ``vllm._C_stable_libtorch``: an empty module. ``vllm/platforms/cuda.py``
   imports this compiled op library at module level; the Triton kernels here
   use none of its ops.
2. ``vllm.models.minimax_m3``: a package shell whose ``__path__`` is the real
   folder, so its real submodules load, but whose ``__init__`` (the whole
   model: layers, MoE, quantization, fused ops needing ``vllm._C``) is not run.
3. ``vllm.config.VllmConfig``: where a full config cannot be built, a
   namespace holding only the real ``CompilationConfig`` the layers read.

Usage: ``python3 gpu_topk_layout.py [--vllm-src DIR] [--timeout S] [--log FILE]
[--shapes model|small] [--device cuda|cpu]`` (``--vllm-src``: a folder holding
the wheel's ``vllm/`` sources and its dist-info, put first on ``sys.path``, for
a host without vLLM installed; ``--timeout``: seconds per scenario
subprocess, default 300; ``--log``: append each scenario's raw record to a
JSONL file as it finishes). One file serves both v0.25.1 patch sets
(``patches/v0.25.1-sm100/checks/`` links to it). Stdlib only at top level;
Python 3.9+.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
import types
from typing import Any

SENTINEL = -2
PR = "vllm-project/vllm#49149"
PREFIX = "model.layers.0.self_attn"

# name -> scenario. Lengths are in tokens; a decode request has one query
# token (decode_query_len == 1); a prefill request is (context_len, query_len).
SCENARIOS: dict[str, dict[str, Any]] = {
    "tp1": {
        "index_heads": 4,
        "index_dim": 128,
        "topk": 16,
        "init_blocks": 0,
        "local_blocks": 1,
        "gqa": 16,
        "head_dim": 128,
        "decode_seq_lens": [2500, 900, 4100, 130, 3000],
        "prefill": [[1000, 300], [0, 520], [2200, 64]],
        "max_num_batched_tokens": 1024,
    },
    "tp1-nd3": {
        "index_heads": 4,
        "index_dim": 128,
        "topk": 16,
        "init_blocks": 0,
        "local_blocks": 1,
        "gqa": 16,
        "head_dim": 128,
        "decode_seq_lens": [2500, 900, 4100],
        "prefill": [[1000, 300], [0, 520], [2200, 64]],
        "max_num_batched_tokens": 1024,
    },
    "tp4": {
        "index_heads": 1,
        "index_dim": 128,
        "topk": 16,
        "init_blocks": 0,
        "local_blocks": 1,
        "gqa": 16,
        "head_dim": 128,
        "decode_seq_lens": [2500, 900, 4100],
        "prefill": [[1000, 300], [0, 520]],
        "max_num_batched_tokens": 1024,
    },
}

# The same three batch compositions, small enough for Triton's interpreter on a CPU (TRITON_INTERPRET=1, a few
# minutes each): 4 index heads (the layout's collisions need more than one), 4 top-k blocks so that a selection
# still leaves blocks out, head dims of 16 (the kernels' smallest tile), float32 (the interpreter computes bfloat16
# wrong: measured, outputs of 1e8 where the reference gives 0.1; in float32 they agree).
SMALL = {"index_dim": 16, "topk": 4, "gqa": 1, "head_dim": 16, "max_num_batched_tokens": 128, "dtype": "float32"}
SMALL_SCENARIOS: dict[str, dict[str, Any]] = {
    "tp1": {**SCENARIOS["tp1"], **SMALL, "decode_seq_lens": [700, 300, 1000, 130, 600],
            "prefill": [[300, 24], [0, 20], [520, 8]]},
    "tp1-nd3": {**SCENARIOS["tp1-nd3"], **SMALL, "decode_seq_lens": [700, 300, 1000],
                "prefill": [[300, 24], [0, 20], [520, 8]]},
    "tp4": {**SCENARIOS["tp4"], **SMALL, "decode_seq_lens": [700, 300, 1000], "prefill": [[300, 24], [0, 20]]},
}


def scenarios(shapes: str) -> dict[str, dict[str, Any]]:
    """``model`` (MiniMax-M3's sizes, the GPU's) or ``small`` (the interpreter's)."""
    return SMALL_SCENARIOS if shapes == "small" else SCENARIOS


BLOCK = 128  # sparse block size == KV page size
# vLLM 0.25.1 takes the MSA path for these top-k block counts on SM100 (its selectors' rule).
MSA_TOPK_BLOCKS = (4, 8, 16, 32)
MSA_INDEXER_DTYPES = ("bf16", "fp8", "fp8_e4m3")
NOT_APPLICABLE = "not-applicable"
# A token's attention is right when it is within REL_TOL (relative, over its heads) of the reference. Measured on
# a CPU at the tp1 scenario's shapes: one block of sixteen chosen wrong in one KV head moves a token by 0.11 or more
# (median 0.14); the reference rounded to bfloat16, as the kernels keep their outputs, by at most 0.0017. What the
# kernels' own rounding is on the GPU each run measures (floor_max_rel_err) and requires below REL_TOL.
REL_TOL = 2e-2
# Two block scores closer than this (index scores are q.k of bf16 values, about 30 in size here) may come out in
# either order from another summation: such a token has two right selections and is not judged.
TIE_EPS = 1e-3
# A scenario judges at least this share of its tokens, or it is inconclusive.
MIN_JUDGED = 0.9


# ---------------------------------------------------------------------------
# vLLM import: the installed code, stubbing only what cannot load
# ---------------------------------------------------------------------------
def load_vllm(vllm_src: str | None, info: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(indexer module, sparse_attention module, sparse attention kernels module); fills ``info`` as it goes.

    ``info["stubs"]`` names each stand-in, ``info["import_errors"]`` each real
    import that failed, so that a failure part-way still says what stood in.
    """
    import importlib

    info.setdefault("stubs", [])
    info.setdefault("import_errors", {})
    if vllm_src:
        src = os.path.abspath(vllm_src)
        if src not in sys.path:
            sys.path.insert(0, src)
        info["vllm_src"] = src
    try:
        importlib.import_module("vllm._C_stable_libtorch")
    except ImportError as e:
        sys.modules["vllm._C_stable_libtorch"] = types.ModuleType("vllm._C_stable_libtorch")
        info["stubs"].append(f"vllm._C_stable_libtorch: empty module (real import failed: {str(e)[:160]})")
        info["import_errors"]["vllm._C_stable_libtorch"] = f"{type(e).__name__}: {str(e)[:400]}"
    try:
        importlib.import_module("vllm.models.minimax_m3")
    except Exception as e:  # noqa: BLE001  (the model package needs vLLM's compiled extensions)
        info["import_errors"]["vllm.models.minimax_m3"] = f"{type(e).__name__}: {str(e)[:400]}"
        import vllm.models

        pkg_dir = os.path.join(os.path.dirname(vllm.models.__file__), "minimax_m3")
        for name in [m for m in sys.modules if m.split(".")[:3] == ["vllm", "models", "minimax_m3"]]:
            del sys.modules[name]
        shell = types.ModuleType("vllm.models.minimax_m3")
        shell.__path__ = [pkg_dir]  # type: ignore[attr-defined]
        shell.__file__ = os.path.join(pkg_dir, "__init__.py")
        shell.__package__ = "vllm.models.minimax_m3"
        sys.modules["vllm.models.minimax_m3"] = shell
        info["stubs"].append(
            f"vllm.models.minimax_m3: package shell, __init__ not run (real import failed: "
            f"{type(e).__name__}: {str(e)[:160]})"
        )
    ix = importlib.import_module("vllm.models.minimax_m3.common.indexer")
    sa = importlib.import_module("vllm.models.minimax_m3.common.sparse_attention")
    attn_ops = importlib.import_module("vllm.models.minimax_m3.common.ops.sparse_attn")
    from vllm.platforms import current_platform

    info["indexer_file"] = ix.__file__
    info["sparse_attention_file"] = sa.__file__
    info["platform"] = type(current_platform).__name__
    try:
        from importlib.metadata import version

        info["vllm_version"] = version("vllm")
    except Exception as e:  # noqa: BLE001
        info["vllm_version"] = f"unknown ({type(e).__name__})"
    return ix, sa, attn_ops


def path_for(capability: tuple[int, int] | None, topk_blocks: int, *, cuda: bool = True,
             indexer_kv_dtype: str = "bf16", kv_cache_dtype: str = "auto") -> dict[str, str]:
    """The impls vLLM 0.25.1 picks (``triton`` or ``msa``, for the indexer and the attention) on a GPU.

    Its rule: ``current_platform.is_device_capability_family(100)`` (compute
    capability 10.x), a top-k block count in MSA_TOPK_BLOCKS, and a cache
    dtype the MSA kernels take.
    """
    sm100 = cuda and capability is not None and capability[0] == 10
    msa_topk = sm100 and topk_blocks in MSA_TOPK_BLOCKS
    return {
        "indexer": "msa" if msa_topk and indexer_kv_dtype in MSA_INDEXER_DTYPES else "triton",
        "attention": "msa" if msa_topk and kv_cache_dtype != "fp8_e5m2" else "triton",
    }


def vllm_path(ix: Any, sa: Any, topk_blocks: int, capability: tuple[int, int] | None,
              cuda: bool = True) -> dict[str, Any]:
    """The path the installed vLLM picks on this GPU: its own selectors asked, the rule beside them.

    A selector that is missing, or raises (e.g. the MSA module does not import),
    leaves that part to the rule, with the reason kept.
    """
    rule = path_for(capability, topk_blocks, cuda=cuda)
    out: dict[str, Any] = {"capability": ".".join(map(str, capability)) if capability else None, "rule": rule}
    asks = (("indexer", "select_indexer_impl_cls", ix, {"topk_blocks": topk_blocks, "indexer_kv_dtype": "bf16"}),
            ("attention", "select_main_impl_cls", sa, {"topk_blocks": topk_blocks, "kv_cache_dtype": "auto"}))
    for part, name, module, kwargs in asks:
        select = getattr(module, name, None)
        if select is None:
            out[part] = rule[part]
            out[f"{part}_impl"] = f"no {name} in the installed code: vLLM 0.25.1's rule"
            continue
        try:
            cls = select(**kwargs)
        except Exception as e:  # noqa: BLE001  (vLLM would fail the same way at start-up)
            out[part] = rule[part]
            out[f"{part}_impl"] = f"{name} raised {type(e).__name__}: {str(e)[:200]}; vLLM 0.25.1's rule"
            continue
        out[f"{part}_impl"] = cls.__name__
        out[part] = "msa" if "MSA" in cls.__name__ else "triton"
    return out


def current_capability() -> tuple[tuple[int, int] | None, bool]:
    """(compute capability of device 0, whether the platform is CUDA), as vLLM's platform sees them."""
    from vllm.platforms import current_platform

    cap = current_platform.get_device_capability()
    return ((cap.major, cap.minor) if cap is not None else None), bool(current_platform.is_cuda())


def not_applicable(path: dict[str, Any]) -> str | None:
    """Why this check does not drive the path vLLM takes here, or None when it is the Triton path."""
    if path.get("indexer") == "triton" and path.get("attention") == "triton":
        return None
    return (f"not applicable on this GPU family: on compute capability {path.get('capability')} vLLM picks "
            f"{path.get('indexer_impl')} and {path.get('attention_impl')} (indexer {path.get('indexer')}, "
            f"attention {path.get('attention')}); this check drives the Triton path")


# ---------------------------------------------------------------------------
# Pure helpers (no torch at import)
# ---------------------------------------------------------------------------
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def padded_num_tokens(max_num_batched_tokens: int) -> int:
    """As nvidia/model.py: pad to a multiple of 4."""
    return (max_num_batched_tokens + 3) // 4 * 4


def make_config(device: str) -> tuple[Any, str]:
    """The config the layers read (only its compilation config's forward-context registry)."""
    from vllm.config import CompilationConfig, DeviceConfig, VllmConfig

    try:
        return VllmConfig(device_config=DeviceConfig(device=device)), "VllmConfig"
    except Exception as e:  # noqa: BLE001
        # A full config validates things this check never uses (e.g. an executor
        # that needs compiled ops); the layers only reach compilation_config.
        why = f"{type(e).__name__}: {str(e)[:200]}"
        return types.SimpleNamespace(compilation_config=CompilationConfig()), f"CompilationConfig alone ({why})"


def geometry(t: Any) -> list[Any]:
    return [list(t.shape), list(t.stride()), t.storage_offset()]


# ---------------------------------------------------------------------------
# The batch: inputs and the metadata vLLM's builders would make of them
# ---------------------------------------------------------------------------
def make_batch(cfg: dict[str, Any], device: str, seed: int) -> types.SimpleNamespace:
    """Random inputs for one scenario, laid out as vLLM lays them out (decodes first, paged caches).

    Pages are handed out in a random order, so a block table entry is never its
    block number and reading another request's row points at other keys.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    H, D, K = cfg["index_heads"], cfg["index_dim"], cfg["topk"]
    num_heads, hd = H * cfg["gqa"], cfg["head_dim"]
    dec = [int(s) for s in cfg["decode_seq_lens"]]
    pre = [(int(c), int(q)) for c, q in cfg["prefill"]]
    nd, tp = len(dec), sum(q for _, q in pre)
    T = nd + tp
    t_pad = padded_num_tokens(cfg["max_num_batched_tokens"])
    if T > t_pad:
        raise ValueError(f"{T} tokens do not fit max_num_batched_tokens {cfg['max_num_batched_tokens']}")
    seq_all = dec + [c + q for c, q in pre]
    blocks = [cdiv(s, BLOCK) for s in seq_all]
    num_pages = sum(blocks) + 1
    perm = torch.randperm(num_pages, generator=gen)
    bt = torch.zeros((len(seq_all), max(blocks) + 1), dtype=torch.int32)
    taken = 0
    for r, nb in enumerate(blocks):
        bt[r, :nb] = perm[taken : taken + nb].to(torch.int32)
        taken += nb
    # Each token: its request and its absolute position (a decode is its sequence's last token).
    request = list(range(nd)) + [nd + r for r, (_, q) in enumerate(pre) for _ in range(q)]
    position = [s - 1 for s in dec] + [c + j for c, q in pre for j in range(q)]
    qsl = [0]
    for n in [1] * nd + [q for _, q in pre]:
        qsl.append(qsl[-1] + n)

    dtype = getattr(torch, cfg.get("dtype", "bfloat16"))

    def randn(*shape: int) -> Any:
        return torch.randn(shape, generator=gen).to(dtype).to(device)

    i32 = dict(dtype=torch.int32, device=device)
    return types.SimpleNamespace(
        H=H, D=D, K=K, init_blocks=cfg["init_blocks"], local_blocks=cfg["local_blocks"], num_heads=num_heads,
        gqa=cfg["gqa"], hd=hd, dtype=dtype, scale=hd**-0.5, dec=dec, pre=pre, nd=nd, np=len(pre), tp=tp, T=T,
        t_pad=t_pad,
        seq_all=seq_all, blocks=blocks, request=request, position=position,
        bt=bt.to(device), seq_t=torch.tensor(seq_all, **i32),
        ctx_t=torch.tensor([0] * nd + [c for c, _ in pre], **i32), qsl_t=torch.tensor(qsl, **i32),
        max_q=max([q for _, q in pre] or [1]), max_seq=max(seq_all),
        kv_idx=randn(num_pages, BLOCK, D), iq=randn(T, H * D), kv=randn(num_pages, 2, BLOCK, H, hd),
        q=randn(T, num_heads * hd),
    )


def request_keys(b: types.SimpleNamespace, cache: Any, r: int) -> Any:
    """Request ``r``'s rows of a paged cache ``[pages, BLOCK, ...]``, in sequence order: ``[seq_len, ...]``
    (float64)."""
    nb = b.blocks[r]
    pages = cache[b.bt[r, :nb].long()]  # [nb, BLOCK, ...]
    return pages.reshape(nb * BLOCK, *pages.shape[2:])[: b.seq_all[r]].double()


# ---------------------------------------------------------------------------
# The reference: block scores, top-k and attention in plain torch (no vLLM kernel, no shared buffer)
# ---------------------------------------------------------------------------
def block_scores(b: types.SimpleNamespace) -> Any:
    """``[H, T, M]`` float64: per index head and token, each block's max of index query . index key over the keys the
    token sees (position <= its own), ``-inf`` for blocks past it. M3's score: max over the block, no scale."""
    import torch

    m = max(b.blocks)
    out = torch.full((b.H, b.T, m), float("-inf"), dtype=torch.float64, device=b.iq.device)
    iq = b.iq.double().view(b.T, b.H, b.D)
    for r in range(len(b.seq_all)):
        tokens = [t for t in range(b.T) if b.request[t] == r]
        keys = request_keys(b, b.kv_idx, r)  # [S, D]
        s = torch.einsum("nhd,sd->hns", iq[tokens], keys)
        pos = torch.arange(keys.shape[0], device=s.device)
        seen = pos[None, :] <= torch.tensor([b.position[t] for t in tokens], device=s.device)[:, None]
        s = torch.where(seen[None], s, torch.full_like(s, float("-inf")))
        nb = b.blocks[r]
        s = torch.nn.functional.pad(s, (0, nb * BLOCK - s.shape[-1]), value=float("-inf"))
        out[:, tokens, :nb] = s.view(b.H, len(tokens), nb, BLOCK).amax(-1)
    return out


def reference_topk(score: Any, position: list[int], topk: int, init_blocks: int, local_blocks: int) -> tuple[Any, Any]:
    """(``[H, T, topk]`` int64 block ids, -1 past ``min(topk, valid)``; ``[H, T]`` float64 margin).

    The blocks M3 attends to: the forced init blocks and the ``local_blocks``
    last visible blocks, then the best scores. The margin is how far the last
    block chosen on score is above the best one left out (inf when every
    visible block is chosen): a row whose margin is within rounding of zero
    has two right answers.
    """
    import torch

    heads, n, m = score.shape
    valid = torch.tensor([p // BLOCK + 1 for p in position], device=score.device)
    blk = torch.arange(m, device=score.device)[None, :]
    visible = blk < valid[:, None]
    s = torch.where(visible[None], score, torch.full_like(score, float("-inf")))
    s = torch.where((visible & (blk < init_blocks))[None], torch.full_like(s, 1e30), s)
    s = torch.where((visible & (blk >= valid[:, None] - local_blocks))[None], torch.full_like(s, 1e29), s)
    k = min(topk + 1, m)
    top = torch.topk(s, k, dim=-1)
    idx = torch.full((heads, n, topk), -1, dtype=torch.int64, device=score.device)
    keep = min(topk, m)
    idx[..., :keep] = top.indices[..., :keep]
    slot = torch.arange(topk, device=score.device)[None, None, :]
    idx = torch.where(slot < valid.clamp(max=topk)[None, :, None], idx, torch.full_like(idx, -1))
    margin = torch.full((heads, n), float("inf"), dtype=torch.float64, device=score.device)
    if m > topk:
        gap = top.values[..., topk - 1] - top.values[..., topk]
        margin = torch.where((valid > topk)[None, :], gap, margin)
    return idx, margin


def reference_attention(b: types.SimpleNamespace, chosen: Any) -> Any:
    """``[T, num_heads, head_dim]`` float64: each query head attends, dense and causal, to the keys of the blocks
    ``chosen`` (``[H, T, K]``, -1 unused) names for its KV head; M3's GQA: query head ``h*gqa + g`` uses KV head h."""
    import torch

    out = torch.zeros((b.T, b.num_heads, b.hd), dtype=torch.float64, device=b.q.device)
    q = b.q.double().view(b.T, b.H, b.gqa, b.hd)
    for r in range(len(b.seq_all)):
        tokens = [t for t in range(b.T) if b.request[t] == r]
        # The main cache is [pages, 2 (K, V), BLOCK, H, hd].
        keys, values = request_keys(b, b.kv[:, 0], r), request_keys(b, b.kv[:, 1], r)  # [S, H, hd]
        seq = keys.shape[0]
        pos = torch.arange(seq, device=keys.device)
        rows = chosen[:, tokens, :].long().to(keys.device)  # [H, n, K]
        picked = torch.zeros((b.H, len(tokens), b.blocks[r] + 1), dtype=torch.bool, device=keys.device)
        # -1 (unused slot) lands in the extra last column, which no position maps to.
        picked.scatter_(-1, torch.where(rows < 0, b.blocks[r], rows), True)
        allowed = picked[..., pos // BLOCK]  # [H, n, S]
        at = torch.tensor([b.position[t] for t in tokens], device=keys.device)
        allowed &= pos[None, None, :] <= at[None, :, None]
        s = torch.einsum("nhgd,shd->hngs", q[tokens], keys) * b.scale
        s = torch.where(allowed[:, :, None, :], s, torch.full_like(s, float("-inf")))
        w = torch.softmax(s, dim=-1)
        out[tokens] = torch.einsum("hngs,shd->nhgd", w, values).reshape(len(tokens), b.num_heads, b.hd)
    return out


def relative_error(got: Any, ref: Any) -> Any:
    """Per token: ``|got - ref| / |ref|`` over all heads and dims (Frobenius), inf where ``got`` is not finite."""
    import torch

    got = got.double().reshape(ref.shape[0], -1)
    ref = ref.reshape(ref.shape[0], -1)
    err = (got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp(min=1e-12)
    return torch.where(torch.isfinite(got).all(-1), err, torch.full_like(err, float("inf")))


def judge_tokens(err: Any, floor: Any, margin: Any, nd: int) -> dict[str, Any]:
    """The scenario's measurement, as numbers the reader can judge again.

    ``err``: per token, the installed code's attention against the reference;
    ``floor``: the same kernels fed the reference's blocks directly, against the
    same reference (their own rounding); ``margin``: the reference top-k's
    ``[H, T]`` margins. A token whose top-k has a tie within TIE_EPS in any head
    is left out (two selections are right there).
    """
    tied = (margin < TIE_EPS).any(0).cpu()
    err, floor = err.cpu(), floor.cpu()
    judged = ~tied
    off = judged & ~(err <= REL_TOL)  # NaN and inf count as off
    first = int(off.nonzero()[0]) if bool(off.any()) else None
    return {
        "tokens": int(err.numel()), "judged": int(judged.sum()), "tied": int(tied.sum()),
        "off": int(off.sum()), "decode_off": int(off[:nd].sum()), "prefill_off": int(off[nd:].sum()),
        "max_rel_err": finite_max(err[judged]), "floor_max_rel_err": finite_max(floor[judged]), "rel_tol": REL_TOL,
        "tie_eps": TIE_EPS, "not_finite": int((~err.isfinite()).sum()),
        "first_off": None if first is None else {"token": first, "side": "decode" if first < nd else "prefill",
                                                 "rel_err": float(err[first])},
    }


def finite_max(values: Any) -> float | None:
    """The largest value (inf if any is not finite), None for none."""
    if values.numel() == 0:
        return None
    if not bool(values.isfinite().all()):
        return float("inf")
    return float(values.max())


def scenario_ok(att: dict[str, Any]) -> bool:
    """The scenario's judgement from its numbers alone (the host can repeat it)."""
    return (att.get("off") == 0 and att.get("judged", 0) >= MIN_JUDGED * att.get("tokens", 0) > 0
            and att.get("floor_max_rel_err") is not None and att["floor_max_rel_err"] <= REL_TOL)


# ---------------------------------------------------------------------------
# One scenario, in its own process: the worker
# ---------------------------------------------------------------------------
def run_scenario(ix: Any, sa: Any, attn_ops: Any, cfg: dict[str, Any], device: str, seed: int) -> dict[str, Any]:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import create_forward_context, override_forward_context

    b = make_batch(cfg, device, seed)
    H, K, nd, np_, tp, T = b.H, b.K, b.nd, b.np, b.tp, b.T
    i32 = dict(dtype=torch.int32, device=device)
    # Token-major buffer as nvidia/model.py allocates it (there: torch.empty; here a sentinel, so that a read of
    # a slot nobody wrote hands the attention a block id no table has).
    buf = torch.full((b.t_pad, H, K), SENTINEL, **i32)
    res: dict[str, Any] = {"shape": {"T": T, "padded_T": b.t_pad, "H": H, "K": K, "nd": nd, "np": tp}}

    # The metadata the two builders produce for a decode-first batch.
    cu_p = (b.qsl_t[nd:] - nd).to(torch.int32)
    seq_p, seq_d = b.seq_t[nd:], b.seq_t[:nd]
    slots = torch.zeros(T, dtype=torch.int64, device=device)
    index_md = ix.MiniMaxM3IndexerMetadata(
        seq_lens=b.seq_t, max_seq_len=b.max_seq, slot_mapping=slots,
        num_actual_tokens=T, num_decodes=nd, num_decode_tokens=nd, num_prefills=np_, num_prefill_tokens=tp,
        prefill=ix.MiniMaxM3IndexerPrefillMetadata(
            cu_seqlens_q=cu_p, seq_lens=seq_p, context_lens=b.ctx_t[nd:], block_table=b.bt[nd:],
            max_query_len=b.max_q, max_seq_len=b.max_seq),
        decode=ix.MiniMaxM3IndexerDecodeMetadata(
            seq_lens=seq_d, block_table=b.bt[:nd], max_seq_len=b.max_seq, decode_query_len=1, max_decode_query_len=1),
    )
    cu_k = torch.zeros(np_ + 1, **i32)
    torch.cumsum(seq_p, dim=0, out=cu_k[1:])
    main_md = sa.MiniMaxM3SparseMetadata(
        seq_lens=b.seq_t, max_seq_len=b.max_seq, slot_mapping=slots,
        num_actual_tokens=T, num_decodes=nd, num_decode_tokens=nd, num_prefills=np_, num_prefill_tokens=tp,
        prefill=sa.MiniMaxM3SparsePrefillMetadata(
            cu_seqlens_q=cu_p, cu_seqlens_k=cu_k, seq_lens=seq_p, context_lens=b.ctx_t[nd:], block_table=b.bt[nd:],
            max_query_len=b.max_q, max_seq_len=b.max_seq, total_kv_blocks=sum(b.blocks[nd:])),
        decode=sa.MiniMaxM3SparseDecodeMetadata(seq_lens=seq_d, block_table=b.bt[:nd], decode_query_len=1),
    )

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    stage = "building the indexer and attention impls"
    try:
        vllm_config, res["config"] = make_config(device)
        if res["config"] != "VllmConfig":
            res["stubs"] = [f"vllm.config.VllmConfig: {res['config']}"]
        with set_current_vllm_config(vllm_config):
            indexer = ix.MiniMaxM3Indexer(
                num_kv_heads=H, scale=b.scale, topk_blocks=K, sparse_block_size=BLOCK, num_index_heads=H,
                index_head_dim=b.D, prefix=PREFIX, init_blocks=b.init_blocks, local_blocks=b.local_blocks,
                topk_indices_buffer=buf,
            )
            impl = sa.select_main_impl_cls(topk_blocks=K, kv_cache_dtype="auto")(
                b.num_heads, b.hd, b.scale, H, "auto", topk_blocks=K, sparse_block_size=BLOCK)
        indexer.index_cache.kv_cache = b.kv_idx  # what bind_kv_cache does
        # The attention layer's two attributes the impl reads.
        layer = types.SimpleNamespace(layer_name=PREFIX, topk_indices_buffer=buf)
        res["impls"] = [type(indexer.impl).__name__, type(impl).__name__]
        res["harness"] = [
            "metadata: vLLM's own metadata dataclasses, filled as its builders fill them for this batch",
            "forward context: vLLM's create_forward_context / override_forward_context",
            f"layer: an object holding the two attributes the attention impl reads ({PREFIX})",
        ]
        ctx = create_forward_context({indexer.index_cache.prefix: index_md, PREFIX: main_md}, vllm_config)
        out_installed = torch.zeros((T, b.num_heads * b.hd), dtype=b.dtype, device=device)
        with override_forward_context(ctx):
            stage = "indexer forward (top-k write)"
            indexer(b.iq)
            sync()
            stage = "sparse attention forward (top-k read)"
            impl.forward(layer, b.q, b.kv, out_installed)
            sync()

        stage = "reference top-k and attention (torch)"
        chosen, margin = reference_topk(block_scores(b), b.position, K, b.init_blocks, b.local_blocks)
        ref = reference_attention(b, chosen)

        stage = "attention kernels fed the reference's blocks"
        # The kernels' own rounding against the reference: what a right selection measures at most.
        direct = torch.zeros((T, b.num_heads, b.hd), dtype=b.dtype, device=device)
        q3 = b.q.view(T, b.num_heads, b.hd)
        rows = chosen.to(torch.int32).to(device)
        if nd:
            attn_ops.minimax_m3_sparse_attn_decode(q3[:nd], b.kv, rows[:, :nd].contiguous(), b.bt[:nd], seq_d, H,
                                                   b.scale, direct[:nd], 1)
        if np_:
            attn_ops.minimax_m3_sparse_attn(q3[nd:], b.kv, rows[:, nd:].contiguous(), b.bt[nd:], cu_p, seq_p,
                                            b.ctx_t[nd:], b.max_q, H, b.scale, direct[nd:])
        sync()
        res["attention"] = judge_tokens(relative_error(out_installed, ref), relative_error(direct, ref), margin, nd)
    except Exception as e:  # noqa: BLE001
        res["error"] = f"{stage}: {type(e).__name__}: {str(e).strip()[:500]}"
        res["traceback"] = traceback.format_exc()[-1500:]
        res["ok"] = False
        return res
    res["ok"] = scenario_ok(res["attention"])
    return res


def use_interpreter() -> None:
    """Run vLLM's Triton kernels in Triton's interpreter, on CPU tensors (``--device cpu``).

    Set before vLLM is imported: Triton reads TRITON_INTERPRET when a kernel is
    defined, and vLLM replaces Triton by a placeholder unless exactly one
    driver is active, or the visible CUDA device list is empty. The
    interpreter has no driver to time autotune configs with: every config
    times the same, so each kernel runs its first.
    """
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        import triton.runtime.autotuner as autotuner
    except ImportError:
        return  # no Triton: the import of vLLM's kernels says so in the record
    autotuner.Autotuner.do_bench = property(  # type: ignore[method-assign,assignment]
        lambda self: (lambda fn, quantiles=None, **kw: [1.0, 1.0, 1.0]))


def worker_main(args: argparse.Namespace) -> int:
    out: dict[str, Any] = {"scenario": args.scenario}
    try:
        t0 = time.time()
        if args.device == "cpu":
            use_interpreter()
        out["import"] = info = {}
        ix, sa, attn_ops = load_vllm(args.vllm_src, info)
        cfg = scenarios(args.shapes)[args.scenario]
        capability, cuda = current_capability()
        out["path"] = path = vllm_path(ix, sa, cfg["topk"], capability, cuda)
        why = not_applicable(path)
        if why is not None:
            out["not_applicable"] = why
            print(json.dumps(out))
            sys.stdout.flush()
            return 0
        out["result"] = run_scenario(ix, sa, attn_ops, cfg, args.device, args.seed)
        out["seconds"] = round(time.time() - t0, 2)
    except Exception as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()[-2000:]
    print(json.dumps(out))
    sys.stdout.flush()
    return 0


# ---------------------------------------------------------------------------
# Orchestrator
# ---------------------------------------------------------------------------
def run_worker(args: argparse.Namespace, scenario: str) -> dict[str, Any]:
    # Started as this check was (no site module, no user site, no bytecode: the runner's isolation; its
    # PYTHONPATH, if any, is inherited), so no .pth file of the image runs in a worker either.
    flags = [flag for flag, on in (("-s", sys.flags.no_user_site), ("-S", sys.flags.no_site),
                                   ("-B", sys.flags.dont_write_bytecode)) if on]
    cmd = [sys.executable, *flags, os.path.abspath(__file__), "--worker", "--scenario", scenario]
    cmd += ["--device", args.device, "--seed", str(args.seed), "--shapes", args.shapes]
    if args.vllm_src:
        cmd += ["--vllm-src", args.vllm_src]
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"timeout": f"no result within {args.timeout:.0f} s", "seconds": args.timeout}
    rec: dict[str, Any] = {"returncode": p.returncode}
    parsed: dict[str, Any] | None = None
    for line in reversed(p.stdout.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                parsed = json.loads(line)
                break
            except ValueError:
                continue
    if parsed is not None:
        rec.update(parsed)
    if p.returncode != 0 or parsed is None:
        tail = (p.stderr or "").strip().splitlines()[-5:]
        rec["fault"] = f"worker exited {p.returncode}: " + " | ".join(tail)[-800:]
    rec["seconds"] = round(time.time() - t0, 2)
    return rec


def outcome(rec: dict[str, Any]) -> str:
    """correct | wrong-attention | illegal-memory-access | fault | inconclusive | timeout | env-error |
    not-applicable, from the scenario's numbers (never from its own ``ok``)."""
    if "timeout" in rec:
        return "timeout"
    if "not_applicable" in rec:
        return NOT_APPLICABLE
    res = rec.get("result") or {}
    if "result" not in rec:
        return "env-error" if "error" in rec else "fault"
    text = f"{res.get('error', '')} {rec.get('fault', '')}".lower()
    if "illegal memory access" in text or "illegal address" in text:
        return "illegal-memory-access"
    att = res.get("attention")
    if "error" in res or "fault" in rec or not isinstance(att, dict):
        return "fault"
    if scenario_ok(att):
        return "correct"
    # Tokens off while the kernels fed the right blocks were right: the installed code chose or read wrong ones.
    floor = att.get("floor_max_rel_err")
    if att.get("off") and floor is not None and floor <= REL_TOL:
        return "wrong-attention"
    return "inconclusive"


def summarize(rec: dict[str, Any]) -> str:
    kind = outcome(rec)
    if kind == "timeout":
        return f"timeout ({rec['timeout']}): inconclusive"
    if kind == "env-error":
        return f"could not run ({rec.get('error', '')[:200]})"
    res = rec.get("result") or {}
    if "error" in res:
        return f"{kind} in {res['error'][:220]}"
    if "fault" in rec:
        return f"{kind} ({rec['fault'][:200]})"
    a = res.get("attention") or {}
    first = a.get("first_off")
    where = f", first {first['side']} token {first['token']} off by {first['rel_err']:.3g}" if first else ""
    return (
        f"attention tokens off {a.get('off')}/{a.get('judged')} judged (decode {a.get('decode_off')}, "
        f"prefill {a.get('prefill_off')}; {a.get('tied')} tied left out), max rel err {_num(a.get('max_rel_err'))} "
        f"(kernels fed the right blocks: {_num(a.get('floor_max_rel_err'))}; tol {a.get('rel_tol')}){where}"
    )


def _num(value: Any) -> str:
    return "n/a" if value is None else f"{value:.3g}"


def provenance(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What the scenarios ran against: ``ran_against``, ``stubs`` and ``import_errors``, over every run.

    ``vllm`` only when every scenario got as far as importing vLLM's code and
    nothing stood in for any of it; a scenario that never said counts as a
    stub, so that silence is never taken for the real code.
    """
    stubs: list[str] = []
    errors: dict[str, str] = {}
    told = True
    for scenario, rec in runs.items():
        imp = rec.get("import")
        if not isinstance(imp, dict) or "indexer_file" not in imp:
            # It never got as far as loading the code under test: no evidence of what that code is.
            told = False
            why = rec.get("timeout") or rec.get("error") or rec.get("fault") or "no record"
            stubs.append(f"{scenario}: did not get to load vLLM's code ({str(why)[:160]})")
            if isinstance(imp, dict):
                errors.update(imp.get("import_errors") or {})
                stubs += [s for s in imp.get("stubs") or [] if s not in stubs]
            continue
        stubs += [s for s in imp.get("stubs") or [] if s not in stubs]
        stubs += [s for s in (rec.get("result") or {}).get("stubs") or [] if s not in stubs]
        errors.update(imp.get("import_errors") or {})
    out: dict[str, Any] = {"ran_against": "vllm" if told and runs and not stubs and not errors else "stub"}
    if stubs:
        out["stubs"] = stubs
    if errors:
        out["import_errors"] = errors
    return out


def verdict(kinds: dict[str, str]) -> tuple[str, str]:
    """(status, lead of the detail) from each scenario's outcome."""
    if kinds and all(k == "correct" for k in kinds.values()):
        return "pass", "the installed indexer and sparse attention attend to the blocks a right top-k selects: "
    bad = [s for s, k in kinds.items() if k in ("wrong-attention", "illegal-memory-access")]
    if bad:
        return "fail", f"installed code attends to the wrong blocks ({', '.join(bad)}): "
    # Timeouts, faults unrelated to the layout, an environment that cannot run it.
    return "fail", "inconclusive, neither a pass nor a caught bug: "


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--vllm-src", default=None, help="folder with the wheel's vllm/ sources and dist-info")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per scenario subprocess")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: vLLM's Triton kernels in Triton's interpreter on CPU tensors (with --shapes small)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scenario", default="all", help="tp1, tp1-nd3, tp4 or all")
    ap.add_argument("--shapes", choices=("model", "small"), default="model",
                    help="small: the same batches cut down for Triton's interpreter on a CPU")
    ap.add_argument("--log", default=None, help="append each scenario's record to this JSONL file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(args)

    name = "topk-layout"
    info: dict[str, Any] = {"pr": PR}
    try:
        import torch

        info["torch"] = torch.__version__
        if args.device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("torch.cuda.is_available() is False")
        import triton

        info["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        print(json.dumps({"checks": [{"name": name, "status": "skip", "detail": f"no torch/CUDA/Triton: {e}"}],
                          "info": info}))
        return 0

    scen = list(scenarios(args.shapes)) if args.scenario == "all" else [args.scenario]
    runs: dict[str, dict[str, Any]] = {}
    # Side by side, each in its own process (an illegal memory access ends only its own): the wall time of
    # one scenario instead of three. Where the path is not applicable, every scenario says so (it is the
    # GPU's), and the check is one skip.
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(scen)) as pool:
        started = {s: pool.submit(run_worker, args, s) for s in scen}
        for s in scen:
            runs[s] = started[s].result()
            runs[s]["outcome"] = outcome(runs[s])
            if args.log:
                try:
                    with open(args.log, "a", encoding="utf-8") as f:
                        f.write(json.dumps({"scenario": s, "record": runs[s]}) + "\n")
                except OSError:
                    pass
    for rec in runs.values():
        if "indexer_file" in (rec.get("import") or {}):
            info["import"] = rec["import"]
            break
    kinds = {s: r["outcome"] for s, r in runs.items()}
    skipped = next((r for r in runs.values() if r["outcome"] == NOT_APPLICABLE), None)
    if skipped is not None:
        check = {"name": name, "status": "skip", "detail": skipped["not_applicable"], "ran_against": NOT_APPLICABLE,
                 "data": {"outcomes": kinds, "path": skipped.get("path"), "runs": runs}}
        print(json.dumps({"checks": [check], "info": info}))
        return 0
    status, lead = verdict(kinds)
    detail = "; ".join(f"{s}: {summarize(r)}" for s, r in runs.items())
    check = {"name": name, "status": status, "detail": lead + detail, "data": {"outcomes": kinds, "runs": runs},
             **provenance(runs)}
    print(json.dumps({"checks": [check], "info": info}))
    return 1 if status == "fail" else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001
        print(json.dumps({"checks": [{"name": "topk-layout", "status": "fail",
                                      "detail": f"check crashed: {type(e).__name__}: {e}"}]}))
        sys.exit(1)
