"""Does an exported ONNX engine compute what the artifact computes? Two serving steps, three ways.

The engine runs under `onnx.reference.ReferenceEvaluator` (numpy float32; the plugin nodes through
plugins/onnx_nodes.reference_ops). What it is held to is the artifact's simulation
(artifact_model.py: canonical weights dequantized exactly, fp8 activations fake-quantized) stepping
over the same kind of paged caches through the plugins' reference cache write and attention, the
spec every kernel is tested against.

Why not equality: a quantized cache (bf16 included) rounds, so a float32 sum taken in another order
moves a few stored values by a whole step, and on a model with large activations (SmolLM2) that
grows layer by layer: numpy and torch, both float32, end ~1e-3 apart in logits on SmolLM2 with a
bf16 cache, and several percent with int4. So the simulation runs twice, in float32 and in float64,
and the engine must be about as close to the float64 run as torch's float32 run is: within a few
times that distance, or within floors that honest rounding stays under. Flips are chance events,
so one float32 run can land on none while the engine lands on a few: on tiny models the engine
measured up to 5e-5 of the largest logit and 0.02% of cache bytes where torch float32 was exact,
and torch float32 up to 1.2e-4 and 0.26% over three seeds. The wrong graphs tried (a final norm
without its weight, RoPE left out, dynamic fp8 activations for static ones) missed by 1.8e-2 to
0.96 of the largest logit, and all but the norm by 24-27% of cache bytes.

Step 1 prefills two sequences into scattered blocks; step 2 decodes one and prefills a chunk of
the other, so attention reads what step 1 wrote.
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from qkiln.errors import ArtifactError
from qkiln.plugins import KVCache, allocate_kv_cache, onnx_nodes
from qkiln.plugins.kv_cache import KV_SCALE_NAMES, offset_key
from qkiln.plugins.reference import reference_cache_write, reference_paged_attention

from .artifact import load_tensors, manifest_digest, read_manifest
from .artifact_model import load_artifact_model
from .onnx_contract import CONTRACT_VERSION, kv_cache_shape, read_engine_model, rewrite_hint
from .onnx_graph import CONTRACT_FILE, step_inputs

BLOCK_SIZE = 4
# Peak resident memory of a check per model parameter: the loaded graph (its proto and the
# evaluator's arrays), one node's dequantized weight at a time, then the float32 simulation made
# float64 in place (quantized linears dequantized per call: simulate.py). Measured: a build's check
# of SmolLM2-135M W4A16 took its RSS from 0.59 to 1.66 GiB (8.6 bytes a parameter; 12 while the
# evaluator held every intermediate and the float64 run was a copy, 3.2 GB before the per-call
# dequantization).
CHECK_BYTES_PER_PARAMETER = 12
SLACK = 4.0  # how many times torch float32's distance from float64 the engine may be
LOGITS_FLOOR = 1e-3  # of the largest logit: honest float32 rounding stays below (see above)
CACHE_FLOOR = 0.02  # of cache bytes


class ReferencePagedAttention:
    """runtime/paged_attention.PagedAttention's step, through the plugins' reference functions."""

    def __init__(self, caches: list[KVCache], head_dim: int):
        self.caches, self.scale, self.metadata = caches, head_dim ** -0.5, None

    def attend(self, layer_id: int, q, k, v):
        cache, (slots, tables, lens, qsl) = self.caches[layer_id], self.metadata
        reference_cache_write(offset_key(k, cache), v, *cache.op_tensors(), slots)
        return reference_paged_attention(q, *cache.op_tensors(), tables, lens, qsl, self.scale)


@dataclass
class OnnxCheck:
    """Distances from the float64 simulation: logits (max |diff| / max |logit|, per step) and the
    fraction of cache bytes that differ after both steps; for the engine and for torch float32."""

    engine_logits: list[float]
    float32_logits: list[float]
    engine_cache: float
    float32_cache: float

    @property
    def ok(self) -> bool:
        return max(self.engine_logits) <= max(SLACK * max(self.float32_logits), LOGITS_FLOOR) \
            and self.engine_cache <= max(SLACK * self.float32_cache, CACHE_FLOOR)

    def summary(self) -> str:
        return (f"logits {max(self.engine_logits):.1e} from float64 (torch float32: "
                f"{max(self.float32_logits):.1e}), cache bytes differing {self.engine_cache:.2%} "
                f"(torch float32: {self.float32_cache:.2%})")


def two_steps(vocab: int, seed: int):
    """Two steps' graph inputs (onnx_graph.INPUTS order) as torch tensors."""
    g = torch.Generator().manual_seed(seed)
    tables = torch.tensor([[5, 2, 7, 0], [3, 6, 1, 4]], dtype=torch.int32)

    def slots(seq: int, positions: range):
        return [int(tables[seq, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]

    first = (range(0, 6), range(0, 9))  # prefills of 6 and 9 tokens
    second = (range(6, 7), range(9, 13))  # a decode, and a chunk of 4 more prompt tokens
    out = []
    for ranges in (first, second):
        positions = [p for r in ranges for p in r]
        out.append((torch.randint(0, vocab, (len(positions),), generator=g), torch.tensor(positions),
                    torch.tensor(slots(0, ranges[0]) + slots(1, ranges[1])), tables,
                    torch.tensor([r.stop for r in ranges], dtype=torch.int32),
                    torch.tensor([0, len(ranges[0]), len(positions)], dtype=torch.int32)))
    return out


class ArtifactCaches:
    """Fresh paged caches as the artifact's engine takes them: its kv dtype (bf16 without a KV
    scheme, as the runtime's default), its static scales installed."""

    def __init__(self, artifact: Path, config, block_size: int = BLOCK_SIZE):
        manifest = read_manifest(artifact)
        self.config, self.block_size = config, block_size
        self.kv = manifest.kv_cache or {"dtype": "bf16"}
        tensors = load_tensors(artifact, manifest, verify=False)
        p = "model.layers.{}.self_attn."
        self.scales = {key: [tensors[p.format(i) + key] for i in range(config.num_hidden_layers)]
                       for key in KV_SCALE_NAMES
                       if p.format(0) + key in tensors}

    def contract(self) -> dict:
        """engine.json's kv_cache shape an engine of this artifact has."""
        return kv_cache_shape(self.kv, self.config)

    def new(self, num_blocks: int) -> list[KVCache]:
        c = self.config
        caches = allocate_kv_cache(c.num_hidden_layers, num_blocks, self.block_size, c.num_key_value_heads,
                                   c.head_dim, self.kv["dtype"], self.kv.get("group_size", 32),
                                   has_k_channel_scale="k_channel_scale" in self.scales,
                                   has_k_offset="k_offset" in self.scales)
        for name, values in self.scales.items():
            for cache, value in zip(caches, values):
                getattr(cache, name).copy_(value)
        return caches


def check_onnx_engine(artifact: Path, engine_dir: Path, seed: int = 0) -> OnnxCheck:
    model = load_artifact_model(Path(artifact), verify=False).model  # the callers verify or just wrote it
    config = model.config
    caches = ArtifactCaches(Path(artifact), config)

    def fresh_caches() -> list[KVCache]:
        return caches.new(8)

    check_contract(Path(engine_dir), caches.contract())
    steps = two_steps(config.vocab_size, seed)
    try:
        engine_logits, engine_caches = _run_engine(engine_dir, fresh_caches(), steps)
    except Exception as e:  # a damaged or foreign graph: say so rather than show the evaluator's stack
        raise ArtifactError(f"the ONNX engine in {engine_dir} failed to run ({type(e).__name__}: {e}); "
                            f"{rewrite_hint(engine_dir)}") from None
    float32_logits, float32_caches = _run_simulation(model, fresh_caches(), steps)
    inv_freq = model.rope.inv_freq  # RoPE tables are float32 in every path
    exact = model.double()  # in place: a copy would hold both (the check's peak)
    exact.rope.inv_freq = inv_freq
    exact_logits, exact_caches = _run_simulation(exact, fresh_caches(), steps)
    return OnnxCheck([_distance(a, b) for a, b in zip(engine_logits, exact_logits)],
                     [_distance(a, b) for a, b in zip(float32_logits, exact_logits)],
                     _bytes_differing(engine_caches, exact_caches), _bytes_differing(float32_caches, exact_caches))


def _run_simulation(model, caches: list[KVCache], steps) -> tuple[list[torch.Tensor], list[KVCache]]:
    backend = ReferencePagedAttention(caches, model.config.head_dim)
    logits = []
    for ids, positions, *metadata in steps:
        backend.metadata = metadata
        with torch.no_grad():
            logits.append(model.compute_logits(model.hidden_states(ids, positions, backend)).double())
    return logits, caches


class ReferenceEngine:
    """An engine directory under onnx's reference evaluator, stepping over paged caches it keeps
    (each step's cache_out.* become the next step's cache.*, as a runtime binding them would)."""

    def __init__(self, engine_dir: Path, caches: list[KVCache]):
        from onnx.reference import ReferenceEvaluator

        self.session = ReferenceEvaluator(read_engine_model(engine_dir), new_ops=onnx_nodes.reference_ops())
        # the index of the last node reading each value (graph outputs are read after the last node)
        self.last_reader = {name: i for i, node in enumerate(self.session.rt_nodes_) for name in node.input}
        self.use(caches)

    def use(self, caches: list[KVCache]) -> None:
        """Step over these caches from now on (the graph is loaded once)."""
        self.caches = caches
        fields = onnx_nodes.written_fields(caches[0].kv_dtype)
        self.state = {f"cache.{i}.{f}": onnx_nodes.to_numpy(getattr(c, f)) for i, c in enumerate(caches)
                      for f in fields}
        self.outputs = ["logits"] + [name.replace("cache.", "cache_out.", 1) for name in self.state]

    def step(self, *inputs: torch.Tensor) -> torch.Tensor:
        """INPUTS as torch tensors (step_inputs) -> logits [rows, vocab] float32; the caches advance."""
        feeds = {n: t.numpy() for n, t in step_inputs(*inputs).items()}
        logits, *written = self._run(feeds | self.state)
        self.state = dict(zip(self.state, written))
        for name, value in self.state.items():
            _, i, field = name.split(".")
            getattr(self.caches[int(i)], field).copy_(onnx_nodes.to_torch(value))
        return torch.from_numpy(np.asarray(logits))

    def _run(self, feeds: dict) -> list:
        """The evaluator's node loop, dropping each value after its last reader: its own `run` holds
        every intermediate to the end, every layer's dequantized weights at once (SmolLM2 W4A16: 1.1 GB
        over the loaded graph). The engine's graph is flat (no subgraphs, no node reading the context)."""
        keep, results = set(self.outputs), {"": None} | self.session.rt_inits_ | feeds  # "": an omitted input
        for i, node in enumerate(self.session.rt_nodes_):
            results.update(zip(node.output, node.run(*(results[name] for name in node.input))))
            for name in (*node.input, *node.output):
                if self.last_reader.get(name, -1) <= i and name not in keep:  # an initializer stays in rt_inits_
                    results.pop(name, None)
        return [results[name] for name in self.outputs]


def _run_engine(engine_dir: Path, caches: list[KVCache], steps) -> tuple[list[torch.Tensor], list[KVCache]]:
    engine = ReferenceEngine(engine_dir, caches)
    return [engine.step(*step).double() for step in steps], caches


def read_engine_contract(engine_dir: Path) -> dict:
    """engine.json, or an ArtifactError saying it is unreadable or not a qkiln engine's."""
    import json

    try:
        contract = json.loads((Path(engine_dir) / CONTRACT_FILE).read_text())
    except (OSError, ValueError) as e:
        raise ArtifactError(f"{Path(engine_dir) / CONTRACT_FILE}: unreadable ({e}); "
                            f"{rewrite_hint(engine_dir)}") from None
    if not isinstance(contract, dict) or contract.get("plugin_domain") != onnx_nodes.DOMAIN:
        raise ArtifactError(f"{engine_dir}: {CONTRACT_FILE} is not a qkiln ONNX engine's contract; "
                            f"{rewrite_hint(engine_dir)}")
    version = contract.get("contract_version")
    if "digest" not in contract and isinstance(version, int) and version >= 4:  # written with one since 4
        raise ArtifactError(f"{Path(engine_dir) / CONTRACT_FILE}: missing field 'digest'; it was edited after "
                            f"export: {rewrite_hint(engine_dir)}")
    if "digest" in contract and contract["digest"] != manifest_digest(contract):
        raise ArtifactError(f"{Path(engine_dir) / CONTRACT_FILE}: its contents do not match its digest: it was "
                            f"edited after export; {rewrite_hint(engine_dir)}")
    return contract


def check_contract_version(contract: dict, engine_dir: Path) -> None:
    if contract.get("contract_version") != CONTRACT_VERSION:
        raise ArtifactError(f"the ONNX engine in {engine_dir} was written by another qkiln version (engine.json "
                            f"contract_version {contract.get('contract_version')}, this qkiln's {CONTRACT_VERSION}); "
                            f"{rewrite_hint(engine_dir)}")


def check_contract(engine_dir: Path, kv_cache: dict) -> None:
    """The engine's engine.json must describe this artifact's cache (an engine of other weights
    would otherwise fail deep inside the evaluator, or worse, run)."""
    contract = read_engine_contract(engine_dir)
    check_contract_version(contract, engine_dir)
    theirs = {key: contract.get("kv_cache", {}).get(key) for key in kv_cache}
    if theirs != kv_cache:
        raise ArtifactError(f"the ONNX engine in {engine_dir} was built for another model or cache (engine.json "
                            f"kv_cache {theirs}, this artifact {kv_cache}); {rewrite_hint(engine_dir)}")


def _distance(a: torch.Tensor, exact: torch.Tensor) -> float:
    return float((a - exact).abs().max() / exact.abs().max())


def _bytes_differing(a: list[KVCache], b: list[KVCache]) -> float:
    fields = onnx_nodes.written_fields(a[0].kv_dtype)
    pairs = [(getattr(x, f), getattr(y, f)) for x, y in zip(a, b) for f in fields]
    differing = sum(int((x.view(torch.uint8) != y.view(torch.uint8)).sum()) for x, y in pairs)
    return differing / sum(x.view(torch.uint8).numel() for x, _ in pairs)


def check_fits_in_memory(num_parameters: int | None) -> str | None:
    """None when a check fits in the memory available now; else why it would not."""
    from qkiln.runtime.memory_limits import available_bytes

    need = (num_parameters or 0) * CHECK_BYTES_PER_PARAMETER
    have = available_bytes()  # the host's, or less under a container's limit
    if need <= have:
        return None
    return (f"checking needs ~{need / 2**30:.0f} GiB (float32 and float64 simulations of "
            f"{num_parameters / 1e9:.1f}B parameters), {have / 2**30:.0f} GiB is available")


def require_engine_matches(artifact: Path, engine_dir: Path) -> OnnxCheck:
    check = check_onnx_engine(artifact, engine_dir)
    if not check.ok:
        raise ArtifactError(f"the ONNX engine in {engine_dir} does not compute what the artifact computes: "
                            f"{check.summary()}; write it again from the artifact (qkiln export --format onnx). "
                            "If neither was edited since qkiln wrote them, report it as a qkiln bug with the "
                            "artifact's manifest")
    return check
