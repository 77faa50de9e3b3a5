"""Calibration token sets: seeded, fixed length, hashed; sources read exactly as stored."""

import json

import pytest
import torch

from qkiln.calib_data import load_text_source, sample_token_set
from qkiln.errors import CalibrationDataError
from qkiln.runtime.tokenizer import Tokenizer
from tiny_models import write_tiny_hf_model


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    d = write_tiny_hf_model(tmp_path_factory.mktemp("m"))
    return Tokenizer.from_dir(d)


def test_file_source_keeps_crlf(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"line one\r\nline two\r\n")
    assert load_text_source(str(tmp_path / "a.txt")).documents == ["line one\r\nline two\r\n"]


def test_jsonl_source_and_bad_line(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "x y"}) + "\n" + json.dumps({"text": "z"}) + "\n")
    assert load_text_source(f"jsonl:{tmp_path / 'd.jsonl'}").documents == ["x y", "z"]
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(CalibrationDataError, match="bad.jsonl:2"):
        load_text_source(str(tmp_path / "bad.jsonl"))


def test_seeded_fixed_length_and_hash(tmp_path, tokenizer):
    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog " * 50)
    src = load_text_source(str(tmp_path / "a.txt"))
    a = sample_token_set(src, tokenizer, num_samples=8, seq_len=32, seed=1)
    b = sample_token_set(src, tokenizer, num_samples=8, seq_len=32, seed=1)
    c = sample_token_set(src, tokenizer, num_samples=8, seq_len=32, seed=2)
    assert len(a.input_ids) == 8 and {len(row) for row in a.input_ids} == {32}
    assert a.sha256 == b.sha256 == a.provenance["token_sha256"]
    assert a.sha256 != c.sha256


def test_text_sha256_names_the_text_not_the_path(tmp_path, tokenizer):
    (tmp_path / "a.txt").write_text("alpha beta gamma " * 40)
    (tmp_path / "copy.txt").write_text("alpha beta gamma " * 40)
    (tmp_path / "b.txt").write_text("alpha beta gamma " * 39 + "alpha beta delta ")
    a, copy, b = (load_text_source(str(tmp_path / n)) for n in ("a.txt", "copy.txt", "b.txt"))
    assert a.sha256 == copy.sha256 != b.sha256
    assert sample_token_set(a, tokenizer, 2, 16).provenance["text_sha256"] == a.sha256
    # document boundaries are part of the text's identity
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "ab"}) + "\n" + json.dumps({"text": "c"}) + "\n")
    (tmp_path / "e.jsonl").write_text(json.dumps({"text": "a"}) + "\n" + json.dumps({"text": "bc"}) + "\n")
    assert load_text_source(str(tmp_path / "d.jsonl")).sha256 != load_text_source(str(tmp_path / "e.jsonl")).sha256


def test_self_source_uses_the_generator(tokenizer):
    src = load_text_source("self:3", self_generator=lambda n, seed: [f"sample {i} seed {seed}" for i in range(n)], seed=5)
    assert src.documents == ["sample 0 seed 5", "sample 1 seed 5", "sample 2 seed 5"]
    with pytest.raises(CalibrationDataError, match="needs a model"):
        load_text_source("self:3")


def test_too_short_is_a_clear_error(tmp_path, tokenizer):
    (tmp_path / "a.txt").write_text("tiny")
    with pytest.raises(CalibrationDataError, match="fewer than one window"):
        sample_token_set(load_text_source(str(tmp_path / "a.txt")), tokenizer, 2, 64)


def test_windows_start_with_bos_when_the_tokenizer_adds_one(tmp_path):
    """Served prompts start with BOS under such a tokenizer, so calibration windows do too."""
    d = write_tiny_hf_model(tmp_path / "m")
    config = json.loads((d / "tokenizer_config.json").read_text())
    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog " * 50)
    src = load_text_source(str(tmp_path / "a.txt"))
    for add_bos in (False, True):
        (d / "tokenizer_config.json").write_text(json.dumps(config | {"add_bos_token": add_bos}))
        tokenizer = Tokenizer.from_dir(d)
        ids = torch.tensor(sample_token_set(src, tokenizer, num_samples=8, seq_len=32, seed=1).input_ids)
        assert ids.shape == (8, 32)
        assert ((ids[:, 0] == tokenizer.bos_token_id).all() == add_bos) and (ids[:, 1:] != tokenizer.bos_token_id).all()
