"""The evaluation protocol: windows, BOS policy, bits per byte, KL; parity with transformers."""

import hashlib
import math

import pytest
import torch
import torch.nn.functional as F

from qkiln.compile.evaluate import evaluate, leading_tokens, make_windows, token_byte_lengths
from qkiln.compile.model_ref import open_model
from tiny_models import sentencepiece_byte_fallback, trained_byte_level_bpe, write_tiny_hf_model


def test_windows_cover_tokens_and_last_is_shorter():
    ids = list(range(10))
    assert make_windows(ids, 4, None) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert make_windows(ids, 4, 99)[2] == [99, 8, 9]


def test_perplexity_matches_a_direct_computation(tmp_path):
    write_tiny_hf_model(tmp_path / "m", "llama")
    m = open_model(str(tmp_path / "m"))
    text = "Hello world, this is a tiny test of the evaluation protocol.\r\nSecond line é ü."
    (tmp_path / "t.txt").write_bytes(text.encode())
    report = evaluate(m, m.tokenizer, str(tmp_path / "t.txt"), seq_len=16, max_tokens=60, progress=False)
    ids = m.tokenizer.encode(text, add_special_tokens=False)[:60]
    nll, n = 0.0, 0
    for i in range(0, len(ids), 16):
        w = torch.tensor([ids[i : i + 16]])
        if w.shape[1] < 2:
            continue
        logp = F.log_softmax(m(w)[0, :-1], -1)
        nll -= logp.gather(-1, w[0, 1:, None]).sum().item()
        n += w.shape[1] - 1
    assert report["num_tokens"] == n
    assert report["perplexity"] == pytest.approx(math.exp(nll / n), rel=1e-5)
    # a byte-level tokenizer with no merges: one scored token per byte, except each window's first
    scored_bytes = len(text.encode()[:60]) - len(range(0, 60, 16))
    assert report["bits_per_byte"] == pytest.approx(nll / math.log(2) / scored_bytes, rel=1e-5)
    assert report["protocol"]["data_sha256"] == hashlib.sha256(text.encode()).hexdigest()


def test_a_jsonl_file_scores_its_documents_joined_by_a_blank_line(tmp_path):
    """Not the JSON syntax: the same report as a text file of the documents, named NAME#FIELD."""
    import json

    from qkiln.errors import CalibrationDataError

    write_tiny_hf_model(tmp_path / "m", "llama")
    m = open_model(str(tmp_path / "m"))
    docs = ["First document, with \"quotes\" and é.", "Second one.\nTwo lines.", "Third: the end."]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"text": d, "body": d.upper()}) for d in docs) + "\n\n")
    (tmp_path / "d.txt").write_text("\n\n".join(docs))
    plain = evaluate(m, m.tokenizer, str(tmp_path / "d.txt"), 16, 200, progress=False)
    for spec, field, text in ((tmp_path / "d.jsonl", "text", docs), (f"jsonl:{tmp_path / 'd.jsonl'}#body", "body",
                                                                      [d.upper() for d in docs])):
        report = evaluate(m, m.tokenizer, str(spec), 16, 200, progress=False)
        assert report["protocol"]["data"] == f"d.jsonl#{field}"
        assert report["protocol"]["data_sha256"] == hashlib.sha256("\n\n".join(text).encode()).hexdigest()
    assert evaluate(m, m.tokenizer, str(tmp_path / "d.jsonl"), 16, 200, progress=False)["perplexity"] == \
        pytest.approx(plain["perplexity"], rel=1e-6)
    # a line separator inside a string is text, not a line end; a BOM and CRLF are read through
    odd = ["one\u2028two\u2029three\x85four", "five"]
    (tmp_path / "odd#1.JSONL").write_text("\ufeff" + "\r\n".join(json.dumps({"text": d}, ensure_ascii=False) for d in odd))
    report = evaluate(m, m.tokenizer, f"jsonl:{tmp_path / 'odd#1.JSONL'}", 16, 200, progress=False)
    assert report["protocol"]["data"] == "odd#1.JSONL#text"
    assert report["protocol"]["data_sha256"] == hashlib.sha256("\n\n".join(odd).encode()).hexdigest()
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"title": "no text"}\n')
    with pytest.raises(CalibrationDataError, match="bad.jsonl:2: expected a JSON object with a 'text' string"):
        evaluate(m, m.tokenizer, str(tmp_path / "bad.jsonl"), 16, 200, progress=False)


def test_non_finite_log_probabilities_are_an_error_not_a_nan_report(tmp_path):
    """A model whose computation overflows has no perplexity: a NaN report (not even JSON) had been
    written with exit 0, and a build's manifest then failed as `not plain JSON`."""
    from safetensors.torch import load_file, save_file

    from qkiln.errors import RecipeError, SourceModelError

    clean = write_tiny_hf_model(tmp_path / "clean", "llama")
    broken = write_tiny_hf_model(tmp_path / "broken", "llama")
    tensors = load_file(str(broken / "model.safetensors"))
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = float("inf")
    save_file(tensors, str(broken / "model.safetensors"))
    (tmp_path / "t.txt").write_text("the quick brown fox jumps over the lazy dog " * 20)
    ok, bad = open_model(str(clean)), open_model(str(broken))
    with pytest.raises(RecipeError, match="model: its log-probabilities on t.txt are not finite"):
        evaluate(bad, bad.tokenizer, str(tmp_path / "t.txt"), 32, 200, progress=False)
    with pytest.raises(SourceModelError, match="the reference's log-probabilities on t.txt are not finite"):
        evaluate(ok, ok.tokenizer, str(tmp_path / "t.txt"), 32, 200, reference=bad, progress=False)
    assert math.isfinite(evaluate(ok, ok.tokenizer, str(tmp_path / "t.txt"), 32, 200, progress=False)["perplexity"])


def test_reference_against_itself_has_zero_kl(tmp_path):
    write_tiny_hf_model(tmp_path / "m", "qwen2")
    m = open_model(str(tmp_path / "m"))
    (tmp_path / "t.txt").write_text("abc def ghi jkl mno pqr stu vwx yz " * 4)
    r = evaluate(m, m.tokenizer, str(tmp_path / "t.txt"), 32, 100, reference=m, progress=False)
    assert r["kl_divergence"] == pytest.approx(0.0, abs=1e-6)
    assert r["top1_agreement"] == 1.0
    # the keys of a build's accuracy report: an eval job compares them with the manifest's
    assert r["perplexity_change"] == r["perplexity"] / r["reference_perplexity"] - 1


def test_smollm2_perplexity_agrees_with_transformers(smollm2, smollm2_transformers, wiki_test_path):
    """Same protocol, transformers' own model as the scorer: within 0.1% (first 1024 tokens)."""
    ours = open_model(str(smollm2.path))

    def hf_scorer(ids):
        with torch.no_grad():
            return smollm2_transformers(ids).logits

    kw = dict(seq_len=512, max_tokens=1024, progress=False)
    a = evaluate(ours, ours.tokenizer, str(wiki_test_path), **kw)
    b = evaluate(hf_scorer, ours.tokenizer, str(wiki_test_path), **kw)
    assert a["num_tokens"] == b["num_tokens"] == 1022
    assert a["perplexity"] == pytest.approx(b["perplexity"], rel=1e-3)


TEXT = "Naïve café, smörgåsbord: 日本語 😀 and a plain sentence.\n" * 3


@pytest.mark.parametrize("kind", ["byte_level", "byte_fallback"])
def test_bytes_per_token_spell_the_text(kind):
    """bits per byte divide by the scored text's bytes: a byte-fallback `<0xC3>` counted as six
    bytes and a SentencePiece word lost its space (4.5x too low a bpb on such text)."""
    from qkiln.runtime.tokenizer import Tokenizer

    backend = trained_byte_level_bpe([TEXT]) if kind == "byte_level" else sentencepiece_byte_fallback()
    tok = Tokenizer(backend, {})
    ids = tok.encode(TEXT, add_special_tokens=False)
    lengths = token_byte_lengths(tok, ids)
    spelled = sum(lengths[i] for i in ids)
    # SentencePiece's normalizer adds one space before the text
    assert spelled == len(TEXT.encode()) + (kind == "byte_fallback")


def test_only_the_text_the_tokens_span_is_tokenized(tmp_path):
    write_tiny_hf_model(tmp_path / "m", "llama")
    tok = open_model(str(tmp_path / "m")).tokenizer
    text = TEXT * 200
    calls = []
    real = tok.encode
    tok.encode = lambda t, **kw: calls.append(len(t)) or real(t, **kw)
    assert leading_tokens(tok, text, 100) == real(text, add_special_tokens=False)[:100]
    assert max(calls) < len(text) / 4  # two prefixes, not the whole file


def test_served_scoring_is_the_engine_s_prompt_logprobs(tmp_path, monkeypatch):
    """`qkiln eval --served`: each window through the runtime engine (paged KV cache, kernels, its
    dtype); in fp32 without KV quantization it agrees with the simulation the build records."""
    import dataclasses

    from qkiln.compile.build import build
    from qkiln.compile.recipe import preset
    from qkiln.compile.served_eval import ServedScorer
    from tiny_models import write_tiny_model_and_text

    monkeypatch.setenv("QKILN_CACHE_DIR", str(tmp_path / "cache"))
    model_dir, text = write_tiny_model_and_text(tmp_path)
    art = build(str(model_dir), dataclasses.replace(preset("w4a16-rtn"), target="cpu"), tmp_path / "a",
                progress=False, log=lambda m: None).path
    simulated = evaluate(open_model(str(art)), open_model(str(art)).tokenizer, str(text), 32, 256, progress=False)
    served = ServedScorer(str(art), "fp32")
    assert "served" in served.description["scoring"] and "float32" in served.description["scoring"]
    from qkiln.plugins import cpu_native  # which kernels computed it: torch's give other numbers

    assert served.description["kernels"].startswith("qkiln native" if cpu_native.native_extension() else "torch")
    report = evaluate(served, served.tokenizer, str(text), 32, 256, progress=False)
    assert report["num_tokens"] == simulated["num_tokens"] and report["num_bytes"] == simulated["num_bytes"]
    assert report["perplexity"] == pytest.approx(simulated["perplexity"], rel=2e-3)
    assert simulated["batch_size"] == 4  # the default; the one that ran is recorded, cut for long windows:
    from qkiln.compile.evaluate import MAX_BATCH_TOKENS

    wide = evaluate(open_model(str(art)), open_model(str(art)).tokenizer, str(text), 32, 256, progress=False,
                    batch_size=10**6)
    assert wide["batch_size"] == MAX_BATCH_TOKENS // 32 and wide["perplexity"] == pytest.approx(simulated["perplexity"])
    bf16 = ServedScorer(str(art), "bf16")
    assert evaluate(bf16, bf16.tokenizer, str(text), 32, 256, progress=False)["perplexity"] != report["perplexity"]


def test_logits_are_scored_a_slice_at_a_time_with_the_whole_logits_report(tmp_path, monkeypatch):
    """A model that offers hidden states never has a batch's whole [B, T, V] logits computed (they
    were the build's peak memory: +2.7 GB for SmolLM2's default evaluation), and the report is the
    one the whole logits give."""
    import qkiln.compile.evaluate as evaluation

    write_tiny_hf_model(tmp_path / "m", "llama")
    write_tiny_hf_model(tmp_path / "r", "llama", seed=1)
    m, ref = open_model(str(tmp_path / "m")), open_model(str(tmp_path / "r"))
    (tmp_path / "t.txt").write_text("Slices of logits score the same windows as the whole. " * 8)
    whole = evaluate(lambda ids: m(ids), m.tokenizer, str(tmp_path / "t.txt"), 40, 400,
                     reference=lambda ids: ref(ids), batch_size=3, progress=False)
    rows = []
    for scorer in (m, ref):
        head = scorer.logits
        monkeypatch.setattr(scorer, "logits", lambda h, head=head: rows.append(h.shape[:-1]) or head(h),
                            raising=False)
    monkeypatch.setattr(evaluation, "SCORE_ROWS", 16)
    sliced = evaluate(m, m.tokenizer, str(tmp_path / "t.txt"), 40, 400, reference=ref, batch_size=3, progress=False)
    assert rows and max(r.numel() for r in rows) <= 16
    for key in ("perplexity", "kl_divergence", "reference_perplexity", "bits_per_byte"):
        assert sliced[key] == pytest.approx(whole[key], rel=1e-5)
    assert sliced["top1_agreement"] == whole["top1_agreement"] and 0 < whole["kl_divergence"]
