"""GPU regression check for upstream vLLM PR #49149, run on the image's INSTALLED code.

The bug (vLLM 0.25.1): ``vllm/models/minimax_m3/nvidia/model.py`` allocates the
shared ``topk_indices_buffer`` token-major ``[T, H, K]`` (int32; T padded to a
multiple of 4), but the Triton indexer (``common/indexer.py``) hands it as
``out=`` to the index top-k kernels, which address it head-major ``[H, T, K]``,
and the Triton sparse attention (``common/sparse_attention.py``) reads it back
head-major too. With two or more sequences in a batch, or one prefill long
enough to span several rows, the kernels address rows they do not own: wrong blocks are attended to, or the engine dies with an
illegal memory access. The fix transposes at both boundaries.

What this check runs is the image's own code, not a copy of its slicing:

* it imports the installed ``vllm.models.minimax_m3.common.indexer`` and
  ``vllm.models.minimax_m3.common.sparse_attention``;
* allocates the buffer as ``nvidia/model.py`` does (pre-filled with a
  sentinel, -2, so slots nobody wrote can be told apart);
* builds ``MiniMaxM3Indexer`` (which picks its kernel impl as in the model)
  and the sparse-attention impl ``select_main_impl_cls`` picks, with the
  per-layer metadata the metadata builders would produce for the batch, in a
  vLLM forward context;
* calls ``indexer(index_query)`` (the top-k write path) and
  ``impl.forward(layer, query, kv_cache, output)`` (the read path), which
  launch vLLM's Triton kernels on the GPU.

The two kernel entry points the attention calls are wrapped so that the
top-k views it hands them are recorded (the real kernels still run). The check
then compares, per (head, token) and as sets, what those views address with a
torch top-k over the kernels' own block scores (ties in score count as equal),
and the attention output with the same kernels fed the reference indices.

Scenarios (MiniMax-M3 sizes: 4 index heads of dim 128, 16 top-k blocks of 128
tokens, init 0, local 1, 64 query heads over 4 KV heads of dim 128), each a
batch of decodes followed by prefills (one with prior context): ``tp1`` (5
decodes), ``tp1-nd3`` (3 decodes) and ``tp4`` (1 index head, as at tensor
parallel 4 or 8). Each scenario runs in its own subprocess (the three side by side), so an illegal
memory access is captured there and cannot poison the next one.

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

One check is printed, ``topk-layout``: ``pass`` when every scenario reads back
exactly what the reference selects; ``fail`` with the wrong rows, or the fault
(illegal memory access) and the stage that raised it. A scenario that times
out is neither a pass nor a caught bug: the check fails as inconclusive.
Without torch, CUDA or Triton it is ``skip``.

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

Usage: ``python3 gpu_topk_layout.py [--vllm-src DIR] [--timeout S] [--log FILE]``
(``--vllm-src``: a folder holding the wheel's ``vllm/`` sources and its
dist-info, put first on ``sys.path``, for a GPU host without vLLM installed;
``--timeout``: seconds per scenario subprocess, default 300; ``--log``: append
each scenario's raw record to a JSONL file as it finishes).
Stdlib only at top level; Python 3.9+.
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


BLOCK = 128  # sparse block size == KV page size
# vLLM 0.25.1 takes the MSA path for these top-k block counts on SM100 (its selectors' rule).
MSA_TOPK_BLOCKS = (4, 8, 16, 32)
MSA_INDEXER_DTYPES = ("bf16", "fp8", "fp8_e4m3")
NOT_APPLICABLE = "not-applicable"
ATTN_ATOL = 2e-2


# ---------------------------------------------------------------------------
# vLLM import: the installed code, stubbing only what cannot load
# ---------------------------------------------------------------------------
def load_vllm(vllm_src: str | None, info: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(indexer module, sparse_attention module, index_topk ops module); fills ``info`` as it goes.

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
    ops = importlib.import_module("vllm.models.minimax_m3.common.ops.index_topk")
    from vllm.platforms import current_platform

    info["indexer_file"] = ix.__file__
    info["sparse_attention_file"] = sa.__file__
    info["platform"] = type(current_platform).__name__
    try:
        from importlib.metadata import version

        info["vllm_version"] = version("vllm")
    except Exception as e:  # noqa: BLE001
        info["vllm_version"] = f"unknown ({type(e).__name__})"
    return ix, sa, ops


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


def installed_sources_have_fix(ix_file: str, sa_file: str) -> dict[str, Any]:
    """Whether the installed indexer / sparse attention carry the transposes (for the record only)."""
    out: dict[str, Any] = {}
    try:
        with open(ix_file, encoding="utf-8") as f:
            out["indexer_transposes"] = "buf.transpose(0, 1)" in f.read()
        with open(sa_file, encoding="utf-8") as f:
            out["sparse_attention_transposes"] = "topk_buffer[:num_tokens].transpose(0, 1)" in f.read()
    except OSError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    return out


# ---------------------------------------------------------------------------
# Pure helpers (no torch at import)
# ---------------------------------------------------------------------------
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def padded_num_tokens(max_num_batched_tokens: int) -> int:
    """As nvidia/model.py: pad to a multiple of 4."""
    return (max_num_batched_tokens + 3) // 4 * 4


def kernel_view(base: Any, view: Any, heads: int, n: int) -> Any:
    """What a kernel that walks ``view`` by strides over [heads, n, K] sees."""
    import torch

    return torch.as_strided(base, (heads, n, view.shape[-1]), tuple(view.stride()), view.storage_offset())


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
# Reference and comparison
# ---------------------------------------------------------------------------
def reference_topk(score: Any, valid: Any, topk: int, force: tuple[int, int] | None) -> Any:
    """Torch top-k per (head, token) over ``score[h, t, :valid[t]]``.

    ``force=(init_blocks, local_blocks)`` applies the prefill kernel's forcing
    (init blocks -> 1e30, then local blocks -> 1e29); decode scores come with
    the forcing already applied. Slots past ``min(topk, valid)`` are -1.
    """
    import torch

    s = score.float().cpu().clone()
    heads, n, m = s.shape
    valid = valid.cpu().long()
    pos = torch.arange(m)[None, :]
    vis = pos < valid[:, None]  # [n, m]
    s = torch.where(torch.isnan(s), torch.full_like(s, -1e30), s)
    if force is not None:
        init_blocks, local_blocks = force
        init = vis & (pos < init_blocks)
        local = vis & (pos >= (valid[:, None] - local_blocks).clamp(min=0))
        s = torch.where(init[None], torch.full_like(s, 1e30), s)
        s = torch.where(local[None], torch.full_like(s, 1e29), s)
    s = torch.where(vis[None], s, torch.full_like(s, float("-inf")))
    k = min(topk, m)
    idx = torch.topk(s, k, dim=-1).indices.to(torch.int32)
    out = torch.full((heads, n, topk), -1, dtype=torch.int32)
    out[:, :, :k] = idx
    slot = torch.arange(topk)[None, None, :]
    out = torch.where(slot < valid.clamp(max=topk)[None, :, None], out, -1)
    return out


def compare_rows(
    seen: Any, ref: Any, score: Any, valid: Any, force: tuple[int, int] | None
) -> dict[str, int]:
    """Compare [H, n, K] read-side indices with the reference, as sets per row."""
    import torch

    seen = seen.cpu().long()
    ref = ref.cpu().long()
    heads, n, k = seen.shape
    exact = (seen.sort(-1).values == ref.sort(-1).values).all(-1)
    res = {
        "rows": heads * n,
        "exact": int(exact.sum()),
        "unwritten": int((seen == SENTINEL).any(-1).sum()),
        "out_of_range": 0,
        "tie_equivalent": 0,
        "mismatch": 0,
    }
    valid = valid.cpu().long()
    s = score.float().cpu()
    m = s.shape[-1]
    if force is not None:
        init_blocks, local_blocks = force
        pos = torch.arange(m)[None, :]
        vis = pos < valid[:, None]
        s = torch.where((vis & (pos < init_blocks))[None], torch.full_like(s, 1e30), s)
        loc = vis & (pos >= (valid[:, None] - local_blocks).clamp(min=0))
        s = torch.where(loc[None], torch.full_like(s, 1e29), s)
    for h, t in (~exact).nonzero().tolist():
        v = int(valid[t])
        nvalid = min(k, v)
        row = seen[h, t]
        head_ok = bool(((row[:nvalid] >= 0) & (row[:nvalid] < v)).all())
        tail_ok = bool((row[nvalid:] == -1).all())
        if not (head_ok and tail_ok) or len(set(row[:nvalid].tolist())) != nvalid:
            if not head_ok:
                res["out_of_range"] += 1
            res["mismatch"] += 1
            continue
        a = s[h, t, row[:nvalid]].sort().values
        b = s[h, t, ref[h, t, :nvalid]].sort().values
        if torch.equal(a, b):
            res["tie_equivalent"] += 1
        else:
            res["mismatch"] += 1
    return res


# ---------------------------------------------------------------------------
# One scenario, in its own process: the worker
# ---------------------------------------------------------------------------
def run_scenario(ix: Any, sa: Any, ops: Any, cfg: dict[str, Any], device: str, seed: int) -> dict[str, Any]:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import create_forward_context, override_forward_context

    torch.manual_seed(seed)
    H, D, K = cfg["index_heads"], cfg["index_dim"], cfg["topk"]
    init_b, local_b = cfg["init_blocks"], cfg["local_blocks"]
    num_heads, hd = H * cfg["gqa"], cfg["head_dim"]
    dec = list(cfg["decode_seq_lens"])
    pre = [tuple(x) for x in cfg["prefill"]]
    nd, np_ = len(dec), len(pre)
    tp = sum(q for _, q in pre)
    T = nd + tp
    t_pad = padded_num_tokens(cfg["max_num_batched_tokens"])
    assert T <= t_pad
    seq_all = dec + [c + q for c, q in pre]
    blocks = [cdiv(s, BLOCK) for s in seq_all]
    num_pages = sum(blocks) + 1
    perm = torch.randperm(num_pages)
    bt = torch.zeros((nd + np_, max(blocks) + 1), dtype=torch.int32)
    p = 0
    for r, nb in enumerate(blocks):
        bt[r, :nb] = perm[p : p + nb].to(torch.int32)
        p += nb
    i32 = dict(dtype=torch.int32, device=device)
    bf16 = dict(dtype=torch.bfloat16, device=device)
    bt = bt.to(device)
    seq_t = torch.tensor(seq_all, **i32)
    ctx_all = torch.tensor([0] * nd + [c for c, _ in pre], **i32)
    qsl = [0]
    for n in [1] * nd + [q for _, q in pre]:
        qsl.append(qsl[-1] + n)
    qsl_t = torch.tensor(qsl, **i32)
    max_q, max_seq = max(q for _, q in pre), max(seq_all)
    kv_idx = torch.randn((num_pages, BLOCK, D), **bf16)
    iq = torch.randn((T, H * D), **bf16)
    kv = torch.randn((num_pages, 2, BLOCK, H, hd), **bf16)
    q = torch.randn((T, num_heads * hd), **bf16)
    scale = hd**-0.5

    # Token-major buffer as nvidia/model.py allocates it (there: torch.empty).
    buf = torch.full((t_pad, H, K), SENTINEL, **i32)
    res: dict[str, Any] = {"shape": {"T": T, "padded_T": t_pad, "H": H, "K": K, "nd": nd, "np": tp}}

    # The metadata the two builders produce for a decode-first batch.
    cu_p = (qsl_t[nd:] - nd).to(torch.int32)
    seq_p, seq_d = seq_t[nd:], seq_t[:nd]
    index_md = ix.MiniMaxM3IndexerMetadata(
        seq_lens=seq_t, max_seq_len=max_seq, slot_mapping=torch.zeros(T, dtype=torch.int64, device=device),
        num_actual_tokens=T, num_decodes=nd, num_decode_tokens=nd, num_prefills=np_, num_prefill_tokens=tp,
        prefill=ix.MiniMaxM3IndexerPrefillMetadata(
            cu_seqlens_q=cu_p, seq_lens=seq_p, context_lens=ctx_all[nd:], block_table=bt[nd:],
            max_query_len=max_q, max_seq_len=max_seq),
        decode=ix.MiniMaxM3IndexerDecodeMetadata(
            seq_lens=seq_d, block_table=bt[:nd], max_seq_len=max_seq, decode_query_len=1, max_decode_query_len=1),
    )
    cu_k = torch.zeros(np_ + 1, **i32)
    torch.cumsum(seq_p, dim=0, out=cu_k[1:])
    main_md = sa.MiniMaxM3SparseMetadata(
        seq_lens=seq_t, max_seq_len=max_seq, slot_mapping=index_md.slot_mapping,
        num_actual_tokens=T, num_decodes=nd, num_decode_tokens=nd, num_prefills=np_, num_prefill_tokens=tp,
        prefill=sa.MiniMaxM3SparsePrefillMetadata(
            cu_seqlens_q=cu_p, cu_seqlens_k=cu_k, seq_lens=seq_p, context_lens=ctx_all[nd:], block_table=bt[nd:],
            max_query_len=max_q, max_seq_len=max_seq, total_kv_blocks=sum(blocks[nd:])),
        decode=sa.MiniMaxM3SparseDecodeMetadata(seq_lens=seq_d, block_table=bt[:nd], decode_query_len=1),
    )

    # Record what the installed code hands the kernels; the kernels still run.
    seen: dict[str, Any] = {}
    real_fns: dict[str, Any] = {}

    def recording(module: Any, name: str, key: str) -> None:
        real = real_fns[name] = getattr(module, name)

        def wrapper(*a: Any, **kw: Any) -> Any:
            seen[key] = (a, kw, None)  # before the call: a launch that faults is still on record
            out = real(*a, **kw)
            seen[key] = (a, kw, out)
            return out

        setattr(module, name, wrapper)

    recording(ix, "minimax_m3_index_decode", "decode_write")
    recording(ix, "minimax_m3_index_score", "prefill_score")
    recording(ix, "minimax_m3_index_topk", "prefill_write")
    recording(sa, "minimax_m3_sparse_attn_decode", "decode_read")
    recording(sa, "minimax_m3_sparse_attn", "prefill_read")

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
                num_kv_heads=H, scale=scale, topk_blocks=K, sparse_block_size=BLOCK, num_index_heads=H,
                index_head_dim=D, prefix=PREFIX, init_blocks=init_b, local_blocks=local_b,
                topk_indices_buffer=buf,
            )
            impl = sa.select_main_impl_cls(topk_blocks=K, kv_cache_dtype="auto")(
                num_heads, hd, scale, H, "auto", topk_blocks=K, sparse_block_size=BLOCK)
        indexer.index_cache.kv_cache = kv_idx  # what bind_kv_cache does
        # The attention layer's two attributes the impl reads.
        layer = types.SimpleNamespace(layer_name=PREFIX, topk_indices_buffer=buf)
        res["impls"] = [type(indexer.impl).__name__, type(impl).__name__]
        res["harness"] = [
            "metadata: vLLM's own metadata dataclasses, filled as its builders fill them for this batch",
            "forward context: vLLM's create_forward_context / override_forward_context",
            f"layer: an object holding the two attributes the attention impl reads ({PREFIX})",
        ]
        ctx = create_forward_context({indexer.index_cache.prefix: index_md, PREFIX: main_md}, vllm_config)
        out_seen = torch.zeros((T, num_heads * hd), **bf16)
        with override_forward_context(ctx):
            stage = "indexer forward (top-k write)"
            indexer(iq)
            sync()
            stage = "sparse attention forward (top-k read)"
            impl.forward(layer, q, kv, out_seen)
            sync()
        res["write_views"] = {k: geometry(seen[k][1]["out"]) for k in ("decode_write", "prefill_write") if k in seen}
        res["read_views"] = {k: geometry(seen[k][0][2]) for k in ("decode_read", "prefill_read") if k in seen}

        stage = "reference scores"
        da = seen["decode_write"][0]
        # Same kernel family, same inputs as the decode write: the scores its top-k saw.
        score_d = ops.minimax_m3_index_decode_score(*da[:5], *da[6:11])
        score_p = seen["prefill_score"][2]
        sync()
        read_d, read_p = seen["decode_read"][0][2], seen["prefill_read"][0][2]
        valid_d = torch.tensor([cdiv(s, BLOCK) for s in dec])
        valid_p = torch.tensor([(c + j) // BLOCK + 1 for c, qn in pre for j in range(qn)])
        ref_d = reference_topk(score_d, valid_d, K, None)
        ref_p = reference_topk(score_p, valid_p, K, (init_b, local_b))
        try:
            got_d = kernel_view(buf, read_d, H, nd)
            got_p = kernel_view(buf, read_p, H, tp)
        except RuntimeError as e:
            res["read_out_of_bounds"] = str(e).splitlines()[0]
            res["ok"] = False
            return res
        res["decode"] = compare_rows(got_d, ref_d, score_d, valid_d, None)
        res["prefill"] = compare_rows(got_p, ref_p, score_p, valid_p, (init_b, local_b))

        stage = "attention with reference indices"
        out_ref = torch.zeros((T, num_heads, hd), **bf16)
        a = seen["decode_read"][0]
        real_fns["minimax_m3_sparse_attn_decode"](a[0], a[1], ref_d.to(device), *a[3:7], out_ref[:nd], a[8])
        a = seen["prefill_read"][0]
        real_fns["minimax_m3_sparse_attn"](a[0], a[1], ref_p.to(device), *a[3:10], out_ref[nd:])
        sync()
        diff = (out_seen.view(T, num_heads, hd).float() - out_ref.float()).abs()
        tok_bad = (diff.amax(dim=(1, 2)) > ATTN_ATOL).cpu()
        res["attention"] = {
            "max_abs_diff": float(diff.max()),
            "tokens_over_tol": int(tok_bad.sum()),
            "decode_tokens_over_tol": int(tok_bad[:nd].sum()),
            "prefill_tokens_over_tol": int(tok_bad[nd:].sum()),
            "atol": ATTN_ATOL,
            "finite": bool(torch.isfinite(out_seen.float()).all()),
        }
    except Exception as e:  # noqa: BLE001
        res["error"] = f"{stage}: {type(e).__name__}: {str(e).strip()[:500]}"
        res["traceback"] = traceback.format_exc()[-1500:]
        res["ok"] = False
        res.setdefault("write_views", {k: geometry(seen[k][1]["out"]) for k in ("decode_write", "prefill_write")
                                       if k in seen and seen[k][1].get("out") is not None})
        res.setdefault("read_views", {k: geometry(seen[k][0][2]) for k in ("decode_read", "prefill_read") if k in seen})
        return res
    bad_rows = res["decode"]["mismatch"] + res["prefill"]["mismatch"]
    res["ok"] = bad_rows == 0 and res["attention"]["tokens_over_tol"] == 0 and res["attention"]["finite"]
    return res


def worker_main(args: argparse.Namespace) -> int:
    out: dict[str, Any] = {"scenario": args.scenario}
    try:
        t0 = time.time()
        out["import"] = info = {}
        ix, sa, ops = load_vllm(args.vllm_src, info)
        cfg = SCENARIOS[args.scenario]
        capability, cuda = current_capability()
        out["path"] = path = vllm_path(ix, sa, cfg["topk"], capability, cuda)
        why = not_applicable(path)
        if why is not None:
            out["not_applicable"] = why
            print(json.dumps(out))
            sys.stdout.flush()
            return 0
        out["result"] = run_scenario(ix, sa, ops, cfg, args.device, args.seed)
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
    cmd += ["--device", args.device, "--seed", str(args.seed)]
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
    """correct | wrong-rows | illegal-memory-access | fault | timeout | env-error | not-applicable."""
    if "timeout" in rec:
        return "timeout"
    if "not_applicable" in rec:
        return NOT_APPLICABLE
    res = rec.get("result") or {}
    if "result" not in rec:
        return "env-error" if "error" in rec else "fault"
    if res.get("ok") is True:
        return "correct"
    text = f"{res.get('error', '')} {rec.get('fault', '')}".lower()
    if "illegal memory access" in text or "illegal address" in text:
        return "illegal-memory-access"
    if res.get("decode", {}).get("mismatch") or res.get("prefill", {}).get("mismatch") \
            or "read_out_of_bounds" in res or res.get("attention", {}).get("tokens_over_tol"):
        return "wrong-rows"
    return "fault"


def summarize(rec: dict[str, Any]) -> str:
    kind = outcome(rec)
    if kind == "timeout":
        return f"timeout ({rec['timeout']}): inconclusive"
    if kind == "env-error":
        return f"could not run ({rec.get('error', '')[:200]})"
    res = rec.get("result") or {}
    if "error" in res:
        return f"{kind} in {res['error'][:220]}"
    if "fault" in rec and kind != "correct":
        return f"{kind} ({rec['fault'][:200]})"
    if "read_out_of_bounds" in res:
        return "wrong-rows: the read path addresses beyond the buffer"
    d, p, a = res.get("decode", {}), res.get("prefill", {}), res.get("attention", {})
    return (
        f"decode rows wrong {d.get('mismatch')}/{d.get('rows')}, "
        f"prefill rows wrong {p.get('mismatch')}/{p.get('rows')}, "
        f"attn tokens off {a.get('tokens_over_tol')} (max diff {a.get('max_abs_diff', 0):.3g})"
    )


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
        return "pass", "the installed indexer and sparse attention read back what they wrote: "
    bad = [s for s, k in kinds.items() if k in ("wrong-rows", "illegal-memory-access")]
    if bad:
        return "fail", f"installed code breaks the top-k layout ({', '.join(bad)}): "
    # Timeouts, faults unrelated to the layout, an environment that cannot run it.
    return "fail", "inconclusive, neither a pass nor a caught bug: "


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--vllm-src", default=None, help="folder with the wheel's vllm/ sources and dist-info")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per scenario subprocess")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scenario", default="all", help="tp1, tp1-nd3, tp4 or all")
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

    scen = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
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
            info["installed_sources"] = installed_sources_have_fix(
                rec["import"]["indexer_file"], rec["import"]["sparse_attention_file"])
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
