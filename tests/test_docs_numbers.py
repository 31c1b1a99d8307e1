"""Numbers and lists in the docs that a command or the code can produce are checked against it, so they cannot
drift: the suite times quoted against the CI measurement they link to, the families against the registry, the
option tables against the commands' own options. (tests/test_docs.py checks links, length and the examples.)"""
from __future__ import annotations

import re

import pytest
import typer

from exitbench.cli import app
from exitbench.models.registry import ARCHITECTURES

from helpers.paths import REPO

README = (REPO / "README.md").read_text()
CONTRIBUTING = (REPO / "docs" / "contributing.md").read_text()


def measured_ci() -> dict[str, int]:
    """The seconds of the CI run the README's test section links to: its fast and slow suites and the whole run."""
    anchor = re.search(r"bench/RESULTS\.md#(ci-after-[\w-]+)", README).group(1)
    results = (REPO / "bench" / "RESULTS.md").read_text()
    section = results[results.index(f'<a id="{anchor}"></a>'):].split("\n## ", 2)[1]
    rows = {"fast": "fast suite", "slow": "slow suite", "all": "in all"}
    return {key: int(re.search(rf"^\| {label}[^|]*\| ([\d,]+) s \|", section, re.M)[1].replace(",", ""))
            for key, label in rows.items()}


def test_the_suite_times_quoted_are_the_measured_ones_in_minutes():
    minutes = {name: round(seconds / 60) for name, seconds in measured_ci().items()}
    assert f"[{minutes['fast']} minutes on two cores]" in README
    assert f"[{minutes['slow']} minutes on two cores]" in README
    assert f"about {minutes['fast']} minutes on two cores" in CONTRIBUTING
    assert f"about {minutes['slow']} minutes on two cores" in CONTRIBUTING
    assert f"about {minutes['all']} minutes on two cores" in CONTRIBUTING


def test_every_registered_family_is_in_the_readmes_model_table():
    table = README[README.index("## Supported models"):].split("\n\n", 2)[1]
    last_column = [line.rsplit("|", 2)[-2] for line in table.splitlines()[2:]]  # past the header and its rule
    named = {name for cell in last_column for name in re.findall(r"`([a-z0-9_]+)`", cell)}
    assert set(ARCHITECTURES) <= named, sorted(set(ARCHITECTURES) - named)


# The commands whose page lists every option: each of its flags must be named there.
OPTION_PAGES = {"run": "sweeps.md", "pareto": "results.md", "check": "results.md", "report": "report.md",
                "export": "results.md"}


@pytest.mark.parametrize("command", sorted(OPTION_PAGES))
def test_every_option_of_the_command_is_on_its_page(command):
    text = (REPO / "docs" / OPTION_PAGES[command]).read_text()
    params = typer.main.get_command(app).commands[command].params
    flags = [f for p in params if p.param_type_name == "option" for f in p.opts + p.secondary_opts
             if f.startswith("--") and f != "--help"]
    assert flags and [f for f in flags if f not in text] == []
