"""Schemes: malformed ones are refused with a RecipeError that says what and where."""

import json

import pytest

from qkiln.errors import RecipeError
from qkiln.quant.scheme import (ActivationScheme, AWQOptions, GPTQOptions, KVCacheScheme, QuantScheme,
                                WeightScheme)

SMOLLM2_LAYER0 = {
    "model.layers.0.self_attn.q_proj": (576, 576), "model.layers.0.self_attn.k_proj": (192, 576),
    "model.layers.0.self_attn.v_proj": (192, 576), "model.layers.0.self_attn.o_proj": (576, 576),
    "model.layers.0.mlp.gate_proj": (1536, 576), "model.layers.0.mlp.up_proj": (1536, 576),
    "model.layers.0.mlp.down_proj": (576, 1536), "lm_head": (49152, 576),
}


@pytest.mark.parametrize("make, words", [
    (lambda: WeightScheme(num_bits=3), "num_bits 4 or 8"),
    (lambda: WeightScheme(num_bits=4, type="float"), "num_bits 8"),
    (lambda: WeightScheme(num_bits=8, type="float", symmetric=False), "symmetric"),
    (lambda: WeightScheme(type="nf4"), "'int' or 'float'"),
    (lambda: WeightScheme(group_size=0), "group_size"),
    (lambda: WeightScheme(zero_point="half"), "zero_point"),
    (lambda: WeightScheme(8, "float", group_size=None, observer="mse"), "observer"),
    (lambda: ActivationScheme(num_bits=4), "fp8 only"),
    (lambda: KVCacheScheme(dtype="int2"), "kv_cache.dtype"),
    (lambda: KVCacheScheme(group_size=7), "group_size"),
    (lambda: GPTQOptions(act_order=True, static_groups=False), "static_groups"),
    (lambda: GPTQOptions(dampening_frac=0), "dampening_frac"),
    (lambda: AWQOptions(clip_max_shrink=1.0), "clip_max_shrink"),
    (lambda: QuantScheme(WeightScheme(8, "float", group_size=None), algorithm="awq"), "'rtn' or 'gptq'"),
    (lambda: QuantScheme(kv_cache=KVCacheScheme(), algorithm="gptq"), "weights scheme"),
    (lambda: AWQOptions(loss_samples=0), "loss_samples"),
    (lambda: QuantScheme(WeightScheme(4), ActivationScheme()), "W8A8"),
    (lambda: QuantScheme(), "quantizes nothing"),
    (lambda: QuantScheme(WeightScheme(4), algorithm="hqq"), "algorithm"),
    (lambda: QuantScheme(WeightScheme(4), ignore=("re:[",)), "regular expression"),
])
def test_malformed_schemes_are_refused(make, words):
    with pytest.raises(RecipeError, match=words.replace("(", r"\(").replace(")", r"\)")):
        make()


def test_partial_groups_are_legal_on_smollm2_shapes():
    QuantScheme(WeightScheme(4, group_size=128), algorithm="gptq").validate(SMOLLM2_LAYER0, head_dim=64)


def test_validation_names_the_offending_layers():
    shapes = dict(SMOLLM2_LAYER0, **{"model.layers.0.odd_proj": (576, 575), "model.layers.1.odd_proj": (64, 99)})
    with pytest.raises(RecipeError) as raised:
        QuantScheme(WeightScheme(4, group_size=64)).validate(shapes)
    message = str(raised.value)
    assert "model.layers.0.odd_proj" in message and "model.layers.1.odd_proj" in message
    assert "q_proj" not in message and "ignore" in message

    fp8 = QuantScheme(WeightScheme(8, "float", group_size=None), ActivationScheme())
    with pytest.raises(RecipeError, match="model.layers.1.odd_proj"):
        fp8.validate(shapes)
    QuantScheme(WeightScheme(4), ignore=("re:.*odd_proj",)).validate(shapes)  # ignored layers are not checked


def test_kv_group_must_divide_head_dim():
    with pytest.raises(RecipeError, match="head_dim 48"):
        QuantScheme(kv_cache=KVCacheScheme("int4", group_size=32)).validate({}, head_dim=48)


def test_int4_kv_scales_are_stored_as_the_cache_stores_them():
    """The paged cache holds int4 scales in fp16: a recipe asking for float32 would have its
    accuracy report computed on scales the runtime never uses."""
    assert KVCacheScheme("int4").scale_dtype == "float16"
    with pytest.raises(RecipeError, match="float16"):
        QuantScheme(kv_cache=KVCacheScheme("int4", scale_dtype="float32")).validate({}, head_dim=64)


def test_ignore_matches_exact_suffix_and_regex():
    scheme = QuantScheme(WeightScheme(4), ignore=("lm_head", "re:.*\\.mlp\\.down_proj$"))
    assert scheme.is_ignored("lm_head") and scheme.is_ignored("model.lm_head")
    assert scheme.is_ignored("model.layers.3.mlp.down_proj")
    assert not scheme.is_ignored("model.layers.3.mlp.up_proj") and not scheme.is_ignored("xlm_head")
    assert scheme.targets(SMOLLM2_LAYER0) == [n for n in SMOLLM2_LAYER0 if "down_proj" not in n and n != "lm_head"]


def test_dict_round_trip_through_json():
    scheme = QuantScheme(WeightScheme(4, symmetric=False, group_size=64, zero_point="float"),
                         kv_cache=KVCacheScheme("int4", 16, key_smoothing_alpha=0.7),
                         ignore=("lm_head", "re:.*embed.*"), algorithm="gptq",
                         gptq=GPTQOptions(act_order=True, dampening_frac=0.05))
    assert QuantScheme.from_dict(json.loads(json.dumps(scheme.to_dict()))) == scheme
    awq = QuantScheme(WeightScheme(4, symmetric=False, group_size=64), algorithm="awq", awq=AWQOptions(grid_size=10))
    assert QuantScheme.from_dict(json.loads(json.dumps(awq.to_dict()))) == awq
    # options of an algorithm that does not run are refused from a file, not recorded as if applied
    with pytest.raises(RecipeError, match="awq options are given but algorithm is 'gptq'"):
        QuantScheme.from_dict(json.loads(json.dumps(scheme.to_dict())) | {"awq": {"grid_size": 10}})
    fp8 = QuantScheme(WeightScheme(8, "float", group_size=None), ActivationScheme(dynamic=False),
                      KVCacheScheme("fp8"))
    assert QuantScheme.from_dict(json.loads(json.dumps(fp8.to_dict()))) == fp8
    assert set(fp8.to_dict()["kv_cache"]).isdisjoint({"group_size", "scale_dtype"})  # int4's only
    older = fp8.to_dict()  # manifests before session 47 listed them for fp8 too: still read
    older["kv_cache"] |= {"group_size": 16, "scale_dtype": "float16"}
    assert QuantScheme.from_dict(older) == fp8


def test_from_dict_refuses_unknown_fields():
    data = QuantScheme(WeightScheme(4)).to_dict()
    data["weights"]["groupsize"] = 64
    with pytest.raises(RecipeError, match="groupsize"):
        QuantScheme.from_dict(data)


@pytest.mark.parametrize("make", [
    lambda: WeightScheme(symmetric="yes"),
    lambda: WeightScheme(group_size=True),
    lambda: WeightScheme(group_size="128"),
    lambda: GPTQOptions(dampening_frac="0.01"),
    lambda: KVCacheScheme(key_smoothing=1),
])
def test_wrong_field_types_from_yaml_are_refused(make):
    with pytest.raises(RecipeError, match="must be"):
        make()


def test_ignore_counts_decoder_layers_from_the_end():
    scheme = QuantScheme(WeightScheme(8, "float", group_size=None), ActivationScheme(), algorithm="gptq",
                         ignore=("lm_head", r"re:model\.layers\.-1\.mlp\.", "layers.-2.self_attn.o_proj"))
    assert scheme.is_ignored("model.layers.3.mlp.down_proj", num_layers=4)
    assert scheme.is_ignored("model.layers.2.self_attn.o_proj", num_layers=4)
    assert not scheme.is_ignored("model.layers.2.mlp.down_proj", num_layers=4)
    assert not scheme.is_ignored("model.layers.3.self_attn.q_proj", num_layers=4)
    assert not scheme.is_ignored("model.layers.3.mlp.down_proj")  # depth unknown: no match from the end
    names = [f"model.layers.{i}.{n}" for i in range(3) for n in ("self_attn.o_proj", "mlp.up_proj")]
    assert scheme.targets(names) == ["model.layers.0.self_attn.o_proj", "model.layers.0.mlp.up_proj",
                                     "model.layers.1.mlp.up_proj", "model.layers.2.self_attn.o_proj"]
