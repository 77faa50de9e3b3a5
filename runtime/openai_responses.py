"""OpenAI-compatible response shapes for server.py: full bodies, stream chunks and usage.

Owns how `RequestOutput`s become `/v1/completions` and `/v1/chat/completions` responses (choices,
logprobs in each API's layout, echo with text offsets, usage with cached tokens). Request bodies
live in openai_protocol.py. Must not know about the engine thread or HTTP: it reads
`RequestOutput`s and returns plain dicts.
"""

import codecs
import time
from dataclasses import replace

from .detokenizer import IncrementalDetokenizer
from .engine import RequestOutput
from .logprob_dicts import LogprobConverter, with_top
from .tokenizer import Tokenizer


class ResponseBuilder:
    """One request's response: the full body, or its stream chunks. `tokenizer` names the tokens in
    logprobs (`token_name`, `token_bytes`)."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, request_id: str, model: str, tokenizer: Tokenizer, include_usage: bool = False,
                 index: int = 0, counts_prompt: bool = True, prompt_logprobs: int | None = None):
        """index: the choice this builder writes (prompt i's choice j of n is i * n + j).
        counts_prompt: usage counts the prompt's tokens here (in the first of a prompt's n choices:
        OpenAI bills a prompt once however many choices it has).
        prompt_logprobs: the request's (vLLM's): the response scores the prompt with the top n."""
        self.request_id, self.model, self.tokenizer = request_id, model, tokenizer
        self.include_usage, self.index, self.counts_prompt = include_usage, index, counts_prompt
        self.num_prompt_logprobs = prompt_logprobs
        self.created = int(time.time())

    def _envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {"id": self.request_id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}

    def start_chunks(self) -> list[dict]:
        return []

    def chunk(self, out: RequestOutput) -> dict | None:
        """The stream chunk for one engine output; None when it carries nothing new."""
        if not (out.new_text or out.finished or out.logprobs):
            return None
        body = self._envelope(self.chunk_object_name, [self._chunk_choice(out)])
        if self.include_usage:
            body["usage"] = None  # OpenAI: only the extra last chunk carries usage
        return body

    def usage(self, final: RequestOutput) -> dict:
        return self._usage(final, len(final.token_ids))

    def _usage(self, final: RequestOutput, num_completion: int) -> dict:
        if not self.counts_prompt:
            return usage(0, num_completion)
        return usage(len(final.prompt_token_ids), num_completion, final.num_cached_tokens)

    def response(self, outputs: list[RequestOutput]) -> dict:
        final = outputs[-1]
        entries = [e for out in outputs for e in out.logprobs]
        body = self._envelope(self.object_name, [self._choice(final, entries)]) | {"usage": self.usage(final)}
        if self.num_prompt_logprobs is not None:  # a chat response's, beside its choices (vLLM's place)
            body["prompt_logprobs"] = self._prompt_logprobs_json(outputs[0])
        return body

    def _prompt_logprobs_json(self, first: RequestOutput) -> list[dict | None] | None:
        if first.prompt_logprobs is None:  # aborted (its client left) before its prompt was scored
            return None
        return LogprobConverter(self.tokenizer).as_json(first.prompt_logprobs, self.num_prompt_logprobs)


def batch_response(bodies: list[dict]) -> dict:
    """One body from each prompt's `response`: their choices in order, their usage summed."""
    total = usage(*(sum(values) for values in zip(*(_usage_counts(b["usage"]) for b in bodies))))
    return bodies[0] | {"choices": [c for b in bodies for c in b["choices"]], "usage": total}


def usage_chunk(builders: list[ResponseBuilder], finals: list[RequestOutput]) -> dict:
    """The extra last stream chunk (stream_options.include_usage): the batch's usage, no choices."""
    return batch_response([b._envelope(b.chunk_object_name, []) | {"usage": b.usage(f)}
                           for b, f in zip(builders, finals)])


class CompletionResponse(ResponseBuilder):
    """With `echo` (the prompt's text): the text and logprobs start with the prompt's, the first
    prompt token's logprob and top being null (nothing scores it), as OpenAI's legacy API and
    vLLM write them. Without `generates` (max_tokens 0) only the prompt is returned."""

    object_name = chunk_object_name = "text_completion"

    def __init__(self, *args, echo: tuple[str, list[int]] | None = None, logprobs: int | None = None,
                 generates: bool = True, skip_special_tokens: bool = True, **kw):
        """echo: (the prompt's text, its token ids) to return first, or None. logprobs: the
        request's (the top n per token). skip_special_tokens: the request's (whether the text,
        and so text_offset, leaves special tokens out)."""
        super().__init__(*args, **kw)
        self.skip_special_tokens = skip_special_tokens
        self.echo, self.prompt_ids = echo if echo is not None else (None, None)
        self.num_logprobs, self.generates = logprobs, generates
        self._prompt_logprobs, self._echoed = None, False
        # text_offset counts characters of the text returned: bytes go through one UTF-8 decoder,
        # so a character split over tokens is counted once, at its last byte.
        self._text_offset, self._utf8 = 0, codecs.getincrementaldecoder("utf-8")("replace")
        tok = self.tokenizer
        # A BOS the tokenizer added is not in the prompt's text as sent.
        self._bos_added = (self.echo is not None and tok.add_bos and self.prompt_ids[:1] == [tok.bos_token_id]
                           and not self.echo.startswith(tok.decode([tok.bos_token_id], skip_special_tokens=False)))

    def chunk(self, out: RequestOutput) -> dict | None:
        self._prompt_logprobs = self._prompt_logprobs or out.prompt_logprobs  # the first output's
        return super().chunk(out if self.generates else _nothing_generated(out))

    def _chunk_choice(self, out: RequestOutput) -> dict:
        prefix, entries = "", out.logprobs
        if self.echo is not None and not self._echoed:  # the first chunk sent carries the prompt
            self._echoed = True
            prefix, entries = self.echo, self._prompt_entries(self._prompt_logprobs) + entries
        return {"index": self.index, "text": prefix + out.new_text, "logprobs": self._logprobs(entries),
                "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}

    def response(self, outputs: list[RequestOutput]) -> dict:
        final = outputs[-1] if self.generates else _nothing_generated(outputs[-1])
        entries = self._prompt_entries(outputs[0].prompt_logprobs) + self._generated_entries(outputs)
        text = (self.echo or "") + final.text
        choice = {"index": self.index, "text": text, "logprobs": self._logprobs(entries),
                  "finish_reason": final.finish_reason, "stop_reason": final.stop_reason}
        if self.num_prompt_logprobs is not None:  # in each choice, as vLLM writes a completion's
            choice["prompt_logprobs"] = self._prompt_logprobs_json(outputs[0])
        return self._envelope(self.object_name, [choice]) | {"usage": self.usage(final)}

    def usage(self, final: RequestOutput) -> dict:
        return self._usage(final, len(final.token_ids) if self.generates else 0)

    def _prompt_entries(self, prompt_logprobs: list[dict | None] | None) -> list[dict]:
        """The echoed prompt's logprob entries (the first token's null), with their text offsets."""
        if self.echo is None or self.num_logprobs is None or prompt_logprobs is None:  # None: aborted unscored
            return []
        offsets = self._echo_offsets()
        first = {"token_id": self.prompt_ids[0], "logprob": None, "top": None, "offset": 0}
        return [first] + [with_top(e, self.num_logprobs) | {"offset": offset}
                          for e, offset in zip(prompt_logprobs[1:], offsets[1:])]

    def _echo_offsets(self) -> list[int]:
        """Where each prompt token starts in the echoed text: the length of what the tokens before
        it decode to, through the tokenizer's own decoder, as generated text is streamed. Counting
        each token's bytes put every SentencePiece token one character late: the "▁" the tokenizer
        prepends to the text is not in it. A BOS the tokenizer added is not in the text either."""
        detok = IncrementalDetokenizer(self.tokenizer, [], skip_special_tokens=False)
        offsets = []
        for k, token_id in enumerate(self.prompt_ids):
            offsets.append(len(detok.output_text))
            if k > 0 or not self._bos_added:
                detok.update([token_id])
        return offsets

    def _generated_entries(self, outputs: list[RequestOutput]) -> list[dict]:
        return [e for out in outputs for e in out.logprobs] if self.generates else []

    def _logprobs(self, entries: list[dict]) -> dict | None:
        if not entries:
            return None
        offsets = []
        for e in entries:
            if "offset" in e:  # an echoed prompt token; generated text follows the whole echo
                offsets.append(e["offset"])
                self._text_offset = len(self.echo)
                continue
            offsets.append(self._text_offset)
            if self._in_text(e):
                self._text_offset += len(self._utf8.decode(self.tokenizer.token_bytes(e["token_id"])))
        return {"tokens": [self.tokenizer.token_name(e["token_id"]) for e in entries],
                "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [None if e["top"] is None else self._top(e) for e in entries],
                "text_offset": offsets}

    def _in_text(self, entry: dict) -> bool:
        """Whether a generated token is spelled in the returned text (special tokens are not, unless
        the request keeps them: skip_special_tokens false)."""
        return not self.skip_special_tokens or entry["token_id"] not in self.tokenizer.special_token_ids

    def _top(self, entry: dict) -> dict:
        """The top n and the token itself, as vLLM writes them (logprobs 0: the token alone), so a
        client can always compare the token with the best (lm-eval's is_greedy)."""
        top = {self.tokenizer.token_name(t): lp for t, lp in entry["top"].items()}
        top.setdefault(self.tokenizer.token_name(entry["token_id"]), entry["logprob"])
        return top


def _nothing_generated(out: RequestOutput) -> RequestOutput:
    """max_tokens 0: the engine made one token (it always samples), which is not returned."""
    return replace(out, new_token_ids=[], new_text="", token_ids=[], text="", logprobs=[],
                   finish_reason="length" if out.finished else None, stop_reason=None)


class ChatResponse(ResponseBuilder):
    object_name, chunk_object_name = "chat.completion", "chat.completion.chunk"

    def start_chunks(self) -> list[dict]:
        choice = {"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        body = self._envelope(self.chunk_object_name, [choice])
        return [body | {"usage": None}] if self.include_usage else [body]

    def _chunk_choice(self, out: RequestOutput) -> dict:
        return {"index": self.index, "delta": {"content": out.new_text} if out.new_text else {},
                "logprobs": self._logprobs(out.logprobs), "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason}

    def _choice(self, final: RequestOutput, entries: list[dict]) -> dict:
        return {"index": self.index, "message": {"role": "assistant", "content": final.text},
                "logprobs": self._logprobs(entries), "finish_reason": final.finish_reason,
                "stop_reason": final.stop_reason}

    def _logprobs(self, entries: list[dict]) -> dict | None:
        if not entries:
            return None
        return {"content": [self._token_logprob(e["token_id"], e["logprob"])
                            | {"top_logprobs": [self._token_logprob(t, lp) for t, lp in e["top"].items()]}
                            for e in entries]}

    def _token_logprob(self, token_id: int, logprob: float) -> dict:
        return {"token": self.tokenizer.token_name(token_id), "logprob": logprob,
                "bytes": list(self.tokenizer.token_bytes(token_id))}


def usage(num_prompt: int, num_completion: int, num_cached: int = 0) -> dict:
    """OpenAI's usage; prompt_tokens_details.cached_tokens counts the prompt tokens the prefix cache
    held (as OpenAI's prompt caching reports them)."""
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion, "prompt_tokens_details": {"cached_tokens": num_cached}}


def _usage_counts(body: dict) -> tuple[int, int, int]:
    return body["prompt_tokens"], body["completion_tokens"], body["prompt_tokens_details"]["cached_tokens"]
