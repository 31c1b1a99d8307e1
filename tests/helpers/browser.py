"""A page opened in headless Chromium (Debian's `chromium` package): what loaded, what failed, a screenshot.

`load` copies the page with a checker script put first in its <head>: it records every error event (scripts,
images) and, once the page has loaded, how many images there are and how many decoded, each exit map row's
declared token count beside the tokens it shows, and any reference to the network. Chromium's --dump-dom
prints the page after its load event, checker output included; stderr is kept for console errors.
"""
from __future__ import annotations

import html
import json
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
  var out = {errors: window.__errors, images: images.length, external: external, maps: docs,
             decoded: images.filter(function (i) { return i.complete && i.naturalWidth > 0; }).length};
  var pre = document.createElement('pre'); pre.id = '__check'; pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
         "--disable-background-networking", "--enable-logging=stderr", "--v=0"]


def chromium() -> str:
    """The browser's path; the test is skipped (with the install line) where there is none."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("no headless Chromium: apt-get install -y chromium")
    return path


def load(page: Path, tmp: Path) -> tuple[dict, str]:
    """(what the checker found, Chromium's stderr) for the page at `page`."""
    text = Path(page).read_text()
    checked = tmp / f"checked-{Path(page).name}"
    checked.write_text(text.replace("<head>", "<head>" + CHECKER, 1))
    res = subprocess.run([chromium(), *FLAGS, "--virtual-time-budget=10000", "--dump-dom", checked.as_uri()],
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
