"""Results you can trust: every way a careless or careful user broke exitbench, each pinned by a test.

- a table of bad commands → exit code 2 and one line naming the bad thing (never a traceback);
- a result cell is reused only for the very same model: any byte of its weights, its config or its tokenizer
  changes its identity;
- `--log-samples` cells are complete only with their samples, and the cell file is written last;
- concurrent sweeps into one directory never compute a cell twice, and a dead sweep's claim is taken over;
- non-finite weights are refused at load (unless asked for), and non-finite numbers in a run are counted;
- partial sweeps are checked on what they ran; a reader skips JSON that is not a cell.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from exitbench.store import cells, disk as results
from exitbench.cli import app
from exitbench.models.embedded import EMBEDDED_DIR
from exitbench.sweep.config import SweepConfig
from exitbench.sweep.schedule import plan, run_cells
from exitbench.harness.task_set import resolve_tasks

from helpers.cells import held_by_another_sweep, load_cells
from helpers.cli import assert_one_line_error, explain, subprocess_env
from helpers.paths import REPO

runner = CliRunner()
EMBEDDED = EMBEDDED_DIR / "tiny-raven"
SMALL = ["--tasks", "chains_lambada", "--policy", "second_order", "--thresholds", "0.1", "--baselines", "16",
         "--limit", "4", "--quiet"]


@pytest.fixture
def raven_copy(tmp_path) -> Path:
    """A copy of the embedded tiny-raven (weights, config, tokenizer) that a test may edit."""
    dst = tmp_path / "raven-copy"
    shutil.copytree(EMBEDDED, dst, ignore=shutil.ignore_patterns("training"))
    return dst


def invoke(args: list[str], capfd) -> tuple[int, list[str], str]:
    """(exit code, non-empty stderr lines, stdout) of `exitbench ARGS` in this process, with whatever reaches
    file descriptor 2 directly (lm-eval's loggers write there)."""
    capfd.readouterr()
    res = runner.invoke(app, args)
    fd = capfd.readouterr()
    stderr = res.stderr + fd.err
    assert res.exception is None or isinstance(res.exception, SystemExit), explain(res)
    assert "Traceback" not in stderr + res.stdout + fd.out
    return res.exit_code, [line for line in stderr.splitlines() if line.strip()], res.stdout + fd.out


def broken_cell(directory: Path) -> Path:
    """A file that carries the cell schema tag but lacks a field readers need."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "chains__kl-0.001__0123456789abcdef.json"
    path.write_text(json.dumps({"schema": cells.SCHEMA, "schema_version": cells.SCHEMA_VERSION,
                                "cell_id": "0123456789abcdef", "key": {}, "model": {}, "task": {}}))
    return path


# ---- bad input: one line, exit code 2 --------------------------------------------------------------------------

def _a_file(tmp: Path) -> str:
    (tmp / "a-file").write_text("not a directory")
    return str(tmp / "a-file")


def _bad_yaml(tmp: Path) -> str:
    (tmp / "bad.yaml").write_text("policy: kl\nthreshold: [1e-3\n  min_steps: 2\n")
    return str(tmp / "bad.yaml")


def _broken_cell_dir(tmp: Path) -> str:
    broken_cell(tmp / "broken")
    return str(tmp / "broken")


def _templated(tmp: Path, template) -> str:
    """tiny-raven with `template` as the chat template in its tokenizer_config.json."""
    dst = tmp / "templated"
    shutil.copytree(EMBEDDED, dst, ignore=shutil.ignore_patterns("training"))
    (dst / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>",
                                                           "chat_template": template}))
    return str(dst)


def _chat(template, words):
    return (lambda t: ["run", *SMALL, "-c", _templated(t, template), "--apply-chat-template", "--out", str(t / "o")],
            words)


# Not writable even for root: /sys refuses new entries.
UNWRITABLE = "/sys/exitbench-test/out"

def run_with(*args: str):
    """`run` with the small sweep's options, then ARGS."""
    return lambda t: ["run", *SMALL, "--out", str(t / "o"), *args]


BAD_COMMANDS = {
    "run --out is a file": (lambda t: ["run", *SMALL, "--out", _a_file(t)], ["--out", "is a file"]),
    "run --out not writable": (lambda t: ["run", *SMALL, "--out", UNWRITABLE], ["--out", "not writable"]),
    "geometry --out is a file": (lambda t: ["geometry", "--out", _a_file(t), "--steps", "2", "--programs", "2"],
                                 ["--out", "is a file"]),
    "geometry --programs 0": (lambda t: ["geometry", "--programs", "0", "--out", str(t / "g")], ["--programs"]),
    "run --thresholds ''": (lambda t: ["run", *SMALL[:4], "--thresholds", "", "--out", str(t / "o")],
                            ["--thresholds", "empty"]),
    "run fixed with thresholds": (lambda t: ["run", "--tasks", "chains", "--policy", "fixed", "--thresholds",
                                             "0.3,2.7", "--out", str(t / "o")], ["--thresholds", "--baselines"]),
    "run whole-number policy, fractional threshold": (
        lambda t: ["run", "--tasks", "chains", "--policy", "argmax_stability", "--thresholds", "2.7",
                   "--out", str(t / "o")], ["2.7", "argmax_stability", "whole"]),
    "run --device tpu": (lambda t: ["run", *SMALL, "--device", "tpu", "--out", str(t / "o")],
                         ["--device", "'tpu'"]),
    "run --dtype float64": (lambda t: ["run", *SMALL, "--dtype", "float64", "--out", str(t / "o")],
                            ["dtype", "float64"]),
    "trace --exit-config bad YAML": (lambda t: ["trace", "a=1 b=a", "--exit-config", _bad_yaml(t)],
                                     ["bad.yaml", "cannot read", "not valid YAML", "line"]),
    "run into a dir with a broken cell": (lambda t: ["run", *SMALL, "--out", _broken_cell_dir(t)],
                                          ["broken cell", "lacks"]),
    "pareto on a broken cell": (lambda t: ["pareto", _broken_cell_dir(t)], ["broken cell", "lacks"]),
    "check on a broken cell": (lambda t: ["check", _broken_cell_dir(t), "--baseline", _broken_cell_dir(t)],
                               ["broken cell"]),
    "pareto --table nope": (lambda t: ["pareto", str(t), "--table", "nope"], ["--table"]),
    # generation settings, checked before compute
    "run --gen-kwargs max_gen_toks=-5": (run_with("--gen-kwargs", "max_gen_toks=-5"), ["max_gen_toks=-5", "≥ 1"]),
    "run --gen-kwargs max_gen_toks=abc": (run_with("--gen-kwargs", "max_gen_toks=abc"), ["--gen-kwargs", "'abc'"]),
    "run --gen-kwargs '=,,='": (run_with("--gen-kwargs", "=,,="), ["--gen-kwargs", "names no setting"]),
    "run --gen-kwargs do_sample=maybe": (run_with("--gen-kwargs", "do_sample=maybe"), ["do_sample", "true or false"]),
    # bounds where a huge value hung or crashed
    "run --timing-repeats 1000000": (run_with("--timing-repeats", "1000000"), ["--timing-repeats", "at most"]),
    "run --threads 99999999999": (run_with("--threads", "99999999999"), ["--threads", "at most"]),
    "trace --threads 99999999999": (lambda t: ["trace", "a=1 b=a", "--threads", "99999999999"], ["--threads"]),
    "run --verify-cells ''": (run_with("--replay", "--verify-cells", ""), ["--verify-cells", "empty"]),
    "fit-exit --tokens 0": (lambda t: ["fit-exit", "--tokens", "0", "--limit", "4", "--out", str(t / "o" / "m.json")],
                            ["--tokens must be ≥ 2", "got 0"]),
    # chat templates that cannot be rendered: named before any compute
    "a chat template that raises": _chat("{{ raise_exception('no chat here') }}", ["chat template", "no chat here"]),
    "a chat template that does not parse": _chat("{% for m in messages %}{{ m.content ", ["chat template",
                                                                                          "TemplateSyntaxError"]),
    "a chat template that is a number": _chat(5, ["chat template", "must be a Jinja string", "int"]),
}
if not torch.cuda.is_available():
    BAD_COMMANDS["run --device cuda without CUDA"] = (
        lambda t: ["run", *SMALL, "--device", "cuda", "--out", str(t / "o")], ["--device cuda", "no CUDA"])


@pytest.mark.parametrize("case", list(BAD_COMMANDS))
def test_bad_command_is_one_line_and_exit_2(case, tmp_path, capfd):
    make_args, needles = BAD_COMMANDS[case]
    capfd.readouterr()
    res = runner.invoke(app, make_args(tmp_path))
    assert_one_line_error(res, needles, fd=capfd.readouterr())
    assert not (tmp_path / "o").exists() or not list((tmp_path / "o").rglob("*.json"))


def test_unwritable_out_fails_before_any_compute(tmp_path, capfd, monkeypatch):
    """The writability check comes before the checkpoint is even read."""
    import exitbench.models.checkpoint as checkpoint

    def no_loading(*a, **k):
        raise AssertionError("the checkpoint was loaded before --out was checked")

    monkeypatch.setattr(checkpoint, "open_checkpoint", no_loading)
    code, lines, _ = invoke(["run", *SMALL, "--out", UNWRITABLE], capfd)
    assert code == 2 and "not writable" in lines[0]


# ---- a cell is reused only for the very same model -------------------------------------------------------------

def _computed_ids(out: Path) -> set[str]:
    return {c["cell_id"] for c in load_cells(out).values()}


def _edit_middle_byte(shard: Path) -> None:
    """Flip one bit in the middle of the largest tensor's data (far from the file's first and last 64 KiB)."""
    tensors = load_file(str(shard))
    key = max(tensors, key=lambda k: tensors[k].numel())
    flat = tensors[key].view(-1)
    middle = flat.numel() // 2
    flat[middle] = torch.nextafter(flat[middle], torch.tensor(float("inf")))
    save_file(tensors, str(shard), metadata={"format": "pt"})


EDITS = {
    "a weight in the middle of a shard": lambda ck: _edit_middle_byte(ck / "model.safetensors"),
    "a config value": lambda ck: (ck / "config.json").write_text(
        json.dumps({**json.loads((ck / "config.json").read_text()), "mean_recurrence": 8, "max_recurrence": 16})),
    "the tokenizer": lambda ck: (ck / "tokenizer.json").write_text(
        (ck / "tokenizer.json").read_text().replace('"<unk>"', '"<UNK>"')),
}


# Each case is three sweeps (4 s). A changed weight stays fast; that config and tokenizer bytes count is also
# checked fast, on the identity itself, in test_identity.
@pytest.mark.parametrize("edit", [e if "weight" in e else pytest.param(e, marks=pytest.mark.slow) for e in EDITS])
def test_a_changed_checkpoint_recomputes_its_cells(edit, raven_copy, tmp_path, capfd):
    out = tmp_path / "out"
    args = ["run", *SMALL, "--checkpoint", str(raven_copy), "--out", str(out)]
    assert invoke(args, capfd)[0] == 0
    first = _computed_ids(out)
    code, lines, stdout = invoke(args, capfd)
    assert code == 0 and any("reusing 2 cell(s)" in line for line in lines), lines
    # The summary marks each row this run did not measure.
    assert sum("reused" in line for line in stdout.splitlines() if "│" in line) == 2, stdout
    assert _computed_ids(out) == first  # unchanged checkpoint: resumed, nothing new
    EDITS[edit](raven_copy)
    assert invoke(args, capfd)[0] == 0
    after = _computed_ids(out)
    assert len(after) == 4 and first < after, f"editing {edit} did not give new cells"


# ---- --log-samples ------------------------------------------------------------------------------------------------

def test_log_samples_recomputes_a_cell_that_has_none(tmp_path, capfd):
    out = tmp_path / "out"
    assert invoke(["run", *SMALL, "--out", str(out)], capfd)[0] == 0
    assert not list(out.glob("*.samples.jsonl"))
    assert invoke(["run", *SMALL, "--out", str(out), "--log-samples"], capfd)[0] == 0
    for name, cell in load_cells(out).items():
        samples = results.samples_path(out / name)
        assert samples.exists(), name
        rows = [json.loads(line) for line in samples.read_text().splitlines()]
        assert len(rows) == 4 and all("exitbench" in r for r in rows)
        # Each exited token's text, log p and greedy flag ride beside its exit steps (what exit maps draw).
        assert all(len(r["exitbench"][k]) == len(r["exitbench"]["exit_steps"]) > 0 for r in rows
                   for k in ("token_text", "logprobs", "greedy"))
        assert cell["samples"] is True


def test_sigterm_stops_a_sweep_as_ctrl_c_does(tmp_path, monkeypatch):
    """A scheduler's kill (SIGTERM) mid-sweep: the cells finished are kept, the command says so and how to
    resume, exit 143; the second cell never starts and leaves no claim behind."""
    import signal

    import exitbench.sweep.schedule

    real, calls = exitbench.sweep.schedule.run_config, []

    def then_terminated(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # a real signal, delivered to this process's handler
        return real(*args, **kwargs)

    monkeypatch.setattr(exitbench.sweep.schedule, "run_config", then_terminated)
    out = tmp_path / "out"
    before = signal.getsignal(signal.SIGTERM)
    res = runner.invoke(app, ["run", *SMALL, "--timing-repeats", "0", "--out", str(out)])
    assert res.exit_code == 143, explain(res)
    assert "interrupted: 1 of the sweep's 2 cells are finished and kept" in " ".join(res.stderr.split())
    assert len(load_cells(out)) == 1 and not list(out.glob(".*.lock"))
    assert signal.getsignal(signal.SIGTERM) == before  # the handler lives for the sweep only


def test_a_sweep_whose_plan_cannot_fit_is_refused_before_its_first_cell(tmp_path, monkeypatch):
    import exitbench.runtime.devices as devices
    import exitbench.sweep.schedule

    def no_compute(*a, **k):
        raise AssertionError("a cell ran")

    monkeypatch.setattr(devices, "available_memory", lambda device: 1000)  # 1 kB free
    monkeypatch.setattr(exitbench.sweep.schedule, "run_config", no_compute)
    res = runner.invoke(app, ["run", *SMALL, "--out", str(tmp_path / "o")])
    assert_one_line_error(res, ["needs at least", "GB free", "--no-memory-check"])
    monkeypatch.setattr(exitbench.sweep.schedule, "run_config", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    res = runner.invoke(app, ["run", *SMALL, "--no-memory-check", "--out", str(tmp_path / "o")])
    assert res.exit_code == 130, explain(res)  # past the check: the first cell started


def test_a_kill_between_samples_and_cell_leaves_no_cell(tmp_path, monkeypatch):
    """The samples go first and the cell last: dying in between leaves no cell to skip on resume."""
    ck_tasks = resolve_tasks(["chains_lambada"])
    from exitbench.models.checkpoint import open_checkpoint

    ck = open_checkpoint(None)
    cfg = SweepConfig(tasks=["chains_lambada"], policies=["second_order"], thresholds=[0.1], baselines=[16],
                      limit=4, log_samples=True)
    out = tmp_path / "out"
    real_write = results.atomic_write
    calls = []

    def dies_at_the_cell(path, write, mode="w"):
        calls.append(Path(path).name)
        if not str(path).endswith(results.SAMPLES_SUFFIX):
            raise KeyboardInterrupt("killed")
        return real_write(path, write, mode)

    monkeypatch.setattr(results, "atomic_write", dies_at_the_cell)
    with pytest.raises(KeyboardInterrupt):
        run_cells(ck, ck_tasks, cfg, out, "cpu")
    assert calls[0].endswith(results.SAMPLES_SUFFIX) and not list(out.glob("*.json"))
    monkeypatch.setattr(results, "atomic_write", real_write)
    done = run_cells(ck, ck_tasks, cfg, out, "cpu")
    assert len(done) == 2 and all(results.samples_path(out / cells.filename(c)).exists() for c in done)


# ---- concurrent sweeps ---------------------------------------------------------------------------------------------

HOLD = """
import sys, time
from pathlib import Path
from exitbench.store import disk as results
claim = results.Claim(Path(sys.argv[1]), sys.argv[2])
assert claim.acquire()
print("held", flush=True)
time.sleep(float(sys.argv[3]))
if len(sys.argv) > 4:  # finish the cell, as a real sweep would, before letting go
    Path(sys.argv[4]).write_text(Path(sys.argv[5]).read_text())
"""


def _hold(directory: Path, cid: str, seconds: float, *write: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(directory), cid, str(seconds), *write],
                            stdout=subprocess.PIPE, text=True, env=subprocess_env())
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_claim_excludes_others_until_its_owner_dies(tmp_path):
    proc = _hold(tmp_path, "abc", 60)
    mine = results.Claim(tmp_path, "abc")
    try:
        assert not mine.acquire()
        proc.kill()  # a kill -9'd sweep: the kernel drops its lock
        proc.wait()
        assert mine.acquire()
    finally:
        mine.release()
        proc.kill()
    assert not (tmp_path / ".abc.lock").exists()


@pytest.fixture(scope="module")
def small_sweep():
    from exitbench.models.checkpoint import open_checkpoint

    ck = open_checkpoint(None)
    tasks = resolve_tasks(["chains_lambada"])
    cfg = SweepConfig(tasks=["chains_lambada"], policies=["second_order"], thresholds=[0.1], baselines=[16], limit=4)
    return ck, tasks, cfg


@pytest.mark.slow  # 5 s, 3 of them waiting on the other sweep; the same collection with the claim held in this
# process (test_a_cell_claimed_through_another_file_is_collected_once_written) stays fast
def test_a_cell_another_sweep_holds_is_collected_not_recomputed(tmp_path, small_sweep):
    ck, tasks, cfg = small_sweep
    reference = tmp_path / "reference"
    made = {c["policy"]["policy"]: c for c in run_cells(ck, tasks, cfg, reference, "cpu")}
    out = tmp_path / "out"
    out.mkdir()
    sweep = plan(ck, tasks, cfg, out, "cpu")
    fixed_key = next(key for _, c, key in sweep.cells if c.policy == "fixed")
    # The other "sweep" holds the fixed cell for 3 s, then writes it (marked, so we can tell) and exits.
    theirs = {**made["fixed"], "cell_id": cells.cell_id(fixed_key), "key": fixed_key,
              "run": {**made["fixed"]["run"], "run_id": "the-other-sweep"}}
    (tmp_path / "theirs.json").write_text(json.dumps(theirs))
    proc = _hold(out, cells.cell_id(fixed_key), 3, str(out / cells.filename(theirs)), str(tmp_path / "theirs.json"))
    try:
        done = {c["policy"]["policy"]: c for c in run_cells(ck, tasks, cfg, out, "cpu", sweep=sweep, poll_s=0.2)}
    finally:
        proc.wait(timeout=30)
    assert done["fixed"]["run"]["run_id"] == "the-other-sweep"  # collected, not computed twice
    assert done["second_order"]["run"]["run_id"] == sweep.run_id


def test_a_cell_claimed_through_another_file_is_collected_once_written(tmp_path, small_sweep):
    """The collection above without a second process or its 3 s: an flock belongs to the open file, so a claim
    this test holds refuses the sweep's own claim on the cell just as another sweep's would. The holder writes
    the cell (atomically) and lets go 0.5 s into the sweep; the sweep collects that cell and computes the rest."""
    ck, tasks, cfg = small_sweep
    made = {c["policy"]["policy"]: c for c in run_cells(ck, tasks, cfg, tmp_path / "reference", "cpu")}
    out = tmp_path / "out"
    out.mkdir()
    sweep = plan(ck, tasks, cfg, out, "cpu")
    fixed_key = next(key for _, c, key in sweep.cells if c.policy == "fixed")
    with held_by_another_sweep(out, fixed_key, made["fixed"], tmp_path / "theirs.json", 0.5):
        done = {c["policy"]["policy"]: c for c in run_cells(ck, tasks, cfg, out, "cpu", sweep=sweep, poll_s=0.05)}
    assert done["fixed"]["run"]["run_id"] == "the-other-sweep"  # collected, not computed twice
    assert done["second_order"]["run"]["run_id"] == sweep.run_id
    assert not list(out.glob(".*.lock"))


def test_a_dead_sweeps_claim_is_taken_over(tmp_path, small_sweep):
    ck, tasks, cfg = small_sweep
    out = tmp_path / "out"
    out.mkdir()
    sweep = plan(ck, tasks, cfg, out, "cpu")
    proc = _hold(out, cells.cell_id(sweep.cells[0][2]), 1)  # dies after 1 s without writing its cell
    t0 = time.monotonic()
    done = run_cells(ck, tasks, cfg, out, "cpu", sweep=sweep, poll_s=0.2)
    proc.wait(timeout=30)
    assert len(done) == 2 and all(c["run"]["run_id"] == sweep.run_id for c in done)
    assert time.monotonic() - t0 >= 1.0
    assert not list(out.glob(".*.lock"))


# ---- non-finite numbers ------------------------------------------------------------------------------------------

def _poison(ck: Path) -> None:
    tensors = load_file(str(ck / "model.safetensors"))
    key = "transformer.core_block.0.attn.Wqkv.weight"
    tensors[key].view(-1)[tensors[key].numel() // 2] = float("nan")
    save_file(tensors, str(ck / "model.safetensors"), metadata={"format": "pt"})


def test_nan_weights_are_refused_at_load_unless_allowed(raven_copy, tmp_path, capfd):
    _poison(raven_copy)
    out = tmp_path / "out"
    capfd.readouterr()
    res = runner.invoke(app, ["run", *SMALL, "--checkpoint", str(raven_copy), "--out", str(out)])
    assert_one_line_error(res, ["core_block.0.attn.Wqkv.weight", "--allow-nonfinite"], fd=capfd.readouterr())
    code, lines, _ = invoke(["run", *SMALL, "--checkpoint", str(raven_copy), "--out", str(out),
                             "--allow-nonfinite"], capfd)
    assert code == 0
    found = load_cells(out)
    assert found and all(c["numerics"]["nonfinite_tokens"] == c["iterations"]["tokens"] for c in found.values())
    assert sum("warning:" in line and "NaN or infinity" in line for line in lines) == len(found)
    # trace warns as run does, instead of printing nan log-probabilities as if they were numbers (a NaN in
    # every weight of the block: one NaN reaches only some of a short prompt's tokens)
    tensors = load_file(str(raven_copy / "model.safetensors"))
    tensors["transformer.core_block.0.attn.Wqkv.weight"].fill_(float("nan"))
    save_file(tensors, str(raven_copy / "model.safetensors"), metadata={"format": "pt"})
    code, lines, _ = invoke(["trace", "a=7 b=a", "--checkpoint", str(raven_copy), "--allow-nonfinite"], capfd)
    assert code == 0 and any("warning:" in line and "NaN or infinity" in line for line in lines), lines
    code, lines, _ = invoke(["trace", "a=7 b=a"], capfd)
    assert code == 0 and not any("warning:" in line for line in lines), lines


def test_finite_runs_count_no_nonfinite_tokens(tmp_path, small_sweep):
    ck, tasks, cfg = small_sweep
    for cell in run_cells(ck, tasks, cfg, tmp_path / "out", "cpu"):
        assert cell["numerics"] == {"nonfinite_tokens": 0}


# ---- readers: partial sweeps, reports that are not cells, plots in new folders ------------------------------------

def test_check_of_a_partial_sweep_says_what_it_compared(tmp_path, capfd):
    baseline = REPO / "results" / "baseline"
    part = tmp_path / "part"
    part.mkdir()
    kept = [p for p in baseline.glob("chains__*.json") if "__fixed-" in p.name or "__kl-" in p.name]
    for p in kept:
        shutil.copy(p, part / p.name)
    code, _, out = invoke(["check", str(part), "--baseline", str(baseline)], capfd)
    assert code == 1 and "missing" in out and "--present-only" in out
    code, _, out = invoke(["check", str(part), "--baseline", str(baseline), "--present-only"], capfd)
    assert code == 0, out
    assert f"compared {len(kept)} of the baseline's" in out and f"{len(kept)} within the tolerances" in out


def test_pareto_skips_reports_that_are_not_cells_and_makes_the_plot_folder(tmp_path, capfd):
    baseline = REPO / "results" / "baseline"
    root = tmp_path / "results"
    shutil.copytree(baseline, root / "baseline")
    (root / "calibrate").mkdir()
    (root / "calibrate" / "tiny-raven-kl.json").write_text(json.dumps({"schema": "exitbench.calibration"}))
    plot = tmp_path / "new" / "folder" / "p.png"
    code, lines, out = invoke(["pareto", str(root), "--plot", str(plot)], capfd)
    assert code == 0, lines
    assert plot.stat().st_size > 0
    assert any("skipped 1 JSON file" in line for line in lines)
    code, _, out = invoke(["pareto", str(root), "--format", "csv", "--table", "matched"], capfd)
    header, *rows = out.strip().splitlines()
    assert header.startswith("group,tolerance,max_tolerance,policy") and rows and "\n\n" not in out.strip()


# ---- what a newcomer reads ------------------------------------------------------------------------------------------

COMMANDS = ["info", "train", "trace", "run", "pareto", "geometry", "check", "calibrate", "fit-exit", "policies"]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_names_no_types_on_flags_and_no_missing_options(command):
    res = runner.invoke(app, [command, "--help"])
    assert res.exit_code == 0, res.output
    assert "<bool>" not in res.output
    assert "--list-policies" not in res.output  # an option trace's help once pointed to, which never existed


def test_policies_lists_every_registered_policy():
    from exitbench.policies import REGISTRY

    res = runner.invoke(app, ["policies"])
    assert res.exit_code == 0
    for name in REGISTRY:
        assert name in res.output


def test_a_quiet_run_prints_the_table_and_nothing_else(tmp_path, capfd):
    code, lines, out = invoke(["run", *SMALL, "--out", str(tmp_path / "o")], capfd)
    assert code == 0
    assert lines == [], lines  # no lm-eval warnings, bootstrap lines, request bars or git noise
    assert "bootstrapping" not in out and "%|" not in out and "cells in" in out


def test_progress_off_a_terminal_is_a_line_per_cell(tmp_path, capfd):
    args = [a for a in SMALL if a != "--quiet"]
    code, lines, out = invoke(["run", *args, "--out", str(tmp_path / "o")], capfd)
    assert code == 0
    progress = [line for line in out.splitlines() if line.startswith("[")]
    assert [line.split("]")[0] for line in progress] == ["[1/2", "[2/2"]
    # so that a slow machine never looks like a hung one: the time spent, and before the end the time left
    assert re.search(r" · \d+ s elapsed, about \d+ s left$", progress[0]), progress
    assert re.search(r" · \d+ s elapsed$", progress[1]), progress


def test_a_run_on_a_busy_machine_says_so_before_it_computes(tmp_path, capfd, monkeypatch):
    """Load above the cores as the run starts: one warning, before the first cell, with advice that fits the
    threads the run uses; nothing when the machine is idle (the session's patched load)."""
    import exitbench.sweep.schedule

    def stop(*args, **kwargs):
        raise KeyboardInterrupt  # the first cell: what was said by then was said before any compute

    monkeypatch.setattr(exitbench.sweep.schedule, "run_config", stop)
    monkeypatch.setattr(os, "getloadavg", lambda: (3.0 * os.cpu_count(), 0.0, 0.0))
    before = torch.get_num_threads()
    try:
        for threads, advice in (("2", "or with --threads 1"), ("1", "rerun on an idle machine")):
            res = runner.invoke(app, ["run", *SMALL, "--threads", threads, "--out", str(tmp_path / threads)])
            assert res.exit_code == 130, explain(res)
            warnings = [line for line in res.stderr.splitlines() if line.startswith("warning:")]
            assert len(warnings) == 1 and "is busy as this run starts" in warnings[0], res.stderr
            assert advice in warnings[0] and (threads == "2" or "--threads 1" not in warnings[0]), warnings
        monkeypatch.setattr(os, "getloadavg", lambda: (0.5, 0.0, 0.0))
        res = runner.invoke(app, ["run", *SMALL, "--out", str(tmp_path / "idle")])
        assert res.exit_code == 130 and "warning:" not in res.stderr, explain(res)
    finally:
        torch.set_num_threads(before)


def test_matched_table_warns_when_speedups_mix_runs(tmp_path, capfd, small_sweep):
    ck, tasks, cfg = small_sweep
    out = tmp_path / "out"
    run_cells(ck, tasks, cfg, out, "cpu")
    code, lines, _ = invoke(["pareto", str(out)], capfd)
    assert code == 0 and not any("different runs" in line for line in lines)
    # a later run adds a threshold to the same directory: its speed-up divides by the older run's full depth
    run_cells(ck, tasks, SweepConfig(**{**cfg.__dict__, "thresholds": [1.0]}), out, "cpu")
    code, lines, _ = invoke(["pareto", str(out)], capfd)
    assert code == 0 and any("warning:" in line and "different runs" in line for line in lines), lines


def test_threads_are_taken_recorded_and_checked(tmp_path, capfd):
    """--threads sets torch's threads for the run; each cell records them and the machine's load around it."""
    before = torch.get_num_threads()
    out = tmp_path / "out"
    try:
        code, lines, _ = invoke(["run", *SMALL, "--threads", "1", "--out", str(out)], capfd)
        assert code == 0, lines
    finally:
        torch.set_num_threads(before)
    for cell in load_cells(out).values():
        assert cell["run"]["machine"]["cpu_threads"] == 1
        load = cell["run"]["load"]
        assert load["cpus"] == os.cpu_count() and load["start"] is not None and load["end"] is not None
    code, lines, _ = invoke(["run", *SMALL, "--threads", "0", "--out", str(tmp_path / "bad")], capfd)
    assert code == 2 and any("--threads must be ≥ 1" in line for line in lines)
