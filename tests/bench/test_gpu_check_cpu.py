"""bench/gpu_check.py's sections that run without a GPU, on a tiny shape with DEVICE = "cpu": the
random-weight model builder for each format, the offline engine loop (GraphRunner without graphs on
CPU), the HF baseline and the final table. The script runs once per lent H200, with minutes of
device time; an error these can show must not first show there. The CUDA-only sections (copy
bandwidth, op checks, kernel timings, graph replays) need the GPU and are not run here.
"""

import pytest
import torch

from qkiln.bench import gpu_check

# hidden, layers, heads, kv_heads, head_dim, ffn, vocab, tied: hidden 128 is one int4 group
TINY = (128, 2, 4, 2, 32, 256, 512, False)


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(gpu_check, "DEVICE", "cpu")
    monkeypatch.setitem(gpu_check.SHAPES, "tiny", TINY)
    return gpu_check


def test_model_builder_counts_the_bytes_a_step_reads(on_cpu):
    hidden, layers, heads, kv_heads, head_dim, ffn, vocab, _ = TINY
    per_layer = hidden * (2 * heads * head_dim + 2 * kv_heads * head_dim + 3 * ffn)
    _, bf16_bytes, config = on_cpu.build_model("tiny", "bf16")
    assert config.num_hidden_layers == layers
    assert bf16_bytes == 2 * (layers * per_layer + vocab * hidden)  # bf16 weights + untied head
    for fmt in ("fp8", "w4a16"):  # quantized layers, the bf16 head as is
        model, quantized_bytes, _ = on_cpu.build_model("tiny", fmt)
        if fmt == "w4a16":  # (fp8 on the CPU is served as bf16: the same bytes)
            assert 2 * vocab * hidden < quantized_bytes < bf16_bytes
        logits = model(torch.randint(0, vocab, (1, 5)))
        assert logits.shape == (1, 5, vocab) and torch.isfinite(logits.float()).all()


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "w4a16"])
def test_offline_section_finishes_every_request(on_cpu, fmt):
    result = {}
    on_cpu.section_offline(result, on_cpu.Budget(120), fmt, 6, max_seconds=60, shape="tiny")
    (row,) = result["offline"]
    assert row["complete"] and row["finished"] == 6 and row["fmt"] == fmt
    assert row["output_tok_s"] > 0 and row["total_tok_s"] > row["output_tok_s"]


def test_hf_section_and_table(on_cpu, capsys):
    result = {"device": "cpu", "bandwidth_tb_s": 0.0}
    on_cpu.section_hf(result, on_cpu.Budget(120), ["tiny"])
    assert result["hf"]["tiny"] > 0
    on_cpu.section_offline(result, on_cpu.Budget(120), "w4a16", 2, max_seconds=60, shape="tiny")
    on_cpu.print_table(result)
    table = capsys.readouterr().out
    assert "tiny" in table and "offline tiny w4a16" in table
