"""exitbench's lm-eval adapter against lm-eval's own `hf` model on the same weights.

A tiny random GPT-2 is saved twice: as an exitbench checkpoint (a looped GPT-2 with one loop group of all its
layers, run once) and as a Hugging Face GPT-2 directory that `lm_eval --model hf --model_args pretrained=DIR`
would load, with the same tokenizer.json. Both adapters then get the same loglikelihood, rolling and greedy
generation requests, under each tokenizer variant and each `add_bos_token` setting, and must agree on the
tokens they build, the log-likelihoods, is_greedy and the generated text.
"""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest
import transformers
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from safetensors.torch import load_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from exitbench.errors import ExitbenchError
from exitbench.harness.model import ExitbenchLM
from exitbench.models import LoopedGPT2, save_checkpoint
from exitbench.models.tokenizer import Tokenizer

from helpers.models import make_gpt2

BOS, EOS = "<bos>", "<eos>"
CORPUS = ["the cat sat on the mat. the dog ran fast, and a big red cat sat on a small mat!",
          "a dog and a cat ran on the red mat; the big dog sat. the small cat ran fast."] * 4
N_POSITIONS = 48  # small, so long requests are truncated and rolling texts need several windows
# Both compute in float32 with different kernels (exitbench's own attention and Conv1D against SDPA and addmm),
# so each log-probability differs by rounding, ~1e-6 on values of order 5 (measured: at most 2.4e-6 per
# loglikelihood request). lm-eval also sums a window's log-probabilities in float32: on a rolling text of ~90
# tokens (a sum near -500) that rounding is ~1e-5 (measured: 2.2e-5). 1e-4 covers both with room, and is far
# below what a wrong token or a missing BOS moves (nats).
LOGLIK_TOL = 1e-4

LONG = " ".join(CORPUS[:2])  # 46 tokens: with a continuation, over N_POSITIONS
LOGLIKELIHOOD = [
    ("", " the cat"),                      # empty context: conditioned on the prefix token
    ("", f"{BOS} the cat"),                # ... unless the continuation starts with it (BOS, or EOS where
    ("", f"{EOS} the cat"),                #     there is no BOS)
    ("the cat sat", " on the mat"),        # multi-token continuation
    ("the cat sat on ", "the mat."),       # context ending in a space: the space moves to the continuation
    (f"{BOS}the dog", " ran fast"),        # already starts with the prefix token's text: no special tokens
    (f"{EOS}the dog", " ran fast"),
    (LONG, " the big dog"),                # longer than the context: truncated from the left
]
ROLLING = ["the cat sat on the mat.", LONG + " " + LONG, f"{BOS}the dog ran"]
GENERATE = [("the cat sat", {"until": ["."], "max_gen_toks": 8, "do_sample": False}),
            ("a big red", {"until": ["\n"], "max_gen_toks": 6, "do_sample": False}),
            (f"{BOS}the dog", {"until": ["."], "max_gen_toks": 5, "do_sample": False})]


def fit_backend(corpus: list[str] = CORPUS) -> HFTokenizer:
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    # GPT-2's byte-level scheme, but only the corpus's own characters in the alphabet: every token then decodes
    # to whole characters, so a random model's generations are real text.
    backend.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=[BOS, EOS],
                                                            show_progress=False))
    return backend


# name: (a BOS post-processor in tokenizer.json, bos id in the configs)
VARIANTS = {"bos_template": (True, 0), "no_post_processor": (False, 0), "eos_only": (False, None)}


def random_gpt2(vocab_size: int, bos: int | None, eos: int) -> LoopedGPT2:
    """Every parameter random, scaled so next-token distributions are far from uniform (no near-ties for argmax
    to flip on) while logits stay of order 5: embeddings N(0, 0.3²), every matrix N(0, 1/fan_in)."""
    return make_gpt2(0, emb=0.3, w=1.0, proj=1.0, vocab_size=vocab_size, n_embd=32, n_layer=2, n_head=4,
                     n_positions=N_POSITIONS, loop_groups=[[0, 1]], loop_steps=[1], max_loop_steps=[1],
                     bos_token_id=bos, eos_token_id=eos, pad_token_id=eos)


class Saved(NamedTuple):
    variant: str
    template: bool
    bos: int | None
    ck_dir: Path  # exitbench's checkpoint
    hf_dir: Path  # the same weights and tokenizer.json as lm-eval's hf model loads them


def save_both(variant: str, root: Path, corpus: list[str] = CORPUS) -> Saved:
    """One random GPT-2 under one tokenizer variant (its BPE fitted on `corpus`), saved both ways."""
    template, bos = VARIANTS[variant]
    backend = fit_backend(corpus)
    eos = backend.token_to_id(EOS)
    tok = Tokenizer(backend, bos_token_id=bos, eos_token_id=eos, pad_token_id=eos)
    if template:
        tok.add_bos_post_processor()
    model = random_gpt2(tok.vocab_size, bos, eos)
    ck_dir = save_checkpoint(model, root / "exitbench", tokenizer=tok)

    hf_config = transformers.GPT2Config(
        vocab_size=tok.vocab_size, n_embd=32, n_layer=2, n_head=4, n_positions=N_POSITIONS,
        activation_function="gelu_new", layer_norm_epsilon=1e-5, tie_word_embeddings=True,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=bos, eos_token_id=eos, pad_token_id=eos)
    hf_model = transformers.GPT2LMHeadModel(hf_config)
    missing, unexpected = hf_model.load_state_dict(load_file(ck_dir / "model.safetensors"), strict=False)
    # exitbench writes Hugging Face GPT-2's own key names; only the causal-mask buffers it never stores differ
    assert unexpected == [] and all(k.endswith((".attn.bias", ".attn.masked_bias")) for k in missing), missing
    hf_dir = root / "hf"
    hf_model.save_pretrained(hf_dir)
    special = {"eos_token": EOS, **({"bos_token": BOS} if bos is not None else {})}
    transformers.PreTrainedTokenizerFast(tokenizer_file=str(ck_dir / "tokenizer.json"), **special
                                         ).save_pretrained(hf_dir)
    return Saved(variant, template, bos, ck_dir, hf_dir)


@pytest.fixture(scope="module")
def saved_as(tmp_path_factory):
    """variant -> Saved, each written once for the module."""
    done: dict[str, Saved] = {}

    def get(variant: str) -> Saved:
        if variant not in done:
            done[variant] = save_both(variant, tmp_path_factory.mktemp(variant))
        return done[variant]
    return get


# add_bos_token=true where there is no BOS is refused (test_add_bos_token_is_checked), not compared
SETTINGS = [(variant, add_bos_token) for variant, (_, bos) in VARIANTS.items()
            for add_bos_token in (None, True, False) if not (add_bos_token and bos is None)]


def instances(kind: str, args_list: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=args, idx=0, metadata=("parity", i, 1))
            for i, args in enumerate(args_list)]


def both(saved: Saved, add_bos_token: bool | None) -> tuple[HFLM, ExitbenchLM]:
    # Without its logits cache: in lm-eval 0.4.13 a one-token continuation that shares context + continuation[:-1]
    # with a longer continuation of a shorter context (here " on the mat" after "the cat sat" and the one-token
    # choices after "the cat sat on the") is scored from the first continuation row of the longer request's
    # logits (Collator.get_cache hands over the untrimmed rows; only is_greedy takes the trailing slice).
    hf = HFLM(pretrained=str(saved.hf_dir), device="cpu", dtype="float32", batch_size=1,
              add_bos_token=add_bos_token, logits_cache=False)
    # batch size 4: exitbench's own batching and sharing of passes must not move a number either
    ours = ExitbenchLM(checkpoint=str(saved.ck_dir), policy="fixed", threshold=1, batch_size=4, device="cpu",
                       add_bos_token=add_bos_token)
    assert ours.max_length == hf.max_length == N_POSITIONS
    assert ours.prefix_token_id == hf.prefix_token_id
    return hf, ours


@pytest.mark.parametrize("variant, add_bos_token", SETTINGS)
def test_same_tokens_and_numbers_as_lm_eval_hf(saved_as, variant, add_bos_token):
    hf, ours = both(saved_as(variant), add_bos_token)

    strings = [c for pair in LOGLIKELIHOOD for c in pair if c] + ROLLING + [p for p, _ in GENERATE]
    for s in strings:
        assert ours.tok_encode(s) == hf.tok_encode(s), s
    for context, continuation in LOGLIKELIHOOD:
        if context:
            assert ours._encode_pair(context, continuation) == hf._encode_pair(context, continuation)

    generated_hf = hf.generate_until(instances("generate_until", GENERATE))
    generated = ours.generate_until(instances("generate_until", GENERATE))
    assert generated == generated_hf
    assert all(generated), generated  # a real generation to compare, not two empty strings

    # Every vocabulary token as a one-token choice after one context (exitbench shares one pass among them), so
    # that some request is greedy; and each prompt followed by its generation.
    specials = {ours.tok.backend.token_to_id(t) for t in (BOS, EOS)}
    vocab = [ours.tok.decode([i]) for i in range(ours.tok.vocab_size) if i not in specials]
    requests = (LOGLIKELIHOOD + [("the cat sat on the", v) for v in vocab]
                + [(prompt, text) for (prompt, _), text in zip(GENERATE, generated)])
    want = hf.loglikelihood(instances("loglikelihood", requests))
    got = ours.loglikelihood(instances("loglikelihood", requests))
    assert [g for _, g in got] == [g for _, g in want]
    assert any(g for _, g in got)
    assert max(abs(a - b) for (a, _), (b, _) in zip(got, want)) < LOGLIK_TOL

    want = hf.loglikelihood_rolling(instances("loglikelihood_rolling", [(t,) for t in ROLLING]))
    got = ours.loglikelihood_rolling(instances("loglikelihood_rolling", [(t,) for t in ROLLING]))
    assert max(abs(a - b) for a, b in zip(got, want)) < LOGLIK_TOL


@pytest.mark.parametrize("variant", VARIANTS)
def test_special_tokens_follow_the_tokenizer_and_add_bos_token(saved_as, variant):
    """What each setting puts in front of a context, and what an empty context is conditioned on."""
    saved = saved_as(variant)
    bos = saved.bos
    for add_bos_token in [None, False] + ([True] if bos is not None else []):
        lm = ExitbenchLM(checkpoint=str(saved.ck_dir), policy="fixed", threshold=1, add_bos_token=add_bos_token)
        plain = lm.tok.encode("the cat")
        with_bos = add_bos_token or (add_bos_token is None and saved.template)
        assert lm.tok_encode("the cat") == ([bos] if with_bos else []) + plain
        assert lm.prefix_token_id == (bos if bos is not None else lm.tok.eos_token_id)
        assert lm._encode_request("", " the cat") == ([lm.prefix_token_id], lm.tok.encode(" the cat"))
        assert lm.get_model_info()["exitbench"]["add_bos_token"] == add_bos_token


@pytest.mark.parametrize("variant", VARIANTS)
def test_add_bos_token_is_checked(saved_as, variant):
    saved = saved_as(variant)
    with pytest.raises(ExitbenchError, match="add_bos_token must be true, false or none"):
        ExitbenchLM(checkpoint=str(saved.ck_dir), add_bos_token="yes")
    if saved.bos is None:
        with pytest.raises(ExitbenchError, match="names no bos_token_id"):
            ExitbenchLM(checkpoint=str(saved.ck_dir), add_bos_token=True)
