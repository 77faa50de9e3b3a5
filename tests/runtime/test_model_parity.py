"""The lean model must match transformers' implementation: fp32 logits within 1e-4 relative."""

import pytest
import torch

from qkiln.runtime.source import load_source
from tiny_models import write_tiny_hf_model

ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3"]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_random_matches_transformers(tmp_path, arch):
    import transformers

    write_tiny_hf_model(tmp_path, arch)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32).eval()
    ours = load_source(tmp_path).build_model(torch.float32)
    ids = torch.randint(0, 256, (2, 100))  # positions past 64 exercise llama3's scaled band
    with torch.no_grad():
        expected = ref(ids).logits
        got = ours(ids)
    assert _rel_err(got, expected) < 1e-4


def test_smollm2_matches_transformers_gguf_loader(smollm2, smollm2_transformers):
    ref = smollm2_transformers
    ours = smollm2.build_model(torch.float32)
    ids = torch.tensor([smollm2.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 8)])
    with torch.no_grad():
        expected = ref(ids).logits
        got = ours(ids)
    assert _rel_err(got, expected) < 1e-4
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
