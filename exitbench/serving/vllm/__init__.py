"""exitbench's looped models and exit policies as a vLLM model plugin.

vLLM finds the plugin through the `vllm.general_plugins` entry point (pyproject.toml), which names `register`; it
runs in every vLLM process, so this module imports nothing heavy: vLLM itself only inside `register`.

- `forward.py`: one vLLM forward of a looped model with per-token exits (exit mode freeze), vLLM-free;
- `model.py`: the vLLM model class over exitbench's own Raven (one weightless Attention per iteration and layer);
- `engine.py`: `VllmEngine`, the caller's side: requests in, exitbench's SequenceResults (with each token's
  exit iteration) out; `lm.py`: the lm-eval model `exitbench run --backend vllm` evaluates through.
"""
from __future__ import annotations

ARCHITECTURES = ("RavenForCausalLM",)
# vLLM reads config.json through transformers, which knows no "huginn_raven": the plugin names a config class.
MODEL_TYPES = ("huginn_raven",)


def register() -> None:
    """The entry point: vLLM's registry learns the architectures, transformers the config's model type."""
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from .hf_config import RavenVllmConfig

    for model_type in MODEL_TYPES:
        AutoConfig.register(model_type, RavenVllmConfig, exist_ok=True)
    for arch in ARCHITECTURES:
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, "exitbench.serving.vllm.model:VllmLoopedLM")
