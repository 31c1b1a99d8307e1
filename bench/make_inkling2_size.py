"""Write a random checkpoint of Inkling 2 Mini's real widths, key names, formats and scales, with fewer layers and
experts than the release (whose 52 GB in bf16 these machines cannot hold): what exitbench reads when a user points
it at thinkingmachines/Inkling-2-Mini, minus the training and most of the depth and width of the MoE.

    python bench/make_inkling2_size.py /tmp/inkling2 [--layers 18] [--experts 8]

- config.json as the multimodal release packs it (shared/reference/inkling2.md): model_type inkling2_loop, the
  text model's fields under text_config with their released values (hidden 2304; 24 query and 8 key/value heads of
  128 in both layer kinds; window 1024; relative extent 1024 with d_rel 16; log scaling from 8192; blocks of 6;
  experts of 1152, 8 chosen, route scale 8; softcaps 4, 25, 30; vocabulary 201,024 padded, 200,058 read; eos
  200006) but `--layers` layers (18: prelude 6, core 6, coda 6, full attention where (i + 1) % 6 == 0) and
  `--experts` experts (8), and the loop under loop_config (core 6-12, 3 passes, gate rank 64);
- the release's keys (`model.llm.*`), written from that reference's list and not from exitbench's module tree, one
  shard per block of layers with an index; the float32-pinned tensors stored F32, the rest BF16; the experts as
  shipped: NVFP4 parts in every layer but the last four, MXFP8 in those (the release's 0-19 and 20-23);
  one vision-tower tensor (`model.visual.*`), which a text loader leaves out;
- a byte-level BPE tokenizer.json of 200,058 entries, `<|endoftext|>` at the eos id.

Weights N(0, 0.02), norms and clip scales 1, depth queries N(0, 1). With the defaults 2,573,017,488 parameters
(the experts 1.15B of them), 3.63 GB on disk and 5.15 GB in bf16 once dequantised. Each shard is streamed
(`sizes.write_shard`): its header written from the layout, each tensor written by a thread while the next is drawn,
the experts quantised one at a time, and laid out as safetensors' save_file lays them out, so the files are the
bytes a save_file of each whole shard made. 19 s at a 3.0 GB peak on two idle cores (the head drawn in float32
beside its bf16 copy), the large tensors from one pool of normals (`sizes.Normals`; 28 s when every value was
drawn), where the whole shards in memory took 80 s at 4.0 GB on 2 shared cores; the NVFP4 rounding is 10 s of it,
the writes mostly hidden behind it (bench/RESULTS.md). Why here and
not in the package: no user needs a random Inkling. It is the fixture of the slow real-width test
(tests/test_full_size.py, its inkling2 row).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from tokenizers import AddedToken

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from exitbench.models.quantized import MXFP8_BLOCK, NVFP4_BLOCK, quantize_mxfp8, quantize_nvfp4  # noqa: E402
from sizes import Normals, byte_level_bpe, safetensors_order, size_main, write_shard  # noqa: E402

TEXT = dict(hidden_size=2304, vocab_size=201024, unpadded_vocab_size=200058, num_attention_heads=24,
            num_key_value_heads=8, head_dim=128, swa_num_attention_heads=24, swa_num_key_value_heads=8,
            swa_head_dim=128, sliding_window_size=1024, d_rel=16, rel_extent=1024, log_scaling_n_floor=8192,
            log_scaling_alpha=0.1, max_position_embeddings=1048576, rms_norm_eps=1e-6, conv_kernel_size=4,
            hidden_act="silu", moe_intermediate_size=1152, num_experts_per_tok=8, route_scale=8.0,
            qk_l2_clip_threshold=22.627416997969522, rel_l2_clip_threshold=8.0, n_layers_per_attn_res_block=6,
            mlp_gate_softcap=4.0, mlp_up_softcap=25.0, final_logit_softcapping=30.0, scoring_func="sigmoid",
            eos_token_id=200006, model_type="inkling2_loop_text")
LOOP = {"core_start": 6, "core_end": 12, "num_passes": 3, "gate_rank": 64}
FLOAT32 = ("mlp.gate.weight", "mlp.gate.bias", "attn_sconv.weight", "mlp_sconv.weight", "attn.k_sconv.weight",
           "attn.v_sconv.weight", "forget_weight", "gain_weight")
VISUAL = "model.visual.backbone.ln_pre.weight"  # the vision tower's one tensor, in shard 0


def config_json(layers: int, experts: int) -> dict:
    text = {**TEXT, "num_hidden_layers": layers, "n_routed_experts": experts, "loop_config": LOOP,
            "layer_types": ["hybrid" if (i + 1) % 6 == 0 else "hybrid_sliding" for i in range(layers)]}
    return {"model_type": "inkling2_loop", "architectures": ["Inkling2LoopForConditionalGeneration"],
            "text_config": text, "torch_dtype": "bfloat16"}


def layout(layers: int, experts: int) -> list[tuple[str, tuple[int, ...]]]:
    c = TEXT
    H, hd, heads, kv, K = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"], 4
    inner, rank, loop = c["moe_intermediate_size"], LOOP["gate_rank"], LOOP["core_end"] - LOOP["core_start"]
    full = lambda i: (i + 1) % 6 == 0  # noqa: E731
    keys = [("model.llm.embed.weight", (c["vocab_size"], H)), ("model.llm.embed_norm.weight", (H,))]
    for i in range(layers):
        p = f"model.llm.layers.{i}"
        extent = c["rel_extent"] if full(i) else c["sliding_window_size"]
        keys += [(f"{p}.attn.attn_sink_proj.weight", (heads, H)), (f"{p}.attn.gate_attn.weight", (heads * hd, H)),
                 (f"{p}.attn.wq_du.weight", (heads * hd, H)), (f"{p}.attn.wk_dv.weight", (kv * hd, H)),
                 (f"{p}.attn.wv_dv.weight", (kv * hd, H)), (f"{p}.attn.wo_ud.weight", (H, heads * hd)),
                 (f"{p}.attn.wr_du.weight", (heads * c["d_rel"], H)), (f"{p}.attn.q_l2_clip.scale", (heads, hd)),
                 (f"{p}.attn.rel_l2_clip.scale", (heads, c["d_rel"])),
                 (f"{p}.attn.rel_logits_proj.proj", (c["d_rel"], extent))]
        if full(i):
            for n in ("k", "v"):
                keys += [(f"{p}.attn.{n}_sconv.static_w", (K, kv * hd)),
                         (f"{p}.attn.{n}_sconv.weight_proj", (kv * K, H))]
            keys += [(f"{p}.{n}_input_norm.weight", (H,)) for n in ("q", "k", "v")]
        else:
            keys += [(f"{p}.attn.{n}_sconv.weight", (kv * hd, 1, K)) for n in ("k", "v")]
            keys += [(f"{p}.attn_norm.weight", (H,))]
        keys += [(f"{p}.attn_sconv.weight", (H, 1, K)), (f"{p}.mlp_sconv.weight", (H, 1, K)),
                 (f"{p}.mlp_norm.weight", (H,)), (f"{p}.mlp.gate.weight", (experts, H)),
                 (f"{p}.mlp.gate.bias", (experts,)),
                 (f"{p}.mlp.experts.w13_weight", (experts, 2 * inner, H)),
                 (f"{p}.mlp.experts.w2_weight", (experts, H, inner))]
        if LOOP["core_start"] <= i < LOOP["core_end"]:
            for n in ("attn", "k", "v", "mlp"):
                keys += [(f"{p}.controllers.{n}.down_weight", (rank, 2 * H)),
                         (f"{p}.controllers.{n}.forget_weight", (H, rank)),
                         (f"{p}.controllers.{n}.gain_weight", (H, rank))]
    keys += [(f"model.llm.attn_res.attn_queries.{i - 1}", (3, H) if full(i) else (H,)) for i in range(1, layers)]
    keys += [(f"model.llm.attn_res.mlp_queries.{i}", (H,)) for i in range(layers)]
    keys += [("model.llm.attn_res.output_query", (H,)), ("model.llm.middle_cycle_cross_pass_queries", (2 * loop, H)),
             ("model.llm.middle_cycle_cross_pass_kv_queries", (2 * loop, H)), ("model.llm.norm.weight", (H,)),
             ("model.llm.unembed.weight", (c["vocab_size"], H))]
    return keys


def make(key: str, shape: tuple[int, ...], normal: Normals) -> torch.Tensor:
    t = torch.empty(shape)
    if key.endswith(("norm.weight", ".scale")):
        return t.fill_(1.0)
    if "attn_res" in key or "middle_cycle" in key:
        return normal(t, 0.0, 1.0)
    if key.endswith("gate.bias"):
        return t.zero_()
    return normal(t, 0.0, 0.02)


def pinned(key: str) -> bool:
    """Whether a (not quantised) key is stored F32 rather than BF16."""
    return key.endswith(FLOAT32) or "attn_res" in key or "middle_cycle" in key


def quantized(key: str, layers: int) -> str | None:
    """The format a key is stored in: "nvfp4" or "mxfp8" for the experts (MXFP8 in the last four layers), None
    for the rest."""
    if ".mlp.experts." not in key:
        return None
    return "mxfp8" if int(key.split(".")[3]) >= layers - 4 else "nvfp4"


def entries(key: str, shape: tuple[int, ...], layers: int) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """What a key is stored as, (key, dtype, shape) per part, before it is made: the header is written first. An
    expert stack (n, rows, cols) as quantize_nvfp4's or quantize_mxfp8's parts, in the order they return them
    (codes two a byte and an E4M3 scale a block of 16 with two per-expert F32 factors; or E4M3 values and a U8
    exponent a block of 32); write_shard holds each made part to its entry."""
    fmt = quantized(key, layers)
    if fmt is None:
        return [(key, torch.float32 if pinned(key) else torch.bfloat16, shape)]
    n, rows, cols = shape
    if fmt == "mxfp8":
        return [(key, torch.float8_e4m3fn, shape), (key + "_scale", torch.uint8, (n, rows, cols // MXFP8_BLOCK))]
    return [(key, torch.uint8, (n, rows, cols // 2)),
            (key + "_scale", torch.float8_e4m3fn, (n, rows, cols // NVFP4_BLOCK)),
            (key + "_amax", torch.float32, (n,)), (key + "_outer_scale_denominator", torch.float32, (n,))]


def quantize_experts(fmt: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """An expert stack's parts, quantised one expert at a time (each expert's parts are its own, its amax
    included) and stacked: the same parts as quantising the stack whole, in less than half the time, as the
    float32 intermediates of one expert are reused where the whole stack's are fresh memory each."""
    quantize = quantize_mxfp8 if fmt == "mxfp8" else quantize_nvfp4
    per = [quantize(w[i:i + 1].to(torch.bfloat16).float()) for i in range(w.shape[0])]
    return {suffix: torch.cat([parts[suffix] for parts in per]) for suffix in per[0]}


def write(out: Path, layers: int = 18, experts: int = 8, seed: int = 0, log=print) -> Path:
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"error: {out} exists and is not empty; choose a new directory")
    out.mkdir(parents=True, exist_ok=True)
    normal = Normals(torch.Generator().manual_seed(seed))
    keys = layout(layers, experts)
    shard_of = lambda key: (int(key.split(".")[3]) // 6 + 1) if ".layers." in key else 0  # noqa: E731
    shards = sorted({shard_of(k) for k, _ in keys})
    names = {s: f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i, s in enumerate(shards)}
    weight_map, total = {}, 0

    def made(group: list[tuple[str, tuple[int, ...]]], visual: bool):
        """The group's tensors as stored, drawn by `normal` in the layout's order (one at a time: write_shard writes
        each while the next is drawn)."""
        for key, shape in group:
            t = make(key, shape, normal)
            fmt = quantized(key, layers)
            if fmt is None:
                t = t if pinned(key) else t.to(torch.bfloat16)  # the float32 draw freed before the next one
                yield key, t
                continue
            parts = quantize_experts(fmt, t)
            del t
            yield from ((key + suffix, part) for suffix, part in parts.items())
        if visual:
            yield VISUAL, torch.ones(1024, dtype=torch.bfloat16)

    for s in shards:
        group = [(key, shape) for key, shape in keys if shard_of(key) == s]
        stored = [entry for key, shape in group for entry in entries(key, shape, layers)]
        if s == 0:
            stored.append((VISUAL, torch.bfloat16, (1024,)))
        # laid out as save_file lays them out (by dtype, then key), so the file is the bytes it made
        total += write_shard(out / names[s], safetensors_order(stored), made(group, s == 0))
        weight_map.update({key: names[s] for key, _, _ in stored})
        log(f"  {names[s]}: {len(stored)} tensors")
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=1) + "\n")
    tok = byte_level_bpe(TEXT["eos_token_id"])
    reserved = TEXT["unpadded_vocab_size"] - TEXT["eos_token_id"] - 1
    specials = ["<|endoftext|>"] + [f"<|reserved_{i}|>" for i in range(reserved)]
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    assert tok.get_vocab_size(with_added_tokens=True) == TEXT["unpadded_vocab_size"]
    assert tok.token_to_id("<|endoftext|>") == TEXT["eos_token_id"]
    tok.save(str(out / "tokenizer.json"))
    (out / "config.json").write_text(json.dumps(config_json(layers, experts), indent=2, sort_keys=True) + "\n")
    log(f"wrote {out}: {len(keys)} keys, {total:,} bytes")
    return out


def main(argv: list[str] | None = None) -> None:
    size_main(__doc__, write, argv, ("--layers", dict(type=int, default=18, help="layers (multiples of 6, at least 18)")), ("--experts", dict(type=int, default=8, help="routed experts per layer (at least 8)")), dtype=False)


if __name__ == "__main__":
    sys.exit(main())
