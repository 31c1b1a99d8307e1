"""Only what pyproject.toml cannot say: the wheel carries the top-level tasks/ inside the package.

The tasks stay at the top of the repository, where users look for them; a plain (non-editable) install has
no repository, so the build copies them to exitbench/tasks, where exitbench.harness.task_set looks first.
"""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithTasks(build_py):
    def run(self):
        super().run()
        if not getattr(self, "editable_mode", False):  # an editable install reads tasks/ where it is
            shutil.copytree(Path(__file__).parent / "tasks", Path(self.build_lib) / "exitbench" / "tasks",
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"), dirs_exist_ok=True)


setup(cmdclass={"build_py": BuildWithTasks})
