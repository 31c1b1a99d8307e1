"""Depth-major scoring against the token-major schedule and against lm-eval's own model. Ratios from one run.

    python bench/depth_major.py                       # every section (about 10 minutes on 2 cores)
    python bench/depth_major.py --sections hf,cells --json bench/depth-major-results.json

Sections (each a median of --repeats, the variants taking turns within a repeat so drift hits them alike):
- hf: rolling perplexity of GSM8K test documents on one random plain GPT-2 (n_embd 64, 4 layers, run once),
  saved both as an exitbench checkpoint and as the Hugging Face GPT-2 directory lm-eval's `hf` model loads,
  with one tokenizer.json. Scoring time of the same lm-eval Instances through `HFLM.loglikelihood_rolling`
  and `ExitbenchLM.loglikelihood_rolling` (fixed depth 1; each schedule), at batch size 1 and 16; the
  log-likelihoods must agree (checked). Target ≤ 1.2× hf.
- looped: the embedded tiny-looped-gpt2 at its default depth, the same documents: exitbench against a bare
  loop of its layers (one `model(ids, depth)` forward per document, batch size 1: no exits, no cache).
- cells: lm-eval cells through ExitbenchLM, each schedule, same cells: tiny-raven on chains_lambada and
  chains_mc, tiny-looped-gpt2 on gsm8k_text (its default depth and decoding-free rules).
- compile: `--compile` against eager on the embedded models, each schedule, fixed depth and second_order,
  rolling perplexity at batch size 1 and 16; the first call (which compiles) is left out of the timing, and
  the run fails if dynamo reached its recompile limit or compiled anything after that first call.
- wide: a random Raven of n_embd --wide (4 core layers), rolling perplexity at batch size 16: time ratio over
  iteration ratio of each decoding-free rule against fixed depth, each schedule. Target ≤ 1.10 depth-major.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
GSM8K = REPO.parent / "shared" / "data" / "gsm8k"

from exitbench.engine import ExitConfig  # noqa: E402
from exitbench.harness.model import ExitbenchLM  # noqa: E402
from exitbench.models.checkpoint import open_checkpoint  # noqa: E402

SCHEDULES = ("token_major", "auto")
DECODING_FREE = ("first_order", "second_order", "second_order_magnitude", "cosine")


def gsm8k_texts(n: int) -> list[str]:
    rows = [json.loads(line) for line in (GSM8K / "test.jsonl").read_text().splitlines()[:n]]
    return [f"Question: {r['question']}\nAnswer: {r['answer']}" for r in rows]


def rolling(texts: list[str]):
    from lm_eval.api.instance import Instance

    return [Instance(request_type="loglikelihood_rolling", doc={}, arguments=(t,), idx=0, metadata=("bench", i, 1))
            for i, t in enumerate(texts)]


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def median_of(times: dict[str, list[float]]) -> dict[str, float]:
    return {k: statistics.median(v) for k, v in times.items()}


# ---- hf: the plain GPT-2 against lm-eval's own model ----------------------------------------------------------
def save_plain_gpt2(root: Path, n_embd: int = 64, n_layer: int = 4, n_positions: int = 512) -> tuple[Path, Path]:
    import transformers
    from safetensors.torch import load_file
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from exitbench.models import LoopedGPT2, LoopedGPT2Config, save_checkpoint
    from exitbench.models.tokenizer import Tokenizer

    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    train = [json.loads(line)["question"] for line in (GSM8K / "train.jsonl").read_text().splitlines()[:2000]]
    backend.train_from_iterator(train, trainers.BpeTrainer(vocab_size=2048, special_tokens=["<eos>"],
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                           show_progress=False))
    eos = backend.token_to_id("<eos>")
    tok = Tokenizer(backend, bos_token_id=None, eos_token_id=eos, pad_token_id=eos)
    config = LoopedGPT2Config(vocab_size=tok.vocab_size, n_embd=n_embd, n_layer=n_layer, n_head=4,
                              n_positions=n_positions, loop_groups=[list(range(n_layer))], loop_steps=[1],
                              max_loop_steps=[1], eos_token_id=eos, pad_token_id=eos)
    model = LoopedGPT2(config)
    model.init_weights(torch.Generator().manual_seed(0))
    ck_dir = save_checkpoint(model.eval(), root / "exitbench", tokenizer=tok)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=tok.vocab_size, n_embd=n_embd, n_layer=n_layer, n_head=4, n_positions=n_positions,
        activation_function="gelu_new", layer_norm_epsilon=1e-5, tie_word_embeddings=True, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, eos_token_id=eos, pad_token_id=eos))
    hf.load_state_dict(load_file(ck_dir / "model.safetensors"), strict=False)
    hf.save_pretrained(root / "hf")
    transformers.PreTrainedTokenizerFast(tokenizer_file=str(ck_dir / "tokenizer.json"), eos_token="<eos>"
                                         ).save_pretrained(root / "hf")
    return ck_dir, root / "hf"


def section_hf(figures: dict, docs: int, repeats: int) -> None:
    from lm_eval.models.huggingface import HFLM

    texts = gsm8k_texts(docs)
    with tempfile.TemporaryDirectory() as tmp:
        ck_dir, hf_dir = save_plain_gpt2(Path(tmp))
        for bs in (1, 16):
            hf = HFLM(pretrained=str(hf_dir), device="cpu", dtype="float32", batch_size=bs, logits_cache=False)
            ours = {s: ExitbenchLM(checkpoint=str(ck_dir), policy="fixed", threshold=1, batch_size=bs, device="cpu",
                                   schedule=s) for s in SCHEDULES}
            times: dict[str, list[float]] = {"hf": [], **{s: [] for s in SCHEDULES}}
            answers = {}
            for _ in range(repeats):
                for name, lm in (("hf", hf), *ours.items()):
                    dt, answers[name] = timed(lambda lm=lm: lm.loglikelihood_rolling(rolling(texts)))
                    times[name].append(dt)
            worst = max(abs(a - b) for s in SCHEDULES for a, b in zip(answers[s], answers["hf"]))
            assert worst < 1e-2, f"log-likelihoods differ from hf's by {worst}"  # sums of ~300 float32 terms
            m = median_of(times)
            tokens = sum(len(ours["auto"].tok_encode(t)) for t in texts)
            print(f"[hf] plain GPT-2 n_embd 64 × 4 layers, {docs} GSM8K documents ({tokens} tokens), rolling, "
                  f"batch size {bs}: hf {m['hf']:.2f} s · exitbench token-major {m['token_major']:.2f} s "
                  f"({m['token_major'] / m['hf']:.2f}×) · depth-major {m['auto']:.2f} s ({m['auto'] / m['hf']:.2f}×)"
                  f" · max |Δ loglik| {worst:.1e}", flush=True)
            figures[f"hf bs{bs}"] = {"seconds": times, "median": m, "depth_major_over_hf": m["auto"] / m["hf"],
                                     "token_major_over_hf": m["token_major"] / m["hf"], "tokens": tokens}


# ---- looped: tiny-looped-gpt2 against a bare loop of its layers -----------------------------------------------
def section_looped(figures: dict, docs: int, repeats: int) -> None:
    ck = open_checkpoint("tiny-looped-gpt2")
    texts = gsm8k_texts(docs)
    ids = [ck.tokenizer.encode(t)[: ck.model.config.block_size - 1] for t in texts]
    depth = ck.model.loop_groups()[0].default_steps
    lms = {s: ExitbenchLM(ck, exit_config=ExitConfig("fixed"), batch_size=1, schedule=s) for s in SCHEDULES}

    @torch.no_grad()
    def bare():
        return [torch.log_softmax(ck.model(torch.tensor([i]), depth)[0].float(), -1) for i in ids]

    times: dict[str, list[float]] = {"bare": [], **{s: [] for s in SCHEDULES}}
    for _ in range(repeats):
        times["bare"].append(timed(bare)[0])
        for s, lm in lms.items():
            times[s].append(timed(lambda lm=lm: lm.loglikelihood_rolling(rolling(texts)))[0])
    m = median_of(times)
    print(f"[looped] tiny-looped-gpt2 at depth {depth} per group, {docs} GSM8K documents, batch size 1: bare loop "
          f"{m['bare']:.2f} s · token-major {m['token_major']:.2f} s ({m['token_major'] / m['bare']:.2f}×) · "
          f"depth-major {m['auto']:.2f} s ({m['auto'] / m['bare']:.2f}×)", flush=True)
    figures["looped"] = {"seconds": times, "median": m, "depth_major_over_bare": m["auto"] / m["bare"]}


# ---- cells: the same lm-eval cells under each schedule -----------------------------------------------------------
def section_cells(figures: dict, limit: int, repeats: int) -> None:
    import lm_eval

    from exitbench.harness.quiet import lm_eval_output
    from exitbench.harness.task_set import resolve_tasks

    cases = [("tiny-raven", "chains_lambada", ["fixed", "second_order", "first_order", "kl"]),
             ("tiny-raven", "chains_mc", ["fixed", "second_order", "first_order", "kl"]),
             ("tiny-looped-gpt2", "gsm8k_text", ["fixed", "second_order", "first_order", "cosine"])]
    total = dict.fromkeys(SCHEDULES, 0.0)
    for name, task, policies in cases:
        ck = open_checkpoint(name)
        tasks = resolve_tasks([task], GSM8K if task.startswith("gsm8k") else None)
        for policy in policies:
            times: dict[str, list[float]] = {s: [] for s in SCHEDULES}
            values = {}
            for _ in range(repeats):
                for s in SCHEDULES:
                    lm = ExitbenchLM(ck, exit_config=ExitConfig(policy), batch_size=16, schedule=s)
                    with lm_eval_output(quiet=True):
                        dt, res = timed(lambda lm=lm: lm_eval.simple_evaluate(
                            lm, tasks=tasks.specs, task_manager=tasks.manager, limit=limit, bootstrap_iters=0,
                            verbosity="ERROR"))
                    times[s].append(dt)
                    values[s] = {k: v for k, v in res["results"][task].items() if isinstance(v, float)}
                    schedule = lm.engine.scoring_schedule
            m = median_of(times)
            for s in SCHEDULES:
                total[s] += m[s]
            rel = max((abs(values["auto"][k] - v) / max(abs(v), 1e-30) for k, v in values["token_major"].items()),
                      default=0.0)
            print(f"[cells] {name} · {task} · {policy} ({schedule}): token-major {m['token_major']:.2f} s · "
                  f"auto {m['auto']:.2f} s · speed-up {m['token_major'] / m['auto']:.2f}× · metrics' largest "
                  f"relative difference {rel:.1e}", flush=True)
            figures[f"cells {name} {task} {policy}"] = {"seconds": times, "schedule": schedule,
                                                         "speedup": m["token_major"] / m["auto"]}
    print(f"[cells] all of them: token-major {total['token_major']:.1f} s · auto {total['auto']:.1f} s · "
          f"speed-up {total['token_major'] / total['auto']:.2f}×", flush=True)
    figures["cells total"] = total


# ---- compile: eager against torch.compile'd steps -------------------------------------------------------------------
def section_compile(figures: dict, docs: int, repeats: int) -> None:
    from torch._dynamo.utils import counters

    from exitbench.engine import ExitEngine

    texts = gsm8k_texts(docs)
    for name in ("tiny-raven", "tiny-looped-gpt2"):
        eager, compiled = open_checkpoint(name), open_checkpoint(name)
        compiled.model.compile_loops()
        bos = [eager.tokenizer.bos_token_id] if eager.tokenizer.bos_token_id is not None else []
        reqs = [((bos + eager.tokenizer.encode(t))[:129], 1) for t in texts]
        for policy in ("fixed", "second_order"):
            for s in SCHEDULES:
                for bs in (1, 16):
                    engines = {tag: ExitEngine(ck.model, ExitConfig(policy), schedule=s)
                               for tag, ck in (("eager", eager), ("compiled", compiled))}
                    first = {tag: timed(lambda e=e: e.score(reqs, batch_size=bs)) for tag, e in engines.items()}
                    graphs = counters["stats"]["unique_graphs"]
                    times = {tag: [] for tag in engines}
                    for _ in range(repeats):
                        for tag, e in engines.items():
                            dt, out = timed(lambda e=e: e.score(reqs, batch_size=bs))
                            times[tag].append(dt)
                    assert counters["stats"]["unique_graphs"] == graphs, "compiled again after the first call"
                    same = all(a.iterations == b.iterations for a, b in zip(first["eager"][1], first["compiled"][1]))
                    assert same, "compiled exits differ from eager ones"
                    m = median_of(times)
                    print(f"[compile] {name} · {policy} · {s} · batch size {bs}: eager {m['eager']:.2f} s · compiled "
                          f"{m['compiled']:.2f} s ({m['eager'] / m['compiled']:.2f}× faster; its first call "
                          f"{first['compiled'][0]:.1f} s)", flush=True)
                    figures[f"compile {name} {policy} {s} bs{bs}"] = {
                        "seconds": times, "median": m, "first_call": {k: v[0] for k, v in first.items()},
                        "eager_over_compiled": m["eager"] / m["compiled"]}
    limit = [k for k in counters["unimplemented"] if "recompile" in k.lower()]
    assert not limit, "dynamo reached its recompile limit: steps ran eagerly"
    print(f"[compile] {counters['stats']['unique_graphs']} graphs compiled in all; recompile limit never reached")


# ---- wide: where arithmetic dominates -----------------------------------------------------------------------------
def section_wide(figures: dict, width: int, docs: int, repeats: int, schedules: tuple[str, ...] = SCHEDULES) -> None:
    sys.path.insert(0, str(REPO / "bench"))
    from engine import wide_model  # the random model bench/engine.py times

    from exitbench.engine import ExitEngine

    base = open_checkpoint(None)
    model = wide_model(base.model.config, width)
    texts = gsm8k_texts(docs)
    reqs = [([base.tokenizer.bos_token_id] + base.tokenizer.encode(t))[:129] for t in texts]
    reqs = [(r, 1) for r in reqs]
    K = model.loop_groups()[0].default_steps
    # Thresholds that put mean iterations near K/2 on these documents, found once on the token-major schedule.
    configs = {"fixed": ExitConfig("fixed", threshold=K)}
    for policy in DECODING_FREE:
        lo, hi = 1e-6, 1e3
        for _ in range(18):
            tau = (lo * hi) ** 0.5
            res = ExitEngine(model, ExitConfig(policy, threshold=tau)).score(reqs[:2], batch_size=16)
            mean = statistics.fmean(i for r in res for i in r.iterations)
            lo, hi = (tau, hi) if mean > K / 2 else (lo, tau)
        configs[policy] = ExitConfig(policy, threshold=(lo * hi) ** 0.5)
    times = {(p, s): [] for p in configs for s in schedules}
    iters = {}
    for _ in range(repeats):
        for p, cfg in configs.items():
            for s in schedules:
                engine = ExitEngine(model, cfg, schedule=s)
                dt, res = timed(lambda engine=engine: engine.score(reqs, batch_size=16))
                times[(p, s)].append(dt)
                iters[p] = statistics.fmean(i for r in res for i in r.iterations)
    m = {k: statistics.median(v) for k, v in times.items()}
    for s in schedules:
        for p in DECODING_FREE:
            ratio = (m[(p, s)] / m[("fixed", s)]) / (iters[p] / iters["fixed"])
            print(f"[wide] n_embd {width}, {docs} documents, batch size 16, {s}: {p} mean iterations "
                  f"{iters[p]:.1f}/{K}, time ratio / iteration ratio {ratio:.2f}", flush=True)
            figures[f"wide {s} {p}"] = {"ratio": ratio, "iterations": iters[p], "seconds": m[(p, s)],
                                        "fixed_seconds": m[("fixed", s)]}
        print(f"[wide] {s}: fixed depth {K} takes {m[('fixed', s)]:.2f} s", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default="hf,looped,cells,compile,wide")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--limit", type=int, default=48, help="cells: documents per task")
    ap.add_argument("--wide", type=int, default=1024)
    ap.add_argument("--wide-schedules", default=",".join(SCHEDULES), help="wide: the schedules to time (token-major "
                    "takes about 15 minutes there)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    sections = set(args.sections.split(","))
    figures: dict = {}
    t0 = time.perf_counter()
    if "hf" in sections:
        section_hf(figures, args.docs, args.repeats)
    if "looped" in sections:
        section_looped(figures, args.docs, args.repeats)
    if "cells" in sections:
        section_cells(figures, args.limit, args.repeats)
    if "compile" in sections:
        section_compile(figures, args.docs, args.repeats)
    if "wide" in sections:
        section_wide(figures, args.wide, args.docs, args.repeats, tuple(args.wide_schedules.split(",")))
    print(f"({time.perf_counter() - t0:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
