"""`TransformersStyleTokenizer`: qkiln's tokenizer with the calls scripts make on a transformers one.

`LLM.get_tokenizer()` returns it, as vLLM's returns a transformers tokenizer, so a ported script's
`tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`, `tok(text)`,
`tok.decode(ids)` and `tok.eos_token_id` work and mean what they mean in transformers, defaults
included: apply_chat_template tokenizes and adds no generation prompt unless asked, decode keeps
special tokens. Owns only that translation; the tokenization and the template are `Tokenizer`'s
(tokenizer.py), so the ids are the ones the engine runs. transformers itself is not imported.
"""

from qkiln.errors import SourceModelError

from .tokenizer import Tokenizer


class TransformersStyleTokenizer:
    def __init__(self, tokenizer: Tokenizer, name_or_path: str = ""):
        self.qkiln_tokenizer = tokenizer
        self.name_or_path = name_or_path
        info = tokenizer.info()
        self.bos_token, self.eos_token = info["bos_token"] or None, info["eos_token"] or None
        self.pad_token, self.unk_token = info["pad_token"] or None, info["unk_token"] or None
        self.chat_template = tokenizer.chat_template

    # ---- special tokens and the vocabulary ---------------------------------------------------
    bos_token_id = property(lambda self: self.qkiln_tokenizer.bos_token_id)
    eos_token_id = property(lambda self: self.qkiln_tokenizer.eos_token_id)
    pad_token_id = property(lambda self: self.convert_tokens_to_ids(self.pad_token) if self.pad_token else None)
    unk_token_id = property(lambda self: self.convert_tokens_to_ids(self.unk_token) if self.unk_token else None)

    @property
    def special_tokens_map(self) -> dict:
        """The named special tokens (bos, eos, unk, pad) and the config's additional_special_tokens
        (their text, where the config stores AddedToken objects)."""
        named = {k: getattr(self, k) for k in ("bos_token", "eos_token", "unk_token", "pad_token") if getattr(self, k)}
        additional = [t if isinstance(t, str) else t.get("content")
                      for t in self.qkiln_tokenizer.config.get("additional_special_tokens") or []]
        return named | ({"additional_special_tokens": additional} if additional else {})

    @property
    def all_special_tokens(self) -> list[str]:
        """transformers': special_tokens_map's, in order, once each; not every added special token
        (SmolLM2 has 17, this 3)."""
        tokens = self.special_tokens_map
        additional = tokens.pop("additional_special_tokens", [])
        return list(dict.fromkeys([*tokens.values(), *additional]))

    @property
    def all_special_ids(self) -> list[int]:
        return [self.convert_tokens_to_ids(t) for t in self.all_special_tokens]

    @property
    def model_max_length(self) -> int:
        """tokenizer_config.json's, else transformers' "no limit" (int(1e30))."""
        return self.qkiln_tokenizer.config.get("model_max_length") or int(1e30)

    @property
    def vocab_size(self) -> int:
        """Without the added tokens, as transformers counts it (`len(tok)` counts them)."""
        return self.qkiln_tokenizer.backend.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self.qkiln_tokenizer.vocab_size

    def get_vocab(self) -> dict[str, int]:
        return self.qkiln_tokenizer.backend.get_vocab(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids):
        backend = self.qkiln_tokenizer.backend
        return backend.id_to_token(ids) if isinstance(ids, int) else [backend.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens):
        backend = self.qkiln_tokenizer.backend
        return backend.token_to_id(tokens) if isinstance(tokens, str) else [backend.token_to_id(t) for t in tokens]

    # ---- text <-> ids ------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True, truncation: bool = False,
               max_length: int | None = None) -> list[int]:
        """With truncation and max_length, the first max_length ids (transformers' right side)."""
        ids = self.qkiln_tokenizer.encode(text, add_special_tokens)
        return ids[:max_length] if truncation and max_length is not None else ids

    def __call__(self, text, add_special_tokens: bool = True, truncation: bool = False,
                 max_length: int | None = None) -> dict:
        """{"input_ids", "attention_mask"} for a text or a list of texts (no padding, no tensors)."""
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens, truncation, max_length)
            return {"input_ids": ids, "attention_mask": [1] * len(ids)}
        ids = [self.encode(t, add_special_tokens, truncation, max_length) for t in text]
        return {"input_ids": ids, "attention_mask": [[1] * len(i) for i in ids]}

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[str]:
        return self.convert_ids_to_tokens(self.encode(text, add_special_tokens))

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return self.decode(self.convert_tokens_to_ids(tokens))

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        if isinstance(ids, int):
            ids = [ids]
        return self.qkiln_tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences, skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def apply_chat_template(self, conversation: list[dict], tools: list | None = None, documents: list | None = None,
                            chat_template: str | None = None, add_generation_prompt: bool = False,
                            continue_final_message: bool = False, tokenize: bool = True, return_tensors=None,
                            return_dict: bool = False, **kwargs):
        """transformers' signature and defaults: the ids (tokenize=True, the default; no special
        tokens added, the template places them; a list as transformers 4 gives it, or with
        return_dict {"input_ids", "attention_mask"} as transformers 5's default) or the text;
        `tools`, `documents` and `kwargs` are the template's variables, as transformers passes them."""
        if return_tensors is not None:
            raise SourceModelError("apply_chat_template here returns text or lists of ids, not tensors: leave "
                                   "return_tensors out")
        if conversation and isinstance(conversation[0], list):  # a batch of conversations
            return [self.apply_chat_template(c, tools, documents, chat_template, add_generation_prompt,
                                             continue_final_message, tokenize, return_dict=return_dict, **kwargs)
                    for c in conversation]
        variables = dict(kwargs, **{k: v for k, v in (("tools", tools), ("documents", documents)) if v is not None})
        text = self.qkiln_tokenizer.apply_chat_template(conversation, add_generation_prompt, continue_final_message,
                                                        variables, chat_template)
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids

    def __repr__(self) -> str:
        return f"TransformersStyleTokenizer(name_or_path={self.name_or_path!r}, vocab_size={len(self)})"
