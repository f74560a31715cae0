"""The golden forward on CPU, on the tiny MiniMax-M3 that gpu-runs/tiny_minimax_m3.py writes (2 layers: the dense
first layer and one MoE layer, short prompts): deterministic, teacher-forcing equal to running the whole sequence,
the sparse path equal to dense attention where every block is chosen (and not where the indexer must choose), the
block selection's rules, and the judge's power: a right computation in bfloat16 passes at the threshold measured
on other prompts, a reply made with the #49149 layout slip fails at a confident position, the golden's own greedy
reply passes.

The served model's blocks are 128 tokens, its top-k 16: every prompt shorter than 2,048 tokens reads all its
blocks, and the indexer decides nothing. The tests that need the indexer to choose use the same weights with 16-token
blocks and a top-k of 4 (``small_blocks``), so that prompts of about a hundred tokens have more blocks than it keeps.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_hotfix.errors import Malformed
from vllm_hotfix.golden import check as golden_check
from vllm_hotfix.golden import judge
from vllm_hotfix.golden.config import Sparse, parse
from vllm_hotfix.golden.forward import Golden, select
from vllm_hotfix.golden.scoring import Scorer, Served
from vllm_hotfix.inimage.reference import QUESTIONS, SENTENCES
from vllm_hotfix.verdicts import Status

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "gpu-runs" / "tiny_minimax_m3.py"
TOKENS = 8  # generated per reply


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # The machine's cores are shared: one thread keeps these tests' time steady.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "model"
    subprocess.run([sys.executable, str(TINY), str(out), "--layers", "2", "--seed", "0"], check=True,
                   capture_output=True)
    return out


def with_config(model: Path, where: Path, **sparse: object) -> Path:
    """The same weights under a config whose sparse settings are ``sparse``."""
    shutil.copytree(model, where)
    data = json.loads((where / "config.json").read_text())
    data["text_config"]["sparse_attention_config"].update(sparse)
    (where / "config.json").write_text(json.dumps(data))
    return where


@pytest.fixture(scope="module")
def small_blocks(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_config(model, tmp_path_factory.mktemp("small") / "model", sparse_block_size=16, sparse_topk_blocks=16)


def prompt(i: int) -> str:
    return SENTENCES[i % len(SENTENCES)] + SENTENCES[(i * 5 + 1) % len(SENTENCES)] + QUESTIONS[i % len(QUESTIONS)]


PROMPTS = [prompt(i) for i in range(6)]


def test_deterministic(model: Path):
    ids = Scorer(model, "cpu").prompt_ids(PROMPTS[0])
    first, second = Golden.load(model, "cpu"), Golden.load(model, "cpu")
    a, b = first.prefill(ids, all_positions=True), second.prefill(ids, all_positions=True)
    assert a.logprobs is not None and b.logprobs is not None and torch.equal(a.logprobs, b.logprobs)
    assert first.greedy(a, TOKENS) == second.greedy(b, TOKENS)


def test_continuations_equal_running_the_whole_sequence(small_blocks: Path):
    g = Golden.load(small_blocks, "cpu")
    ids = Scorer(small_blocks, "cpu").prompt_ids(PROMPTS[1])
    head, tail = ids[:60], ids[60:]
    whole = g.prefill(ids, all_positions=True)
    prefix = g.prefill(head)
    rows = g.extend(prefix, [tail, tail[:5]])
    assert whole.logprobs is not None
    assert torch.allclose(rows[0], whole.logprobs[60:], atol=1e-4)
    assert torch.allclose(rows[1], whole.logprobs[60:65], atol=1e-4)
    assert torch.allclose(prefix.last, whole.logprobs[59], atol=1e-4)


def test_sparse_attention_choosing_every_block_is_dense_attention(model: Path, tmp_path: Path):
    ids = Scorer(model, "cpu").prompt_ids(PROMPTS[2])
    every = Golden.load(with_config(model, tmp_path / "every", sparse_block_size=16, sparse_topk_blocks=64), "cpu")
    dense_dir = with_config(model, tmp_path / "dense", sparse_attention_freq=[0, 0])
    dense = Golden.load(dense_dir, "cpu")
    assert every.sparse_layer(0) and not dense.sparse_layer(0)
    chosen = Golden.load(with_config(model, tmp_path / "chosen", sparse_block_size=16, sparse_topk_blocks=2), "cpu")
    a, b, c = (m.prefill(ids, all_positions=True).logprobs for m in (every, dense, chosen))
    assert a is not None and b is not None and c is not None
    assert len(ids) > 16 * 4
    assert torch.allclose(a, b, atol=1e-5)
    # where the indexer must choose, it changes what the model computes: the sparse path is not dense attention
    assert (a - c).abs().max() > 0.05


def sparse(**kw: int) -> Sparse:
    return Sparse(**{"index_heads": 1, "index_dim": 4, "topk_blocks": 2, "block_size": 4, "init_blocks": 0,
                     "local_blocks": 0, "layers": frozenset({0}), **kw})


@pytest.mark.parametrize(("settings", "position", "scores", "blocks"), [
    # three blocks reachable (position 9 is in block 2), top-2 of their scores
    ({}, 9, [5.0, 1.0, 3.0, 9.0], {0, 2}),
    # block 3 lies after the query: never chosen, whatever its score
    ({}, 9, [1.0, 2.0, 3.0, 99.0], {1, 2}),
    # fewer reachable blocks than the top-k: all of them
    ({}, 5, [1.0, 2.0, 3.0, 4.0], {0, 1}),
    # the init block forced in, the best of the rest
    ({"init_blocks": 1}, 13, [-9.0, 1.0, 5.0, 3.0], {0, 2}),
    # the local block (the query's own) forced in
    ({"local_blocks": 1}, 13, [7.0, 5.0, 1.0, -9.0], {0, 3}),
    # both forced: nothing left to choose
    ({"init_blocks": 1, "local_blocks": 1}, 13, [-9.0, 8.0, 9.0, -9.0], {0, 3}),
    # a NaN score is the lowest
    ({}, 13, [float("nan"), 1.0, 2.0, 0.5], {1, 2}),
])
def test_block_selection(settings, position, scores, blocks):
    sp = sparse(**settings)
    mask = select(torch.tensor([[scores]]), torch.tensor([position]), 16, sp)[0, 0]
    expected = torch.tensor([(k // 4) in blocks and k <= position for k in range(16)])
    assert torch.equal(mask, expected)


@pytest.mark.parametrize(("change", "key"), [
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"use_gemma_norm": False}, "use_gemma_norm"),
    ({"attention_output_gate": True}, "attention_output_gate"),
    ({"rope_scaling": {"factor": 2}}, "rope_scaling"),
    ({"sparse_attention_config": {"sparse_score_type": "mean"}}, "sparse_score_type"),
    ({"sparse_attention_config": {"sparse_disable_index_value": [0, 1]}}, "sparse_disable_index_value"),
])
def test_config_outside_what_the_golden_implements_is_refused_naming_the_key(model: Path, change, key):
    data = json.loads((model / "config.json").read_text())
    text = data["text_config"]
    for k, v in change.items():
        if k == "sparse_attention_config":
            text[k] = {**text[k], **v}
        else:
            text[k] = v
    with pytest.raises(Malformed, match=key):
        parse(data)


class HeadMajorRead(Golden):
    """The #49149 slip, written here from its description: the indexer stores each step's top-k token-major,
    [tokens, heads, k], and the attention reads the buffer head-major, [heads, tokens, k], so (head h, token t)
    attends to the blocks chosen for another (head, token). Here in every prompt's prefill (one step, all its
    tokens); the query's own block stays readable so no row is left without a key."""

    def allowed(self, scores: torch.Tensor, positions: torch.Tensor, keys: int) -> torch.Tensor:
        sp = self.cfg.sparse
        assert sp is not None
        heads, n, count = scores.shape
        tokens = select(scores, positions, count * sp.block_size, sp)
        blocks = tokens.view(heads, n, count, sp.block_size).any(-1)  # the indexer's choice per (head, token)
        if int(positions[0]) == 0:
            blocks = blocks.transpose(0, 1).contiguous().view(heads, n, count)
        read = blocks.repeat_interleave(sp.block_size, dim=-1)[..., :keys]
        key = torch.arange(keys)
        own = (key[None, :] // sp.block_size) == (positions[:, None] // sp.block_size)
        return (read | own[None]) & (key[None, :] <= positions[:, None])[None]


def serve(model: Golden, ids: list[int], request: int, prompt: int) -> Served:
    """What a server computing as ``model`` would send: its greedy reply, its log-probabilities and top-5."""
    prefix = model.prefill(ids)
    tokens, _ = model.greedy(prefix, TOKENS)
    dists = torch.cat((prefix.last[None], model.extend(prefix, [tokens[:-1]])[0]))
    top = torch.topk(dists, 5)
    return Served("fixed", 1, request, prompt, tuple(f"token_id:{t}" for t in tokens),
                  tuple(float(dists[j, t]) for j, t in enumerate(tokens)),
                  tuple({f"token_id:{int(i)}": float(v) for i, v in zip(top.indices[j], top.values[j], strict=True)}
                        for j in range(len(tokens))), len(ids))


@pytest.fixture(scope="module")
def judged(small_blocks: Path) -> dict[str, object]:
    """The noise measured on bfloat16 replies (the trusted image), and every way of serving the prompts judged at
    it: float16 (another right computation in lower precision), the layout slip, the golden's own greedy reply."""
    scorer = Scorer(small_blocks, "cpu")
    ids = [scorer.prompt_ids(p) for p in PROMPTS]
    assert all(len(i) > 16 * 4 for i in ids), "every prompt must span several blocks"
    bf16 = Golden.load(small_blocks, "cpu", torch.bfloat16)
    recorded, section = judge.recorded(scorer.score(PROMPTS, [serve(bf16, ids[k], k, k) for k in range(len(PROMPTS))]))
    assert recorded.status is Status.PASS and section is not None, recorded.detail
    limits = judge.thresholds(section)
    assert limits is not None
    out: dict[str, object] = {"thresholds": limits, "noise": section["noise"]}
    for name, served_by in (("fp16", Golden.load(small_blocks, "cpu", torch.float16)),
                            ("slip", HeadMajorRead.load(small_blocks, "cpu")), ("golden", scorer.golden)):
        scored = scorer.score(PROMPTS, [serve(served_by, ids[k], k, k) for k in range(len(PROMPTS))])
        out[name] = judge.check(judge.judge(scored, limits))
        out[f"{name}-noise"] = judge.noise(scored)
    return out


def test_a_right_computation_in_lower_precision_passes_at_the_thresholds_measured_in_bfloat16(judged):
    check = judged["fp16"]
    assert check.status is Status.PASS, (check.detail, judged["noise"])
    assert check.data["confident"] > 0


def test_the_49149_layout_slip_fails_at_a_confident_position(judged):
    check = judged["slip"]
    assert check.status is Status.FAIL, (check.detail, judged["noise"])
    first = check.data["first_disagreement"]
    assert first["margin_nats"] > judged["thresholds"].of(first["prompt"]) and first["golden"] != first["served"]
    # and a recording from it would be refused: it lies far from the golden everywhere
    assert judged["slip-noise"]["median_nats"] > judge.NOISE_CEILING, judged["slip-noise"]


def test_the_goldens_own_greedy_reply_passes(judged):
    check = judged["golden"]
    assert check.status is Status.PASS and check.data["agreeing"] == check.data["confident"] > 0, check.detail


def test_a_reply_whose_prompt_the_server_counted_otherwise_cannot_be_scored(model: Path):
    scorer = Scorer(model, "cpu")
    ids = scorer.prompt_ids(PROMPTS[0])
    bad = Served("http", 1, 0, 0, ("token_id:70",), (-0.1,), ({"token_id:70": -0.1},), len(ids) + 1)
    odd = Served("http", 1, 1, 0, ("hello",), (-0.1,), ({},), len(ids))
    got = scorer.score(PROMPTS, [bad, odd])
    assert "the server counted" in got[0].problem and "no token ID" in got[1].problem


def test_the_check_on_a_recording_then_on_a_judged_run(model: Path):
    scorer = Scorer(model, "cpu")
    ids = [scorer.prompt_ids(p) for p in PROMPTS[:2]]
    served = [serve(scorer.golden, ids[k], k, k) for k in range(2)]
    recorded, section = golden_check.run(model, PROMPTS, served, section=None, recording=True)
    assert recorded.status is Status.PASS and section is not None, recorded.detail
    assert section["timing"]["device"] == "cpu" and section["noise"]["max_nats"] < 1e-3
    got, kept = golden_check.run(model, PROMPTS, served, section=section, recording=False)
    assert got.status is Status.PASS and kept is None, got.detail


def test_without_torch_the_check_is_a_skip_that_says_so(tmp_path: Path):
    code = ("import sys; sys.modules['torch'] = None\n"
            "from vllm_hotfix.golden import check\n"
            "got, section = check.run(__import__('pathlib').Path('.'), ['p'], [], section={'noise': "
            "{'threshold_nats': 1.0}}, recording=False)\n"
            "print(got.status.value, '|', got.detail, '|', section)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, check=True)
    status, detail, section = (part.strip() for part in done.stdout.split("|"))
    assert status == "skip" and "torch is not installed on this host" in detail and section == "None"


def test_the_gpu_hosts_golden_run_reports_the_noise_of_a_reference(model: Path, tmp_path: Path):
    """gpu-runs/golden_run.py, as the GPU host runs it: on a reference whose answers a bfloat16 computation gave
    (at concurrency 1 and at two fixed-batch levels), it times the golden and reports the noise per prompt."""
    import importlib.util

    from vllm_hotfix.inimage import reference as answers

    spec = importlib.util.spec_from_file_location("golden_run", REPO / "gpu-runs" / "golden_run.py")
    assert spec is not None and spec.loader is not None
    golden_run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(golden_run)
    scorer = Scorer(model, "cpu")
    bf16 = Golden.load(model, "cpu", torch.bfloat16)
    prompts = PROMPTS[:2]
    served = [serve(bf16, scorer.prompt_ids(p), k, k) for k, p in enumerate(prompts)]
    got = [answers.Answer(p, s.prompt_tokens, s.tokens, s.logprobs, tuple(dict(t) for t in s.top), "length",
                          answers.tokens_sha256(s.tokens)) for p, s in zip(prompts, served, strict=True)]
    levels = {"answers": {str(c): [{**a.to_dict(), "prompt": k} for k, a in enumerate(got)] for c in (1, 2)}}
    ref = answers.write(answers.Reference("m", "m", TOKENS, 5, tuple(got), "0", "now", "image", levels=levels),
                        tmp_path / "answers.json")
    out = tmp_path / "golden.json"
    assert golden_run.main([str(model), "--reference", ref.path, "--device", "cpu", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["greedy"]["prompts"] == 2 and report["greedy"]["tokens_each"] == TOKENS
    assert report["scoring"]["replies"] == 6 and report["scoring"]["distinct_replies"] == 2
    assert set(report["noise"]["by_prompt_max_nats"]) == {"0", "1"}
    judged = report["judged_at_this_noise"]
    assert judged["positions"] == 6 * TOKENS and judged["first_disagreement"] is None
    assert report["greedy_vs_reference"]["prompts"] == 2


def sweep_and_probe(served: list[Served]) -> tuple[bytes, bytes]:
    """What a runner sends back for ``served`` (one reply per prompt): the HTTP sweep's replies at concurrency 1
    and 2 (``LEVEL:I``), and the fixed-batch probe's lines at levels 1 and 2."""
    http, lines = {}, []
    for level in (1, 2):
        for s in served:
            http[f"{level}:{s.request}"] = {"text": "", "finish_reason": "length", "prompt_tokens": s.prompt_tokens,
                                            "completion_tokens": len(s.tokens), "tokens": list(s.tokens),
                                            "logprobs": list(s.logprobs), "top": [dict(t) for t in s.top],
                                            "model": "m"}
        lines.append({"pass": 0, "level": level, "seconds": 0.1, "replies": [
            {"request": s.request, "prompt": s.prompt, "prompt_tokens": s.prompt_tokens, "tokens": list(s.tokens),
             "logprobs": list(s.logprobs), "top_logprobs": [dict(t) for t in s.top], "finish_reason": "length"}
            for s in served]})
    return json.dumps(http).encode(), json.dumps({"lines": [*lines, {"done": True}], "exit": 0}).encode()


def test_the_host_records_the_golden_noise_then_judges_a_run_against_it(small_blocks: Path):
    """The smoke's wiring (plan.golden_check): a recording run's replies (bfloat16) give the reference its golden
    section; a run whose replies a right computation made passes against it, one with the layout slip fails,
    naming the reply; a run whose sweep did not run is a skip."""
    from vllm_hotfix.checking.launchers import base, plan
    from vllm_hotfix.inimage import reference as answers
    from vllm_hotfix.verdicts import Check
    from vllm_hotfix.verdicts import judge as verdict_of

    scorer = Scorer(small_blocks, "cpu")
    prompts = PROMPTS[:3]
    ids = [scorer.prompt_ids(p) for p in prompts]
    job = {"serve": {"batches": {"prompts": prompts}}}
    swept = verdict_of("img", "sha256:0", [Check("serve-sweep", Status.PASS, "ok")], gpu_verified=False)

    def launched(served_by: Golden) -> base.Launched:
        http, probe = sweep_and_probe([serve(served_by, ids[k], k, k) for k in range(len(prompts))])
        return base.Launched(swept, replies=http, batches=probe)

    checks, section = plan.golden_check(job, launched(Golden.load(small_blocks, "cpu", torch.bfloat16)), None,
                                        small_blocks)
    assert [c.status for c in checks] == [Status.PASS] and section is not None, checks
    # judged: the HTTP sweep at concurrency 1 (not at 2: its batches are the timing's), fixed batches at 1 and 2
    assert section["recorded"]["replies"] == 3 * len(prompts)
    assert set(section["recorded"]["by_source"]) == {"http:1", "fixed:1", "fixed:2"}
    ref = answers.Reference("m", "m", TOKENS, 5, (), "0", "now", "image", golden=section)
    right, _ = plan.golden_check(job, launched(Golden.load(small_blocks, "cpu", torch.float16)), ref, small_blocks)
    assert right[0].status is Status.PASS, right[0].detail
    wrong, kept = plan.golden_check(job, launched(HeadMajorRead.load(small_blocks, "cpu")), ref, small_blocks)
    assert wrong[0].status is Status.FAIL and kept is None
    assert "HTTP sweep at concurrency 1, request" in wrong[0].detail, wrong[0].detail
    skipped = verdict_of("img", "sha256:0", [Check("serve-sweep", Status.SKIP, "no --serve-model")],
                         gpu_verified=False)
    none, _ = plan.golden_check(job, base.Launched(skipped), ref, small_blocks)
    assert none[0].status is Status.SKIP and "no --serve-model" in none[0].detail
    # no model folder on this host, or no answers judged: no golden check at all
    assert plan.golden_check(job, launched(scorer.golden), ref, None) == ([], None)
    assert plan.golden_check({"serve": {}}, launched(scorer.golden), ref, small_blocks) == ([], None)
