"""The engines a sweep's cells run on, by name (`exitbench run --backend NAME`), as lm-eval registers its models.

A backend is chosen once, when the sweep's config is read, and everything that differs between engines asks it:
which lm-eval model class evaluates the cells, what it refuses before anything is read, what it cannot run, the
part of a cell's key that names it, whether its cells are retimed beside full depth, and what it must stop when
the run ends. No other module compares a backend's name.

- `hf`: exitbench's own engine (exitbench.engine), the default; named in no key, so its cells keep their ids.
- `vllm`: exitbench's rules inside vLLM's own loop (exitbench.serving.vllm), exit mode freeze.
"""
from __future__ import annotations

from typing import Any

from ..errors import ExitbenchError


class Backend:
    name = "hf"
    engine = "exitbench's"  # whose loop runs the cells, for messages
    # Options it cannot honour, as (SweepConfig field, the flag a user typed)
    unsupported: tuple[tuple[str, str], ...] = ()
    # Whether a cell's repeated timings pair it with full depth on exitbench's own engine: another engine's clock
    # is no pair for that one (docs/serving.md).
    retimed = True

    def lm_class(self) -> type:
        """The lm-eval model class that evaluates a cell."""
        from ..harness.model import ExitbenchLM

        return ExitbenchLM

    def prepare(self) -> None:
        """Refuse, before anything is read or written, a machine that cannot run it."""

    def check_configs(self, model: Any, configs: list[Any]) -> None:
        """Refuse, before any cell runs, an exit config it cannot serve on `model`."""

    def key_part(self) -> dict[str, str]:
        """What a cell's key says of the engine (nothing for the default, so its cells keep their ids)."""
        return {} if self.name == DEFAULT else {"backend": self.name}

    def title(self) -> str:
        """What a run's table title adds, so no table hides which engine made it."""
        return "" if self.name == DEFAULT else f" (backend {self.name})"

    def teardown(self) -> None:
        """Stop what it started, while the run's process group still stands."""


class VllmBackend(Backend):
    name = "vllm"
    engine = "vLLM's"
    unsupported = (("replay", "--replay"), ("compile_step", "--compile"))
    retimed = False

    def lm_class(self) -> type:
        from ..serving.vllm.lm import VllmLM

        return VllmLM

    def prepare(self) -> None:
        from ..serving.vllm.engine import import_vllm

        import_vllm()

    def check_configs(self, model: Any, configs: list[Any]) -> None:
        from ..serving.vllm.forward import check_servable

        for config in configs:
            check_servable(model, config)

    def teardown(self) -> None:
        from ..serving.vllm.engine import shutdown

        shutdown()


DEFAULT = "hf"
BACKENDS: dict[str, Backend] = {b.name: b for b in (Backend(), VllmBackend())}


def backend(name: str) -> Backend:
    """The backend called `name`, or one line naming the known ones."""
    if name not in BACKENDS:
        raise ExitbenchError(f"--backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    return BACKENDS[name]


def check_options(name: str, config: Any) -> None:
    """Refuse the options the backend cannot honour (`config`: the SweepConfig), in one line."""
    chosen = backend(name)
    if any(getattr(config, field) for field, _ in chosen.unsupported):
        raise ExitbenchError(f"--backend {name} runs cells exactly, in {chosen.engine} own loop: drop "
                             f"{' and '.join(flag for _, flag in chosen.unsupported)}, or use --backend {DEFAULT}")
