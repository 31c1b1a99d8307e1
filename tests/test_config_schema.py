"""config.json's schema is each family's own config class (exitbench/models/schema.py): every field the class
declares, and every name it reads under another (`read_also`), is typed before a weight is read, for every
registered family; a family registers with one call, its names read from its config class."""
from __future__ import annotations

from dataclasses import fields

import pytest

from exitbench.cli import app
from exitbench.models.embedded import EMBEDDED_DIR
from exitbench.models.registry import ARCHITECTURES, architecture_of
from exitbench.models.schema import ConfigCommon, schema_for

from helpers.cli import assert_one_line_error, runner
from helpers.files import FIXTURES, edited_copy

# One checkpoint of each registered family, and an integer field its config class declares.
FAMILIES = {
    "huginn_raven": (EMBEDDED_DIR / "tiny-raven", "n_layers_in_coda"),
    "looped_gpt2": (EMBEDDED_DIR / "tiny-looped-gpt2", "n_layer"),
    "ouro": (FIXTURES / "ouro-tiny", "total_ut_steps"),
    "nanbeige": (FIXTURES / "nanbeige-tiny", "num_loops"),
    "hrm_text": (FIXTURES / "hrm-text-tiny", "H_cycles"),
    "dory": (FIXTURES / "dory-tiny", "n_recurrent_loops"),
    # Inkling 2's fields passed untyped before the schema came from its class
    "inkling2_loop_text": (FIXTURES / "inkling2-tiny", "swa_head_dim"),
}


def test_every_registered_family_is_covered_here():
    assert set(FAMILIES) == set(ARCHITECTURES)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_schema_is_the_config_class(family):
    config_class = ARCHITECTURES[family].config_class
    schema = schema_for(config_class)
    declared = {f.name for f in fields(config_class)} - {"extra", "variant"}
    assert set(schema.model_fields) == declared | set(getattr(config_class, "read_also", {})) \
        | set(ConfigCommon.model_fields)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_declared_field_of_the_wrong_type_is_refused_in_one_line(family, tmp_path):
    source, field = FAMILIES[family]
    for i, value in enumerate(("7", 7.5, True, [7])):
        copy = edited_copy(source, tmp_path / f"{family}-{i}", **{field: value})
        res = runner.invoke(app, ["info", "-c", str(copy)])
        assert_one_line_error(res, ["config.json", field])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_family_answers_to_every_name_its_config_class_gives(family):
    c = ARCHITECTURES[family].config_class
    for name in (c.model_type, *getattr(c, "model_type_aliases", ())):
        assert architecture_of({"model_type": name}) is ARCHITECTURES[family]
    for name in (c.hf_class, *getattr(c, "hf_aliases", ())):
        assert architecture_of({"architectures": [name]}) is ARCHITECTURES[family]
