"""Score an artifact as `qkiln serve` computes it (`qkiln eval ARTIFACT --served`).

The recorded accuracy and `qkiln eval ARTIFACT` score the artifact's fp32 simulation. Serving runs
the runtime's engine: its dtype (bf16 by default), kernels and paged KV cache, whose INT4 codes
bf16 rounding can flip (about 1% of perplexity on SmolLM2 with an INT4 KV cache). This scorer
runs every window through that engine as a prompt with prompt logprobs, the quantity a
loglikelihood evaluation reads from the server, so the protocol's numbers describe the server.
It gives each target token's logprob, not whole distributions: perplexity and bits per byte,
no KL.
"""

import torch

from qkiln.plugins import cpu_native
from qkiln.plugins.packed_weights import W4A16Weight
from qkiln.runtime.llm import LLM
from qkiln.runtime.loader import resolve_dtype
from qkiln.runtime.quantized_linear import QuantizedLinear
from qkiln.runtime.sampling_params import SamplingParams

from .artifact import is_artifact_dir, read_manifest


class ServedScorer:
    def __init__(self, model: str, dtype: str = "auto", int8_activations: bool = False):
        self.llm = LLM(model, dtype=dtype, int8_activations=int8_activations)
        self.tokenizer = self.llm.tokenizer
        self.config = self.llm.engine.model.config
        dtype_name = str(resolve_dtype(dtype)).removeprefix("torch.")
        # On a CPU, int4 linears take bf16 activations whatever the dtype (W4A16; plugins/cpu_linear.py;
        # int8 ones keep fp32): "float32" alone read as an fp32 score of the recipe.
        int4 = any(isinstance(m, QuantizedLinear) and isinstance(m.packed, W4A16Weight)
                   for m in self.llm.engine.model.modules())
        caveat = " (int4 linears with bf16 activations)" if int4 and dtype_name == "float32" else ""
        self.description = {"scoring": f"served: qkiln's runtime engine in {dtype_name}{caveat}"
                                       f"{' with int8 activations' if int8_activations else ''}, paged KV cache "
                                       f"{self.llm.engine.kv_dtype}, prompt logprobs"}
        # torch's CPU kernels give close but not the same numbers (README): a score says which ran
        self.description["kernels"] = "qkiln native CPU" if cpu_native.native_extension() is not None \
            else "torch CPU (qkiln's native kernels not loaded)"
        if is_artifact_dir(model):  # the score's key in a registry, as the simulation's report has it
            self.description["digest"] = read_manifest(model).digest

    def score_targets(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> the logprob of ids[:, 1:] given what precedes them [B, T - 1] (fp32)."""
        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
        outputs = self.llm.generate([row.tolist() for row in ids], params, use_tqdm=False)  # eval shows its own
        return torch.tensor([[scored[token].logprob for scored, token in zip(out.prompt_logprobs[1:],
                                                                              out.prompt_token_ids[1:])]
                             for out in outputs])
