"""The native CPU decode stack (runtime/decode_stack.py, csrc/decode_stack.cpp): bit-identical to
the Python layer loop, used exactly for the steps and models it claims."""

import pytest
import torch

from qkiln.plugins import cpu_native, ops
from qkiln.plugins.packed_weights import int8_act_panels_fast
from qkiln.runtime.engine import EngineConfig, LLMEngine, NonFiniteLogitsError
from qkiln.runtime.loader import load_for_serving
from qkiln.runtime.sampling_params import SamplingParams
from tiny_models import write_tiny_hf_model

pytestmark = pytest.mark.skipif(cpu_native.native_ops() is None, reason="native CPU kernels not built")
STACK_RECIPES = ("w4a16-rtn", "w8a16", "w4a16-rtn+kv-fp8", "w4a16-rtn+kv-int4")


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    from qkiln.compile.build import build
    from qkiln.compile.recipe import load_recipe

    tmp = tmp_path_factory.mktemp("stack")
    source = write_tiny_hf_model(tmp / "m", "llama")
    out = {name: build(str(source), load_recipe(name), tmp / name, use_cache=False, progress=False,
                       log=lambda m: None).path for name in STACK_RECIPES}
    smoothing = tmp / "kv-smoothing.yaml"  # int4 KV with key smoothing: not natively served
    smoothing.write_text("scheme:\n  weights: {num_bits: 4, group_size: 32}\n"
                         "  kv_cache: {dtype: int4, key_smoothing: true}\n")
    out["smoothing"] = build(str(source), load_recipe(str(smoothing)), tmp / "smoothing", use_cache=False,
                             progress=False, log=lambda m: None).path
    return source, out


def _engine(path, monkeypatch, stack: bool, dtype="bf16", int8_activations=False, **config) -> LLMEngine:
    monkeypatch.setenv("QKILN_DECODE_STACK", "1" if stack else "0")
    loaded = load_for_serving(str(path), dtype=dtype, int8_activations=int8_activations)
    config.setdefault("kv_dtype", loaded.kv_dtype)  # an artifact's KV scheme, as `qkiln serve` does
    # the default 512 MiB pool is 65,536 blocks for this model: 3 s to zero per engine, and 0.1 s
    # for the integrity check after every step
    config.setdefault("num_kv_blocks", 256)
    return LLMEngine(loaded.model, loaded.tokenizer, EngineConfig(**config), kv_scales=loaded.kv_scales)


def _run_recording(engine: LLMEngine, prompts, max_tokens: int):
    """Greedy token ids per prompt, every step's logits, and per step (tokens, sequences, whether
    the stack served it). Where the stack's head also gave the step's argmax, it is checked against
    ops.argmax of the logits."""
    logits, steps = [], []
    runner, stack = engine.runner, engine.runner.decode_stack
    run = runner.run

    def recording(plan, argmax=False):
        steps.append([sum(s.num_scheduled_tokens for s in plan.scheduled), len(plan.scheduled), False])
        out = run(plan, argmax)
        if out.argmax is not None:
            assert torch.equal(out.argmax, ops.argmax(out.logits))
        logits.append(out.logits)
        return out

    runner.run = recording
    if stack is not None:
        for name in ("hidden_states", "logits"):
            def counted(*args, served=getattr(stack, name)):
                steps[-1][2] = True
                return served(*args)

            setattr(stack, name, counted)
    ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
           for p in prompts]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        engine.check_integrity()
    return [done[i] for i in ids], logits, steps


@pytest.mark.parametrize("recipe", STACK_RECIPES)
def test_stack_is_bit_identical_to_the_python_layers(artifacts, monkeypatch, recipe):
    """kv-fp8: calibrated per-head scales and a key offset; kv-int4: per-(slot, head, group) scales
    and minimums; both written and read in the stack."""
    _, paths = artifacts
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (5, 19, 33)]
    fast = _engine(paths[recipe], monkeypatch, stack=True)
    slow = _engine(paths[recipe], monkeypatch, stack=False)
    assert fast.runner.decode_stack is not None and slow.runner.decode_stack is None
    cache = fast.runner.backend.caches[0]
    if recipe.endswith("kv-fp8"):
        assert cache.k.dtype == torch.float8_e4m3fn and cache.k_offset is not None
        assert not torch.equal(cache.k_scale, torch.ones_like(cache.k_scale))
    if recipe.endswith("kv-int4"):
        assert cache.k.dtype == torch.uint8 and cache.k_group_scale is not None
    tokens_fast, logits_fast, steps = _run_recording(fast, prompts, 12)
    tokens_slow, logits_slow, _ = _run_recording(slow, prompts, 12)
    assert tokens_fast == tokens_slow
    assert sum(served for _, _, served in steps) == 11  # every decode step; not the prefill
    assert len(logits_fast) == len(logits_slow)
    for a, b in zip(logits_fast, logits_slow):
        assert torch.equal(a, b)


@pytest.mark.parametrize("threads", [2, 3])
def test_native_head_argmax_keeps_torchs_ties_and_nans(artifacts, monkeypatch, threads):
    """The head's argmax is taken per thread over its own columns, then merged: with every logit
    tied the first column wins, and the first NaN (in a later thread's columns) beats them all,
    as torch.argmax has it. The engine refuses NaN rows (NonFiniteLogitsError, found through that
    argmax); past that check, the argmax itself is what is tested."""
    _, paths = artifacts
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        engine = _engine(paths["w8a16"], monkeypatch, stack=True)
        assert engine.runner.decode_stack.stack.has_head
        head = engine.runner.model.lm_head.packed  # int8 [vocab, hidden], fp32 scales [vocab]
        head.weight.copy_(head.weight[:1].expand_as(head.weight))
        head.scales.fill_(head.scales[0].item())
        for nans, expected in (((), 0), ((250, 200), 200)):
            head.scales[list(nans)] = float("nan")
            if nans:
                with pytest.raises(NonFiniteLogitsError, match="at output token 1"):
                    _run_recording(engine, [[5, 6, 7]], 4)
                for request_id in list(engine.requests):
                    engine.abort_request(request_id)
                monkeypatch.setattr(engine, "_check_finite", lambda *args: None)
            tokens, logits, steps = _run_recording(engine, [[5, 6, 7]], 4)
            assert tokens == [[expected] * 4] and sum(served for _, _, served in steps) == 3
            assert all(torch.equal(row.float().argmax(-1), torch.tensor([expected])) for row in logits)
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("rows,int8_activations", [(20, True), (4, True), (20, False), (12, False)],
                         ids=["int8-activations", "int8-activations-4-rows", "exact", "exact-12-rows"])
@pytest.mark.parametrize("recipe", ["w4a16-rtn", "w8a16", "w4a16-rtn+kv-int4"])
def test_many_row_steps_are_bit_identical(artifacts, monkeypatch, recipe, rows, int8_activations):
    """The stack also serves decode steps of more than 16 rows: with int8 activations loaded through
    the same int8-activation GEMM as the Python path, else (exact) through the same bf16 GEMM on the
    dequantized weights; each thread takes its share of the rows for the row-wise ops (3 threads:
    shares of 7 and 6 of 20 rows). Exact int4 switches to that GEMM above cpu_linear.int4_gemv_rows
    (8; 16 where the copy is held in fp32), int8 above 16: 12 rows take the dense form for w4a16
    (the GEMV form with fp32 copies) and the GEMV form for w8a16, as in Python. With int8
    activations int4 layers round in the GEMV form too (csrc/cpu_gemv_int4_a8.cpp), at any row
    count where the CPU lacks AVX512-VNNI (no many-row panels: the GEMV form serves 20 rows)."""
    _, paths = artifacts
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 256, (3 + i,), generator=generator).tolist() for i in range(rows)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        fast = _engine(paths[recipe], monkeypatch, stack=True, int8_activations=int8_activations)
        slow = _engine(paths[recipe], monkeypatch, stack=False, int8_activations=int8_activations)
        stack = fast.runner.decode_stack.stack
        panels, int4 = int8_act_panels_fast(), recipe != "w8a16"  # int8 layers round via panels only
        assert stack.int8_activations == (int8_activations and panels)
        assert stack.dense_rows == (not int8_activations or (not panels and not int4))
        assert (stack.max_gemv_rows > 16) == (int8_activations and not panels and int4)
        tokens_fast, logits_fast, steps = _run_recording(fast, prompts, 6)
        tokens_slow, logits_slow, _ = _run_recording(slow, prompts, 6)
    finally:
        torch.set_num_threads(threads)
    assert tokens_fast == tokens_slow
    assert [served for _, _, served in steps] == [n == s for n, s, _ in steps]
    assert any(served and s == rows for _, s, served in steps)
    assert all(torch.equal(a, b) for a, b in zip(logits_fast, logits_slow))


def test_many_row_steps_serve_every_layer_of_a_deep_model(tmp_path, monkeypatch):
    """Many-row int8-activation steps on a 9-layer model, bit-identical to the Python path: each
    layer's five task queues (4 linears, attention) must be its own. Taken at a fixed stride from
    a deque, layers 6+ claimed tasks from memory past the deque's chunks (a segfault at 64 decode
    rows of SmolLM2). On CPUs without AVX512-VNNI the GEMV form serves these rows (still compared)."""
    from qkiln.compile.build import build
    from qkiln.compile.recipe import load_recipe

    source = write_tiny_hf_model(tmp_path / "m", "llama", num_hidden_layers=9)
    path = build(str(source), load_recipe("w4a16-rtn"), tmp_path / "w4", use_cache=False,
                 progress=False, log=lambda m: None).path
    generator = torch.Generator().manual_seed(13)
    prompts = [torch.randint(0, 256, (3 + i,), generator=generator).tolist() for i in range(20)]
    fast = _engine(path, monkeypatch, stack=True, int8_activations=True)
    slow = _engine(path, monkeypatch, stack=False, int8_activations=True)
    assert len(fast.runner.model.model.layers) == 9
    tokens_fast, logits_fast, steps = _run_recording(fast, prompts, 6)
    tokens_slow, logits_slow, _ = _run_recording(slow, prompts, 6)
    assert tokens_fast == tokens_slow
    assert any(served and s == 20 for _, s, served in steps)
    assert all(torch.equal(a, b) for a, b in zip(logits_fast, logits_slow))


@pytest.mark.parametrize("recipe", ["w4a16-rtn", "w8a16"])
def test_amx_codes_steps_match_the_dense_copies(artifacts, monkeypatch, recipe):
    """Opted in on an AMX CPU (QKILN_AMX_CODES=1), many-row steps read the int4 / int8 codes
    (csrc/cpu_gemm_codes_amx.cpp) and keep no dense copy: the stack and the Python path give the
    bits the dense copies give."""
    if not cpu_native.native_extension().codes_amx_ready():
        pytest.skip("the AMX codes GEMMs need a CPU with AMX-BF16")
    _, paths = artifacts
    generator = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, 256, (3 + i,), generator=generator).tolist() for i in range(20)]
    dense = _run_recording(_engine(paths[recipe], monkeypatch, stack=False), prompts, 6)
    monkeypatch.setenv("QKILN_AMX_CODES", "1")
    for stack in (True, False):
        engine = _engine(paths[recipe], monkeypatch, stack=stack)
        packed = [m.packed for m in engine.runner.model.modules() if hasattr(m, "packed")]
        assert packed and all(p.many_rows_form and p.dequantized is None for p in packed
                              if getattr(p, "target", None) == "cpu" and hasattr(p, "many_rows_form"))
        tokens, logits, steps = _run_recording(engine, prompts, 6)
        assert tokens == dense[0] and all(torch.equal(a, b) for a, b in zip(logits, dense[1]))
        assert any(served for _, _, served in steps) == stack


def test_mixed_steps_take_the_python_path(artifacts, monkeypatch):
    _, paths = artifacts
    # Staggered budgets mix prefill with decodes; decode-only steps of 17 rows (past the GEMV row
    # limit) and fewer are the stack's.
    engine = _engine(paths["w4a16-rtn"], monkeypatch, stack=True, max_num_batched_tokens=64)
    prompts = [[i + 1] * (3 + i) for i in range(17)]
    reference = _engine(paths["w4a16-rtn"], monkeypatch, stack=False, max_num_batched_tokens=64)
    tokens, _, steps = _run_recording(engine, prompts, 6)
    assert tokens == _run_recording(reference, prompts, 6)[0]
    for num_tokens, num_seqs, served in steps:
        assert served == (num_tokens == num_seqs)
    assert any(n == s == 17 for n, s, _ in steps) and any(n > s for n, s, _ in steps)
    assert any(served and s <= 16 for _, s, served in steps)


def test_models_the_stack_cannot_serve_keep_the_python_path(artifacts, monkeypatch):
    source, paths = artifacts
    assert _engine(paths["smoothing"], monkeypatch, stack=True).runner.backend.caches[0].k_channel_scale is not None
    assert _engine(paths["smoothing"], monkeypatch, stack=True).runner.decode_stack is None
    assert _engine(paths["w4a16-rtn"], monkeypatch, stack=True, dtype="fp32").runner.decode_stack is None
    assert _engine(source, monkeypatch, stack=True).runner.decode_stack is None  # bf16 linears
    assert _engine(source, monkeypatch, stack=True, dtype="fp16").runner.decode_stack is None  # nn.Linear
    monkeypatch.setattr(cpu_native, "_ops_enabled", False)
    assert _engine(paths["w4a16-rtn"], monkeypatch, stack=True).runner.decode_stack is None


def test_loaded_artifacts_keep_their_gemv_weights_in_one_buffer(artifacts):
    """loader.py gathers the decode GEMVs' tensors (plugins/weight_arena.py) in layer order."""
    from qkiln.runtime.quantized_linear import QuantizedLinear

    for recipe in ("w4a16-rtn", "w8a16"):
        model = load_for_serving(str(artifacts[1][recipe])).model
        weights = [m.packed for m in model.modules() if isinstance(m, QuantizedLinear)]
        tensors = [w.packed if hasattr(w, "packed") else w.weight for w in weights]
        assert len(tensors) == 4 * model.config.num_hidden_layers + (model.lm_head is not None)
        assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1, recipe
        assert [t.data_ptr() for t in tensors] == sorted(t.data_ptr() for t in tensors)


@pytest.mark.parametrize("recipe", ["w4a16-rtn", "w8a16"])
def test_artifacts_serve_without_the_native_kernels(artifacts, monkeypatch, recipe):
    """QKILN_NATIVE_CPU=0 (or no compiler): torch's int4 / int8 kernels serve the same artifact to
    bf16 rounding, prompts of more than 4 tokens included (torch's int8 kernel blocks rows by 4;
    test_plugins_linear holds the unaligned-weight case that crashed it)."""
    ids = torch.arange(3, 15)[None]

    def last_logits():
        model = load_for_serving(str(artifacts[1][recipe])).model
        with torch.inference_mode():
            return model(ids)[0, -1].float()

    native = last_logits()
    monkeypatch.setenv("QKILN_NATIVE_CPU", "0")
    monkeypatch.setattr(cpu_native, "_extension", cpu_native._MISSING)
    assert cpu_native.native_extension() is None
    fallback = last_logits()
    assert (fallback - native).abs().max() <= 2e-2 * native.abs().max()


def test_stack_results_do_not_depend_on_the_thread_count(artifacts, monkeypatch):
    # One parallel region splits the tiles and attention tasks over the threads; a tile's result
    # must not depend on which thread computed it.
    _, paths = artifacts
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5]]
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(_run_recording(_engine(paths["w4a16-rtn"], monkeypatch, stack=True), prompts, 6))
    finally:
        torch.set_num_threads(threads)
    for tokens, logits, _ in results[1:]:
        assert tokens == results[0][0]
        assert all(torch.equal(a, b) for a, b in zip(logits, results[0][1]))


@pytest.mark.parametrize("rows,int8_activations", [(1, False), (20, True), (20, False)])
def test_a_failing_step_raises_and_the_stack_keeps_working(artifacts, monkeypatch, rows, int8_activations):
    # An error inside the parallel region (here a slot past the cache) must come back as a Python
    # exception, not terminate the process, and leave the stack usable; 20 rows: the many-row
    # sections (int8 activations; exact, dense weights), where every thread writes its own rows' slots.
    _, paths = artifacts
    engine = _engine(paths["w4a16-rtn"], monkeypatch, stack=True, int8_activations=int8_activations)
    stack = engine.runner.decode_stack.stack
    cache = engine.runner.backend.caches[0]
    hidden = engine.runner.model.config.hidden_size
    h = torch.randn(rows, hidden, dtype=torch.bfloat16)
    cos = torch.ones(rows, 1, engine.runner.model.config.head_dim, dtype=torch.bfloat16)
    sin = torch.zeros_like(cos)
    tables = torch.arange(rows, dtype=torch.int32)[:, None]
    lens, starts = torch.ones(rows, dtype=torch.int32), torch.arange(rows + 1, dtype=torch.int32)
    slots = tables.flatten().long() * cache.k.shape[1]
    past_the_cache = slots.clone()
    past_the_cache[-1] = cache.k.shape[0] * cache.k.shape[1]
    with pytest.raises(RuntimeError, match="past the cache"):
        stack.forward(h.clone(), cos, sin, past_the_cache, tables, lens, starts)
    out = stack.forward(h.clone(), cos, sin, slots, tables, lens, starts)
    assert out.shape == (rows, hidden) and torch.isfinite(out.float()).all()


@pytest.mark.parametrize("rows", [12, 20])
def test_fp32_dense_copies_serve_many_rows_alike(artifacts, monkeypatch, rows):
    """Where the CPU has no fast bf16 GEMM (AVX2 only), the many-row copies are held in fp32
    (packed_weights.pack_dense), forced here on any CPU: the stack and the Python path give the
    same bits at 12 rows (still the int4 GEMV, which serves up to 16 rows there) and at 20 (the
    fp32 GEMM, cpu_linear.dense_linear and NativeLinear::dense alike)."""
    from qkiln.plugins import packed_weights

    monkeypatch.setattr(packed_weights, "onednn_bf16_available", lambda: False)
    monkeypatch.setattr(cpu_native, "bf16_panels_available", lambda in_features: False)
    _, paths = artifacts
    generator = torch.Generator().manual_seed(13)
    prompts = [torch.randint(0, 256, (3 + i,), generator=generator).tolist() for i in range(rows)]
    fast = _engine(paths["w4a16-rtn"], monkeypatch, stack=True)
    slow = _engine(paths["w4a16-rtn"], monkeypatch, stack=False)
    copies = [m.packed.dequantized for m in fast.runner.model.modules() if hasattr(m, "packed")]
    assert copies and all(c is not None and c.dtype == torch.float32 for c in copies)
    assert fast.runner.decode_stack.stack.max_gemv_rows == 16
    tokens_fast, logits_fast, steps = _run_recording(fast, prompts, 6)
    tokens_slow, logits_slow, _ = _run_recording(slow, prompts, 6)
    assert tokens_fast == tokens_slow
    assert any(served and s == rows for _, s, served in steps)
    assert all(torch.equal(a, b) for a, b in zip(logits_fast, logits_slow))
