"""A request's prompt as token ids, for the server: text, chat messages or ids, with the guards
that keep a huge text off the tokenizer and ids outside the vocabulary off the engine.

Owns tokenizing off the event loop (a long prompt took seconds there, and every other client
waited), prompt truncation (SamplingParams.truncate_prompt_tokens) and the refusals, as
InvalidRequestError naming the request's field (ids outside the vocabulary in the engine's own
words, a RequestError). Must not know about routes or responses.
"""

import asyncio

from qkiln.errors import SourceModelError

from .async_engine import AsyncLLMEngine
from .engine import check_in_vocabulary, truncation
from .openai_protocol import ChatPrompt, InvalidRequestError
from .sampling_params import check_unicode


# A text /tokenize counts, or a prompt truncate_prompt_tokens cuts, is tokenized whole whatever the
# context: the tokenizer holds ~170 bytes per character meanwhile (an 8 MB text took the server from
# 2.4 to 3.7 GB). Four times a long book; an evaluation's longest documents are far shorter.
MAX_UNBOUNDED_CHARS = 1 << 20


async def chat_prompt_ids(engine: AsyncLLMEngine, body: ChatPrompt, add_special_tokens: bool = False,
                          keep_last: int | None = None, check_length: bool = True) -> list[int]:
    """The token ids of a chat prompt as the model's template renders it (off the event loop); the
    template places BOS, so no special tokens are added by default."""
    tokenizer = engine.tokenizer
    check_length = check_length and keep_last is None  # a truncated prompt may be longer than the context
    try:
        knows_developer = "developer" in (tokenizer.chat_template or "")
        messages = [m.as_template_dict(knows_developer) for m in body.messages]
        if check_length:
            check_text_length(engine, sum(len(m["content"]) for m in messages), "messages")
        text = await asyncio.to_thread(tokenizer.apply_chat_template, messages, body.add_generation_prompt,
                                       body.continue_final_message, body.chat_template_kwargs)
    except SourceModelError as e:  # no template, or the template refused these messages
        raise InvalidRequestError(str(e), param="messages") from e
    return await encode_text(engine, text, "messages", add_special_tokens, keep_last, check_length)


def check_token_ids(engine: AsyncLLMEngine, ids: list[int], what: str) -> None:
    """Ids outside the vocabulary are refused here, before anything decodes them (an echo)."""
    check_in_vocabulary(ids, engine.vocab_size, "prompt token id" if what.startswith("prompt") else "token id", what)


def kept_prompt_tokens(engine: AsyncLLMEngine, truncate_prompt_tokens: int | None) -> int | None:
    """How many of its last tokens a prompt keeps (SamplingParams.truncate_prompt_tokens), None: all."""
    return truncation(truncate_prompt_tokens, engine.max_model_len, engine.max_request_len)


async def encode_text(engine: AsyncLLMEngine, text: str, what: str, add_special_tokens: bool = True,
                      keep_last: int | None = None, check_length: bool = True) -> list[int]:
    """Token ids, tokenized off the event loop (a long prompt took seconds there, and every other
    client waited): a text too long for any context is refused before tokenizing, unless it is
    truncated to its last `keep_last` tokens or only counted (check_length False; the body limit
    bounds it)."""
    if check_length and keep_last is None:
        check_text_length(engine, len(text), what)
    elif len(text) > MAX_UNBOUNDED_CHARS:
        raise InvalidRequestError(f"the {what} is {len(text)} characters long; a text that is counted or truncated "
                                  f"rather than run whole may have at most {MAX_UNBOUNDED_CHARS} (split it)",
                                  param=what)
    check_unicode(text, f"the {what}", what)
    return await asyncio.to_thread(engine.tokenizer.encode, text, add_special_tokens, keep_last)


def check_text_length(engine: AsyncLLMEngine, num_chars: int, what: str) -> None:
    """No token of the vocabulary stands for more than max_token_chars characters (x4: normalizers
    may fold several characters into one), so a longer text cannot fit the context: refuse it
    without tokenizing (a 16 MB prompt took 10 s and 2 GB to refuse)."""
    limit = engine.max_request_len * engine.tokenizer.max_token_chars * 4
    if num_chars > limit:
        raise InvalidRequestError(f"the {what} is {num_chars} characters long, more than the {request_limit(engine)} "
                                  "can hold; shorten it, or send truncate_prompt_tokens to keep its last tokens",
                                  param=what)


def request_limit(engine: AsyncLLMEngine) -> str:
    """The tokens a request may reach, and what sets them: the model's context, or the KV cache."""
    limit = engine.max_request_len
    return (f"model's {limit}-token context" if limit == engine.max_model_len
            else f"{limit}-token limit the KV cache sets (serve --kv-cache-mb)")
