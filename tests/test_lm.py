"""The lm-eval adapter (`ExitbenchLM`, model "exitbench") against direct ExitEngine runs of the same tokens.

Requests are lm-eval `Instance`s built by hand, so every check here is about the adapter itself: what it
encodes, how it shares and batches passes, what it records, and that none of that changes an answer.
The embedded tiny-raven (trained on the chains task) answers easy chains at full depth; a random tiny Raven
over an 18-word vocabulary (helpers/models.py) stands in where long generations are needed.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from exitbench.models.checkpoint import open_checkpoint
from exitbench.engine import ExitConfig, ExitEngine
from exitbench.errors import ExitbenchError
from exitbench.harness.model import ExitbenchLM
from exitbench.models import save_checkpoint

from helpers.models import make_tiny_raven, make_tiny_tokenizer
from helpers.paths import TASKS_DIR

CHAINS = [json.loads(line) for line in (TASKS_DIR / "chains" / "test.jsonl").read_text().splitlines()
          if line.strip()]
DIGITS = [str(d) for d in range(10)]
R = 16  # tiny-raven's default depth (mean_recurrence); "accurate at full depth"
# The chains generate task's own generation kwargs (tasks/chains/chains.yaml).
CHAINS_GEN = {"until": ["\n"], "max_gen_toks": 2, "do_sample": False}

ADAPTIVE = [ExitConfig("second_order", threshold=0.1), ExitConfig("kl", threshold=1e-2)]
CONFIGS = [ExitConfig("fixed", threshold=R), *ADAPTIVE]
CONFIG_IDS = ["fixed16", "second_order0.1", "kl0.01"]
# The adapter does the same whatever the rule (the engine decides the exits): fixed depth and second_order fast,
# kl with the slow tests (its exits are checked against the engine in tests/test_engine.py and test_policies.py).
CONFIGS_FAST = [CONFIGS[0], CONFIGS[1], pytest.param(CONFIGS[2], marks=pytest.mark.slow)]


def docs(hop: int | None = None, n: int = 1) -> list[dict]:
    """The first n chains documents (of one hop, when given)."""
    return [d for d in CHAINS if hop is None or d["hop"] == hop][:n]


def req(kind: str, args: tuple, task: str = "t", doc_id: int = 0, idx: int = 0, doc: dict | None = None):
    return Instance(request_type=kind, doc=doc or {}, arguments=args, idx=idx, metadata=(task, doc_id, 1))


@pytest.fixture(scope="module")
def raven():
    """The embedded default checkpoint, loaded once for the module."""
    return open_checkpoint(None)


@pytest.fixture(scope="module")
def random18(tmp_path_factory) -> Path:
    """A random tiny Raven whose every token id decodes to a word: it generates long, EOS-free text."""
    return save_checkpoint(make_tiny_raven(vocab_size=18), tmp_path_factory.mktemp("random18") / "ck",
                           tokenizer=make_tiny_tokenizer())


def adapter(ck, cfg: ExitConfig, **kwargs) -> ExitbenchLM:
    return ExitbenchLM.from_checkpoint(ck, cfg, **kwargs)


def engine_score(ck, cfg: ExitConfig, tokens: list[int], n_ctx: int) -> tuple[float, bool, list[list[int]]]:
    """(sum logprob, all greedy, exit steps per token) of one request scored alone by a fresh engine."""
    (res,) = ExitEngine(ck.model, cfg).score([(tokens, n_ctx)])
    return sum(res.logprobs), all(res.greedy), [r.exit_steps for r in res.records]


def direct_tokens(ck, context: str, continuation: str) -> tuple[list[int], int]:
    """What the adapter should score for (context, continuation), built here from the tokenizer alone."""
    ctx = ck.tokenizer.encode(context, add_bos=True)
    whole = ck.tokenizer.encode(context + continuation, add_bos=True)
    assert whole[:len(ctx)] == ctx
    return whole, len(ctx)


# ---- loglikelihood -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg", CONFIGS_FAST, ids=CONFIG_IDS)
def test_loglikelihood_equals_direct_engine_score(raven, cfg):
    """Single-token, multi-token and wrong continuations, mixed in one call at batch size 4."""
    cases = []
    for d in docs(n=12):
        wrong = str((int(d["answer"]) + 1) % 10)
        cases += [(d["prompt"], " " + d["answer"]), (d["prompt"], " " + wrong),
                  (d["prompt"], f" {d['answer']} <eos>")]  # two tokens: the digit, then end of text
    lm = adapter(raven, cfg, batch_size=4)
    requests = [req("loglikelihood", c, task="chains_lambada", doc_id=i // 3, idx=i % 3)
                for i, c in enumerate(cases)]
    got = lm.loglikelihood(requests)
    assert len(got) == len(cases)
    for (context, continuation), (logprob, greedy) in zip(cases, got):
        tokens, n_ctx = direct_tokens(raven, context, continuation)
        want_lp, want_greedy, _ = engine_score(raven, cfg, tokens, n_ctx)
        assert isinstance(logprob, float) and isinstance(greedy, bool)
        assert logprob == pytest.approx(want_lp, abs=1e-5), (context, continuation)
        assert greedy == want_greedy, (context, continuation)
    # the two-token continuation really is two scored tokens
    tokens, n_ctx = direct_tokens(raven, *cases[2])
    assert len(tokens) - n_ctx == 2


@pytest.mark.parametrize("hop", [1, 2])
def test_is_greedy_is_honest_on_easy_hops(raven, hop):
    """At full depth the right digit of an easy hop is the argmax (greedy, near-zero loss); every wrong digit
    is not greedy and scores far lower."""
    lm = adapter(raven, ExitConfig("fixed", threshold=R))
    for j, d in enumerate(docs(hop, n=3)):
        requests = [req("loglikelihood", (d["prompt"], " " + c), task="chains_mc", doc_id=j, idx=i)
                    for i, c in enumerate(DIGITS)]
        out = lm.loglikelihood(requests)
        right = int(d["answer"])
        assert out[right][1] is True
        assert out[right][0] > -0.1
        for i, (lp, greedy) in enumerate(out):
            if i != right:
                assert greedy is False, (d["prompt"], i)
                assert lp < out[right][0] - 3


def options_scored_as_alone(ck, cfg: ExitConfig, lm: ExitbenchLM, questions: list[dict]) -> list:
    """Score the ten options of each of `questions` in one multiple-choice task through `lm` (built on `cfg`) and
    check each result against the engine scoring that option on its own; the requests."""
    requests = [req("loglikelihood", (d["prompt"], " " + c), task="chains_mc", doc_id=j, idx=i)
                for j, d in enumerate(questions) for i, c in enumerate(DIGITS)]
    out = lm.loglikelihood(requests)
    for r, (lp, greedy) in zip(requests, out):
        want_lp, want_greedy, _ = engine_score(ck, cfg, *direct_tokens(ck, *r.args))
        assert lp == pytest.approx(want_lp, abs=1e-5), r.args
        assert greedy == want_greedy
    return requests


@pytest.mark.parametrize("cfg", CONFIGS_FAST, ids=CONFIG_IDS)
def test_multiple_choice_options_match_scoring_each_alone(raven, cfg):
    """The ten options of a question share one pass inside a task; each option's result is still what the
    engine gives that option scored on its own, and the shared pass's tokens are counted once."""
    lm = adapter(raven, cfg, batch_size=8)
    questions = docs(n=6)
    requests = options_scored_as_alone(raven, cfg, lm, questions)
    stats = {(s["doc_id"], s["idx"]): s for s in lm.request_stats}
    assert len(stats) == len(requests)
    for j in range(len(questions)):
        assert [stats[(j, i)]["tokens"] for i in range(10)] == [1] + [0] * 9
    assert sum(s["tokens"] for s in lm.request_stats) == len(questions)


def test_shared_pass_stays_within_a_task(raven):
    """The same (context, continuation) in two tasks: same answer, but each task counts its own tokens."""
    lm = adapter(raven, ExitConfig("second_order", threshold=0.1), batch_size=8)
    d = docs(n=1)[0]
    requests = [req("loglikelihood", (d["prompt"], " " + c), task=task, doc_id=0, idx=i)
                for task in ("chains_mc", "chains_lambada") for i, c in enumerate(DIGITS[:3])]
    out = lm.loglikelihood(requests)
    assert out[:3] == out[3:]
    per_task = {}
    for s in lm.request_stats:
        per_task[s["task_name"]] = per_task.get(s["task_name"], 0) + s["tokens"]
    assert per_task == {"chains_mc": 1, "chains_lambada": 1}


def test_multiple_choice_sharing_under_the_oracle_policy(raven):
    cfg = ExitConfig("oracle")
    options_scored_as_alone(raven, cfg, adapter(raven, cfg, batch_size=8), docs(n=4))


@pytest.mark.parametrize("cfg", [ExitConfig("fixed", threshold=4), *ADAPTIVE], ids=["fixed4", *CONFIG_IDS[1:]])
def test_loglikelihood_batch_size_never_changes_results(raven, cfg):
    """Batching changes no exit and no greedy flag; log-probabilities agree to float32 rounding (padded batched
    matmuls round differently, ~1e-6)."""
    requests = [req("loglikelihood", (d["prompt"], " " + d["answer"]), task="chains_lambada", doc_id=j)
                for j, d in enumerate(docs(n=24))]
    one = adapter(raven, cfg, batch_size=1)
    many = adapter(raven, cfg, batch_size=16)
    a, b = one.loglikelihood(requests), many.loglikelihood(requests)
    assert [g for _, g in a] == [g for _, g in b]
    assert [lp for lp, _ in a] == pytest.approx([lp for lp, _ in b], abs=1e-5)
    assert [s["exit_steps"] for s in one.request_stats] == [s["exit_steps"] for s in many.request_stats]


def test_loglikelihood_rejects_an_empty_continuation(raven):
    lm = adapter(raven, ExitConfig("fixed", threshold=R))
    with pytest.raises(ExitbenchError, match="continuation"):
        lm.loglikelihood([req("loglikelihood", ("f=3 X=0", ""))])


# ---- loglikelihood_rolling ---------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[1]], ids=CONFIG_IDS[:2])
def test_rolling_windows_longer_than_the_context(raven, cfg):
    max_length = 8
    lm = ExitbenchLM(policy=cfg.policy, threshold=cfg.threshold, max_length=max_length, batch_size=3)
    assert lm.max_length == max_length
    texts = [docs(12, n=1)[0]["prompt"], docs(7, n=1)[0]["prompt"] + " " + docs(7, n=1)[0]["answer"],
             "f=3 X=0 c=X"]  # the last one fits in one window
    requests = [req("loglikelihood_rolling", (t,), task="rolling", doc_id=i) for i, t in enumerate(texts)]
    got = lm.loglikelihood_rolling(requests)
    bos = raven.tokenizer.bos_token_id
    for text, value, stats in zip(texts, got, lm.request_stats):
        # lm-eval's hf model rolls over the text as the tokenizer encodes it with its special tokens, so the
        # post-processor's BOS is scored after the prefix BOS of the first window.
        tokens = raven.tokenizer.encode(text, add_special_tokens=True)
        assert tokens[:2] == [bos, raven.tokenizer.encode(text)[0]]
        windows = [make_disjoint_window(w) for w in
                   get_rolling_token_windows(token_list=tokens, prefix_token=bos, max_seq_len=max_length,
                                             context_len=1)]
        # every token predicted exactly once, in order, and no window is longer than the context allows
        assert [t for _, cont in windows for t in cont] == tokens
        assert all(len(ctx) + len(cont) - 1 <= max_length for ctx, cont in windows)
        want = sum(engine_score(raven, cfg, ctx + cont, len(ctx))[0] for ctx, cont in windows)
        assert isinstance(value, float)
        assert value == pytest.approx(want, abs=1e-4)
        assert stats["tokens"] == len(tokens)
        assert len(stats["exit_steps"]) == len(tokens)
        if len(tokens) > max_length:
            assert len(windows) > 1
    assert len(raven.tokenizer.encode(texts[0])) > 3 * max_length  # the long text really needs windows
    # With a context of 8, the long text scores differently than in one full-context pass (the windows matter).
    full = ExitbenchLM(policy=cfg.policy, threshold=cfg.threshold).loglikelihood_rolling(requests[:1])[0]
    assert full != pytest.approx(got[0], abs=1e-3)


# ---- generate_until ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg", CONFIGS[:2], ids=CONFIG_IDS[:2])
def test_greedy_answer_of_easy_chains(raven, cfg):
    lm = adapter(raven, cfg, batch_size=4)
    easy = [d for hop in (1, 2, 3) for d in docs(hop, n=3)]
    requests = [req("generate_until", (d["prompt"], dict(CHAINS_GEN)), task="chains", doc_id=i)
                for i, d in enumerate(easy)]
    assert lm.generate_until(requests) == [d["answer"] for d in easy]


def test_stop_strings_cut_the_output(random18):
    lm = ExitbenchLM(checkpoint=str(random18), policy="fixed", threshold=4)
    prompt = "the cat sat on"
    full = lm.generate_until([req("generate_until", (prompt, {"until": [], "max_gen_toks": 20}))])[0]
    words = full.split()
    assert len(words) >= 6, full  # a long generation to cut
    stop = words[3]  # a word that first appears at or before position 3
    cut = lm.generate_until([req("generate_until", (prompt, {"until": [stop], "max_gen_toks": 20}))])[0]
    assert cut == full[:full.index(stop)]
    assert stop not in cut
    assert lm.request_stats[-1]["tokens"] <= 4  # generation stopped at the stop string, not at 20 tokens
    # a plain string (not a list) works too, and a stop string that never appears changes nothing
    assert lm.generate_until([req("generate_until", (prompt, {"until": stop, "max_gen_toks": 20}))])[0] == cut
    assert lm.generate_until([req("generate_until", (prompt, {"until": ["zebra"], "max_gen_toks": 20}))])[0] == full


def test_max_gen_toks_is_respected(random18):
    lm = ExitbenchLM(checkpoint=str(random18), policy="fixed", threshold=4, max_gen_toks=5)
    ck = lm.ck
    prompt = "the cat sat on"
    (ref,) = ExitEngine(ck.model, ExitConfig("fixed", threshold=4)).generate(
        # the tiny tokenizer has no post-processor, so (as under lm-eval's hf model) the prompt gets no BOS
        [ck.tokenizer.encode(prompt, add_special_tokens=True)], 20, stop_ids=[ck.tokenizer.eos_token_id])
    assert len(ref.tokens) == 20  # this prompt never reaches EOS within 20 tokens
    for n in (1, 3, 7):
        out = lm.generate_until([req("generate_until", (prompt, {"until": [], "max_gen_toks": n}))])[0]
        assert lm.request_stats[-1]["tokens"] == n
        assert out == ck.tokenizer.decode(ref.tokens[:n])
    # without max_gen_toks in the request, the constructor's max_gen_toks applies
    lm.generate_until([req("generate_until", (prompt, {"until": []}))])
    assert lm.request_stats[-1]["tokens"] == 5
    # and never more than half the context
    small = ExitbenchLM(checkpoint=str(random18), policy="fixed", threshold=4, max_length=16)
    small.generate_until([req("generate_until", (prompt, {"until": [], "max_gen_toks": 100}))])
    assert small.request_stats[-1]["tokens"] == 8


def test_generate_rejects_sampling(raven):
    lm = adapter(raven, ExitConfig("fixed", threshold=R))
    with pytest.raises(ExitbenchError, match="decodes greedily .* pass --gen-kwargs do_sample=false"):
        lm.generate_until([req("generate_until", ("f=3", {"until": [], "do_sample": True}))])


# fixed depth's batched generation with the slow tests: an adaptive rule's rows end at different times (harder)
@pytest.mark.parametrize("cfg", [pytest.param(CONFIGS[0], marks=pytest.mark.slow), CONFIGS[1]], ids=CONFIG_IDS[:2])
def test_generate_batch_size_one_and_eight_agree(raven, random18, cfg):
    """Prompts of different lengths whose generations end at different times: batching changes no output
    and no exit."""
    chains = [req("generate_until", (d["prompt"], dict(CHAINS_GEN)), task="chains", doc_id=i)
              for i, d in enumerate(docs(n=12))]
    one, eight = adapter(raven, cfg, batch_size=1), adapter(raven, cfg, batch_size=8)
    assert one.generate_until(chains) == eight.generate_until(chains)
    assert [s["exit_steps"] for s in one.request_stats] == [s["exit_steps"] for s in eight.request_stats]

    small_cfg = ExitConfig(cfg.policy, threshold=4 if cfg.policy == "fixed" else cfg.threshold)
    ck = open_checkpoint(random18)
    prompts = ["the cat sat on", "a dog ran", "big red mat", "the", "cat", "dog dog", "the small cat sat",
               "red", "slow dog and a big cat"]
    texts = [req("generate_until", (p, {"until": ["mat"], "max_gen_toks": 3 + i}), task="g", doc_id=i)
             for i, p in enumerate(prompts)]
    one, eight = adapter(ck, small_cfg, batch_size=1), adapter(ck, small_cfg, batch_size=8)
    a, b = one.generate_until(texts), eight.generate_until(texts)
    assert a == b
    assert len({len(s["exit_steps"]) for s in one.request_stats}) > 1  # rows really ended at different steps
    assert [s["exit_steps"] for s in one.request_stats] == [s["exit_steps"] for s in eight.request_stats]


# ---- constructor and request statistics ---------------------------------------------------------------------

def test_constructor_batch_sizes_and_device():
    assert ExitbenchLM(batch_size=3).batch_size == 3
    assert ExitbenchLM(batch_size="5").batch_size == 5
    assert ExitbenchLM(batch_size="auto").batch_size >= 1
    assert ExitbenchLM(batch_size="auto", max_batch_size=4).batch_size == 4
    assert ExitbenchLM(batch_size="auto:4", max_batch_size=2).batch_size == 2
    assert ExitbenchLM(batch_size=32, max_batch_size=8).batch_size == 8
    for bad in (0, -2, "many"):
        with pytest.raises(ExitbenchError, match="batch_size"):
            ExitbenchLM(batch_size=bad)
    if not torch.cuda.is_available():
        # A device asked for and missing is an error, never a silent CPU run.
        with pytest.raises(ExitbenchError, match="no CUDA device"):
            ExitbenchLM(device="cuda:0")
    assert ExitbenchLM(device="cpu").device == torch.device("cpu")
    assert ExitbenchLM(device="auto").device.type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_constructor_exit_knobs():
    lm = ExitbenchLM(policy="second_order", threshold=0.05, min_steps=2, max_steps=12, max_gen_toks=7)
    assert lm.exit_config.policy == "second_order" and lm.exit_config.threshold == 0.05
    assert lm.engine.policies[0].max_steps == 12 and lm.engine.policies[0].min_steps == 2
    assert lm.max_gen_toks == 7
    assert lm.max_length == lm.ck.model.config.block_size
    info = lm.get_model_info()["exitbench"]
    assert info["exit"]["policy"] == "second_order" and info["architecture"] == "huginn_raven"
    with pytest.raises(ExitbenchError, match="secnd_order"):
        ExitbenchLM(policy="secnd_order")


def test_constructor_rejects_unknown_model_args():
    with pytest.raises(ExitbenchError, match="treshold"):
        ExitbenchLM(treshold=16)
    with pytest.raises(ExitbenchError, match="pretrainde"):
        get_model("exitbench").create_from_arg_string("pretrainde=tiny-raven,policy=fixed")
    # lm-eval's usual name for the checkpoint is one (tests/test_hub.py: with a hub id)
    lm = get_model("exitbench").create_from_arg_string("pretrained=tiny-raven,policy=fixed")
    assert lm.ck.path.name == "tiny-raven"


def test_registered_in_lm_eval_with_cli_style_args():
    """How lm-eval's CLI builds the model: an arg string plus batch_size/max_batch_size/device."""
    cls = get_model("exitbench")
    assert cls is ExitbenchLM
    lm = cls.create_from_arg_string("policy=fixed,threshold=16",
                                    {"batch_size": "auto", "max_batch_size": 6, "device": "cpu"})
    assert lm.batch_size == 6
    assert lm.exit_config.threshold == 16
    assert lm.device == torch.device("cpu")
    lm = cls.create_from_arg_obj({"policy": "second_order", "threshold": 0.1}, {"batch_size": 2, "device": None})
    assert lm.batch_size == 2


def test_request_stats_rows(raven):
    lm = adapter(raven, ExitConfig("second_order", threshold=0.1), batch_size=4)
    d1, d2 = docs(1, n=1)[0], docs(6, n=1)[0]
    lm.loglikelihood([req("loglikelihood", (d1["prompt"], " " + d1["answer"]), task="chains_lambada",
                          doc_id=7, idx=0),
                      req("loglikelihood", (d2["prompt"], f" {d2['answer']} <eos>"), task="chains_lambada",
                          doc_id=9, idx=0)])
    lm.generate_until([req("generate_until", (d2["prompt"], dict(CHAINS_GEN)), task="chains", doc_id=3, idx=0)])
    lm.loglikelihood_rolling([req("loglikelihood_rolling", (d2["prompt"],), task="rolling", doc_id=5, idx=2)])
    rows = lm.request_stats
    assert [(r["task_name"], r["doc_id"], r["idx"], r["kind"]) for r in rows] == [
        ("chains_lambada", 7, 0, "loglikelihood"), ("chains_lambada", 9, 0, "loglikelihood"),
        ("chains", 3, 0, "generate_until"), ("rolling", 5, 2, "loglikelihood_rolling")]
    n_rolling = len(raven.tokenizer.encode(d2["prompt"], add_special_tokens=True))  # BOS included, as lm-eval
    assert [r["tokens"] for r in rows] == [1, 2, 2, n_rolling]  # generation: the digit, then EOS
    for r in rows:
        assert len(r["exit_steps"]) == r["tokens"]
        assert all(len(steps) == 1 and 1 <= steps[0] <= R for steps in r["exit_steps"])  # one loop group
        assert r["iterations"] == [sum(steps) for steps in r["exit_steps"]]
        assert r["mean_iterations"] == pytest.approx(sum(r["iterations"]) / r["tokens"])
        assert r["flops"] > 0 and r["seconds"] >= 0 and 0 <= r["probe_share"] <= 1
    # the adaptive policy really exits early somewhere, and the recorded exits are the engine's own
    assert min(s for r in rows for steps in r["exit_steps"] for s in steps) < R
    _, _, steps = engine_score(raven, lm.exit_config, *direct_tokens(raven, d2["prompt"], f" {d2['answer']} <eos>"))
    assert rows[1]["exit_steps"] == steps
    fixed = adapter(raven, ExitConfig("fixed", threshold=R))
    fixed.loglikelihood([req("loglikelihood", (d2["prompt"], f" {d2['answer']} <eos>"), task="x")])
    assert fixed.request_stats[0]["exit_steps"] == [[R], [R]]
    assert fixed.request_stats[0]["mean_iterations"] == R
