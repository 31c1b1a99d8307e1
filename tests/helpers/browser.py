"""A page opened in headless Chromium (Debian's `chromium` package): what loaded, what failed, a screenshot.

`load` copies the page with a checker script put first in its <head>: it records every error event (scripts,
images) and, once the page has loaded, how many images there are and how many decoded, each exit map row's
declared token count beside the tokens it shows, any reference to the network, and the layout (images' shown
and drawn widths, tables' edges). Chromium's --dump-dom prints the page after its load event, checker output
included; stderr is kept for console errors. `layout_problems` reads the layout as a reader would see it.
"""
from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

CHECKER = """<script>
window.__errors = [];
window.addEventListener('error', function (e) {
  var what = e.target && e.target !== window ? (e.target.tagName + ' ' + String(e.target.src || '').slice(0, 40))
                                             : String(e.message);
  window.__errors.push(what);
}, true);
window.addEventListener('load', function () {
  var images = Array.from(document.images);
  var docs = Array.from(document.querySelectorAll('.exitmaps')).map(function (block) {
    var doc = block.closest('.doc'), task = null, h = doc;
    while (h && !(h.classList && h.classList.contains('task'))) { h = h.previousElementSibling; }
    if (h) { task = h.dataset.task; }
    return {doc: doc ? doc.dataset.doc : null, task: task,
            rows: Array.from(block.querySelectorAll('.row')).map(function (r) {
              return [parseInt(r.dataset.tokens), r.querySelectorAll('.tok').length]; })};
  });
  var external = Array.from(document.querySelectorAll('[src],[href]')).map(function (e) {
    return e.getAttribute('src') || e.getAttribute('href'); }).filter(function (u) { return /^(https?:)?\\/\\//.test(u); });
  // Layout at the window's width: each image's shown and drawn width beside the room its box gives
  // it; each table's right edge, and the scrolling box (if any) that keeps a wider one whole.
  var view = document.documentElement.clientWidth;
  var room = function (e) {
    var s = getComputedStyle(e);
    return e.clientWidth - parseFloat(s.paddingLeft) - parseFloat(s.paddingRight); };
  var figures = images.map(function (i) {
    return {alt: i.alt, figure: i.classList.contains('figure'), shown: i.getBoundingClientRect().width,
            natural: i.naturalWidth, room: room(i.parentElement)}; });
  var tables = Array.from(document.querySelectorAll('table')).filter(function (t) {
    return t.getClientRects().length > 0; }).map(function (t) {
    var box = t.closest('div.wide');
    return {head: t.querySelector('th') ? t.querySelector('th').textContent : '',
            right: t.getBoundingClientRect().right, width: t.scrollWidth,
            scroll: box ? getComputedStyle(box).overflowX : null,
            box_right: box ? box.getBoundingClientRect().right : null,
            box_scroll_width: box ? box.scrollWidth : null}; });
  var out = {errors: window.__errors, images: images.length, external: external, maps: docs,
             decoded: images.filter(function (i) { return i.complete && i.naturalWidth > 0; }).length,
             layout: {view: view, page: document.documentElement.scrollWidth, images: figures, tables: tables}};
  var pre = document.createElement('pre'); pre.id = '__check'; pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
         "--disable-background-networking", "--enable-logging=stderr", "--v=0"]


def chromium() -> str:
    """The browser's path; the test is skipped (with the install line) where there is none, but fails where
    EXITBENCH_REQUIRE_CHROMIUM is set (CI installs it and never skips these)."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        if os.environ.get("EXITBENCH_REQUIRE_CHROMIUM"):
            pytest.fail("EXITBENCH_REQUIRE_CHROMIUM is set but there is no chromium on PATH")
        pytest.skip("no headless Chromium: apt-get install -y chromium")
    return path


def load(page: Path, tmp: Path, width: int = 1280) -> tuple[dict, str]:
    """(what the checker found, Chromium's stderr) for the page at `page`, laid out in a window `width` CSS
    pixels wide (a laptop's)."""
    text = Path(page).read_text()
    checked = tmp / f"checked-{Path(page).name}"
    checked.write_text(text.replace("<head>", "<head>" + CHECKER, 1))
    res = subprocess.run([chromium(), *FLAGS, f"--window-size={width},2000", "--virtual-time-budget=10000",
                          "--dump-dom", checked.as_uri()],
                         capture_output=True, text=True, timeout=120)
    found = re.search(r'<pre id="__check">(.*?)</pre>', res.stdout, re.S)
    assert found, f"the checker never ran (exit {res.returncode}):\n{res.stderr[-3000:]}"
    return json.loads(html.unescape(found.group(1))), res.stderr


def console_errors(stderr: str) -> list[str]:
    """The page's own errors among Chromium's log lines (not its complaints about D-Bus or the GPU)."""
    return [line for line in stderr.splitlines() if "CONSOLE" in line and ("Uncaught" in line or "Error" in line)]


def screenshot(page: Path, png: Path, width: int = 1280, height: int = 2000) -> Path:
    subprocess.run([chromium(), *FLAGS, f"--window-size={width},{height}", f"--screenshot={png}",
                    Path(page).resolve().as_uri()], capture_output=True, text=True, timeout=120, check=True)
    return png


# A label smaller than this many CSS pixels is hard to read (browsers' smallest default minimum font size is
# about 9-10 px; the report's tables are set at 12.5 px).
LEGIBLE_PX = 10.0


def layout_problems(found: dict, label_pt: float, dpi: float) -> list[str]:
    """What a reader of the page at the checker's window width would find cut off, shrunk or too small: a page
    wider than its window, a frontier figure (img.figure) narrower than its box or whose `label_pt` labels
    (drawn at `dpi`) show under LEGIBLE_PX, a table past the window's edge outside a box that scrolls."""
    lay, problems = found["layout"], []
    view = lay["view"]
    if lay["page"] > view + 1:
        problems.append(f"the page is {lay['page']} px wide in a {view} px window")
    for img in lay["images"]:
        if not img["figure"]:
            continue
        if img["shown"] < 0.95 * img["room"]:
            problems.append(f"figure {img['alt']!r} is {img['shown']:.0f} px wide in {img['room']:.0f} px")
        px = label_pt / 72 * dpi * img["shown"] / max(img["natural"], 1)
        if px < LEGIBLE_PX:
            problems.append(f"figure {img['alt']!r}: its labels show at {px:.1f} px")
    for t in lay["tables"]:
        scrolls = t["scroll"] in ("auto", "scroll") and t["box_right"] <= view + 1 \
            and t["box_scroll_width"] >= t["width"]
        if t["right"] > view + 1 and not scrolls:
            problems.append(f"table {t['head']!r} ends at {t['right']:.0f} px in a {view} px window, cut off")
    return problems
