"""`Tokenizer`: the HF `tokenizers` library plus the few policies around it that models need.

Owns: encode/decode, the BOS policy (`add_bos`), special token ids, and the chat template
(rendered with jinja2, as transformers does). Built from a `tokenizer.json` directory or from
GGUF metadata (llama.cpp's `tokenizer.ggml.*` keys: byte-level or SentencePiece BPE). Must not import
`transformers`: the runtime serves without it.
"""

import datetime
import functools
import json
import math
import os
import re
import warnings
from pathlib import Path

import jinja2
import jinja2.ext
from tokenizers import (AddedToken, Regex, Tokenizer as HFTokenizer, decoders, models, normalizers, pre_tokenizers,
                        processors)

from qkiln.errors import SourceModelError

from .template_limits import BoundedSandbox, render_bounded

# transformers 5 saves the chat template beside tokenizer_config.json, in its own file, and named
# ones (Hermes' and Command-R's "tool_use") as additional_chat_templates/NAME.jinja
CHAT_TEMPLATE_FILE = "chat_template.jinja"
NAMED_TEMPLATES_DIR = "additional_chat_templates"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", CHAT_TEMPLATE_FILE)
# Texts longer than this are encoded through encode_batch, which lets other threads run (the
# server's event loop, the engine); 1M characters took 0.58 s with the GIL held throughout.
LONG_TEXT = 16_384



def _llama3_style_split(digits: str) -> str:
    return (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|" + digits
            + r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


# llama.cpp pre-tokenizer names -> the split rules their merges were learned with (GPT-2's is
# ByteLevel's own default, SmolLM's in _gguf_pre_tokenizer). Qwen2's tokenizer.json is Llama 3's
# rule with digits one at a time.
_SPLITS = {**dict.fromkeys(("llama3", "llama-bpe", "llama-v3", "smaug-bpe"), _llama3_style_split(r"\p{N}{1,3}")),
           "qwen2": _llama3_style_split(r"\p{N}")}  # Qwen2 / 2.5 / 3
# llama.cpp's LLAMA3 pre-tokenizer type: a pre-token that is a whole vocabulary entry is that token
# before any merge (Llama 3's tokenizer.json sets ignore_merges; 588 of its tokens no merge path
# reaches), and BOS is added unless the file says otherwise
_LLAMA3_PRE = ("llama3", "llama-bpe", "llama-v3")


class Tokenizer:
    def __init__(self, backend: HFTokenizer, config: dict):
        self.backend = backend
        self.config = config
        self.bos_token_id = self._token_id(config.get("bos_token"))
        self.eos_token_id = self._token_id(config.get("eos_token"))
        # tokenizer.json's post-processor decides only what tokenizer_config.json leaves unsaid (as
        # transformers 4's Llama tokenizers did; transformers 5 drops the flags beside a tokenizer.json,
        # so `save` writes a post-processor that agrees with them, and a disagreement is warned about)
        before, after = self._post_processor_tokens()
        if "add_bos_token" in config:
            self.add_bos = bool(config["add_bos_token"]) and self.bos_token_id is not None
        else:  # Llama 3's layout: no flag, tokenizer.json's post-processor puts BOS first (transformers follows it)
            self.add_bos = len(before) == 1
            self.bos_token_id = before[0] if self.add_bos else self.bos_token_id
        if "add_eos_token" in config:
            self.add_eos = bool(config["add_eos_token"]) and self.eos_token_id is not None
        else:
            self.add_eos = len(after) == 1 and after[0] == self.eos_token_id
        # tokenizer_config.json's chat_template: one template, or named ones [{"name", "template"}]
        self.chat_templates = _named_templates(config.get("chat_template"))
        self.chat_template = self.chat_templates.get("default")
        self._compiled: dict[str, jinja2.Template] = {}
        # the flags the post-processor disagrees with ("add_eos_token true"): from_dir warns of them
        self.flag_conflicts = [f"{flag} {str(config[flag]).lower()}" for flag, says, policy in (
            ("add_bos_token", before, self._policy_tokens()[0]), ("add_eos_token", after, self._policy_tokens()[1]))
            if flag in config and says != policy]

    def _policy_tokens(self) -> tuple[list[int], list[int]]:
        """The ids `encode` adds before and after a text."""
        return [self.bos_token_id] * self.add_bos, [self.eos_token_id] * self.add_eos

    def _post_processor_tokens(self) -> tuple[list[int], list[int]]:
        """The ids tokenizer.json's post-processor adds before and after a text."""
        plain = self.backend.encode("a", add_special_tokens=False).ids
        full = self.backend.encode("a", add_special_tokens=True).ids
        for start in range(len(full) - len(plain) + 1):
            if full[start:start + len(plain)] == plain:
                return full[:start], full[start + len(plain):]
        return [], []

    def _token_id(self, token) -> int | None:
        text = _token_text(token)
        return self.backend.token_to_id(text) if text else None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token of the vocabulary spells (bounds a text's token count)."""
        return max(map(len, self.backend.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, add_special_tokens: bool = True, keep_last: int | None = None) -> list[int]:
        """Plain tokenization; BOS is prepended (EOS appended) only when the tokenizer's policy says so.
        keep_last: at most that many ids, the text's last ones with the BOS / EOS kept (transformers'
        left truncation, which vLLM's truncate_prompt_tokens uses)."""
        if len(text) > LONG_TEXT:  # encode_batch releases the GIL; encode holds it throughout
            ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            ids = self.backend.encode(text, add_special_tokens=False).ids
        head = [self.bos_token_id] if add_special_tokens and self.add_bos else []
        tail = [self.eos_token_id] if add_special_tokens and self.add_eos else []
        if keep_last is not None:
            room = max(keep_last - len(head) - len(tail), 0)
            ids = ids[max(len(ids) - room, 0):] if room else []
        return head + ids + tail

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def _decoder_types(self) -> set[str]:
        return _decoder_types(json.loads(self.backend.to_str()).get("decoder"))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token adds to a decoded text. Decoding a lone token is not enough: a token
        holding part of a UTF-8 character decodes to U+FFFD (OpenAI's logprobs `bytes` field exists
        for exactly those tokens)."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added_ids:
            return piece.encode("utf-8")
        if "ByteLevel" in self._decoder_types and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        if "ByteFallback" in self._decoder_types and (byte := _BYTE_PIECE.fullmatch(piece)):
            return bytes([int(byte.group(1), 16)])
        if self._decoder_types & {"Metaspace", "Replace"}:  # SentencePiece: "▁" is the space
            return piece.replace("\u2581", " ").encode("utf-8")
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def token_name(self, token_id: int) -> str:
        """A token as logprobs name it: its text, or (part of a character) OpenAI's `bytes:\\xNN...`."""
        raw = self.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    @functools.cached_property
    def _added_ids(self) -> frozenset[int]:
        return frozenset(self.backend.get_added_tokens_decoder())

    def info(self) -> dict:
        """The special tokens' text, the BOS / EOS policy and the chat template, as vLLM's
        GET /tokenizer_info gives them (a remote tokenizer, lm-evaluation-harness's, reads them)."""
        return {**{key: _token_text(self.config.get(key)) for key in ("bos_token", "eos_token", "pad_token",
                                                                      "unk_token")},
                "add_bos_token": self.add_bos, "add_eos_token": self.add_eos, "chat_template": self.chat_template}

    @functools.cached_property
    def special_token_ids(self) -> frozenset[int]:
        """The tokens `decode(skip_special_tokens=True)` leaves out."""
        return frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, template_kwargs: dict | None = None,
                            chat_template: str | None = None) -> str:
        """The conversation rendered as transformers renders it. The template comes with the model
        (or `chat_template`), so it runs sandboxed: one that reaches for Python internals is
        refused, not run. continue_final_message: end the text inside the last message, so that
        generation continues it. template_kwargs: more variables for the template (vLLM's
        chat_template_kwargs, e.g. Qwen3's enable_thinking)."""
        template = self._template(chat_template, has_tools=bool((template_kwargs or {}).get("tools")))
        # keys whose value is None are left out, as transformers and vLLM leave them (an OpenAI SDK
        # message's `tool_calls: None` crashed Llama 3's template; `content: None` printed "None")
        messages = [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in messages]
        if continue_final_message:
            final = messages[-1].get("content") if messages else None
            if not isinstance(final, str) or not final:
                raise SourceModelError("continue_final_message needs text in the last message to continue")
            messages = [*messages[:-1], {**messages[-1], "content": final + _CONTINUE_TAG}]
        # as transformers: the caller's variables may replace the special tokens, not the conversation
        variables = {**{key: _token_text(self.config.get(key)) for key in ("bos_token", "eos_token", "unk_token",
                                                                         "pad_token")},
                     **(template_kwargs or {}), "messages": messages, "add_generation_prompt": add_generation_prompt}
        try:
            text = render_bounded(template, variables)
        except Exception as e:  # the template is the model's code: raise_exception(), a sandbox refusal, a TypeError
            raise SourceModelError(f"chat template error: {e}") from None
        return _cut_at_continue_tag(text, final) if continue_final_message else text

    def _template(self, chat_template: str | None, has_tools: bool) -> jinja2.Template:
        """As transformers' get_chat_template picks: `chat_template` by name among the model's named
        templates, or as a template's source; else "tool_use" when tools are given and the model has
        one, else the default."""
        if chat_template is not None and chat_template not in self.chat_templates:
            return _compile_template(chat_template)
        name = chat_template or ("tool_use" if has_tools and "tool_use" in self.chat_templates else "default")
        if name not in self.chat_templates:
            named = f" (it has {', '.join(sorted(self.chat_templates))}: name one)" if self.chat_templates else ""
            raise SourceModelError(f"this model's tokenizer has no default chat template{named}; use "
                                   "/v1/completions instead")
        if name not in self._compiled:
            self._compiled[name] = _compile_template(self.chat_templates[name])
        return self._compiled[name]

    def chat_prompt_ids(self, messages: list[dict], add_generation_prompt: bool = True, **template_options) -> list[int]:
        """A conversation rendered with the chat template (apply_chat_template's options), as token
        ids: the template places BOS, so encoding adds none (a second BOS on Llama / Mistral
        templates otherwise)."""
        text = self.apply_chat_template(messages, add_generation_prompt, **template_options)
        return self.encode(text, add_special_tokens=False)

    def save(self, directory: Path) -> None:
        """tokenizer.json and tokenizer_config.json; the first's post-processor adds what `encode`
        adds, so transformers (lm-eval's HF tokenizer backend), which follows it, gives the same ids."""
        directory.mkdir(parents=True, exist_ok=True)
        backend = self.backend
        if self._post_processor_tokens() != self._policy_tokens():
            backend = _with_post_processor(backend, *(None if not ids else backend.id_to_token(ids[0])
                                                      for ids in self._policy_tokens()))
        backend.save(str(directory / "tokenizer.json"))
        (directory / "tokenizer_config.json").write_text(json.dumps(self.config, indent=2, sort_keys=True))

    @classmethod
    def from_dir(cls, directory: Path) -> "Tokenizer":
        path = Path(directory) / "tokenizer.json"
        if not path.is_file():
            if (Path(directory) / "tokenizer.model").is_file():
                raise SourceModelError(f"{directory} has a SentencePiece tokenizer.model but no tokenizer.json, which "
                                       "is what qkiln reads: write one with transformers, "
                                       "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)")
            raise SourceModelError(f"{directory} has no tokenizer.json; copy the model's tokenizer files there")
        if not os.access(path, os.R_OK):  # tokenizers' message called it invalid, and re-downloading fixed nothing
            raise SourceModelError(f"{path}: cannot be read (permission denied): make it readable by this user "
                                   "(chmod a+r) or ask its owner to")
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise SourceModelError(f"{path} is not a valid tokenizer.json ({e}); re-download it") from e
        config = read_json_config(Path(directory) / "tokenizer_config.json") or {}
        config = {k: v for k, v in config.items() if k in _KEPT_CONFIG_KEYS}
        named = _named_templates(config.get("chat_template"))
        template_path = Path(directory) / CHAT_TEMPLATE_FILE
        if template_path.is_file():  # transformers reads it in preference to the config's
            named["default"] = template_path.read_text(encoding="utf-8")
        for path in sorted((Path(directory) / NAMED_TEMPLATES_DIR).glob("*.jinja")):
            named[path.stem] = path.read_text(encoding="utf-8")
        config.pop("chat_template", None)
        if named:  # written back as tokenizer_config.json holds it (an artifact's tokenizer/ keeps them all)
            config["chat_template"] = _config_templates(named)
        tokenizer = cls(backend, config)
        if tokenizer.flag_conflicts:
            warnings.warn(f"{directory}: tokenizer_config.json says {' and '.join(tokenizer.flag_conflicts)}, which "
                          "tokenizer.json's post-processor does not do; qkiln follows tokenizer_config.json "
                          "(transformers 4's Llama tokenizers did, transformers 5 follows tokenizer.json), and a "
                          "build's tokenizer.json is written to agree (an artifact built before qkiln did that warns "
                          "too: rebuild it so transformers reads the same)", stacklevel=2)
        return tokenizer

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> "Tokenizer":
        """llama.cpp's `tokenizer.ggml.*` keys: a byte-level BPE ('gpt2', built as transformers
        builds it) or a SentencePiece BPE ('llama': Llama 2, Mistral, TinyLlama; tokenized as
        llama.cpp tokenizes it)."""
        kind = meta.get("tokenizer.ggml.model")
        if kind not in ("gpt2", "llama"):
            raise SourceModelError(f"GGUF tokenizer type {kind!r} is not supported (only byte-level BPE 'gpt2' and "
                                   "SentencePiece BPE 'llama'); use the model's Hugging Face directory instead")
        tokens = meta["tokenizer.ggml.tokens"]
        backend = _byte_level_bpe(meta, tokens) if kind == "gpt2" else _sentencepiece_bpe(meta, tokens)
        types = _per_token(meta, "token_type", tokens) or [1] * len(tokens)
        name = lambda key: _token_at(tokens, meta.get(f"tokenizer.ggml.{key}"), key)  # noqa: E731
        config = {
            "bos_token": name("bos_token_id"),
            "eos_token": name("eos_token_id"),
            # llama.cpp's defaults when the key is absent: SentencePiece and Llama 3 vocabularies add BOS
            "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token",
                                           kind == "llama" or meta.get("tokenizer.ggml.pre") in _LLAMA3_PRE)),
            "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
            "chat_template": _gguf_chat_templates(meta),
            "unk_token": name("unknown_token_id"),
        }
        # UNKNOWN (2) and CONTROL (3) tokens are special, and so are BOS, EOS and UNK whatever their
        # type says (a file without types decoded "<s> hi"); USER_DEFINED (4) ones (Qwen's
        # <tool_call>, <think>) are plain text matched whole, as llama.cpp and transformers do
        named = {config["bos_token"], config["eos_token"], config["unk_token"]} - {None}
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t, ty in zip(tokens, types) if ty in (2, 3) or t in named])
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == 4])
        backend.post_processor = _bos_eos_processor(backend, config)
        return cls(backend, config)


def _bos_eos_processor(backend: HFTokenizer, config: dict):
    """What the BOS / EOS policy does to an encoding, written into tokenizer.json as Llama's own
    file has it: `Tokenizer.encode` adds them itself (it encodes without special tokens), but
    an artifact's tokenizer loaded by transformers (lm-eval's HF tokenizer backend) read none
    from the config and scored every text without its BOS. None: the policy adds nothing."""
    ends = [(config["bos_token"], config["add_bos_token"]), (config["eos_token"], config["add_eos_token"])]
    return _template_processor(backend, *(token if add and token is not None else None for token, add in ends))


def _named_templates(raw) -> dict[str, str]:
    """tokenizer_config.json's chat_template, one template or named ones [{"name", "template"}], by name."""
    if isinstance(raw, list):
        return {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
    return {"default": raw} if isinstance(raw, str) and raw else {}


def _gguf_chat_templates(meta: dict) -> str | list[dict] | None:
    """tokenizer.chat_template, and the named ones llama.cpp writes as tokenizer.chat_template.NAME,
    in tokenizer_config.json's forms."""
    named = {"default" if key == "tokenizer.chat_template" else key.removeprefix("tokenizer.chat_template."): value
             for key, value in meta.items()
             if key == "tokenizer.chat_template" or key.startswith("tokenizer.chat_template.")}
    return _config_templates(named)


def _config_templates(named: dict[str, str]) -> str | list[dict] | None:
    """Templates by name in tokenizer_config.json's forms: one string, or [{"name", "template"}]."""
    if not named:
        return None
    return named["default"] if list(named) == ["default"] else [{"name": k, "template": v} for k, v in named.items()]


def _with_post_processor(backend: HFTokenizer, bos: str | None, eos: str | None) -> HFTokenizer:
    """A copy of `backend` whose post-processor adds `bos` / `eos` (None: nothing) and keeps what
    else it did (ByteLevel's offsets): its BOS / EOS templates are replaced."""
    data = json.loads(backend.to_str())
    current = data.get("post_processor")
    parts = [] if current is None else current["processors"] if current["type"] == "Sequence" else [current]
    parts = [p for p in parts if p["type"] not in ("TemplateProcessing", "BertProcessing", "RobertaProcessing")]
    template = _template_processor(backend, bos, eos)
    parts += [] if template is None else [json.loads(template.__getstate__())]
    data["post_processor"] = None if not parts else parts[0] if len(parts) == 1 else \
        {"type": "Sequence", "processors": parts}
    return HFTokenizer.from_str(json.dumps(data))


def _template_processor(backend: HFTokenizer, bos: str | None, eos: str | None):
    """A TemplateProcessing that puts `bos` first and `eos` last (None: leave it out); None for neither."""
    if bos is None and eos is None:
        return None

    def template(sequence: str, type_id: int) -> list[str]:
        return ([f"{bos}:{type_id}"] * (bos is not None) + [f"${sequence}:{type_id}"]
                + [f"{eos}:{type_id}"] * (eos is not None))

    single, pair = " ".join(template("A", 0)), " ".join(template("A", 0) + template("B", 1))
    special = [(t, backend.token_to_id(t)) for t in dict.fromkeys(t for t in (bos, eos) if t is not None)]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _byte_level_bpe(meta: dict, tokens: list[str]) -> HFTokenizer:
    merges = _file_merges(meta)
    if merges is None:
        raise SourceModelError("GGUF metadata lacks tokenizer.ggml.merges (a BPE vocabulary needs them): the file "
                               "is incomplete; convert the model again")
    pre = meta.get("tokenizer.ggml.pre", "default")
    backend = _bpe(tokens, merges, fuse_unk=False, ignore_merges=pre in _LLAMA3_PRE)
    backend.pre_tokenizer = _gguf_pre_tokenizer(pre)
    if pre == "qwen2":  # Qwen2's tokenizer.json normalizes to NFC before splitting
        backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(meta: dict, tokens: list[str]) -> HFTokenizer:
    """SentencePiece's BPE as llama.cpp runs it: spaces are "▁" with one prepended, pieces merge
    best score first across the whole text, and a character outside the vocabulary falls back to
    its UTF-8 byte tokens (<0x..>). The file stores scores, not merges; the merges are their order."""
    merges = _file_merges(meta)
    if merges is None:
        scores = _per_token(meta, "scores", tokens)
        if scores is None:
            raise SourceModelError("GGUF metadata lacks tokenizer.ggml.scores (a SentencePiece vocabulary needs them): "
                                   "the file is incomplete; convert the model again")
        if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in scores):
            raise SourceModelError("GGUF metadata tokenizer.ggml.scores holds a value that is not a finite number: the "
                                   "file is damaged; convert the model again")
        merges = _merges_from_scores(tokens, scores)
    unk = _token_at(tokens, meta.get("tokenizer.ggml.unknown_token_id"), "unknown_token_id")
    backend = _bpe(tokens, merges, fuse_unk=True, byte_fallback=True, unk_token=unk)
    # llama.cpp puts the space before the text and after every special token, whether or not the
    # text starts with one (SentencePiece's add_dummy_prefix): a normalizer runs on each stretch
    # of text between added tokens. (transformers' GGUF converter uses Metaspace, which skips it
    # before a text starting with a space and after special tokens.)
    space = [normalizers.Prepend("\u2581")] if meta.get("tokenizer.ggml.add_space_prefix", True) else []
    backend.normalizer = normalizers.Sequence(space + [normalizers.Replace(" ", "\u2581")])
    strip = [decoders.Strip(content=" ", left=1, right=0)] if space else []  # the space prepended
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         *strip])
    return backend


def _file_merges(meta: dict) -> list[tuple[str, str]] | None:
    """`tokenizer.ggml.merges` ("left right" strings) as pairs, or None when the file has none."""
    merges = meta.get("tokenizer.ggml.merges")
    return None if merges is None else [tuple(m.split(" ", 1)) for m in merges]


def _per_token(meta: dict, key: str, tokens: list[str]) -> list | None:
    """`tokenizer.ggml.{key}`, one entry per token, or None when absent (a shorter list was cut
    short silently: the tokens past its end lost their scores or types)."""
    values = meta.get(f"tokenizer.ggml.{key}")
    if values is not None and len(values) != len(tokens):
        raise SourceModelError(f"GGUF metadata tokenizer.ggml.{key} has {len(values)} entries for {len(tokens)} "
                               "tokens: the file is inconsistent; convert the model again")
    return values


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces of the vocabulary is a merge, ranked by the merged
    piece's score (highest first), then by the longer left and right parts, then by the parts' ids
    (transformers' GGUF converter's order). SentencePiece's BPE joins the adjacent pair whose join
    scores best, so this tokenizes as it does wherever the scores are distinct, as a trained
    vocabulary's are; among equal scores llama.cpp joins the leftmost pair in the text, which no
    fixed merge order can reproduce."""
    ids = {token: i for i, token in enumerate(tokens)}
    ranked = []
    for piece, score in zip(tokens, scores):
        splits = [(piece[:i], piece[i:]) for i in range(1, len(piece)) if piece[:i] in ids and piece[i:] in ids]
        splits.sort(key=lambda pair: (ids[pair[0]], ids[pair[1]]))
        ranked += [(-score, -len(left), -len(right), order, left, right)
                   for order, (left, right) in enumerate(splits, start=len(ranked))]
    return [(left, right) for *_, left, right in sorted(ranked)]


def _bpe(tokens: list[str], merges: list[tuple[str, str]], **options) -> HFTokenizer:
    try:
        return HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, **options))
    except Exception as e:  # tokenizers raises a bare Exception: a merge of tokens not in the vocabulary
        raise SourceModelError(f"GGUF tokenizer metadata is inconsistent ({e}); convert the model again") from None


def read_json_config(path: Path) -> dict | None:
    """A model folder's JSON object file (tokenizer_config.json, generation_config.json), or None
    when it has none; a damaged one is a SourceModelError."""
    if not path.is_file():
        return None
    try:
        loaded = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SourceModelError(f"{path} is malformed ({e}); re-download it") from None
    if not isinstance(loaded, dict):
        raise SourceModelError(f"{path} holds a {type(loaded).__name__}, not a JSON object; re-download it")
    return loaded


def _token_at(tokens: list[str], token_id, key: str) -> str | None:
    if token_id is None:
        return None
    if not 0 <= token_id < len(tokens):
        raise SourceModelError(f"GGUF metadata tokenizer.ggml.{key} is {token_id}, outside the vocabulary of "
                               f"{len(tokens)} tokens; the file is inconsistent: convert the model again")
    return tokens[token_id]


_KEPT_CONFIG_KEYS = ("bos_token", "eos_token", "add_bos_token", "add_eos_token", "chat_template", "pad_token",
                     "unk_token")


def _gguf_pre_tokenizer(pre: str):
    if pre in _SPLITS:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre == "smollm":
        # SmolLM's tokenizer.json: every digit is its own pre-token, then GPT-2's byte-level split.
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    if pre in ("default", "gpt-2", "gpt2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    raise SourceModelError(f"GGUF pre-tokenizer {pre!r} is not supported; use the model's Hugging Face directory")


def _decoder_types(decoder: dict | None) -> set[str]:
    """The types in a tokenizer.json decoder, Sequence members included."""
    if not decoder:
        return set()
    return {decoder.get("type")}.union(*(_decoder_types(d) for d in decoder.get("decoders") or []))


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, reversed: each byte is spelled as one printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF_CHAR = _byte_level_alphabet()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _raise_template_error(message: str):
    raise jinja2.TemplateError(message)


def _token_text(token) -> str:
    """A tokenizer_config special token as text: a string, or an AddedToken's {"content": ...}."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else ""  # a list or a number names no token (it failed as a TypeError)


class _GenerationTag(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (it marks the assistant's tokens for
    training masks; TRL writes it into fine-tunes, SmolLM3 ships it): the body, rendered as is."""
    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _template_environment() -> jinja2.Environment:
    """transformers' chat-template environment: sandboxed and immutable, loop controls, the
    generation tag, tojson that keeps non-ASCII text, and the raise_exception / strftime_now
    globals templates call."""
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _GenerationTag])
    env.filters["tojson"] = lambda value, ensure_ascii=False, indent=None, separators=None, sort_keys=False: \
        json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = lambda format: datetime.datetime.now().strftime(format)
    return env


_TEMPLATE_ENV = _template_environment()
# appended to the message to continue, then cut from the text (transformers' tag): where the
# message ends in the rendered text, whatever else in the template matches its last characters
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _compile_template(source: str) -> jinja2.Template:
    try:
        return _TEMPLATE_ENV.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise SourceModelError(f"the chat template does not parse ({e}); fix it (tokenizer_config.json's "
                               "chat_template or chat_template.jinja)") from None
    except jinja2.TemplateError as e:  # a sandbox refusal while jinja folded its constants
        raise SourceModelError(f"chat template error: {e}") from None


def _cut_at_continue_tag(text: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise SourceModelError("the chat template does not reproduce the last message's text, so it cannot be "
                               "continued; send it without continue_final_message")
    end = text.rindex(tag)
    # a template that trims the message (|trim) took its trailing space: continue after the trimmed text
    return text[:end] if text[end:end + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:end].rstrip()
