"""The MiniMax-M3 text backbone in plain PyTorch, at float32 or at the serving dtype with the engine's rounding points.

Written from vLLM 0.25.1's definition (``vllm/models/minimax_m3/nvidia/model.py``,
``common/indexer.py``, ``common/ops/index_topk.py``, ``common/ops/sparse_attn.py``,
the fused MoE's sigmoid router and ``SiluAndMulWithClamp``), never calling
vLLM, its kernels or its buffers. Per layer, as vLLM computes it:

- Gemma-style RMSNorm, ``x / sqrt(mean(x^2) + eps) * (1 + weight)``, before
  attention and before the MLP (pre-norm residual stream), and at the end;
- attention: q, k, v and, on sparse layers, the index query (one per KV head)
  and the index key (one per token) from the hidden state; per-head Gemma
  norms of q, k, index q and index k; partial NeoX rotary embedding on the
  first ``rotary_dim`` dims of all four; on sparse layers the lightning
  indexer's block score ``max over the block's keys at or before the query of
  index_q . index_k`` (no scale), the init blocks and the local blocks forced
  in, the ``topk_blocks`` best of the rest, then each KV head's 16 query
  heads attend, causally, to the tokens of its own index head's chosen blocks
  (softmax scale ``head_dim ** -0.5``); dense layers attend causally to all;
- the first layers' dense MLP and the others' MoE: a float32 sigmoid router
  whose top-k is chosen on ``sigmoid + routing bias``, weighted by the
  sigmoid renormalised over the chosen experts and scaled by
  ``routed_scaling_factor``, plus the shared expert; every MLP is SwiGLU-OAI
  (``gate`` clamped above, ``up`` clamped both ways, ``gate * sigmoid(alpha *
  gate) * (up + beta)``);
- the LM head on the final norm, log-softmax.

At float32 it is the model's definition. At a lower dtype (the serving
dtype, what the ``golden`` check computes in) it follows where vLLM 0.25.1's
kernels round, read from their sources: weights and activations in the
dtype, matrix products accumulated in float32 and rounded once; the norms,
SwiGLU-OAI, the fused per-head norm + rotary embedding, the residual add
fused with the next norm (which reads the unrounded sum), the indexer's
scores, the attention logits and softmax, the router and the top-k sum of
the experts' weighted outputs in float32; ``routed_scaling_factor`` applied
to the MoE's output, not to its weights; the cosines and sines of the
rotary cache rounded to the dtype.

Sequences are computed alone (no padding across prompts): :meth:`Golden.prefill`
runs a prompt once and keeps its keys and values, :meth:`Golden.extend` runs
any number of continuations of it in one batch (the replies served to one
prompt share its prefix), :meth:`Golden.greedy` generates the golden's own
reply. Queries go through attention in chunks so a prompt of thousands of
tokens needs a few hundred MB, not the square of its length.

Imports torch at module level: import this module only where torch is there
(:mod:`.scoring` asks first).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import Malformed
from .config import ModelConfig, Sparse
from .config import load as load_config

# Query rows per attention chunk: 512 rows x 5,600 keys x 64 heads x 4 bytes is about 730 MB.
QUERY_CHUNK = 512
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
           "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a ``.safetensors`` file (an 8-byte header length, a JSON header, the raw data), as float32."""
    data = Path(path).read_bytes()
    try:
        (size,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + size])
    except (struct.error, ValueError) as exc:
        raise Malformed(f"{path}: not a safetensors file ({exc})") from None
    base = 8 + size
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise Malformed(f"{path}: tensor {name} is {entry.get('dtype')}, the golden reads F32, BF16 and F16")
        start, end = entry["data_offsets"]
        raw = bytearray(data[base + start:base + end])
        flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        out[name] = flat.reshape(entry["shape"]).to(torch.float32)
    return out


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the model folder: ``model.safetensors``, or the shards its index names."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        out: dict[str, torch.Tensor] = {}
        for shard in shards:
            out.update(read_safetensors(folder / shard))
        return out
    single = folder / "model.safetensors"
    if not single.is_file():
        raise Malformed(f"{folder}: no model.safetensors (nor an index of shards)")
    return read_safetensors(single)


def _router(name: str) -> bool:
    return name.endswith((".gate.weight", ".e_score_correction_bias"))


def gemma_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma-style RMSNorm, computed in float32 whatever ``x``'s dtype (as FlashInfer's kernel does)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """SwiGLU-OAI computed in float32 and rounded once to the inputs' dtype (as vLLM's activation kernel does)."""
    g = gate.float().clamp(max=cfg.swiglu_limit)
    u = up.float().clamp(min=-cfg.swiglu_limit, max=cfg.swiglu_limit)
    return (g * torch.sigmoid(cfg.swiglu_alpha * g) * (u + cfg.swiglu_beta)).to(gate.dtype)


def select(scores: torch.Tensor, positions: torch.Tensor, keys: int, sp: Sparse,
           flip_under: float | None = None) -> torch.Tensor:
    """Which keys each index head lets each query read, [index_heads, n, keys], from the block scores ``scores``
    [index_heads, n, blocks] of queries at ``positions`` [n]: the blocks holding a key at or before the query
    (``position // block_size + 1`` of them), the init blocks and the local (last) blocks forced in, the
    ``topk_blocks`` best in all; a NaN score counts as the lowest; and within the chosen blocks, the keys at
    or before the query. ``flip_under``: the other side of every contested choice, where a head's last block
    chosen on merit leads the best block left out by less than this (:func:`merit`'s relative gap): that head
    reads the left-out block instead (:attr:`Golden.contest`)."""
    blocks = scores.shape[-1]
    block = torch.arange(blocks, device=scores.device)
    valid_blocks = positions // sp.block_size + 1
    valid = block[None, :] < valid_blocks[:, None]
    s = torch.where(torch.isnan(scores), torch.full_like(scores, -1e30), scores)
    s = torch.where((block[None, :] < sp.init_blocks)[None] & valid[None], torch.full_like(s, 1e30), s)
    local = block[None, :] >= (valid_blocks[:, None] - sp.local_blocks)
    s = torch.where((local & valid)[None], torch.full_like(s, 1e29), s)
    s = torch.where(valid[None], s, torch.full_like(s, float("-inf")))
    picked = torch.topk(s, min(sp.topk_blocks, blocks), dim=-1).indices
    chosen = torch.zeros_like(s, dtype=torch.bool).scatter_(-1, picked, True) & valid[None]
    if flip_under is not None:
        gap, last, left, contested = merit(scores, positions, sp)
        swap = contested[None] & (gap < flip_under)  # [h, n]
        chosen = chosen.scatter(-1, last[..., None], ~swap[..., None] & chosen.gather(-1, last[..., None]))
        chosen = chosen.scatter(-1, left[..., None], swap[..., None] | chosen.gather(-1, left[..., None]))
    tokens = chosen.repeat_interleave(sp.block_size, dim=-1)[..., :keys]
    causal = torch.arange(keys, device=scores.device)[None, :] <= positions[:, None]
    return tokens & causal[None]


def merit(scores: torch.Tensor, positions: torch.Tensor, sp: Sparse
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each head's contested choice per query: the gap [h, n] between the score of the last block the top-k chose
    on merit (not forced in as an init or local block) and the best block it left out, relative to the larger
    of the query's block scores in magnitude; those two blocks' indices [h, n] each; and whether anything was
    left to choose [n] (fewer reachable blocks than the top-k, or every slot forced, leave nothing: the gap
    there is meaningless)."""
    blocks = scores.shape[-1]
    block = torch.arange(blocks, device=scores.device)
    valid_blocks = positions // sp.block_size + 1
    valid = block[None, :] < valid_blocks[:, None]
    forced = ((block[None, :] < sp.init_blocks) | (block[None, :] >= (valid_blocks[:, None] - sp.local_blocks))) & valid
    slots = sp.topk_blocks - forced.sum(-1)  # [n]: chosen on merit
    free = valid & ~forced
    s = torch.where(torch.isnan(scores), torch.full_like(scores, -1e30), scores.float())
    scale = torch.where(valid[None], s.abs(), torch.zeros_like(s)).amax(-1).clamp_min(1e-30)  # [h, n]
    s = torch.where(free[None], s, torch.full_like(s, float("-inf")))
    if blocks < 2:  # one block: nothing to choose (contested is False); a second, empty column keeps the shapes
        s = torch.nn.functional.pad(s, (0, 1), value=float("-inf"))
    ranked = torch.sort(s, dim=-1, descending=True)  # [h, n, blocks]
    contested = (slots > 0) & (free.sum(-1) > slots)
    at = slots.clamp(1, max(1, s.shape[-1] - 1))[None, :, None].expand(ranked.values.shape[0], -1, 1)
    last, left = ranked.values.gather(-1, at - 1)[..., 0], ranked.values.gather(-1, at)[..., 0]
    gap = (last - left) / scale
    return gap, ranked.indices.gather(-1, at - 1)[..., 0], ranked.indices.gather(-1, at)[..., 0], contested


@dataclass
class Prefix:
    """A prompt run once: its per-layer keys, values and index keys, and its last position's log-probabilities."""

    ids: list[int]
    keys: list[torch.Tensor]  # per layer [P, kv_heads, head_dim], normed and rotated
    values: list[torch.Tensor]  # per layer [P, kv_heads, head_dim]
    index_keys: list[torch.Tensor | None]  # per layer [P, head_dim] (None: a dense layer)
    last: torch.Tensor  # [vocab] log-probabilities of the token after the prompt
    logprobs: torch.Tensor | None = None  # [P, vocab] at every prompt position, where asked for


class Golden:
    """The model of one folder on one device, float32."""

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, torch.Tensor], device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32):
        # ``dtype``: float32 is the model's definition; the serving dtype follows the engine's numerics (the
        # golden check computes in it, and measures its envelope against float32).
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        missing = [n for n in self.names() if n not in weights]
        if missing:
            raise Malformed(f"the weights lack {len(missing)} tensor(s) the model needs, e.g. {', '.join(missing[:3])}")
        # vLLM serves the weights in the config's dtype (rounded once, when it loads them) except the router's,
        # which it keeps in float32: the golden computes with those values, in ``dtype``.
        served = _DTYPES.get(cfg.dtype, torch.float32)
        self.w = {n: weights[n].to(self.device, torch.float32 if _router(n) else served).to(dtype)
                  for n in self.names()}
        self.trace: list[tuple[str, int, torch.Tensor]] | None = None  # see run()
        # Where set, every block choice contested by less than this relative gap reads the other side
        # (select's flip_under): a world the record's measurements (gpu-runs/golden_worlds.py) compare.
        self.contest: float | None = None
        # Where set, (share, seed): another rounding of the same computation (the other worlds of scoring.py): after
        # every attention and every MLP, that share of the output's elements moved one step of the dtype up or
        # down, chosen by a hash of (seed, layer, place, position, element), so a token gets the same steps
        # whatever batch it runs in, in a prefill or in a continuation.
        self.jostle: tuple[float, int] | None = None
        half = cfg.rotary_dim // 2
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.rotary_dim, 2, dtype=torch.float32,
                                                               device=self.device)[:half] / cfg.rotary_dim))

    @classmethod
    def load(cls, folder: Path, device: str | torch.device | None = None, dtype: torch.dtype = torch.float32
             ) -> Golden:
        """The model in ``folder`` (config.json and its safetensors) on ``device`` (CUDA where there is one)."""
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        return cls(load_config(Path(folder)), read_weights(Path(folder)), device, dtype)

    def names(self) -> list[str]:
        cfg = self.cfg
        out = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
        for i in range(cfg.layers):
            p, a = f"model.layers.{i}", f"model.layers.{i}.self_attn"
            out += [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"]
            out += [f"{a}.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
            if self.sparse_layer(i):
                out += [f"{a}.{n}.weight" for n in ("index_q_proj", "index_k_proj", "index_q_norm", "index_k_norm")]
            if i in cfg.moe_layers:
                m = f"{p}.block_sparse_moe"
                out.append(f"{m}.gate.weight")
                if cfg.routing_bias:
                    out.append(f"{m}.e_score_correction_bias")
                for e in range(cfg.experts):
                    out += [f"{m}.experts.{e}.{n}.weight" for n in ("w1", "w2", "w3")]
                if cfg.shared_inter:
                    out += [f"{m}.shared_experts.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
            else:
                out += [f"{p}.mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
        return out

    def sparse_layer(self, i: int) -> bool:
        return self.cfg.sparse is not None and i in self.cfg.sparse.layers

    # -- the pieces -------------------------------------------------------------------------------------------
    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Partial NeoX rotary embedding of ``x`` [..., n, heads, head_dim] at ``positions`` [n], computed in
        ``x``'s dtype with the cosines and sines rounded to the model's dtype (vLLM keeps its cos/sin cache so)."""
        rd, half = self.cfg.rotary_dim, self.cfg.rotary_dim // 2
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos = freqs.cos()[:, None, :].to(self.dtype).to(x.dtype)
        sin = freqs.sin()[:, None, :].to(self.dtype).to(x.dtype)
        x1, x2, rest = x[..., :half], x[..., half:rd], x[..., rd:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)

    def norm_rope(self, x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The per-head Gemma norm then the rotary embedding, in float32 and rounded once to ``x``'s dtype: vLLM
        fuses the two (``fused_minimax_m3_qknorm_rope_kv_insert``), so the normed values are never rounded."""
        return self.rope(gemma_norm(x.float(), weight, self.cfg.eps), positions).to(x.dtype)

    def mlp(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        w = self.w
        h = swiglu_oai(x @ w[f"{prefix}.gate_proj.weight"].T, x @ w[f"{prefix}.up_proj.weight"].T, self.cfg)
        return h @ w[f"{prefix}.down_proj.weight"].T

    def moe(self, x: torch.Tensor, i: int) -> torch.Tensor:
        cfg, w, m = self.cfg, self.w, f"model.layers.{i}.block_sparse_moe"
        # The router computes in float32 whatever the model's dtype (vLLM's GateLinear does).
        scores = torch.sigmoid(x.float() @ w[f"{m}.gate.weight"].float().T)
        choice = scores + w[f"{m}.e_score_correction_bias"][None, :] if cfg.routing_bias else scores
        chosen = torch.topk(choice, cfg.experts_per_token, dim=-1).indices
        if self.trace is not None:
            self.trace.append(("experts", i, chosen.sort(-1).values.cpu()))
        weights = scores.gather(1, chosen)
        weights = weights / weights.sum(-1, keepdim=True)
        # As vLLM's fused MoE: each chosen expert's output weighted (rounded to the dtype), the top-k summed in
        # float32 and rounded once, then routed_scaling_factor applied to that output (apply_routed_scale_to_output).
        slots = torch.zeros((x.shape[0], cfg.experts_per_token, x.shape[1]), dtype=x.dtype, device=x.device)
        for e in range(cfg.experts):
            rows, slot = torch.nonzero(chosen == e, as_tuple=True)
            if rows.numel() == 0:
                continue
            xe = x[rows]
            h = swiglu_oai(xe @ w[f"{m}.experts.{e}.w1.weight"].T, xe @ w[f"{m}.experts.{e}.w3.weight"].T, cfg)
            slots[rows, slot] = ((h @ w[f"{m}.experts.{e}.w2.weight"].T).float() * weights[rows, slot, None]
                                 ).to(x.dtype)
        out = (slots.float().sum(1).to(x.dtype) * cfg.routed_scale).to(x.dtype)
        if cfg.shared_inter:
            out = out + self.mlp(x, f"{m}.shared_experts")
        return out

    def allowed(self, scores: torch.Tensor, positions: torch.Tensor, keys: int) -> torch.Tensor:
        """Which keys each index head lets each query read (see :func:`select`)."""
        assert self.cfg.sparse is not None
        return select(scores, positions, keys, self.cfg.sparse, self.contest)

    def attend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, iq: torch.Tensor | None,
               ik: torch.Tensor | None, start: int) -> torch.Tensor:
        """Queries ``q`` [n, heads, d] at positions start.. over keys ``k``/``v`` [S, kv_heads, d] at 0..S-1: the
        attention's output."""
        cfg = self.cfg
        n, keys = q.shape[0], k.shape[0]
        group = cfg.heads // cfg.kv_heads
        scale = cfg.head_dim ** -0.5
        out = torch.empty_like(q)
        for a in range(0, n, QUERY_CHUNK):
            b = min(n, a + QUERY_CHUNK)
            positions = torch.arange(start + a, start + b, device=q.device)
            if iq is not None and ik is not None:
                sp = cfg.sparse
                assert sp is not None
                # The indexer's scores and the attention's logits are float32 accumulations of the dtype's
                # operands, never rounded to the dtype (vLLM's kernels keep them in registers).
                raw = torch.einsum("chd,sd->hcs", iq[a:b].float(), ik.float())
                causal = torch.arange(keys, device=q.device)[None, :] <= positions[:, None]
                raw = raw.masked_fill(~causal[None], float("-inf"))
                blocks = -(-keys // sp.block_size)
                pad = blocks * sp.block_size - keys
                if pad:
                    raw = torch.nn.functional.pad(raw, (0, pad), value=float("-inf"))
                scores = raw.view(raw.shape[0], b - a, blocks, sp.block_size).amax(-1)
                mask = self.allowed(scores, positions, keys)  # [kv_heads, c, S]
            else:
                mask = (torch.arange(keys, device=q.device)[None, :] <= positions[:, None])[None]
            qc = q[a:b].view(b - a, cfg.kv_heads, group, cfg.head_dim)
            logits = torch.einsum("ckgd,skd->kgcs", qc.float(), k.float()) * scale
            logits = logits.masked_fill(~mask[:, None], float("-inf"))
            probs = torch.softmax(logits, dim=-1).to(v.dtype)
            out[a:b] = torch.einsum("kgcs,skd->ckgd", probs, v).reshape(b - a, cfg.heads, cfg.head_dim)
        return out

    def project(self, i: int, x: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """q, k, v, index q, index k of hidden states ``x`` [n, hidden] at ``positions``: normed and rotated."""
        cfg, w, a = self.cfg, self.w, f"model.layers.{i}.self_attn"
        n = x.shape[0]
        q = (x @ w[f"{a}.q_proj.weight"].T).view(n, cfg.heads, cfg.head_dim)
        k = (x @ w[f"{a}.k_proj.weight"].T).view(n, cfg.kv_heads, cfg.head_dim)
        v = (x @ w[f"{a}.v_proj.weight"].T).view(n, cfg.kv_heads, cfg.head_dim)
        q = self.norm_rope(q, w[f"{a}.q_norm.weight"], positions)
        k = self.norm_rope(k, w[f"{a}.k_norm.weight"], positions)
        if not self.sparse_layer(i):
            return q, k, v, None, None
        sp = cfg.sparse
        assert sp is not None
        iq = (x @ w[f"{a}.index_q_proj.weight"].T).view(n, sp.index_heads, sp.index_dim)
        ik = (x @ w[f"{a}.index_k_proj.weight"].T).view(n, 1, sp.index_dim)
        iq = self.norm_rope(iq, w[f"{a}.index_q_norm.weight"], positions)
        ik = self.norm_rope(ik, w[f"{a}.index_k_norm.weight"], positions)[:, 0]
        return q, k, v, iq, ik

    # -- whole sequences --------------------------------------------------------------------------------------
    def run(self, ids: torch.Tensor, start: int, prefix: Prefix | None, all_positions: bool
            ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], list[torch.Tensor | None]]:
        """Tokens ``ids`` [R, n] at positions start.., each row after ``prefix`` (None: start is 0): the
        log-probabilities [R, n, vocab] (or [R, 1, vocab] of the last position only), the new rows' keys,
        values and index keys per layer ([R, n, ...]). Where :attr:`trace` is a list, each layer's residual
        stream and the MoE's expert choice are appended to it (the depth measurement reads them)."""
        cfg, w = self.cfg, self.w
        rows, n = ids.shape
        positions = torch.arange(start, start + n, device=self.device)
        stream = w["model.embed_tokens.weight"][ids.reshape(-1)]  # [R*n, hidden]: the residual stream
        # The norm after each residual add reads the sum before it is rounded to the dtype (FlashInfer's fused
        # add + Gemma RMSNorm keeps it in float32); the stream itself is kept in the dtype.
        summed = stream.float()
        keys, values, index_keys = [], [], []
        for i in range(cfg.layers):
            p = f"model.layers.{i}"
            x = gemma_norm(summed, w[f"{p}.input_layernorm.weight"], cfg.eps).to(self.dtype)
            parts = [self.project(i, x[r * n:(r + 1) * n], positions) for r in range(rows)]
            outs = []
            for q, k, v, iq, ik in parts:
                if prefix is not None:
                    k_all = torch.cat((prefix.keys[i], k))
                    v_all = torch.cat((prefix.values[i], v))
                    pik = prefix.index_keys[i]
                    ik_all = torch.cat((pik, ik)) if pik is not None and ik is not None else ik
                else:
                    k_all, v_all, ik_all = k, v, ik
                outs.append(self.attend(i, q, k_all, v_all, iq, ik_all, start))
            attn = self.jostled(torch.cat(outs).reshape(rows * n, cfg.heads * cfg.head_dim), positions, i, 0)
            summed = stream.float() + (attn @ w[f"{p}.self_attn.o_proj.weight"].T).float()
            stream = summed.to(self.dtype)
            x = gemma_norm(summed, w[f"{p}.post_attention_layernorm.weight"], cfg.eps).to(self.dtype)
            mlp = self.moe(x, i) if i in cfg.moe_layers else self.mlp(x, f"{p}.mlp")
            summed = stream.float() + self.jostled(mlp, positions, i, 1).float()
            stream = summed.to(self.dtype)
            if self.trace is not None:
                self.trace.append(("stream", i, stream.float().cpu()))
            keys.append(torch.stack([part[1] for part in parts]))
            values.append(torch.stack([part[2] for part in parts]))
            iks = [part[4] for part in parts if part[4] is not None]
            index_keys.append(torch.stack(iks) if len(iks) == rows else None)
        hidden = summed.view(rows, n, cfg.hidden)
        if not all_positions:
            hidden = hidden[:, -1:]
        hidden = gemma_norm(hidden, w["model.norm.weight"], cfg.eps).to(self.dtype)
        return torch.log_softmax((hidden @ w["lm_head.weight"].T).float(), dim=-1), keys, values, index_keys

    def jostled(self, t: torch.Tensor, positions: torch.Tensor, layer: int, place: int) -> torch.Tensor:
        """``t`` [rows * n, width] (rows of tokens at ``positions`` [n]) with :attr:`jostle`'s steps; itself where
        none is set or ``t`` is float32 (a step of float32 is no rounding the engine makes)."""
        if self.jostle is None or t.dtype not in (torch.bfloat16, torch.float16):
            return t
        share, seed = self.jostle
        width = t.shape[-1]
        pos = positions.repeat(t.shape[0] // positions.shape[0]).to(torch.int64)
        h = (pos[:, None] * 73_856_093) ^ (torch.arange(width, device=t.device, dtype=torch.int64)[None, :]
                                           * 19_349_663) ^ (layer * 83_492_791 + place * 2_654_435 + seed * 97_531)
        h = (h * 6_364_136_223_846_793_005 + 1_442_695_040_888_963_407) >> 33
        u = (h & 0xFFFF).to(torch.float32) / 65_536.0
        step = torch.where(u < share / 2, -1, torch.where(u < share, 1, 0))
        # The step moves the magnitude (sign kept, never past zero or the largest finite value), in the bits.
        bits = t.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
        top = 0x7F7F if t.dtype is torch.bfloat16 else 0x7BFF
        magnitude = ((bits & 0x7FFF) + step).clamp(0, top)
        out = (bits & 0x8000) | magnitude
        return torch.where(out >= 0x8000, out - 0x10000, out).to(torch.int16).view(t.dtype)

    @torch.no_grad()
    def prefill(self, ids: Sequence[int], all_positions: bool = False) -> Prefix:
        """Run the prompt ``ids`` once; its keys and values are kept for :meth:`extend`."""
        if not ids:
            raise Malformed("an empty prompt")
        t = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        logprobs, keys, values, index_keys = self.run(t, 0, None, all_positions)
        return Prefix(list(ids), [k[0] for k in keys], [v[0] for v in values],
                      [None if ik is None else ik[0] for ik in index_keys], logprobs[0, -1],
                      logprobs[0] if all_positions else None)

    @torch.no_grad()
    def extend(self, prefix: Prefix, continuations: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Log-probabilities after every token of each continuation of ``prefix`` (teacher-forced): for a
        continuation of L tokens, [L, vocab], row j the distribution of the token after its j-th token. The
        continuations run as one batch, padded at their ends (causal: padding changes no earlier row)."""
        if not continuations:
            return []
        longest = max(len(c) for c in continuations)
        if longest == 0:
            return [prefix.last.new_zeros((0, self.cfg.vocab)) for _ in continuations]
        padded = [list(c) + [0] * (longest - len(c)) for c in continuations]
        t = torch.tensor(padded, dtype=torch.long, device=self.device)
        logprobs = self.run(t, len(prefix.ids), prefix, True)[0]
        return [logprobs[r, :len(c)] for r, c in enumerate(continuations)]

    @torch.no_grad()
    def greedy(self, prefix: Prefix, max_tokens: int) -> tuple[list[int], list[float]]:
        """The golden's own reply to ``prefix``'s prompt, greedy, and the top-1 margin (nats) at each position."""
        tokens: list[int] = []
        margins: list[float] = []
        dist = prefix.last
        for _ in range(max_tokens):
            top = torch.topk(dist, 2)
            tokens.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
            dist = self.extend(prefix, [tokens])[0][-1]
        return tokens, margins
