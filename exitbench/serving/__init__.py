"""exitbench's exit policies inside serving engines (vLLM: exitbench.serving.vllm, with the `[vllm]` extra)."""
