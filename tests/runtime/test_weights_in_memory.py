"""A loaded model holds its weights in memory: rewriting the files it was loaded from (cp over
them, rsync --inplace, a registry re-download, a truncate) must not change what it serves. A tensor
left as a view of the file's memory map (the embedding, stored in the serving dtype) read the file
for as long as the server ran: truncated, the next request killed the server with SIGBUS; rewritten
in place, it served other weights than the ones verify_artifact had checked (probe, session 48)."""

import pytest

from qkiln.runtime.llm import LLM
from qkiln.runtime.sampling_params import SamplingParams
from tiny_models import write_tiny_hf_model


def _overwrite_in_place(path):
    """Zeros over every byte of the file, same inode and size: what a mapping would see."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.write(bytes(size))


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outputs = llm.generate([[5, 1, 4, 1], [9, 2, 6]], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_tiny_hf_model(tmp_path_factory.mktemp("in_memory") / "m", "llama")


def test_an_artifact_served_survives_its_weights_rewritten(source, tmp_path):
    from qkiln.compile.build import build
    from qkiln.compile.recipe import load_recipe

    artifact = build(str(source), load_recipe("w4a16-rtn"), tmp_path / "a", use_cache=False, progress=False,
                     log=lambda m: None).path
    llm = LLM(str(artifact), dtype="bf16")
    before = _greedy(llm)
    shards = sorted((artifact / "weights").glob("*.safetensors"))
    assert shards
    for shard in shards:
        _overwrite_in_place(shard)
    assert _greedy(llm) == before


def test_a_checkpoint_served_as_is_survives_its_weights_rewritten(source, tmp_path):
    import shutil

    copy = shutil.copytree(source, tmp_path / "m")
    llm = LLM(str(copy), dtype="fp32")  # stored fp32: no conversion would copy a tensor
    before = _greedy(llm)
    for shard in copy.glob("*.safetensors"):
        _overwrite_in_place(shard)
    assert _greedy(llm) == before
