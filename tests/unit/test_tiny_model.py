import argparse

import pytest

from llumnix.tiny_model import PRESETS, TinyModelRecipe, add_arguments, read_recipe_record, recipe_from_args


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["out", *argv])


def test_llama_intermediate_rule_and_7b_like_shape():
    assert TinyModelRecipe(hidden=4096, head_dim=128, heads=32, kv_heads=32).intermediate_size == 11008
    seven = PRESETS["7b-like"]
    assert (seven.layers, seven.hidden, seven.heads, seven.kv_heads, seven.head_dim) == (4, 1024, 16, 2, 64)
    q_and_o = 2 * seven.hidden * seven.heads * seven.head_dim
    attention = q_and_o + 2 * seven.hidden * seven.kv_heads * seven.head_dim
    mlp = 3 * seven.hidden * seven.intermediate_size
    assert 40e6 < seven.layers * (attention + mlp) < 50e6


def test_options_override_the_preset_and_change_the_digest():
    recipe = recipe_from_args(parse("--preset", "7b-like", "--layers", "2", "--seed", "5"))
    assert recipe.layers == 2 and recipe.hidden == 1024 and recipe.seed == 5
    assert recipe_from_args(parse()) == TinyModelRecipe()
    assert recipe.digest() != PRESETS["7b-like"].digest()
    assert TinyModelRecipe().digest() == TinyModelRecipe().digest()


@pytest.mark.parametrize("fields, message", [
    ({"head_dim": 48}, "CPU attention"),
    ({"heads": 4, "kv_heads": 3}, "multiple of kv_heads"),
    ({"dtype": "int8"}, "dtype"),
    ({"layers": 0}, "positive"),
])
def test_invalid_shapes_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        TinyModelRecipe(**fields)


def test_built_model_records_its_recipe(tiny_model_dir):
    record = read_recipe_record(tiny_model_dir)
    assert record is not None and record["digest"] == TinyModelRecipe().digest()
    files = {p.name for p in tiny_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
