"""The one thing pyproject.toml cannot say: exitbench's optional C extension (exitbench/_probe.c).

`optional=True`: where no C compiler is found the build goes on without it, and the exit rules fall back to
torch ops for a lone CPU token (slower by a few microseconds per iteration; see exitbench/policies/latent.py).
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("exitbench._probe", ["exitbench/_probe.c"], optional=True,
                             extra_compile_args=["-O2"])])
