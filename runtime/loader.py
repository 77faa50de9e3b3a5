"""Load a model for serving: an artifact (verified, quantized layers per its manifest) or a
source model (unquantized, so the runtime is useful before a build).

The artifact path imports only `compile.artifact` (the schema leaf), never `transformers`.
"""

import dataclasses
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from qkiln.compile.artifact import is_artifact_dir, load_tensors, read_manifest, verify_artifact
from qkiln.compile.artifact_archive import unpacked
from qkiln.errors import ArtifactError, QkilnError, TargetUnavailableError
from qkiln.plugins import cpu_native
from qkiln.plugins.kv_cache import KV_SCALE_NAMES
from qkiln.plugins.packed_weights import int8_act_panels_fast
from qkiln.plugins.weight_arena import gather_gemv_weights
from qkiln.quant.scheme import KV_INT4_GROUP_SIZE

from .config import ModelConfig, artifact_config
from .dense_linear import pack_dense_linears
from .engine import EngineConfig, LLMEngine, check_kv_pool_fits
from .memory_limits import release_freed_memory
from .fusion import fuse_tensors, projection_out_sizes
from .model import CausalLM
from .quantized_linear import QuantizedLinear, make_quantized_linear
from .source import build_model, load_source, local_path
from .tokenizer import Tokenizer

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}


@dataclass
class ServingModel:
    name: str
    model: CausalLM
    tokenizer: Tokenizer
    kv_dtype: str = "auto"
    kv_group_size: int = KV_INT4_GROUP_SIZE  # a build's int4 KV groups (quant/scheme.py)
    kv_scales: dict | None = None  # per-layer static scales for the KV cache
    manifest: object = None

    def engine(self, **engine_kwargs) -> LLMEngine:
        """An engine over this model: its KV dtype, group size and scales unless `engine_kwargs`
        name others (None: the model's)."""
        kv_dtype = engine_kwargs.pop("kv_dtype", None) or self.kv_dtype
        kv_group_size = engine_kwargs.pop("kv_group_size", None) or self.kv_group_size
        config = EngineConfig(kv_dtype=kv_dtype, kv_group_size=kv_group_size, **engine_kwargs)
        # messages name the build too: two artifacts in folders of one name (runs/1/art, runs/2/art) differ
        digest = getattr(self.manifest, "digest", None)
        name = self.name if digest is None else f"{self.name} (manifest {digest[:12]})"
        return LLMEngine(self.model, self.tokenizer, config, kv_scales=self.kv_scales, name=name)


def check_engine_options(options: dict, device: str, who: str, takes: str) -> None:
    """Refuse an unknown engine option or a bad value before the model loads (seconds, or minutes
    for a large one): EngineConfig's own TypeError named an internal class, after the load.
    who: the caller's name ("LLM()"); takes: what else it takes, for the message."""
    check_device(device)
    known = {f.name for f in dataclasses.fields(EngineConfig)} - {"device"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"{who} has no option {', '.join(unknown)}; it takes {takes}, and the engine's "
                        f"{', '.join(sorted(known))}")
    # None for these two means the model's (ServingModel.engine); anything else is checked now
    config = EngineConfig(device=device, **{k: v for k, v in options.items()
                                            if not (k in ("kv_dtype", "kv_group_size") and v is None)})
    if config.num_kv_blocks is None and str(device) == "cpu":  # the engine checks the exact pool again
        check_kv_pool_fits(config.kv_cache_bytes)


def check_device(device) -> None:
    """Before the load: a device torch cannot name, or CUDA on a machine without it, failed at the
    load's last step (an AssertionError from torch) after the whole model was read."""
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        kind = None
    if kind not in ("cpu", "cuda"):
        raise QkilnError(f"device {device!r}: qkiln runs on 'cpu' or 'cuda' (or 'cuda:N')")
    if kind == "cuda" and not torch.cuda.is_available():
        raise TargetUnavailableError(f"device {device!r}: this machine has no CUDA GPU that torch "
                                     f"{torch.__version__} can use; use device 'cpu' or run it on a GPU machine")


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():  # vLLM takes torch dtypes too
        return dtype
    if dtype == "auto":
        return torch.bfloat16  # quantized CPU kernels want bf16 activations; GPUs too
    if dtype not in _DTYPES:
        raise QkilnError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def load_for_serving(name: str, dtype: str = "auto", device: str = "cpu", fuse: bool = True,
                     int8_activations: bool = False, dense_prefill: bool = True) -> ServingModel:
    """fuse: run q/k/v and gate/up as one linear each (fusion.py); False keeps HF's modules.
    int8_activations: an artifact's int4 linears compute every step with activations rounded to
    int8 per 32 channels, its int8 linears steps of up to 16 rows, and more where the CPU has
    AVX512-VNNI (CPU only, opt-in: faster, not exact; plugins/packed_weights.py).
    dense_prefill: see make_quantized_linear (an artifact's int4 / int8 linears on the CPU).
    An archive is unpacked and verified into a temporary folder, removed once loaded (nothing is
    read from the artifact's files after the load)."""
    with unpacked(str(name), check_target=True) as path:
        return _load_for_serving(path, dtype, device, fuse, int8_activations, dense_prefill)


def _load_for_serving(name: str, dtype: str, device: str, fuse: bool, int8_activations: bool,
                      dense_prefill: bool) -> ServingModel:
    torch_dtype = resolve_dtype(dtype)
    path = local_path(name)  # an artifact may be named by a hub id too
    is_artifact = is_artifact_dir(path)
    if int8_activations:
        check_int8_activations(name, is_artifact, device)
    if is_artifact:
        loaded = load_artifact(path, torch_dtype, device, fuse, int8_activations, dense_prefill)
        release_freed_memory()  # the load's temporaries (~200 MB for SmolLM2) back to the OS
        return loaded
    src = load_source(name)
    weights = dict(src.state_dict)
    fused = fuse_tensors(weights, {}, src.config.num_hidden_layers, projection_out_sizes(src.config)) if fuse \
        else frozenset()
    model = build_model(src.config, weights, torch_dtype, fused=fused).to(device)
    pack_dense_linears(model)
    return ServingModel(str(name), model, src.tokenizer)


def check_int8_activations(name: str, is_artifact: bool, device: str = "cpu") -> None:
    """Refuse the int8-activation option where it has nothing to act on (a source model, or a
    device other than the CPU) rather than ignore it; serving and evaluation share this rule."""
    if not is_artifact or str(device) != "cpu":
        raise QkilnError("int8 activations apply to an artifact's quantized linears on the CPU; "
                            f"{name} on {device} has none to apply them to: drop the option or "
                            "build an artifact (qkiln build) first")
    ext = cpu_native.native_extension()
    if ext is None:  # the rounding is the native kernels' own: torch's would run exact, flag or not
        raise QkilnError("int8 activations run in qkiln's native CPU kernels, which are not loaded here (said "
                         "above: QKILN_NATIVE_CPU=0 or no C++ compiler); drop the option, or enable them")
    if not int8_act_panels_fast():
        print("qkiln: this CPU has no AVX512-VNNI: int4 linears round activations to int8 at every "
              "step (the GEMV kernel), int8 linears (an int8 head) up to 16 rows a step and stay "
              "exact above", file=sys.stderr)


def load_artifact(path: Path, dtype: torch.dtype, device: str = "cpu", fuse: bool = True,
                  int8_activations: bool = False, dense_prefill: bool = True) -> ServingModel:
    # served as its folder's name (an archive's, unpacked), which a registry may have renamed, and a
    # symlink's own (a `current -> releases/<id>` layout keeps its name); the manifest's name is the
    # one it was built under
    name = Path(os.path.normpath(Path(path).absolute())).name or read_manifest(path).name
    path = Path(os.path.realpath(path))  # read from one folder, whatever the link points to meanwhile
    with _read_as_one(path):
        verify_artifact(path)  # hashes, version, target: refuse before loading anything
        manifest = read_manifest(path)
        config = artifact_config(path, manifest)
        tensors = load_tensors(path, manifest, verify=False)
        linears = dict(manifest.quantization.get("linears", {}))
        fused = fuse_tensors(tensors, linears, config.num_hidden_layers, projection_out_sizes(config)) if fuse \
            else frozenset()
        target = "cuda" if str(device).startswith("cuda") else "cpu"

        def make_linear(name, in_features, out_features, bias):
            if name not in linears:  # its weights are assigned next: no init (nor a draw from the global RNG)
                return torch.nn.Linear(in_features, out_features, bias=bias, device="meta")
            b = tensors.get(name + ".bias")
            return make_quantized_linear(name, linears[name], tensors, target, dtype,
                                         None if b is None else b.to(dtype), int8_activations, dense_prefill)

        plain = {k: v for k, v in tensors.items() if k.rsplit(".", 1)[0] not in linears and not _is_kv_tensor(k)}
        model = build_model(config, plain, dtype, make_linear=make_linear, strict_quantized=set(linears), fused=fused)
        if model.lm_head is None and "lm_head" in linears:
            # A tied head quantized as its own copy: logits use it, embedding lookups stay exact.
            model.lm_head = make_linear("lm_head", config.hidden_size, config.vocab_size, False)
        model = model.to(device)
        pack_dense_linears(model)  # layers left unquantized (recipe `ignore`), a tied bf16 head
        # The decode GEMVs' weights in one buffer, in layer order: huge pages (weight_arena.py)
        gather_gemv_weights([m.packed for m in model.modules() if isinstance(m, QuantizedLinear)])
        kv = manifest.kv_cache
        kv_scales = _kv_scales(tensors, config, kv) if kv else None
        tokenizer = Tokenizer.from_dir(path / "tokenizer")
    return ServingModel(name, model, tokenizer, kv_dtype=kv["dtype"] if kv else "auto",
                        kv_group_size=(kv or {}).get("group_size", KV_INT4_GROUP_SIZE), kv_scales=kv_scales,
                        manifest=manifest)


@contextmanager
def _read_as_one(path: Path):
    """The block reads the artifact at `path`; `build --force` may rename a new one in meanwhile,
    and what was read may then mix the two. Said as such (exit 6: load it again) after the block,
    and also when the block fails: the mix had failed as a recipe error (exit 4, 'int4 scales
    have shape ...'), which a deploy script retrying on 6 did not retry."""
    folder = os.stat(path)

    def check_same_folder():
        now = os.stat(path)
        if (now.st_dev, now.st_ino) != (folder.st_dev, folder.st_ino):
            raise ArtifactError(f"the artifact at {path} was replaced while it loaded (a rebuild?): what was read "
                                "may mix the two; load it again")

    try:
        yield
    except (QkilnError, OSError) as e:
        try:
            check_same_folder()
        except (ArtifactError, OSError):
            raise ArtifactError(f"the artifact at {path} was replaced while it loaded (a rebuild?), which "
                                f"failed it ({e}); load it again") from e
        raise
    check_same_folder()


def _is_kv_tensor(name: str) -> bool:
    return name.endswith(tuple(f"self_attn.{key}" for key in KV_SCALE_NAMES))


def _kv_scales(tensors, config: ModelConfig, kv: dict) -> dict:
    out = {}
    for key in KV_SCALE_NAMES:
        names = [f"model.layers.{i}.self_attn.{key}" for i in range(config.num_hidden_layers)]
        present = [n in tensors for n in names]
        if all(present):
            out[key] = [tensors[n].float() for n in names]
        elif any(present):  # served as it is, the other layers would run with scales of 1
            missing = names[present.index(False)]
            raise ArtifactError(f"the artifact has KV {key} for some layers but not {missing}; it was written "
                                "wrong: rebuild it")
    return out
