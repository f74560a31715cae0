"""The topk-layout check's reference, on CPU: the batch it builds, the top-k a right indexer selects, the dense
attention over those blocks, and the comparison that decides a scenario.

What the check runs on a GPU (the installed indexer and sparse attention on vLLM's Triton kernels) is compared
there with these functions; here each is held to a plain loop written from MiniMax-M3's definition, and the
tolerance to what one wrong block does to a token's output.
"""

from __future__ import annotations

import math
from types import ModuleType, SimpleNamespace

import pytest

from conftest import TOPK_CHECK, load_script

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def check() -> ModuleType:
    return load_script(TOPK_CHECK)


@pytest.fixture(scope="module")
def batch(check: ModuleType) -> SimpleNamespace:
    return check.make_batch(check.SMALL_SCENARIOS["tp1-nd3"], "cpu", 0)


def test_the_batch_is_laid_out_as_vllms_builders_lay_it_out(check: ModuleType, batch: SimpleNamespace) -> None:
    b = batch
    cfg = check.SMALL_SCENARIOS["tp1-nd3"]
    assert b.nd == 3 and b.T == 3 + sum(q for _, q in cfg["prefill"]) and b.T <= b.t_pad
    # Decodes first, each its sequence's last token; then each prefill's tokens after its context.
    assert b.position[:3] == [s - 1 for s in cfg["decode_seq_lens"]]
    assert b.position[3] == cfg["prefill"][0][0] and b.request[3] == 3
    assert b.qsl_t.tolist()[-1] == b.T and b.qsl_t.tolist()[:4] == [0, 1, 2, 3]
    # Every request's pages are its own, and no page is at its block number (so another row means other keys).
    pages = [p for r, nb in enumerate(b.blocks) for p in b.bt[r, :nb].tolist()]
    assert len(pages) == len(set(pages)) == sum(b.blocks)
    assert any(b.bt[r, i] != i for r in range(len(b.blocks)) for i in range(b.blocks[r]))


def test_block_scores_are_the_max_over_the_keys_each_token_sees(check: ModuleType, batch: SimpleNamespace) -> None:
    b = batch
    score = check.block_scores(b)
    iq = b.iq.double().view(b.T, b.H, b.D)
    for t in (0, 2, 3, 3 + 23, b.T - 1):
        r, p = b.request[t], b.position[t]
        keys = check.request_keys(b, b.kv_idx, r)
        for h in range(b.H):
            for blk in range(b.blocks[r]):
                seen = [pos for pos in range(blk * 128, min((blk + 1) * 128, b.seq_all[r])) if pos <= p]
                want = max(float(iq[t, h] @ keys[pos]) for pos in seen) if seen else -math.inf
                assert float(score[h, t, blk]) == pytest.approx(want, abs=1e-9), (t, h, blk)


def test_the_reference_top_k_forces_the_local_block_and_takes_the_best_scores(check: ModuleType) -> None:
    # One head, two tokens: at position 700 (6 visible blocks) and 200 (2 visible, fewer than top-k).
    score = torch.tensor([[[5.0, 9.0, 1.0, 7.0, 3.0, 0.5, 99.0], [4.0, 2.0, 8.0, 8.0, 8.0, 8.0, 8.0]]],
                         dtype=torch.float64)
    idx, margin = check.reference_topk(score, [700, 200], 3, 0, 1)
    assert set(idx[0, 0].tolist()) == {5, 1, 3}  # block 5 is local (forced); then 9.0 and 7.0; 99.0 is not visible
    assert float(margin[0, 0]) == pytest.approx(7.0 - 5.0)
    assert sorted(idx[0, 1].tolist()) == [-1, 0, 1] and math.isinf(float(margin[0, 1]))
    # An exact tie at the boundary: two right selections, margin 0.
    tied = torch.tensor([[[5.0, 6.0, 6.0, 1.0, 0.0, 0.0]]], dtype=torch.float64)
    _, margin = check.reference_topk(tied, [700], 2, 0, 1)
    assert float(margin[0, 0]) == 0.0
    # An init block is forced too.
    idx, _ = check.reference_topk(score[:, :1], [700], 3, 1, 1)
    assert set(idx[0, 0].tolist()) == {0, 5, 1}


def test_the_reference_attention_is_dense_softmax_over_the_chosen_blocks(check: ModuleType,
                                                                        batch: SimpleNamespace) -> None:
    b = batch
    chosen, _ = check.reference_topk(check.block_scores(b), b.position, b.K, b.init_blocks, b.local_blocks)
    out = check.reference_attention(b, chosen)
    q = b.q.double().view(b.T, b.num_heads, b.hd)
    for t in (1, 3, 3 + 30, b.T - 1):
        r, p = b.request[t], b.position[t]
        keys, values = check.request_keys(b, b.kv[:, 0], r), check.request_keys(b, b.kv[:, 1], r)
        for qh in range(b.num_heads):
            h = qh // b.gqa
            blocks = {int(x) for x in chosen[h, t] if x >= 0}
            pos = [i for i in range(b.seq_all[r]) if i // 128 in blocks and i <= p]
            s = torch.stack([q[t, qh] @ keys[i, h] for i in pos]) * b.scale
            want = torch.softmax(s, 0) @ torch.stack([values[i, h] for i in pos])
            assert torch.allclose(out[t, qh], want, atol=1e-12), (t, qh)


def _one_block_wrong(b: SimpleNamespace, chosen: torch.Tensor) -> torch.Tensor:
    """Each token's choice with one block of one head swapped for a visible block left out (where there is one)."""
    wrong = chosen.clone()
    for t in range(b.T):
        valid = b.position[t] // 128 + 1
        row = wrong[0, t]
        left_out = [x for x in range(valid) if x not in row.tolist()]
        if left_out:
            row[0] = left_out[0]
    return wrong


def test_one_wrong_block_moves_a_token_far_past_the_tolerance_and_rounding_does_not(
        check: ModuleType, batch: SimpleNamespace) -> None:
    b = batch
    chosen, margin = check.reference_topk(check.block_scores(b), b.position, b.K, b.init_blocks, b.local_blocks)
    ref = check.reference_attention(b, chosen)
    err = check.relative_error(check.reference_attention(b, _one_block_wrong(b, chosen)), ref)
    moved = [t for t in range(b.T) if b.position[t] // 128 + 1 > b.K]
    assert moved and float(err[moved].min()) > 5 * check.REL_TOL
    # The kernels keep probabilities and outputs in bfloat16: rounding the reference so moves it far less.
    rounded = check.relative_error(ref.to(torch.bfloat16), ref)
    assert float(rounded.max()) < check.REL_TOL / 4
    judged = check.judge_tokens(err, rounded, margin, b.nd)
    assert judged["off"] == len(moved) and judged["first_off"]["token"] == moved[0]
    assert not check.scenario_ok(judged)
    right = check.judge_tokens(rounded, rounded, margin, b.nd)
    assert right["off"] == 0 and check.scenario_ok(right)


def test_a_token_with_a_tie_is_left_out_and_nan_counts_as_off(check: ModuleType) -> None:
    err = torch.tensor([0.001, 0.5, float("nan"), 0.001], dtype=torch.float64)
    floor = torch.full((4,), 0.001, dtype=torch.float64)
    margin = torch.tensor([[1.0, 1e-5, 1.0, math.inf], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    got = check.judge_tokens(err, floor, margin, 1)
    assert got["tied"] == 1 and got["judged"] == 3 and got["off"] == 1 and got["first_off"]["token"] == 2
    assert got["not_finite"] == 1 and got["max_rel_err"] == math.inf


def test_the_small_shapes_keep_what_makes_the_layout_matter(check: ModuleType) -> None:
    for name, small in check.SMALL_SCENARIOS.items():
        big = check.SCENARIOS[name]
        assert small["index_heads"] == big["index_heads"]  # the collisions between heads
        assert len(small["decode_seq_lens"]) == len(big["decode_seq_lens"])  # 5 and 3 decodes
        assert len(small["prefill"]) == len(big["prefill"])
        # Some token still has more visible blocks than it may choose.
        assert max(small["decode_seq_lens"]) // 128 + 1 > small["topk"]
