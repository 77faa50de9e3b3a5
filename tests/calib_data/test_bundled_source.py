"""`bundled:NAME` calibration texts ship inside the package, so the default needs no ../shared."""

import pytest

from qkiln.calib_data import load_text_source
from qkiln.calib_data.sources import BUNDLED_DIR, bundled_names
from qkiln.compile.recipe import DEFAULT_CALIBRATION_SOURCE
from qkiln.errors import CalibrationDataError


def _parts(spec: str) -> list[str]:
    return spec.removeprefix("mix:").split("+") if spec.startswith("mix:") else [spec]


def test_default_source_is_bundled_and_loads_without_files_outside_the_package():
    assert all(part.startswith("bundled:") for part in _parts(DEFAULT_CALIBRATION_SOURCE))
    source = load_text_source(DEFAULT_CALIBRATION_SOURCE)
    assert source.spec == DEFAULT_CALIBRATION_SOURCE and len(source.documents) == len(_parts(DEFAULT_CALIBRATION_SOURCE))
    # 128 windows of 512 tokens want ~65k tokens (~4 bytes each) without heavy overlap; the wheel stays small
    assert 250_000 <= sum(len(d.encode()) for d in source.documents) <= 600_000


def test_every_bundled_text_has_its_license_listed():
    readme = (BUNDLED_DIR / "README.md").read_text()
    assert bundled_names() and all(f"{name}.txt" in readme for name in bundled_names())


@pytest.mark.parametrize("name", ["no-such-text", "../sources", ""])
def test_unknown_bundled_name_is_refused_with_the_list(name):
    with pytest.raises(CalibrationDataError, match=bundled_names()[0]):
        load_text_source(f"bundled:{name}")


@pytest.mark.parametrize("spec, message", [
    ("", "names nothing"), ("file:", "names nothing"), ("self:0", "at least 1"), ("self:-1", "at least 1"),
    ("file:" + "x" * 300, "cannot be read"),
    ("wikitext", "'wikitext': no such file; use file:PATH, bundled:NAME \\(pride-and-prejudice"),  # a bare name
    ("mix:bundled:wikitext2-valid+", "needs parts joined by single '\\+'"),  # a typo that had been recorded
    ("mix:self:2++self:2", "needs parts joined"), ("mix:", "needs parts joined"),
])
def test_malformed_sources_are_calibration_errors(spec, message):
    with pytest.raises(CalibrationDataError, match=message):
        load_text_source(spec, self_generator=lambda n, seed: ["never called"])


@pytest.mark.parametrize("value", ["12345", "null", "[\"a\"]"])
def test_a_jsonl_text_that_is_not_a_string_names_its_line(tmp_path, value):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "fine"}\n{"text": ' + value + '}\n')
    with pytest.raises(CalibrationDataError, match=r"d.jsonl:2: expected a JSON object with a 'text' string"):
        load_text_source(f"jsonl:{path}")


@pytest.mark.parametrize("spec, recorded", [
    ("/data/x/wiki.test.raw", "wiki.test.raw"),
    ("file:../shared/data/emma.txt", "file:emma.txt"),
    ("jsonl:/d/chat.jsonl#content", "jsonl:chat.jsonl#content"),
    ("mix:self:8+file:/a/b.txt+bundled:wikitext2-valid", "mix:self:8+file:b.txt+bundled:wikitext2-valid"),
    ("hf:wikitext/wikitext-2-raw-v1:test", "hf:wikitext/wikitext-2-raw-v1:test"),
])
def test_provenance_names_files_without_their_directories(spec, recorded):
    from qkiln.calib_data import portable_spec

    assert portable_spec(spec) == recorded


def test_bundled_evaluation_text_is_the_head_of_wiki_test_raw():
    """The main job's accuracy report reads `bundled:wikitext2-test-raw`, not ../shared (a clone
    elsewhere has none): byte for byte the start of the WikiText-2 raw test file, CRLF kept."""
    from pathlib import Path

    from qkiln.calib_data import eval_data_file, read_eval_text
    from qkiln.calib_data.sources import bundled_eval_names

    path, field = eval_data_file("bundled:wikitext2-test-raw")
    assert field is None and path.is_file() and "wikitext2-test-raw" not in bundled_names()  # not for calibration
    assert "eval/wikitext2-test-raw.txt" in (BUNDLED_DIR / "README.md").read_text()
    text, name = read_eval_text("bundled:wikitext2-test-raw")
    assert name == "wikitext2-test-raw.txt" and text.startswith(" = Robert Boulter = \r\n")
    with pytest.raises(CalibrationDataError, match="no bundled evaluation text 'pride-and-prejudice'; bundled ones: "
                                                  + ", ".join(bundled_eval_names())):
        eval_data_file("bundled:pride-and-prejudice")  # calibration text: not an evaluation's
    shared = Path(__file__).resolve().parents[2] / "../shared/data/wikitext-2-raw/wiki.test.raw"
    if shared.is_file():
        assert shared.read_bytes().startswith(path.read_bytes())
