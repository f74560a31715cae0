"""What the golden forward needs of a model folder's ``config.json``, read and checked without torch.

The forward implements the branches vLLM 0.25.1's MiniMax-M3 text backbone
(``vllm/models/minimax_m3/nvidia/model.py``) takes for the released
MiniMax-M3 configuration and for the tiny models ``gpu-runs/tiny_minimax_m3.py``
writes: Gemma-style RMSNorm (``1 + weight``) everywhere, per-head q/k norms,
partial NeoX rotary embedding, SwiGLU-OAI with clamping, a sigmoid-routed MoE
with a routing bias and a shared expert, and the lightning indexer's
score-only (``max``) block selection. A config that asks for another branch
(a softmax router, an output gate, rope scaling, an index value path...)
is refused with the key at fault: a golden that silently computed another
model would judge nothing.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import Malformed

ARCHITECTURE = "MiniMaxM3SparseForCausalLM"


@dataclass(frozen=True, slots=True)
class Sparse:
    """The lightning indexer's settings (``sparse_attention_config``)."""

    index_heads: int
    index_dim: int
    topk_blocks: int
    block_size: int
    init_blocks: int
    local_blocks: int
    layers: frozenset[int]  # layers whose attention runs the index branch


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The text backbone's shapes and constants, as the forward uses them."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    eps: float
    dense_inter: int
    expert_inter: int
    shared_inter: int
    experts: int
    experts_per_token: int
    routed_scale: float
    routing_bias: bool
    swiglu_alpha: float
    swiglu_beta: float
    swiglu_limit: float
    moe_layers: frozenset[int]
    sparse: Sparse | None
    dtype: str = "bfloat16"  # what vLLM serves the weights in (``torch_dtype``)

    def prompt_class(self, tokens: int) -> str:
        """``long`` where a prompt of ``tokens`` tokens has more blocks than the indexer keeps (it chooses),
        else ``short`` (every block is read): the prompt classes of :mod:`.coverage`."""
        sp = self.sparse
        return "long" if sp is not None and tokens > sp.topk_blocks * sp.block_size else "short"


def _want(text: Mapping[str, Any], key: str, allowed: Sequence[Any], default: Any = None) -> None:
    value = text.get(key, default)
    if value not in allowed:
        raise Malformed(f"{key} {value!r}: the golden forward implements {' or '.join(map(repr, allowed))} only")


def parse(data: Mapping[str, Any]) -> ModelConfig:
    """The config of a MiniMax-M3 model folder (its ``text_config`` where it has one); Malformed, naming the
    key, for anything the forward does not implement."""
    text = data.get("text_config") or data
    if not isinstance(text, Mapping):
        raise Malformed("text_config is not an object")
    archs = list(data.get("architectures") or text.get("architectures") or [])
    if ARCHITECTURE not in archs:
        raise Malformed(f"architectures {archs}: the golden forward is {ARCHITECTURE}'s only")
    _want(text, "use_gemma_norm", (True,))
    _want(text, "qk_norm_type", ("per_head",))
    _want(text, "hidden_act", ("swigluoai",))
    _want(text, "attention_output_gate", (False, None))
    _want(text, "scoring_func", ("sigmoid",))
    _want(text, "rope_scaling", (None, {}))
    _want(text, "num_mtp_modules", (0, None))
    _want(text, "tie_word_embeddings", (False, None))
    try:
        layers = int(text["num_hidden_layers"])
        head_dim = int(text["head_dim"])
        freq = text.get("moe_layer_freq")
        moe = frozenset(range(layers)) if freq is None else frozenset(i for i, f in enumerate(freq) if f)
        sparse = None
        cfg = text.get("sparse_attention_config")
        if cfg:
            if cfg.get("sparse_score_type", "max") != "max":
                raise Malformed(f"sparse_score_type {cfg.get('sparse_score_type')!r}: the golden implements 'max'")
            on = frozenset(i for i, f in enumerate(cfg.get("sparse_attention_freq") or []) if f)
            disabled = list(cfg.get("sparse_disable_index_value") or [])
            if any(i >= len(disabled) or not disabled[i] for i in on):
                raise Malformed("sparse_disable_index_value: the golden implements the score-only indexer (index "
                                "value disabled on every sparse layer), as vLLM 0.25.1 does")
            sparse = Sparse(int(cfg["sparse_num_index_heads"]), int(cfg["sparse_index_dim"]),
                            int(cfg["sparse_topk_blocks"]), int(cfg["sparse_block_size"]),
                            int(cfg.get("sparse_init_block", 0)), int(cfg.get("sparse_local_block", 0)), on)
            if sparse.index_heads != int(text["num_key_value_heads"]):
                raise Malformed("sparse_num_index_heads must equal num_key_value_heads (each KV head attends to the "
                                "blocks of its own index head)")
            if sparse.index_dim != head_dim:
                raise Malformed("sparse_index_dim must equal head_dim (the index branch shares the main rotary "
                                "embedding)")
        factor = float(text.get("partial_rotary_factor", 1.0))
        inter = int(text["intermediate_size"])
        return ModelConfig(
            vocab=int(text["vocab_size"]), hidden=int(text["hidden_size"]), layers=layers,
            heads=int(text["num_attention_heads"]), kv_heads=int(text["num_key_value_heads"]), head_dim=head_dim,
            rotary_dim=int(head_dim * factor), rope_theta=float(text["rope_theta"]),
            eps=float(text.get("rms_norm_eps", 1e-6)),
            dense_inter=int(text.get("dense_intermediate_size", inter)), expert_inter=inter,
            shared_inter=inter * int(text.get("n_shared_experts") or 0),
            experts=int(text["num_local_experts"]), experts_per_token=int(text["num_experts_per_tok"]),
            routed_scale=float(text.get("routed_scaling_factor", 1.0)),
            routing_bias=bool(text.get("use_routing_bias", False)),
            swiglu_alpha=float(text["swiglu_alpha"]), swiglu_beta=float(text["swiglu_beta"]),
            swiglu_limit=float(text["swiglu_limit"]), moe_layers=moe, sparse=sparse,
            dtype=str(text.get("torch_dtype") or data.get("torch_dtype") or "bfloat16"))
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, Malformed):
            raise
        raise Malformed(f"config.json lacks or mangles {exc}") from None


def load(folder: Path) -> ModelConfig:
    """The config of the model in ``folder``; Malformed naming the file when it cannot be used."""
    path = Path(folder) / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise Malformed(f"{path}: cannot read it ({exc})") from None
    if not isinstance(data, Mapping):
        raise Malformed(f"{path}: not an object")
    try:
        return parse(data)
    except Malformed as exc:
        raise Malformed(f"{path}: {exc}") from None
