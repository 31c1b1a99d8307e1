"""Checkpoints that lie: a safetensors header or a config.json that does not describe a loadable model ends
`exitbench info` and `exitbench run` with one line and exit code 2, never a load of the wrong bytes, a traceback,
or a generation that cannot see `<eos>`.

- safetensors headers as strict as the format: every tensor in bounds, the tensors tiling the data section
  exactly (no overlap, no gap), byte length = shape × dtype size, and the dtype the model needs. Where the
  `safetensors` library refuses a mutated file, each case checks that it does, so "as strict as the format"
  is measured, not assumed;
- config.json through one typed schema: strict types ("1" is not an id, "no" not a bool), token ids inside
  the vocabulary of the model and of the tokenizer;
- Hypothesis properties over random config-value swaps and random header edits (offset shifts, dtype swaps,
  truncation): never a traceback, never a file written in the checkpoint.

The fast equivalent of test_full_size's Huginn-0125 layout is here too: its real config and header layout,
with sparse files standing in for the 7.8 GB of weights, since `info` reads headers only.
"""
from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from typer.testing import CliRunner

from exitbench.cli import app
from exitbench.models.embedded import EMBEDDED_DIR

from helpers.bench import bench_script
from helpers.cli import assert_one_line_error, run_cli
from helpers.files import model_copy
from helpers.models import HUGINN_PARAMETERS

runner = CliRunner()
RAVEN = EMBEDDED_DIR / "tiny-raven"
GPT2 = EMBEDDED_DIR / "tiny-looped-gpt2"
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
RAVEN_VOCAB = 3186  # tiny-raven's vocab_size, padded_vocab_size and tokenizer size alike
RUN = ["--tasks", "chains_lambada", "--policy", "fixed", "--baselines", "16", "--limit", "2"]
# The safetensors format's dtype codes (format.md), including those exitbench does not load.
ALL_CODES = ["BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64",
             "I64", "U64"]
# No database in the repository, and no per-example deadline: a shared 2-core machine makes timings noisy.
FAST = settings(max_examples=25, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


# ---- building and breaking checkpoints -------------------------------------------------------------------

@pytest.fixture
def raven(tmp_path) -> Path:
    return model_copy(RAVEN, tmp_path / "raven")


@pytest.fixture
def gpt2(tmp_path) -> Path:
    return model_copy(GPT2, tmp_path / "gpt2")


def read_safetensors(file: Path) -> tuple[dict, bytes]:
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_safetensors(file: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # the format pads its header to 8 bytes
    file.write_bytes(len(text).to_bytes(8, "little") + text + data)


def edit_header(ck: Path, edit) -> Path:
    file = ck / WEIGHTS
    header, data = read_safetensors(file)
    new_data = edit(header, data)  # edits the header in place; may return new data bytes
    write_safetensors(file, header, new_data if isinstance(new_data, bytes) else data)
    return file


def edit_config(ck: Path, **fields) -> None:
    config = json.loads((ck / CONFIG).read_text())
    config.update(fields)
    (ck / CONFIG).write_text(json.dumps(config))


def snapshot(path: Path) -> dict[str, tuple[int, int]]:
    """Every file under `path` with its size and modification time: a command that only reads changes neither."""
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*")}


def info(ck: Path):
    return runner.invoke(app, ["info", "-c", str(ck), "--json"])


def refused(ck: Path, words=()) -> str:
    """`exitbench info` on `ck` ends with one line containing `words`, exit 2, and writes nothing in `ck`."""
    before = snapshot(ck)
    line = assert_one_line_error(info(ck), words)
    assert snapshot(ck) == before
    return line


def safetensors_refuses(file: Path) -> bool:
    try:
        with safe_open(str(file), framework="pt") as fh:
            list(fh.keys())
    except Exception:  # safetensors raises its own SafetensorError (and OSError for a short file)
        return True
    return False


# ---- safetensors headers -----------------------------------------------------------------------------------

ADAPTER, MLP_PROJ = "transformer.adapter.weight", "transformer.core_block.0.mlp.proj.weight"
MLP_FC = "transformer.core_block.0.mlp.fc.weight"


def overlap(header, data):
    # Same shape, so every size check passes: the load used to read the adapter's bytes as the MLP's.
    header[MLP_PROJ]["data_offsets"] = list(header[ADAPTER]["data_offsets"])


def set_entry(key, **fields):
    def edit(header, data):
        header[key].update(fields)
    return edit


def drop_entry(key):
    def edit(header, data):
        del header[key]
    return edit


HEADER_CASES = {
    # name: (edit, words the error line must hold, whether the safetensors library refuses the file too)
    "overlap": (overlap, [WEIGHTS, MLP_PROJ, ADAPTER, "overlap"], True),
    "gap": (drop_entry("freqs_cis"), [WEIGHTS, "32,768 bytes", "no tensor", "lm_head.weight"], True),
    "trailing-bytes": (lambda h, d: d + bytes(12), [WEIGHTS, "12 bytes", "after the last tensor"], True),
    "string-offsets": (set_entry("freqs_cis", data_offsets=["0", "32768"]), [WEIGHTS, "freqs_cis", "data_offsets"],
                       True),
    "float-shape": (set_entry("freqs_cis", shape=[1, 256.0, 1, 16, 2]), [WEIGHTS, "freqs_cis", "shape"], True),
    "negative-offset": (set_entry("freqs_cis", data_offsets=[-4, 32764]), [WEIGHTS, "freqs_cis", "data_offsets"],
                        True),
    "metadata-not-strings": (lambda h, d: h.update({"__metadata__": {"format": 1}}), [WEIGHTS, "__metadata__"],
                             True),
    # A core weight relabelled: same byte count, so only the dtype the model needs can catch it.
    "i32-core-weight": (set_entry(MLP_FC, dtype="I32"), [WEIGHTS, MLP_FC, "I32", "floating"], False),
}


@pytest.mark.parametrize("case", list(HEADER_CASES))
def test_bad_header_is_one_line(raven, case):
    edit, words, library_refuses = HEADER_CASES[case]
    file = edit_header(raven, edit)
    assert safetensors_refuses(file) == library_refuses
    refused(raven, words)


@pytest.mark.parametrize("case", ["overlap", "i32-core-weight"])
def test_run_refuses_bad_header(raven, tmp_path, capfd, case):
    """Loading, not only `info`: the overlap used to run (quality 0.42 for a model that scores 1.0), the I32
    weight used to be a traceback out of load_state_dict."""
    edit, words, _ = HEADER_CASES[case]
    edit_header(raven, edit)
    before = snapshot(raven)
    capfd.readouterr()
    res, _ = run_cli("-c", str(raven), *RUN, "--out", str(tmp_path / "out"))
    assert_one_line_error(res, words, fd=capfd.readouterr())
    assert snapshot(raven) == before


def _no_metadata(header, data):
    del header["__metadata__"]


@pytest.mark.parametrize("edit", [_no_metadata, lambda h, d: h.update({"__metadata__": None})],
                         ids=["no-metadata", "null-metadata"])
def test_what_the_format_allows_is_allowed(raven, edit):
    """Strict, not stricter: metadata is optional in the format, and the library reads both files."""
    file = edit_header(raven, edit)
    assert not safetensors_refuses(file)
    res = info(raven)
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("at,ok", [(0, True), (32768, True), (4085248, True), (100, False)])
def test_a_zero_size_tensor_may_sit_only_at_a_boundary(raven, at, ok):
    """A tensor of no bytes shares none, so it may sit between two tensors or at either end, but not inside
    one (the library's rule too)."""
    from exitbench.errors import CheckpointError
    from exitbench.models.shards import read_header

    file = edit_header(raven, lambda h, d: h.update(
        {"empty": {"dtype": "F32", "shape": [0, 4], "data_offsets": [at, at]}}))
    assert safetensors_refuses(file) == (not ok)
    if ok:
        assert read_header(file)["empty"].nbytes == 0
    else:
        with pytest.raises(CheckpointError, match="tensor empty .* overlaps tensor freqs_cis"):
            read_header(file)


def test_good_header_still_loads(raven, tmp_path):
    """The checks refuse what is wrong, not what safetensors writes: the embedded model runs as before."""
    res, _ = run_cli("-c", str(raven), *RUN, "--out", str(tmp_path / "out"))
    assert res.exit_code == 0, res.output


TENSORS = sorted(k for k in read_safetensors(RAVEN / WEIGHTS)[0] if k != "__metadata__")


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mutations")


def fresh_raven(scratch: Path) -> Path:
    return model_copy(RAVEN, Path(tempfile.mkdtemp(dir=scratch)) / "ck")


@FAST
@given(key=st.sampled_from(TENSORS), which=st.sampled_from([(1, 0), (0, 1), (1, 1)]),
       delta=st.integers(-5000, 5000).filter(bool))
def test_any_offset_shift_is_refused(scratch, key, which, delta):
    """Moving either end of any tensor, or the whole tensor, by any number of bytes breaks the tiling or the
    byte count: always one line naming the file, never a load of someone else's bytes."""
    ck = fresh_raven(scratch)

    def shift(header, data):
        begin, end = header[key]["data_offsets"]
        header[key]["data_offsets"] = [begin + which[0] * delta, end + which[1] * delta]

    assert safetensors_refuses(edit_header(ck, shift))
    refused(ck, [WEIGHTS])
    shutil.rmtree(ck.parent)


@FAST
@given(key=st.sampled_from(TENSORS), code=st.sampled_from([c for c in ALL_CODES if c != "F32"]))
def test_any_dtype_swap_is_refused(scratch, key, code):
    """Every tensor of tiny-raven is F32; any other code is the wrong byte count (F16, I64, …), a dtype exitbench
    cannot load (U32, F8_E4M3) or, at the same size, not the floating dtype the model needs (I32)."""
    ck = fresh_raven(scratch)
    edit_header(ck, set_entry(key, dtype=code))
    refused(ck, [WEIGHTS, key])
    shutil.rmtree(ck.parent)


@FAST
@given(cut=st.integers(1, (RAVEN / WEIGHTS).stat().st_size))
def test_any_truncation_is_refused(scratch, cut):
    ck = fresh_raven(scratch)
    file = ck / WEIGHTS
    raw = file.read_bytes()
    file.write_bytes(raw[:len(raw) - cut])
    assert safetensors_refuses(file)
    refused(ck, [WEIGHTS])
    shutil.rmtree(ck.parent)


# ---- config.json -------------------------------------------------------------------------------------------

CONFIG_CASES = {
    # name: (fields set, words the error line must hold)
    "bos-out-of-vocab": ({"bos_token_id": 999999}, [CONFIG, "bos_token_id", "999999", str(RAVEN_VOCAB)]),
    "eos-out-of-vocab": ({"eos_token_id": RAVEN_VOCAB}, [CONFIG, "eos_token_id", str(RAVEN_VOCAB)]),
    "pad-negative": ({"pad_token_id": -1}, [CONFIG, "pad_token_id", "-1"]),
    "bos-string": ({"bos_token_id": "1"}, [CONFIG, "bos_token_id", "'1'"]),
    "eos-bool": ({"eos_token_id": True}, [CONFIG, "eos_token_id", "True"]),
    "eos-list": ({"eos_token_id": [2]}, [CONFIG, "eos_token_id"]),
    "model-type-list": ({"model_type": ["huginn_raven"]}, [CONFIG, "model_type"]),
    "torch-dtype-list": ({"torch_dtype": ["float32"]}, [CONFIG, "torch_dtype"]),
    "rope-base-nan": ({"rope_base": math.nan}, [CONFIG, "rope_base"]),
    "provenance-not-an-object": ({"exitbench": 5}, [CONFIG, "exitbench"]),
    "training-not-an-object": ({"exitbench": {"training": "yesterday"}}, [CONFIG, "exitbench.training"]),
    "mean-recurrence-float": ({"mean_recurrence": 16.0}, [CONFIG, "mean_recurrence"]),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_bad_config_is_one_line(raven, case):
    fields, words = CONFIG_CASES[case]
    edit_config(raven, **fields)
    refused(raven, words)


@pytest.mark.parametrize("fields,words", [
    ({"tie_word_embeddings": "no"}, [CONFIG, "tie_word_embeddings", "'no'"]),
    ({"layer_norm_epsilon": "tiny"}, [CONFIG, "layer_norm_epsilon"]),
    ({"activation_function": ["gelu_new"]}, [CONFIG, "activation_function"]),
    ({"bos_token_id": 2048}, [CONFIG, "bos_token_id", "2048"]),
])
def test_bad_gpt2_config_is_one_line(gpt2, fields, words):
    edit_config(gpt2, **fields)
    refused(gpt2, words)


def test_token_id_outside_the_tokenizer(tiny_checkpoint):
    """vocab_size 100, an 18-token tokenizer: id 50 fits the embedding but is no token, so generation would
    never see it (an `<eos>` that cannot be produced runs every request to its length limit)."""
    edit_config(tiny_checkpoint, eos_token_id=50)
    refused(tiny_checkpoint, [CONFIG, "eos_token_id", "50", "tokenizer.json", "18"])


def test_more_layers_than_tensors_is_refused_before_the_model_is_built(raven):
    """Each layer is Python objects even on the meta device: 20,000 of them cost `info` 40 s and 1 GB before the
    keys could be compared, a million all memory. Every layer stores a tensor, so the count is checked first."""
    edit_config(raven, n_layers_in_coda=5000)
    refused(raven, [CONFIG, "5,001 layers", "14 tensors"])


def test_extra_fields_are_allowed(raven):
    """Real configs carry many fields exitbench does not read; their types are not exitbench's business."""
    # (num_key_value_heads was one of them until Ouro: exitbench reads it now, so its type is checked.)
    edit_config(raven, use_cache="yes", transformers_version=5, auto_map=[1, 2], initializer_range="small")
    res = info(raven)
    assert res.exit_code == 0, res.output


# Every field of tiny-raven's config.json that exitbench reads, by the JSON type it must have.
KINDS = {
    "int": ["block_size", "hidden_size", "intermediate_size", "mean_backprop_depth", "mean_recurrence", "n_embd",
            "n_heads", "n_layers_in_coda", "n_layers_in_prelude", "n_layers_in_recurrent_block",
            "num_attention_heads", "vocab_size"],
    "int-or-null": ["bos_token_id", "eos_token_id", "max_recurrence", "pad_token_id", "padded_vocab_size"],
    "number": ["init_scale", "norm_eps", "rope_base"],
    "bool": ["bias", "qk_bias", "tie_embeddings"],
    "str-or-null": ["model_type", "torch_dtype"],  # null: as if absent (architectures, the files' dtype decide)
    "list-of-str-or-null": ["architectures"],
    "object": ["exitbench"],
}
FIELD_KIND = {name: kind for kind, names in KINDS.items() for name in names}

_ints = st.integers(-(2 ** 40), 2 ** 40)
_floats = st.floats(allow_nan=False, allow_infinity=False)
_text = st.text(max_size=8)
_scalars = st.one_of(st.none(), st.booleans(), _ints, _floats, _text)
_lists = st.lists(_scalars, max_size=3)
_objects = st.dictionaries(st.text(max_size=4), _scalars, max_size=3)
WRONG = {
    "int": st.one_of(st.none(), st.booleans(), _floats, _text, _lists, _objects),
    "int-or-null": st.one_of(st.booleans(), _floats, _text, _lists, _objects),
    "number": st.one_of(st.none(), st.booleans(), _text, _lists, _objects),
    "bool": st.one_of(st.none(), _ints, _floats, _text, _lists, _objects),
    "str-or-null": st.one_of(st.booleans(), _ints, _floats, _lists, _objects),
    "list-of-str-or-null": st.one_of(st.booleans(), _ints, _floats, _text, _objects,
                                     st.lists(st.one_of(st.none(), st.booleans(), _ints, _floats), min_size=1,
                                              max_size=3)),
    "object": st.one_of(st.none(), st.booleans(), _ints, _floats, _text, _lists),
}


@st.composite
def wrong_field(draw):
    name = draw(st.sampled_from(sorted(FIELD_KIND)))
    return name, draw(WRONG[FIELD_KIND[name]])


def test_kinds_cover_every_field_the_models_read():
    """The property below is only as good as its field list: it must name every field of tiny-raven's config
    except those no architecture reads (HF's duplicates n_layers and num_key_value_heads)."""
    config = json.loads((RAVEN / CONFIG).read_text())
    assert set(config) - set(FIELD_KIND) == {"n_layers", "num_key_value_heads"}


@FAST
@given(field_value=wrong_field())
def test_any_wrongly_typed_field_is_refused(scratch, field_value):
    """A value of the wrong JSON type in any field exitbench reads: one line naming config.json and the field."""
    name, value = field_value
    ck = fresh_raven(scratch)
    edit_config(ck, **{name: value})
    refused(ck, [CONFIG, name])
    shutil.rmtree(ck.parent)


_json = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6)


@FAST
@given(name=st.sampled_from(sorted(json.loads((RAVEN / CONFIG).read_text()))), value=_json)
def test_any_field_any_value_is_a_report_or_one_line(scratch, name, value):
    """Any JSON value in any field: a report (exit 0) or one line (exit 2); no traceback, nothing written.
    (A value of the right type can still be wrong, e.g. init_scale -1: the architecture's own checks say so.)"""
    ck = fresh_raven(scratch)
    edit_config(ck, **{name: value})
    before = snapshot(ck)
    res = info(ck)
    if res.exit_code != 0:
        assert_one_line_error(res)
    assert snapshot(ck) == before
    shutil.rmtree(ck.parent)


@FAST
@given(name=st.sampled_from(["bos_token_id", "eos_token_id", "pad_token_id"]),
       value=st.one_of(st.integers(-(2 ** 63), 2 ** 63), st.integers(RAVEN_VOCAB - 3, RAVEN_VOCAB + 3)))
@example(name="bos_token_id", value=65504)  # Huginn-0125's: CI's draw once found it
def test_token_ids_are_accepted_exactly_inside_the_vocabulary(scratch, name, value):
    from exitbench.models.raven.config import HUGINN_TOKEN_IDS

    ck = fresh_raven(scratch)
    edit_config(ck, **{name: value})
    if 0 <= value < RAVEN_VOCAB:
        res = info(ck)
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["tokenizer"]["special_tokens"][name.removesuffix("_token_id")]["id"] == value
    elif value == HUGINN_TOKEN_IDS[name]:
        # Huginn-0125's own id, outside this vocabulary: a conversion's leftover, read past by design (the
        # tokenizer's special tokens stand instead; `stale_token_ids`). Hypothesis draws it: it samples the
        # constants of the code under test.
        assert info(ck).exit_code == 0
    else:
        refused(ck, [CONFIG, name, str(value)])
    shutil.rmtree(ck.parent)


# ---- Huginn-0125's own layout still passes -----------------------------------------------------------------

def _huginn_maker():
    return bench_script("make_huginn_size")


def test_huginn_layout_passes_the_checks(tmp_path):
    """The released config (bench/make_huginn_size.py's copy of it), its 65,536-token tokenizer with the special
    tokens at Huginn's ids, and the hub's 4-shard layout, the tied embedding stored twice and the freqs_cis
    table included, pass the schema, the token-id and the header checks. The data sections are sparse files:
    `info` reads headers only, so 7.8 GB of zeros cost no disk and no time."""
    probe = tmp_path / "probe"
    with open(probe, "wb") as fh:
        fh.truncate(1 << 30)
    if probe.stat().st_blocks * 512 > 1 << 20:  # a file system without holes would write the 7.8 GB out
        pytest.skip(f"{tmp_path} does not keep sparse files sparse")
    probe.unlink()
    maker = _huginn_maker()
    ck = tmp_path / "huginn"
    ck.mkdir()
    (ck / CONFIG).write_text(json.dumps(maker.CONFIG))
    maker.make_tokenizer().save(str(ck / "tokenizer.json"))
    keys = maker.layout()
    per_shard = math.ceil(len(keys) / maker.SHARDS)
    weight_map = {}
    for i in range(maker.SHARDS):
        name = f"model-{i + 1:05d}-of-{maker.SHARDS:05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for key, shape in keys[i * per_shard:(i + 1) * per_shard]:
            size = 2 * math.prod(shape)
            header[key] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
            weight_map[key] = name
            offset += size
        write_safetensors(ck / name, header, b"")
        with open(ck / name, "r+b") as fh:
            fh.truncate(fh.seek(0, 2) + offset)
    (ck / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    res = info(ck)
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["parameters"] == HUGINN_PARAMETERS
    assert (report["dtype"], report["stored_dtype"]) == ("bfloat16", "bfloat16")
    assert report["tokenizer"]["special_tokens"] == {"bos": {"id": 65504, "token": "<|begin_text|>"},
                                                     "eos": {"id": 65505, "token": "<|end_text|>"},
                                                     "pad": {"id": 65509, "token": "<|pad|>"}}
