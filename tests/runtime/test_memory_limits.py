"""Memory an operator can plan for (probe s50): what is available counts a container's cgroup limit,
a KV pool that cannot fit is refused before anything is allocated (it was an allocation traceback
after the model loaded, or an OOM kill), and an int4 artifact can be served without its dense
prefill copies (which made it larger in memory than the unquantized model)."""

import pytest

from qkiln.errors import QkilnError
from qkiln.runtime import memory_limits
from qkiln.runtime.llm import LLM
from qkiln.runtime.quantized_linear import QuantizedLinear
from qkiln.runtime.sampling_params import SamplingParams
from tiny_models import write_tiny_hf_model


def test_a_cgroup_limit_caps_what_is_available(tmp_path, monkeypatch):
    import psutil

    monkeypatch.setattr(memory_limits, "_CGROUP_ROOT", tmp_path)  # a container's /sys/fs/cgroup, as v2 writes it
    (tmp_path / "memory.max").write_text(f"{1 << 30}\n")
    (tmp_path / "memory.current").write_text(f"{256 << 20}\n")
    assert memory_limits.available_bytes() == min(768 << 20, psutil.virtual_memory().available)
    (tmp_path / "memory.max").write_text("max\n")  # no limit: the host's
    assert abs(memory_limits.available_bytes() - psutil.virtual_memory().available) < 256 << 20


def test_a_kv_pool_that_cannot_fit_is_refused_before_the_model_loads(tmp_path):
    too_big = 4 * memory_limits.available_bytes()
    with pytest.raises(QkilnError, match="the KV cache pool needs .* lower --kv-cache-mb"):
        LLM("no-such-model", kv_cache_bytes=too_big)  # the model would not load: this is checked first
    model = write_tiny_hf_model(tmp_path, "llama")
    with pytest.raises(QkilnError, match="the KV cache pool needs"):  # counted in blocks, after the load
        LLM(str(model), dtype="fp32", num_kv_blocks=too_big // 1024)


def test_an_int4_artifact_serves_without_its_dense_prefill_copies(tmp_path):
    from qkiln.compile.build import build
    from qkiln.compile.recipe import load_recipe

    source = write_tiny_hf_model(tmp_path / "m", "llama")
    artifact = str(build(str(source), load_recipe("w4a16-rtn"), tmp_path / "a", use_cache=False, progress=False,
                         log=lambda m: None).path)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    prompt = list(range(3, 3 + 40))
    scores = {}
    for dense in (True, False):
        llm = LLM(artifact, dtype="fp32", dense_prefill=dense, num_kv_blocks=16)
        linears = [m for m in llm.engine.model.modules() if isinstance(m, QuantizedLinear)]
        copies = [getattr(m.packed, "dequantized", None) is not None for m in linears]
        assert linears and all(copies) == dense and any(copies) == dense
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        scores[dense] = [next(iter(entry.values())).logprob for entry in out.prompt_logprobs[1:]]
    # the same weights through another kernel (which rounds activations to bf16 on the way): close, not equal
    assert scores[True] == pytest.approx(scores[False], abs=0.02)
