"""The README and docs/ stay true: links resolve, the README stays short and undated, the index routes to every
page, docs/engine.md's Python example runs, and (slow) the README's and the quickstart's commands run as written.

Anchors are checked too: a link `page.md#anchor` must name a heading of `page.md` as GitHub slugs it (or an
explicit `<a id="...">` / `<a name="...">` there), and a bare `#anchor` one of the linking file's own.

The commands are read from the ```bash blocks of README.md and docs/quickstart.md, never copied here, so a renamed
option fails this test instead of a reader. A command whose trailing comment says "not run" is skipped (the
convention for commands that need a GPU, the internet or GSM8K); `python -m pytest` lines are checked to be there,
not run (CI runs them).
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from exitbench.analysis.plot import LABEL_PT
from exitbench.analysis.report import FIGURE_DPI

from helpers.browser import console_errors, layout_problems, load, screenshot

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
QUICKSTART = DOCS / "quickstart.md"
MAX_README_LINES = 200

FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
IMG_SRC = re.compile(r"<img\b[^>]*\bsrc\s*=\s*[\"']([^\"']+)[\"']", re.I)
HTML_ANCHOR = re.compile(r"<a\b[^>]*\b(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", re.I)
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
# 7 to 40 hex digits as a word, with at least one digit and one letter: what a commit hash looks like.
COMMIT = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b", re.I)


def doc_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def split_fences(text: str) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """The lines outside fenced code blocks (those inside blanked, so line numbers hold), and each block as
    (info string, its lines)."""
    prose, blocks = [], []
    fence, info, body = None, "", []
    for line in text.splitlines():
        m = FENCE.match(line)
        if fence is None and m:
            fence, info, body = m.group(2), m.group(3).strip(), []
            prose.append("")
        elif fence is not None and m and m.group(2).startswith(fence[0]) and len(m.group(2)) >= len(fence) \
                and not m.group(3).strip():
            blocks.append((info, body))
            fence = None
            prose.append("")
        elif fence is not None:
            body.append(line)
            prose.append("")
        else:
            prose.append(line)
    return prose, blocks


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text, lower-cased, without punctuation and symbols, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # a link's text only
    text = re.sub(r"<[^>]+>", "", text).lower()                  # no HTML tags
    kept = "".join(c for c in text   # letters, marks, decimal and letter numbers (github-slugger drops ², ¼)
                   if c in "-_ " or unicodedata.category(c)[0] in "LM" or unicodedata.category(c) in ("Nd", "Nl"))
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    prose, _ = split_fences(path.read_text(encoding="utf-8"))
    found, seen = set(), {}
    for line in prose:
        found.update(HTML_ANCHOR.findall(line))
        m = HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every Markdown link and image and every <img src> outside code."""
    prose, _ = split_fences(path.read_text(encoding="utf-8"))
    out = []
    for number, line in enumerate(prose, start=1):
        line = INLINE_CODE.sub("", line)
        out += [(number, t) for t in LINK.findall(line)]
        out += [(number, t) for t in IMG_SRC.findall(line)]
    return out


def is_external(target: str) -> bool:
    return re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) is not None


def test_the_slug_is_githubs():
    assert slug("Replay: the whole grid from one pass") == "replay-the-whole-grid-from-one-pass"
    assert slug("The embedded default: `tiny-raven`") == "the-embedded-default-tiny-raven"
    assert slug("KL against first- and second-order exits") == "kl-against-first--and-second-order-exits"
    assert slug("Frontiers: `exitbench pareto`") == "frontiers-exitbench-pareto"
    assert slug("tiny-ouro's exit rules at batch size 1 (issue 28)") == "tiny-ouros-exit-rules-at-batch-size-1-issue-28"
    assert slug("About 2¼ minutes, 13:56–16:11 × 2") == "about-2-minutes-13561611--2"


def test_every_relative_link_resolves():
    broken = []
    for path in [*doc_files(), ROOT / "bench" / "RESULTS.md"]:
        for number, target in links(path):
            if is_external(target):
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(ROOT)}:{number}: {target}"
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{where} (no heading or anchor #{anchor} in {dest.relative_to(ROOT)})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_readme_is_short_and_undated():
    text = README.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; at most {MAX_README_LINES}"
    dates = [(n, d) for n, line in enumerate(lines, 1) for d in DATE.findall(line)]
    assert not dates, f"dates in README.md (they belong in bench/RESULTS.md): {dates}"
    hashes = [(n, h) for n, line in enumerate(lines, 1) for h in COMMIT.findall(line)]
    assert not hashes, f"commit-hash-like words in README.md (they belong in bench/RESULTS.md): {hashes}"


def test_the_date_and_hash_patterns_catch_what_they_should():
    assert DATE.findall("measured 2026-12-03 on") == ["2026-12-03"]
    assert COMMIT.findall("a clean clone of 9aa2d22, at 0a49739879ffb72693fd346d0f6aa545ad884302") == \
        ["9aa2d22", "0a49739879ffb72693fd346d0f6aa545ad884302"]
    assert not COMMIT.findall("deadbeef 1234567 exitbench 2¼ minutes 985 tests second_order τ=1e-4")


def test_readme_opens_with_the_main_job_and_the_tests():
    """The first code block is the two commands a new user types: the main job, and the test command .ci/run
    runs (`python -m pytest`)."""
    _, blocks = split_fences(README.read_text(encoding="utf-8"))
    info, body = blocks[0]
    assert info == "bash"
    commands = [line.strip() for line in body if line.strip()]
    assert len(commands) == 2, commands
    assert any(part.strip().startswith("exitbench run ") for part in commands[0].split("&&")), commands[0]
    assert commands[1] == "python -m pytest"


def test_the_index_routes_to_every_page():
    index = DOCS / "index.md"
    assert index.exists()
    linked = {(index.parent / t.partition("#")[0]).resolve() for _, t in links(index) if not is_external(t)}
    pages = {p.resolve() for p in DOCS.rglob("*.md") if p != index}
    missing = sorted(str(p.relative_to(ROOT)) for p in pages - linked)
    assert not missing, f"docs/index.md does not link {missing}"


def test_every_figure_in_docs_img_is_shown_somewhere():
    """A figure moved or renamed leaves no orphan behind: every image under docs/img/ is linked from the docs."""
    shown = {(path.parent / t.partition("#")[0]).resolve() for path in doc_files() for _, t in links(path)
             if not is_external(t)}
    images = {p.resolve() for p in (DOCS / "img").rglob("*") if p.suffix in (".png", ".svg", ".jpg", ".gif")}
    orphans = sorted(str(p.relative_to(ROOT)) for p in images - shown)
    assert not orphans, f"figures no page shows: {orphans}"


def test_the_engine_pages_python_runs(capsys):
    """docs/engine.md's Python example, as written: the engine on the embedded model, one generated token."""
    _, blocks = split_fences((DOCS / "engine.md").read_text(encoding="utf-8"))
    sources = ["\n".join(body) for info, body in blocks if info.split()[:1] == ["python"]]
    assert sources
    for source in sources:
        exec(compile(source, "docs/engine.md", "exec"), {"__name__": "docs_engine"})
    assert capsys.readouterr().out.strip()


# ---- the commands, run as written ------------------------------------------------------------------------------

def split_comment(line: str) -> tuple[str, str]:
    """A shell line's code and its trailing comment (a `#` that starts a word outside quotes)."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i], line[i + 1:]
    return line, ""


def shell_commands(path: Path) -> list[tuple[str, str]]:
    """(command, trailing comment) of each command in the ```bash blocks of `path`: backslash continuations
    joined, `a && b` split into two."""
    _, blocks = split_fences(path.read_text(encoding="utf-8"))
    out = []
    for info, body in blocks:
        if info.split()[:1] != ["bash"]:
            continue
        pending = ""
        for line in body:
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            code, comment = split_comment(pending + line)
            pending = ""
            out += [(part.strip(), comment.strip()) for part in code.split("&&") if part.strip()]
    return out


def exitbench_argv(command: str, comment: str) -> list[str] | None:
    """argv of an `exitbench ...` command to run; None for any other command, or one whose comment says
    "not run"."""
    words = shlex.split(command)
    if words[:1] != ["exitbench"] or "not run" in comment:
        return None
    return words


def doc_commands(path: Path) -> list[list[str]]:
    return [argv for argv in (exitbench_argv(*c) for c in shell_commands(path)) if argv]


def test_the_docs_commands_are_found():
    """The slow test below runs something: the README's main job and its next two commands, and the quickstart's."""
    readme = doc_commands(README)
    assert readme[0][:2] == ["exitbench", "run"]
    assert [argv[1] for argv in readme[1:3]] == ["pareto", "report"]
    assert ("python -m pytest", "") in shell_commands(README)
    assert len(doc_commands(QUICKSTART)) >= 5


def run_exitbench(argv: list[str], cwd: Path) -> None:
    # As every subprocess of the suites runs (tests/helpers/cli.py): offline, one intra-op thread. The
    # environment, not the command: on two busy cores torch's thread barriers make these commands 5-10× slower.
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-m", *argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, (f"`{shlex.join(argv)}` (from the docs) exited {proc.returncode}:\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("page", ["README.md", "docs/quickstart.md"])
def test_the_commands_of_the_page_run_as_written(page, tmp_path):
    """Each `exitbench` command of the page's ```bash blocks, in order, in one fresh working directory (each may
    read what the one before wrote). The README's main job runs on 24 documents: its 600 take minutes (most of
    it retiming), and what this test guards is the spelling of its options, which --limit does not change.
    Everything else runs exactly as the page says. (The fast twin: test_the_docs_commands_are_found.)
    The README's report page is then looked at in headless Chromium (reader_sees_the_report)."""
    commands = doc_commands(ROOT / page)
    assert commands
    for argv in commands:
        if page == "README.md" and argv[:2] == ["exitbench", "run"] and "--limit" not in argv:
            argv = [*argv, "--limit", "24"]   # the only change this test makes to a command (see above)
        run_exitbench(argv, tmp_path)
    if page == "README.md":
        report_argv = next(argv for argv in commands if argv[1] == "report")
        reader_sees_the_report(tmp_path / report_argv[2] / "report.html", tmp_path)


def reader_sees_the_report(page: Path, tmp: Path) -> None:
    """The page the README's `exitbench report` wrote, in a laptop-wide headless Chromium window: it loads
    cleanly, shows exit maps (samples are on by default), frontier figures at the page's width with labels of a
    legible size, and no table cut off at the window's edge. A screenshot is kept beside it (and copied to
    $EXITBENCH_SCREENSHOTS, where set, for a person to look at)."""
    found, stderr = load(page, tmp)
    assert found["errors"] == [] and console_errors(stderr) == [], (found["errors"], console_errors(stderr))
    assert found["images"] == found["decoded"] > 0, found
    assert found["maps"] and all(declared == shown > 0 for m in found["maps"] for declared, shown in m["rows"]), \
        found["maps"]
    assert sum(img["figure"] for img in found["layout"]["images"]) == 3  # iterations, wall-clock, FLOPs
    assert layout_problems(found, LABEL_PT, FIGURE_DPI) == []
    png = screenshot(page, tmp / "report.png", height=5000)
    if os.environ.get("EXITBENCH_SCREENSHOTS"):
        target = Path(os.environ["EXITBENCH_SCREENSHOTS"])
        target.mkdir(parents=True, exist_ok=True)
        (target / "readme-report.png").write_bytes(png.read_bytes())
