"""The bench scripts (bench/*.py) as modules, for the tests that call their functions: loaded from their files, as
they are scripts, not a package."""
from __future__ import annotations

import importlib.util
from types import ModuleType

from helpers.paths import REPO


def bench_script(name: str) -> ModuleType:
    """bench/NAME.py, loaded afresh (its `if __name__ == "__main__"` block not run)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
