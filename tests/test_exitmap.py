"""Exit maps (exitbench/exitmap.py): from `exitbench trace` (--html, --png, --vs) and from samples; every token
drawn once per loop group, greedy misses marked, the facts in the hover text. In a browser:
tests/test_report_browser.py (slow)."""
from __future__ import annotations

import re

from exitbench.analysis import exitmap

from helpers.cli import assert_one_line_error, explain, runner
from exitbench.cli import app

PROMPT = "the cat sat on the mat and the dog ran"  # ten words of the tiny word-level tokenizer


def test_trace_draws_every_token_of_each_policy(tmp_path, tiny_checkpoint):
    html, png = tmp_path / "map.html", tmp_path / "map.png"
    # --add-bos-token: this tokenizer adds no BOS of its own, and the map below reads every word after one
    res = runner.invoke(app, ["trace", PROMPT, "-c", str(tiny_checkpoint), "--policy", "second_order", "--add-bos-token",
                              "--threshold", "0.1", "--vs", "kl:1e-3", "--html", str(html), "--png", str(png)])
    assert res.exit_code == 0, explain(res)
    # Each policy's trace says what runs and how long it took (a deep model's is minutes).
    assert "tracing second_order τ=0.1" in res.stderr and "tracing kl τ=0.001" in res.stderr
    assert res.stderr.count(" tokens in ") == 2
    page = html.read_text()
    # Scoring predicts every token after BOS: ten tokens, one row per policy.
    assert re.findall(r'data-tokens="(\d+)"', page) == ["10", "10"]
    assert page.count('class="tok') == 20
    assert "second_order τ=0.1" in page and "kl τ=0.001" in page
    # Word tokens keep the space the decoder puts between them, so the row reads as the text.
    text = "".join(re.findall(r'<span class="tok[^"]*"[^>]*>([^<]*)</span>', page)[:10])
    assert text == " " + PROMPT, text
    assert "signal at steps 1…" in page and "log p" in page  # hover text
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_trace_map_bad_input_is_one_line(tmp_path, tiny_checkpoint):
    ck = str(tiny_checkpoint)
    assert_one_line_error(runner.invoke(app, ["trace", PROMPT, "-c", ck, "--html", str(tmp_path / "m.png")]),
                          ["--html", ".html"])
    assert_one_line_error(runner.invoke(app, ["trace", PROMPT, "-c", ck, "--vs", "kl:soon"]), ["--vs"])
    assert_one_line_error(runner.invoke(app, ["trace", PROMPT, "-c", ck, "--vs", "nosuchpolicy"]), ["nosuchpolicy"])


def test_one_row_per_loop_group():
    tokens = [exitmap.MapToken(" a", [2, 5, 1], -0.1, True), exitmap.MapToken(" b", [6, 6, 6], -3.0, False)]
    m = exitmap.ExitMap("second_order τ=0.5", tokens, max_steps=6)
    page = exitmap.html_fragment([m])
    labels = re.findall(r'<div class="label">([^<]*)<small>([^<]*)</small>', page)
    assert [lab for lab, _ in labels] == [f"second_order τ=0.5 · group {g}" for g in (1, 2, 3)]
    assert labels[0][1] == "mean 4.00 of 13.00 it."  # group 1's mean beside the total over groups
    assert re.findall(r'data-step="(\d+)"', page) == ["2", "6", "5", "6", "1", "6"]
    assert page.count('class="tok miss"') == 3  # b's greedy miss, in each group's row
    assert "exit steps 2 + 5 + 1 = 8" in page
    fig = exitmap.draw([m])
    assert fig.get_figheight() > 1


def test_samples_without_token_text_draw_numbered_tokens():
    """Samples written before exitbench kept each token's text still draw: as numbered blanks."""
    sample = {"doc_id": 0, "arguments": [["x=1 y=x", {"until": ["\n"]}]], "acc": 1,
              "exitbench": {"exit_steps": [[3], [4]], "mean": 3.5}}
    m = exitmap.from_sample(sample, {"policy": "kl", "threshold": 1e-4, "max_steps": 16}, "acc")
    assert [t.text for t in m.tokens] == ["[0]", "[1]"] and m.context == "x=1 y=x" and m.note == "accuracy 1"
    assert m.max_steps == 16 and m.mean_iterations == 3.5


def test_pieces_keep_the_decoders_spaces(tiny_tokenizer):
    ids = tiny_tokenizer.encode(PROMPT)
    pieces = tiny_tokenizer.pieces(ids)
    assert "".join(pieces) == tiny_tokenizer.decode(ids) and len(pieces) == len(ids)
