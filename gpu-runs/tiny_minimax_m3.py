"""Write a tiny MiniMax-M3 checkpoint that vLLM serves without any download.

    python3 gpu-runs/tiny_minimax_m3.py OUT_DIR [--layers 2] [--seed 0] [--flat]

The model is vLLM's own MiniMax-M3 text backbone (architecture
``MiniMaxM3SparseForCausalLM``, config ``model_type`` ``minimax_m3_vl`` with a
``text_config``), shrunk to small widths while keeping what the #49149 bug
needs: every layer runs the sparse "index" attention branch (lightning indexer
+ top-k block selection + block-sparse attention, the common Triton path on
Hopper), with 4 index heads (= KV heads) of dim 128, 16 top-k blocks of 128
tokens, init 0 / local 1, as in the released model. With more than one index
head, the kernels address the token-major [tokens, 4, 16] top-k buffer as
head-major (the bug), so (head h, token t) shares its slot with (h + 1, t - 4):
in any step with five or more query tokens one token's top-k overwrites
another's, across sequences as soon as two share a step (two prefills, a
prefill next to decodes, or five or more decodes; up to four decodes alone
do not collide).
The first layer has the dense MLP, the others a sigmoid-routed MoE with a
shared expert, like the released model's leading dense layers.

A model that reads its prompt. With plain random weights at 0.02 the replies
hardly depend on the prompt: measured on an H200 (2 layers, seed 0), 20
distinct replies for the 24 prompts of the sweep and a median gap of 0.014
nats between the first reply token's two best candidates, so a reply that
read the wrong top-k blocks often came out the same, and near-ties were
everywhere. Three gains fix that (measured on the same H200: 24 distinct
replies for 24 prompts, median first-token gap 1.4 nats):

- the attention's per-head q and k norms scaled by 2 (Gemma-style RMSNorm
  multiplies by ``1 + weight``: weight 1.0), so the attention scores are
  sharp enough that each token attends to a few others, not to an average of
  all (records up to 2026-12-07 used 4; see below);
- the attention's output projection scaled by 8, so what attention read
  (the prompt) outweighs the token's own embedding in the residual stream;
- the LM head scaled by 15, so the logits are spread: the best token leads
  its runner-up by about a nat, not by a hundredth.

Why 2 and not 4: a q/k gain g multiplies the attention logits by g squared,
and at 4 (logits spread about 16 apart) attention is nearly an argmax, which
turns every rounding into a different choice of key. Measured on CPU, seed 2,
4 layers, the golden at bfloat16 against float32 (golden_run.py on 8 short
prompts; docs/gpu-verification.md has the table): at gain 4 the residual
streams part by 1.3%, 4.3%, 11.7% and 24.6% after layers 0-3 (two to three
times more at every layer) and the bfloat16 golden's first token differs from
float32's at 27 of 64 positions; at gain 2, 0.7%, 1.4%, 2.0% and 2.6%, and 4
of 64, while the model still reads its prompt (8 distinct replies to 8
prompts). A trained model's error does not double at every layer either
(bfloat16 serves models of sixty layers), so a golden that can judge this
model at four layers is held to what it will meet, not excused from it.
``--qk-norm-gain`` and ``--o-proj-gain`` write other gains, for that
measurement.

The recording step measures it again on every run (distinct replies and the
median first-token gap, in the reference file's ``prompt_sensitivity`` and
the record). ``--flat`` writes the earlier weights (no gains), as in the
records up to 2026-12-03.

Weights are random (float32 in safetensors; vLLM casts them to the serving
dtype), named as the released checkpoint names them, so that vLLM's own
``load_weights`` maps them (q/k/v/index_q/index_k -> fused qkv_proj,
gate/up -> gate_up_proj, experts' w1/w2/w3). The tokenizer is byte-level BPE
over the 256 byte symbols with no merges, written by the ``tokenizers``
library, with a small chat template: it needs no download.

Needs numpy, safetensors and tokenizers (a GPU host with torch has them).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# The released model's attention geometry, which the index kernels are written for.
HEAD_DIM = 128
KV_HEADS = 4  # index heads must equal KV heads (MinimaxM3QKVParallelLinearWithIndexer)
Q_HEADS = 64  # 16 query heads per KV head, as the released model has on one GPU
INDEX_DIM = 128  # index head size must equal the main head size
TOPK_BLOCKS = 16
BLOCK = 128
# Widths shrunk from 6144 / 3072 / 12288 / 128 experts.
HIDDEN = 256
EXPERT_INTER = 128
DENSE_INTER = 256
EXPERTS = 8
TOP_K = 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 320  # 256 byte symbols + specials, padded to a multiple of 64
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def config(layers: int) -> dict:
    text = {
        "model_type": "minimax_m3_text",
        "architectures": ["MiniMaxM3SparseForCausalLM"],
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": EXPERT_INTER,
        "dense_intermediate_size": DENSE_INTER,
        "shared_intermediate_size": EXPERT_INTER,
        "num_hidden_layers": layers,
        "num_attention_heads": Q_HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "use_gemma_norm": True,
        "attention_output_gate": False,
        "rope_theta": 5000000,
        "rotary_dim": HEAD_DIM // 2,
        "partial_rotary_factor": 0.5,
        "hidden_act": "swigluoai",
        "swiglu_alpha": 1.702,
        "swiglu_beta": 1.0,
        "swiglu_limit": 7.0,
        "use_qk_norm": True,
        "qk_norm_type": "per_head",
        "num_local_experts": EXPERTS,
        "num_experts_per_tok": TOP_K,
        "n_shared_experts": 1,
        "scoring_func": "sigmoid",
        "use_routing_bias": True,
        "routed_scaling_factor": 2.0,
        "num_mtp_modules": 0,
        "moe_layer_freq": [0] + [1] * (layers - 1),
        "sparse_attention_config": {
            "use_sparse_attention": True,
            "sparse_index_dim": INDEX_DIM,
            "sparse_num_index_heads": KV_HEADS,
            "sparse_topk_blocks": TOPK_BLOCKS,
            "sparse_block_size": BLOCK,
            "sparse_disable_index_value": [1] * layers,
            "sparse_score_type": "max",
            "sparse_init_block": 0,
            "sparse_local_block": 1,
            "sparse_attention_freq": [1] * layers,
        },
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 0,
        "pad_token_id": 0,
    }
    return {
        "model_type": "minimax_m3_vl",
        "architectures": ["MiniMaxM3SparseForCausalLM"],
        "text_config": text,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 0,
        "pad_token_id": 0,
        "tie_word_embeddings": False,
    }


# The gains that make the model read its prompt (see the module's docstring).
QK_NORM_GAIN = 2.0
O_PROJ_GAIN = 8.0
LM_HEAD_GAIN = 15.0


def weights(layers: int, seed: int, flat: bool = False, qk_gain: float = QK_NORM_GAIN,
            o_gain: float = O_PROJ_GAIN) -> dict:
    import numpy as np

    rng = np.random.default_rng(seed)

    def w(*shape: int, scale: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        # Gemma-style RMSNorm multiplies by (1 + weight): zeros keep the scale at one.
        return np.zeros((n,), dtype=np.float32)

    qk, o_gain, head_gain = (1.0, 1.0, 1.0) if flat else (qk_gain, o_gain, LM_HEAD_GAIN)
    lm_head = w(VOCAB, HIDDEN) * head_gain
    # Only byte symbols are ever the most likely token: no end-of-text, so every
    # request generates its max_tokens and sequences stay in flight together.
    lm_head[: len(SPECIALS)] = 0
    lm_head[len(SPECIALS) + 256:] = 0
    t: dict = {
        "model.embed_tokens.weight": w(VOCAB, HIDDEN, scale=1.0),
        "model.norm.weight": ones(HIDDEN),
        "lm_head.weight": lm_head,
    }
    for i in range(layers):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = ones(HIDDEN)
        t[f"{p}.post_attention_layernorm.weight"] = ones(HIDDEN)
        a = f"{p}.self_attn"
        t[f"{a}.q_proj.weight"] = w(Q_HEADS * HEAD_DIM, HIDDEN)
        t[f"{a}.k_proj.weight"] = w(KV_HEADS * HEAD_DIM, HIDDEN)
        t[f"{a}.v_proj.weight"] = w(KV_HEADS * HEAD_DIM, HIDDEN)
        t[f"{a}.o_proj.weight"] = w(HIDDEN, Q_HEADS * HEAD_DIM) * o_gain
        # Gemma-style: the norm multiplies by (1 + weight), so a gain g is weight g - 1.
        t[f"{a}.q_norm.weight"] = ones(HEAD_DIM) + (qk - 1.0)
        t[f"{a}.k_norm.weight"] = ones(HEAD_DIM) + (qk - 1.0)
        # Large index projections spread the index scores, so top-k picks differ by head.
        t[f"{a}.index_q_proj.weight"] = w(KV_HEADS * INDEX_DIM, HIDDEN, scale=0.2)
        t[f"{a}.index_k_proj.weight"] = w(INDEX_DIM, HIDDEN, scale=0.2)
        t[f"{a}.index_q_norm.weight"] = ones(INDEX_DIM)
        t[f"{a}.index_k_norm.weight"] = ones(INDEX_DIM)
        if i == 0:
            m = f"{p}.mlp"
            t[f"{m}.gate_proj.weight"] = w(DENSE_INTER, HIDDEN)
            t[f"{m}.up_proj.weight"] = w(DENSE_INTER, HIDDEN)
            t[f"{m}.down_proj.weight"] = w(HIDDEN, DENSE_INTER)
            continue
        m = f"{p}.block_sparse_moe"
        t[f"{m}.gate.weight"] = w(EXPERTS, HIDDEN, scale=0.2)
        t[f"{m}.e_score_correction_bias"] = np.zeros((EXPERTS,), dtype=np.float32)
        for e in range(EXPERTS):
            t[f"{m}.experts.{e}.w1.weight"] = w(EXPERT_INTER, HIDDEN)
            t[f"{m}.experts.{e}.w3.weight"] = w(EXPERT_INTER, HIDDEN)
            t[f"{m}.experts.{e}.w2.weight"] = w(HIDDEN, EXPERT_INTER)
        t[f"{m}.shared_experts.gate_proj.weight"] = w(EXPERT_INTER, HIDDEN)
        t[f"{m}.shared_experts.up_proj.weight"] = w(EXPERT_INTER, HIDDEN)
        t[f"{m}.shared_experts.down_proj.weight"] = w(HIDDEN, EXPERT_INTER)
    return t


def tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 byte symbols
    vocab = {sym: i for i, sym in enumerate(SPECIALS)}
    for sym in sorted(alphabet):
        vocab.setdefault(sym, len(vocab))
    # Pad with unused symbols up to the model's vocabulary, so every id decodes.
    while len(vocab) < VOCAB:
        vocab[f"<|unused_{len(vocab)}|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS + [s for s in vocab if s.startswith("<|unused_")])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 8192,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
    }, indent=1) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps({
        "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=2, help="decoder layers (first dense MLP, the rest MoE)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--flat", action="store_true", help="no gains: the earlier weights, which hardly read the prompt")
    ap.add_argument("--qk-norm-gain", type=float, default=QK_NORM_GAIN,
                    help=f"the q/k norms' gain (default {QK_NORM_GAIN:g}; 4 until 2026-12-07: see the docstring)")
    ap.add_argument("--o-proj-gain", type=float, default=O_PROJ_GAIN, help=f"the output projection's gain "
                                                                          f"(default {O_PROJ_GAIN:g})")
    args = ap.parse_args(argv)
    if args.layers < 1:
        ap.error("--layers must be at least 1")
    from safetensors.numpy import save_file

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "config.json").write_text(json.dumps(config(args.layers), indent=1) + "\n")
    (args.out / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}) + "\n")
    tensors = weights(args.layers, args.seed, args.flat, args.qk_norm_gain, args.o_proj_gain)
    save_file(tensors, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    (args.out / "model.safetensors").chmod(0o644)
    tokenizer(args.out)
    size = sum(v.nbytes for v in tensors.values())
    gains = "no gains (--flat)" if args.flat else (f"gains: q/k norm x{args.qk_norm_gain:g}, "
                                                   f"o_proj x{args.o_proj_gain:g}, lm_head x{LM_HEAD_GAIN:g}")
    print(f"wrote {args.out}: MiniMaxM3SparseForCausalLM, {args.layers} layer(s), {len(tensors)} tensors, "
          f"{size / 1e6:.1f} MB, {gains}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
