"""Where calibration and evaluation text comes from.

Sources: a local text file (read exactly as stored: UTF-8, no newline conversion), a JSONL
file (one document per line, field `text`), a Hugging Face `datasets` name when that package
and the network are available, samples the model generates itself (the caller supplies the
generator, since this package must not import models), or a text shipped with qkiln in
`calib_data/bundled/` (licenses in its README.md), so the default needs no download.
A source is named by a spec string, which goes into the manifest as provenance:
    file:PATH  |  jsonl:PATH[#field]  |  hf:NAME[/CONFIG]:SPLIT[#field]  |  self:NUM_SAMPLES
    bundled:NAME  |  mix:SPEC+SPEC+...   (the documents of every part, in order; windows are drawn from all)
A bare existing path means file: (or jsonl: for *.jsonl).
"""

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from qkiln.errors import CalibrationDataError

# (num_samples, seed) -> generated documents; provided by compile/ with the model loaded.
SelfGenerator = Callable[[int, int], list[str]]
BUNDLED_DIR = Path(__file__).resolve().parent / "bundled"


def bundled_names() -> list[str]:
    """Names `bundled:NAME` accepts (the .txt files shipped in calib_data/bundled/)."""
    return sorted(p.stem for p in BUNDLED_DIR.glob("*.txt"))


def _read_bundled(name: str) -> str:
    if name not in bundled_names():
        raise CalibrationDataError(f"no bundled calibration text {name!r}; bundled texts: "
                                   f"{', '.join(bundled_names()) or 'none (is the package installed whole?)'}")
    return read_text_exact(BUNDLED_DIR / f"{name}.txt")


@dataclass(frozen=True)
class TextSource:
    spec: str
    documents: list[str]

    @property
    def sha256(self) -> str:
        """Hash of the text itself (each document's UTF-8 bytes, length-prefixed so that document
        boundaries count): names the data in provenance independently of the tokenizer and of
        the path it was read from."""
        h = hashlib.sha256()
        for doc in self.documents:
            data = doc.encode("utf-8")
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
        return h.hexdigest()


def read_text_exact(path: Path) -> str:
    """The file's text exactly as stored: bytes decoded as UTF-8, CRLF kept."""
    try:
        return Path(path).read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise CalibrationDataError(f"data file {path} does not exist; check the path") from None
    except OSError as e:  # a directory, no permission, a name too long, ...
        raise CalibrationDataError(f"data file {path} cannot be read ({e.strerror or e}); give a text file") from None
    except UnicodeDecodeError as e:
        raise CalibrationDataError(f"{path} is not UTF-8 text ({e}); convert it to UTF-8") from e


# Between an evaluation file's JSONL documents: a blank line, as paragraphs are in the plain files
EVAL_DOCUMENT_SEPARATOR = "\n\n"


def bundled_eval_names() -> list[str]:
    """Names an evaluation's `bundled:NAME` accepts: held-out texts in calib_data/bundled/eval/,
    which calibration's `bundled:` does not offer (its texts are in calib_data/bundled/)."""
    return sorted(p.stem for p in (BUNDLED_DIR / "eval").glob("*.txt"))


def eval_data_file(spec: str | Path) -> tuple[Path, str | None]:
    """An evaluation data spec -> (its file, the JSONL field to read, or None for a text file as
    stored): `PATH` or `file:PATH` (`*.jsonl`: field "text"), `jsonl:PATH[#FIELD]` (a path may
    hold '#': only a trailing `#identifier` names the field), or `bundled:NAME`."""
    spec = str(spec)
    if spec.startswith("bundled:"):
        name = spec.removeprefix("bundled:")
        if name not in bundled_eval_names():
            raise CalibrationDataError(f"no bundled evaluation text {name!r}; bundled ones: "
                                       f"{', '.join(bundled_eval_names()) or 'none (is the package installed whole?)'}")
        return BUNDLED_DIR / "eval" / f"{name}.txt", None
    if spec.startswith("jsonl:"):
        path, hash_, field = spec.removeprefix("jsonl:").rpartition("#")
        if not hash_ or not field.isidentifier():
            path, field = spec.removeprefix("jsonl:"), ""
        if not path:
            raise CalibrationDataError("jsonl: names no file; write jsonl:PATH or jsonl:PATH#FIELD")
        return Path(path), field or "text"
    spec = spec.removeprefix("file:")
    return Path(spec), ("text" if spec.lower().endswith(".jsonl") else None)


def read_eval_text(spec: str | Path) -> tuple[str, str]:
    """(the text an evaluation scores, the name its protocol records): a text file exactly as
    stored, or a JSONL file's documents joined by EVAL_DOCUMENT_SEPARATOR (not its JSON syntax)."""
    path, field = eval_data_file(spec)
    if field is None:
        return read_text_exact(path), path.name
    documents = _read_jsonl(path, field)
    if not documents:
        raise CalibrationDataError(f"{path} holds no documents; give a JSONL file with a {field!r} string per line")
    return EVAL_DOCUMENT_SEPARATOR.join(documents), f"{path.name}#{field}"


def _read_jsonl(path: Path, field: str) -> list[str]:
    docs = []
    # JSON Lines ends lines with \n only: str.splitlines also splits at U+2028 / U+2029 / NEL, which
    # JSON strings may hold unescaped (json.dumps(ensure_ascii=False) writes them so)
    for i, line in enumerate(read_text_exact(path).removeprefix("\ufeff").split("\n"), 1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        try:
            text = json.loads(line)[field]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CalibrationDataError(f"{path}:{i}: expected a JSON object with a {field!r} string ({e})") from e
        if not isinstance(text, str):
            raise CalibrationDataError(f"{path}:{i}: expected a JSON object with a {field!r} string, "
                                       f"got {type(text).__name__}")
        docs.append(text)
    return docs


def _read_hf_dataset(name: str, split: str, field: str) -> list[str]:
    try:
        import datasets
    except ImportError:
        raise CalibrationDataError("hf: sources need `pip install datasets`; or pass a local file") from None
    # NAME is a repo ("wikitext", "org/repo"); a third part is the config: org/repo/config
    repo, _, config = name.rpartition("/") if name.count("/") > 1 else (name, "", "")
    try:
        ds = datasets.load_dataset(repo, config or None, split=split)
    except Exception as e:  # offline, unknown name, ...: the message says which
        raise CalibrationDataError(f"could not load dataset {name!r} ({e}); pass a local file instead") from e
    texts = [row.get(field) for row in ds]
    if not all(isinstance(t, str) for t in texts):
        raise CalibrationDataError(f"dataset {name!r} split {split!r} has rows without a {field!r} string; "
                                   "name the text column with #FIELD")
    return [t for t in texts if t.strip()]


def _exists(path: str) -> bool:
    try:
        return Path(path).exists()
    except OSError:  # a name too long for the file system, ...: not a file we can read either
        return False


_SPEC_KINDS = ("file", "jsonl", "hf", "bundled", "self", "mix")


def portable_spec(spec: str) -> str:
    """The spec as provenance: every file path reduced to its name. The text's sha256 recorded
    beside it names the data; a path says only where one host kept it, and made the same build
    from another directory a different manifest (and digest)."""
    kind, sep, rest = spec.partition(":")
    if kind == "mix":
        return "mix:" + "+".join(portable_spec(p) for p in rest.split("+"))
    if kind in ("file", "jsonl"):
        path, hash_, field = rest.partition("#")
        return f"{kind}:{Path(path).name}{hash_}{field}"
    if sep and kind in _SPEC_KINDS:
        return spec
    return Path(spec).name if spec else spec  # a bare path


def load_text_source(spec: str, self_generator: SelfGenerator | None = None, seed: int = 0) -> TextSource:
    kind, sep, rest = spec.partition(":")
    if kind == "mix":
        names = rest.split("+")
        if not rest or not all(names):  # "mix:a+" is a typo (the manifest had recorded it as given)
            raise CalibrationDataError(f"calibration source {spec!r}: mix: needs parts joined by single '+', e.g. "
                                       "mix:self:64+file:valid.txt")
        parts = [load_text_source(p, self_generator, seed) for p in names]
        return TextSource(spec, [d for part in parts for d in part.documents])
    if not spec or (sep and not rest and kind != "bundled"):  # bundled: lists its names itself
        raise CalibrationDataError(f"calibration source {spec!r} names nothing; use file:PATH, jsonl:PATH, "
                                   "hf:NAME:SPLIT, self:N, bundled:NAME or mix:A+B")
    if not sep and not _exists(spec):  # a bare name: a file that is not there, or a misremembered source
        raise CalibrationDataError(f"calibration source {spec!r}: no such file; use file:PATH, bundled:NAME "
                                   f"({', '.join(bundled_names())}), self:N, jsonl:PATH, hf:NAME:SPLIT or mix:A+B")
    if not sep or _exists(spec):
        kind, rest = ("jsonl" if spec.endswith(".jsonl") else "file"), spec
    if kind == "file":
        return TextSource(spec, [read_text_exact(Path(rest))])
    if kind == "jsonl":
        path, _, field = rest.partition("#")
        return TextSource(spec, _read_jsonl(Path(path), field or "text"))
    if kind == "hf":
        name_split, _, field = rest.partition("#")
        name, _, split = name_split.rpartition(":")
        return TextSource(spec, _read_hf_dataset(name or name_split, split or "train", field or "text"))
    if kind == "bundled":
        return TextSource(spec, [_read_bundled(rest)])
    if kind == "self":
        if self_generator is None:
            raise CalibrationDataError("self: calibration needs a model to generate samples; use `qkiln build`")
        try:
            num = int(rest)
        except ValueError:
            raise CalibrationDataError(f"self:NUM_SAMPLES expects an integer, got {rest!r}") from None
        if num < 1:
            raise CalibrationDataError(f"self:NUM_SAMPLES generates NUM_SAMPLES texts: give at least 1, got {num}")
        return TextSource(spec, self_generator(num, seed))
    raise CalibrationDataError(
        f"unknown data source {spec!r}; use file:PATH, jsonl:PATH, hf:NAME:SPLIT, self:N, bundled:NAME or mix:A+B"
    )
