"""Every command on one checkpoint, as a user types them: what a new family's "every command runs" test does."""
from __future__ import annotations

import json
from pathlib import Path

from helpers.cli import explain, runner

from exitbench.cli import app


def run_every_command(ck: str, tmp_path: Path, *, sentence: str, calibrate: str, steps: int = 6) -> dict:
    """run with every policy exactly and by replay, calibrate (confidence at the thresholds `calibrate`), fit-exit
    and the learned rule, geometry (to `steps` iterations), trace, report and info --plan on `ck`, over documents made
    of `sentence`.
    Each must exit 0; returns the run's cells, the replay's cell count and info's report."""
    docs = tmp_path / "docs.txt"
    docs.write_text("\n\n".join(f"{sentence} {i}" for i in range(24)))
    exit_model = tmp_path / "exit.json"
    common = ["-c", ck, "--tasks", "chains_lambada", "--limit", "2", "--baselines", "2", "--quiet"]
    commands = {
        "run": ["run", *common, "-p", "all", "--out", str(tmp_path / "r")],
        "replay": ["run", *common, "-p", "all", "--replay", "--out", str(tmp_path / "replay")],
        "calibrate": ["calibrate", "-c", ck, "--text", str(docs), "--policy", "confidence", "--thresholds",
                      calibrate, "--out", str(tmp_path / "cal.json")],
        "fit-exit": ["fit-exit", "-c", ck, "--text", str(docs), "--limit", "24", "--tokens", "600",
                     "-o", str(exit_model)],
        "learned": ["run", *common, "-p", "learned", "--exit-model", str(exit_model), "--thresholds", "0.5",
                    "--out", str(tmp_path / "r")],
        "geometry": ["geometry", "-c", ck, "--text", str(docs), "-n", str(steps), "--tokens", "300", "-o",
                     str(tmp_path / "geo")],
        "trace": ["trace", sentence, "-c", ck, "-p", "first_order", "--generate", "2",
                  "--json", str(tmp_path / "trace.json")],
        "report": ["report", str(tmp_path / "r")],
        "info": ["info", "-c", ck, "--plan", "--json"],
    }
    for name, args in commands.items():
        res = runner.invoke(app, args)
        assert res.exit_code == 0, f"{name}: {explain(res)}"
    assert (tmp_path / "r" / "report.html").exists() and (tmp_path / "geo" / "geometry.json").exists()
    return {"cells": [json.loads(f.read_text()) for f in (tmp_path / "r").glob("*.json")],
            "replayed": len(list((tmp_path / "replay").glob("*.json"))), "info": json.loads(res.stdout)}
