"""The `lm_head` scheme: an int8 copy of a tied output projection, built, simulated and served."""

import pytest
import torch

from qkiln.compile.artifact import read_manifest
from qkiln.compile.artifact_model import load_artifact_model
from qkiln.compile.build import build
from qkiln.compile.recipe import load_recipe, preset
from qkiln.errors import RecipeError
from qkiln.quant.scheme import QuantScheme
from qkiln.runtime.loader import load_for_serving
from tiny_models import write_tiny_hf_model


@pytest.fixture(scope="module")
def tied_artifact(tmp_path_factory):
    root = tmp_path_factory.mktemp("head")
    model = write_tiny_hf_model(root / "m", "llama")  # tie_word_embeddings=True
    return model, build(str(model), load_recipe("w4a16-rtn"), root / "a", use_cache=False, progress=False,
                        log=lambda m: None).path


def test_tied_head_is_stored_as_its_own_int8_linear(tied_artifact):
    _, path = tied_artifact
    manifest = read_manifest(path)
    entry = manifest.quantization["linears"]["lm_head"]
    assert entry["format"] == "int8" and entry["out_features"] == manifest.architecture["vocab_size"]
    assert manifest.recipe["scheme"]["lm_head"]["num_bits"] == 8


def test_runtime_and_simulation_use_the_quantized_head_and_exact_embeddings(tied_artifact):
    source, path = tied_artifact
    served = load_for_serving(str(path), dtype="fp32").model
    simulated = load_artifact_model(path)
    embed = load_for_serving(str(source), dtype="fp32").model.model.embed_tokens.weight
    assert served.lm_head.kind == "int8"
    # lookups keep the (bf16-stored) exact embedding; the head is its int8 copy, close but not equal
    torch.testing.assert_close(served.model.embed_tokens.weight, embed.to(torch.bfloat16).float())
    hidden_size = served.config.hidden_size  # the simulated head dequantizes per call: read it through a call
    with torch.no_grad():
        head = simulated.model.lm_head(torch.eye(hidden_size)).t()
    assert not torch.equal(head, served.model.embed_tokens.weight)
    assert (head - served.model.embed_tokens.weight).abs().max() <= embed.abs().max().item() / 100
    h = torch.randn(3, head.shape[1])
    with torch.inference_mode():  # the served head computes exactly with the simulated int8 weights
        torch.testing.assert_close(served.lm_head(h), h @ head.t(), rtol=1e-4, atol=1e-4)
        ids = torch.randint(0, 256, (1, 19))
        got, want = served(ids).float(), simulated(ids)
    # end to end the int4 kernels round activations to bf16: agreement at that level
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2 * want.abs().max().item())


def test_lm_head_scheme_must_be_integer():
    with pytest.raises(RecipeError, match="lm_head"):
        QuantScheme.from_dict({"weights": {"num_bits": 4}, "lm_head": {"num_bits": 8, "type": "float"}})
    assert preset("fp8-w8a8").scheme.lm_head is None  # fp8 keeps the head in bf16 (quality target)
