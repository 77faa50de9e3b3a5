"""The plugins' ops are visible to torch.export and torch.compile at the model level: a serving step
of a quantized artifact (W4A16 linears, int4 paged KV cache) exports to one graph whose nodes are
qkiln's ops, with the cache tensors as inputs it mutates, and compiles with fullgraph=True; both
give the eager step's logits bit for bit and write the same cache."""

import dataclasses

import pytest
import torch

from qkiln.compile.build import build
from qkiln.compile.recipe import preset
from qkiln.plugins.kv_cache import KVCache, allocate_kv_cache
from qkiln.runtime.loader import load_for_serving
from qkiln.runtime.paged_attention import AttentionMetadata, PagedAttention
from tiny_models import write_tiny_model_and_text

CACHE_FIELDS = ("k", "v", "k_group_scale", "k_group_min", "v_group_scale", "v_group_min")


class Step(torch.nn.Module):
    """One engine step as a pure function of its tensors: ids, positions, the attention metadata,
    then every layer's int4 cache tensors (CACHE_FIELDS order), which it writes in place."""

    def __init__(self, model, group_size: int):
        super().__init__()
        self.model, self.group_size = model, group_size

    def forward(self, input_ids, positions, slot_mapping, block_tables, seq_lens, query_start_loc, *cache):
        n = len(CACHE_FIELDS)
        caches = [KVCache(kv_dtype="int4", group_size=self.group_size,
                          **dict(zip(CACHE_FIELDS, cache[i:i + n]))) for i in range(0, len(cache), n)]
        backend = PagedAttention(caches, self.model.config.head_dim)
        backend.metadata = AttentionMetadata(slot_mapping, block_tables, seq_lens, query_start_loc)
        return self.model.compute_logits(self.model.hidden_states(input_ids, positions, backend))


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    model_dir, text = write_tiny_model_and_text(root)
    r = preset("w4a16-rtn+kv-int4")
    r = dataclasses.replace(
        r, calibration=dataclasses.replace(r.calibration, source=str(text), num_samples=4, seq_len=64),
        evaluation=dataclasses.replace(r.evaluation, data=str(text), seq_len=64, max_tokens=256))
    mp = pytest.MonkeyPatch()
    mp.setenv("QKILN_CACHE_DIR", str(root / "cache"))
    artifact = build(str(model_dir), r, root / "a", progress=False, log=lambda m: None).path
    mp.undo()
    model = load_for_serving(str(artifact), "bf16").model
    return Step(model, r.scheme.kv_cache.group_size)


def _inputs(step: Step, seed: int):
    """Two sequences: one prefilling 5 tokens, one decoding its 12th, with scattered blocks."""
    cfg = step.model.config
    caches = allocate_kv_cache(cfg.num_hidden_layers, 8, 4, cfg.num_key_value_heads, cfg.head_dim, "int4",
                               group_size=step.group_size)
    g = torch.Generator().manual_seed(seed)
    for c in caches:  # random history for the decoding sequence (any bytes are valid int4 codes)
        for name in CACHE_FIELDS:
            t = getattr(c, name)
            t.copy_(torch.randint(0, 256, t.shape, generator=g).to(t.dtype) if t.dtype == torch.uint8
                    else torch.rand(t.shape, generator=g).to(t.dtype) * 0.1)
    tables = torch.tensor([[5, 2, 0], [7, 1, 3]], dtype=torch.int32)
    ids = torch.randint(0, cfg.vocab_size, (6,), generator=g)
    positions = torch.tensor([0, 1, 2, 3, 4, 11])
    slots = torch.tensor([20, 21, 22, 23, 8, 3 * 4 + 3])  # seq 0: blocks 5, 2; seq 1: position 11 in block 3
    meta = (slots, tables, torch.tensor([5, 12], dtype=torch.int32), torch.tensor([0, 5, 6], dtype=torch.int32))
    flat = [getattr(c, name) for c in caches for name in CACHE_FIELDS]
    return (ids, positions, *meta, *flat)


def _cache_of(args):
    return [t.clone() for t in args[6:]]


def test_export_graph_holds_the_qkiln_ops_and_matches_eager(step):
    args = _inputs(step, seed=0)
    with torch.no_grad():
        eager, eager_cache = step(*args), _cache_of(args)
        args = _inputs(step, seed=0)
        ep = torch.export.export(step, args, strict=False)
        targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
        for op in ("qkiln.paged_attention.default", "qkiln.cache_write.default", "qkiln.w4a16_linear.default"):
            assert op in targets, sorted(targets)
        # functionalized (the inference IR a deployment lowers): the cache tensors are inputs the
        # graph writes, not constants baked into it
        ep = ep.run_decompositions({})
        mutated = set(ep.graph_signature.user_inputs_to_mutate.values())
        assert len(mutated) == len(args) - 6, ep.graph_signature
        args = _inputs(step, seed=0)
        exported = ep.module()(*args)
    assert torch.equal(exported, eager)
    assert all(torch.equal(a, b) for a, b in zip(_cache_of(args), eager_cache))


def test_compile_fullgraph_matches_eager(step):
    args = _inputs(step, seed=1)
    with torch.no_grad():
        eager, eager_cache = step(*args), _cache_of(args)
        args = _inputs(step, seed=1)
        compiled = torch.compile(step, fullgraph=True)(*args)  # fullgraph: any graph break fails
    assert torch.equal(compiled, eager)
    assert all(torch.equal(a, b) for a, b in zip(_cache_of(args), eager_cache))
