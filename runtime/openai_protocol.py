"""OpenAI-compatible request shapes for server.py: request bodies (pydantic) and the error body.

Owns what `/v1/completions`, `/v1/chat/completions` and the tokenizer endpoints accept and the
translation of a request into `SamplingParams`; responses are built in openai_responses.py. Must
not know about the engine thread or HTTP. Validation is
strict (a string "5" is not an integer, `true` is not a number): a wrong type is the client's
bug and gets a 400 naming the field rather than a silent coercion. A whole number sent as a float
(`"max_tokens": 4.0`, what a client computing it by division sends) counts as that integer, as
OpenAI's and vLLM's servers take it. Unknown fields are ignored,
as OpenAI clients send many optional ones (user, ...); known ones that would change the answer
and are not implemented (best_of, tools, JSON mode, guided decoding) are refused unless at their
no-op values.
"""

import functools
import json
import types
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from qkiln.errors import RequestError

from .sampling_params import MAX_LOGPROBS, MAX_N, SEED_MAX, SEED_MIN, SamplingParams


def _whole_float_as_int(value):
    return int(value) if isinstance(value, float) and value.is_integer() else value


# an integer field (a count, a seed): 4.0 is 4, 4.5 and "4" are refused
Whole = Annotated[int, BeforeValidator(_whole_float_as_int)]

# Every choice of a completion batch (prompts x n) is an engine request: without a bound one HTTP
# request could queue 2048 x 128 of them ahead of every other client's.
MAX_CHOICES_PER_REQUEST = 2048


class InvalidRequestError(RequestError):
    """A request the server refuses (400), naming the offending field as OpenAI's `param`."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False
    continuous_usage_stats: Literal[False] = False  # vLLM's usage in every chunk: not supported


class SamplingFields(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    # the body's top-level keys no field reads (a typo, another server's extension): ignored, as
    # OpenAI and vLLM ignore them, and named in the server's log, as vLLM names them
    _ignored_fields: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _remember_ignored_fields(cls, data, handler):
        request = handler(data)
        if isinstance(data, dict):  # a caller's own strings, bound for a log: escaped and cut short
            names = sorted(set(data) - set(cls.model_fields))
            request._ignored_fields = tuple(json.dumps(n)[1:-1][:64] for n in names[:16]) + \
                ((f"... {len(names) - 16} more",) if len(names) > 16 else ())
        return request

    @property
    def ignored_fields(self) -> tuple[str, ...]:
        return self._ignored_fields

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        """OpenAI's spec makes its optional fields nullable, null meaning the default, and clients
        (OpenAPI-generated ones, gateways forwarding every key) send them so."""
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if v is not None or k not in _non_nullable_fields(cls)}
        return data

    model: str | None = None  # absent: the served model (as vLLM does; OpenAI requires it)
    max_tokens: Whole | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: Whole = Field(default=-1, ge=-1)  # extension (vLLM): -1 or 0 disables it
    seed: Whole | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    n: Whole = Field(default=1, ge=1, le=MAX_N)  # choices per prompt, each its own engine request
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension, for benchmarks
    min_tokens: Whole = Field(default=0, ge=0)  # extension
    stop_token_ids: list[int] | None = None  # extension (vLLM)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None  # {"token id": bias}; SamplingParams checks keys and ranges
    repetition_penalty: float = 1.0  # extension (vLLM)
    min_p: float = 0.0  # extension (vLLM)
    # accepted at their no-op values, which OpenAI clients send by default; anything else would
    # change the answer, and is refused rather than ignored
    tools: list | None = None
    tool_choice: str | dict | None = None
    functions: list | None = None  # legacy function calling, which `tools` replaced
    function_call: str | dict | None = None
    response_format: dict | None = None
    best_of: Whole | None = None
    # vLLM's extensions (SamplingParams documents them)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: Whole | None = None
    # vLLM's: the prompt's tokens scored, each with its top n (non-streamed responses only)
    prompt_logprobs: Whole | None = None
    # vLLM's extensions that change the answer, which lm-evaluation-harness forwards from a task's
    # generation_kwargs: refused unless at their no-op values (ignored, a task scored differently)
    use_beam_search: bool = False
    guided_json: object = None
    guided_regex: str | None = None
    guided_choice: list | None = None
    guided_grammar: str | None = None
    # ... and vLLM's newer ones, which clients of vLLM >= 0.12 send (its structured_outputs replaced
    # guided_*): each changes the answer or what it holds, or isolates the prefix cache (cache_salt)
    structured_outputs: object = None
    structural_tag: object = None
    return_tokens_as_token_ids: object = False
    logits_processors: object = None
    priority: object = 0
    cache_salt: object = None
    modalities: object = None  # OpenAI's; ["text"] is its default

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_supported(self) -> None:
        if self.best_of not in (None, 1):
            raise InvalidRequestError("best_of > 1 is not supported; leave it out (n returns n samples)",
                                      param="best_of")
        for name, no_op in (("use_beam_search", False), ("guided_json", None), ("guided_regex", None),
                            ("guided_choice", None), ("guided_grammar", None), ("structured_outputs", None),
                            ("structural_tag", None), ("return_tokens_as_token_ids", False),
                            ("logits_processors", None), ("priority", 0), ("cache_salt", None), ("modalities", None)):
            value = getattr(self, name)
            if name == "modalities" and value == ["text"]:
                continue
            if value != no_op or type(value) is not type(no_op):  # 0 is not false here
                raise InvalidRequestError(f"{name} is not supported; leave it out (or send {json.dumps(no_op)})",
                                          param=name)
        # checked before the server cuts the prompt with it (SamplingParams names the range)
        SamplingParams(truncate_prompt_tokens=self.truncate_prompt_tokens, prompt_logprobs=self.prompt_logprobs)
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidRequestError("prompt_logprobs are not available with stream true (as in vLLM); send the "
                                      "request without stream", param="prompt_logprobs")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options applies to streamed responses: set stream true or leave "
                                      "stream_options out", param="stream_options")
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise InvalidRequestError(f"{name} (function calling) are not supported; leave them out", param=name)
        for name in ("tool_choice", "function_call"):  # "none" and "auto" without tools: no-ops
            if getattr(self, name) not in (None, "none", "auto"):
                raise InvalidRequestError(f"{name} {json.dumps(getattr(self, name))} needs function calling, which "
                                          "is not supported; leave it out", param=name)
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise InvalidRequestError("only response_format {\"type\": \"text\"} is supported (no JSON mode)",
                                      param="response_format")

    def requested_max_tokens(self, defaults: dict) -> tuple[int | None, str | None]:
        """(max_tokens, the field that set it, or None). Left out, it is the smaller of the API's
        default (16 for completions, none for chat) and the model's recommended one; null, the
        model's or the rest of the context (None), as vLLM reads it. The server cuts such a default
        to the room left, as vLLM does, and refuses one the request set that does not fit."""
        if self.max_tokens is not None and "max_tokens" in self.model_fields_set:
            return self.max_tokens, "max_tokens"
        candidates = [v for v in (self.max_tokens, defaults.get("max_tokens")) if v is not None]
        return (min(candidates) if candidates else None), None

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
                        defaults: dict | None = None) -> list[SamplingParams]:
        """One SamplingParams per choice (SamplingParams.choices: choice j's seed is seed + j; only
        the first scores the prompt, unless the response streams each choice's own).
        defaults: the model's recommended sampling values (LLMEngine.sampling_defaults), which the
        fields this request left out take, as in vLLM."""
        defaults = defaults or {}
        # one scoring of the prompt serves both the echo's logprobs and prompt_logprobs
        prompt_logprobs = max((n for n in (prompt_logprobs, self.prompt_logprobs) if n is not None), default=None)
        given = {name: getattr(self, name) if name in self.model_fields_set
                 else defaults.get(name, getattr(self, name))
                 for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
        # SamplingParams takes a string or a list of stops, and validates itself when made
        made = SamplingParams(max_tokens=max_tokens, seed=self.seed, stop=self.stop, ignore_eos=self.ignore_eos,
                              logprobs=logprobs, min_tokens=self.min_tokens, stop_token_ids=self.stop_token_ids,
                              prompt_logprobs=prompt_logprobs, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty, **given,
                              logit_bias=self.logit_bias, n=self.n,
                              allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
                              skip_special_tokens=self.skip_special_tokens,
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              truncate_prompt_tokens=self.truncate_prompt_tokens)
        # its checked token ids (TokenIds) serve the request's other prompts as they are: a whole
        # vocabulary of allowed ids is gone through once per request, not once per prompt
        self.stop_token_ids, self.allowed_token_ids = made.stop_token_ids, made.allowed_token_ids
        return made.choices(score_prompt_once=not self.stream)


class CompletionRequest(SamplingFields):
    # one prompt (text or token ids) or a batch of them (one choice each, `index` in order)
    prompt: str | list[int] | list[str] | list[list[int]]
    # OpenAI's default for completions; 0 only with echo (score the prompt, generate nothing)
    max_tokens: Whole | None = Field(default=16, ge=0)
    logprobs: Whole | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    # vLLM's: false for a prompt that carries its own BOS (a chat template rendered by the client)
    add_special_tokens: bool = True
    suffix: str | None = None  # insertion (fill in the middle): refused unless empty

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value):
        """One message for every wrong shape, not one per alternative of the union."""
        def is_ids(x):
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if not (isinstance(value, str) or is_ids(value) or
                (isinstance(value, list) and (all(isinstance(p, str) for p in value) or all(map(is_ids, value))))):
            raise ValueError("send a string, a list of token ids, or a list of strings or of token-id lists "
                             "(not mixed)")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The batch: a bare string or id list is a batch of one."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)

    def check_supported(self) -> None:
        super().check_supported()
        if isinstance(self.prompt, list) and not self.prompt:
            raise InvalidRequestError("prompt is an empty list; send a string, token ids, or a list of them",
                                      param="prompt")
        num_prompts = len(self.prompts())
        if num_prompts * self.n > MAX_CHOICES_PER_REQUEST:
            raise InvalidRequestError(f"{num_prompts} prompts x n {self.n} is {num_prompts * self.n} choices; one "
                                      f"request takes at most {MAX_CHOICES_PER_REQUEST}: split the batch",
                                      param="prompt")
        if self.suffix:
            raise InvalidRequestError("suffix (insertion) is not supported; leave it out", param="suffix")
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequestError("max_tokens 0 generates nothing; it needs echo true (to score the prompt)",
                                      param="max_tokens")

    @property
    def generates(self) -> bool:
        return self.max_tokens != 0


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    # OpenAI's roles; "tool" / "function" turns are refused with `tools` (no function calling)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None  # a participant's name: templates that know it print it (vLLM passes it on)
    tool_calls: list | None = None  # an assistant's function calls: refused, not dropped from the prompt

    @field_validator("role", mode="before")
    @classmethod
    def _no_tool_turns(cls, value):
        if value in ("tool", "function"):
            raise ValueError(f"{value} messages answer function calls, which are not supported; send the "
                             "conversation's text turns only")
        return value

    @field_validator("tool_calls")
    @classmethod
    def _no_tool_calls(cls, value):
        if value:
            raise ValueError("tool_calls (function calling) are not supported; send the assistant's text only")
        return value

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value):
        if isinstance(value, list):
            kinds = sorted({str(part.get("type")) for part in value if isinstance(part, dict)} - {"text"})
            if kinds:
                raise ValueError(f"only text content parts are supported, not {', '.join(kinds)}")
        return value

    def as_template_dict(self, template_knows_developer: bool = False) -> dict:
        content = self.content
        if isinstance(content, list):  # OpenAI's content parts: only text; joined as vLLM joins them
            content = "\n".join(part.text for part in content)
        # OpenAI's newer name for the system role; a template that has never heard of it would put
        # the instructions in a turn the model was not trained on, after its default system prompt
        role = "system" if self.role == "developer" and not template_knows_developer else self.role
        return {"role": role, "content": content or ""} | ({"name": self.name} if self.name is not None else {})


# Checked before the messages are validated: a million empty ones held the event loop 6 s.
MAX_MESSAGES = 4096


class ChatPrompt(BaseModel):
    """The fields a chat prompt is rendered from: chat completions' and /tokenize's."""
    model_config = ConfigDict(strict=True, extra="ignore")
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    # vLLM's: open an assistant turn after the messages (default), or continue the last message,
    # an assistant's (prefill: "The answer is") in place
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's: more variables for the chat template (Qwen3's {"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's, refused: a template sent with the request (vLLM too refuses it unless trusted) and
    # documents for RAG templates (each would change the prompt)
    chat_template: str | None = None
    documents: list | None = None

    def check_chat_prompt(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequestError("continue_final_message continues the last message, so it needs "
                                      "add_generation_prompt false", param="continue_final_message")
        for name in ("chat_template", "documents"):
            if getattr(self, name):
                raise InvalidRequestError(f"{name} is not supported; leave it out", param=name)
        if self.chat_template_kwargs and {"messages", "add_generation_prompt"} & set(self.chat_template_kwargs):
            raise InvalidRequestError("chat_template_kwargs may not set messages or add_generation_prompt; send "
                                      "them as the request's own fields", param="chat_template_kwargs")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise InvalidRequestError("continue_final_message needs the last message to be the assistant's",
                                      param="continue_final_message")


class ChatCompletionRequest(SamplingFields, ChatPrompt):
    max_completion_tokens: Whole | None = Field(default=None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: Whole | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # vLLM's, refused: it would change the answer
    add_special_tokens: bool = False  # vLLM's: the template places BOS; true adds the tokenizer's too

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self, defaults: dict) -> tuple[int | None, str | None]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return super().requested_max_tokens(defaults)

    def check_supported(self) -> None:
        super().check_supported()
        self.check_chat_prompt()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs true", param="top_logprobs")
        if self.echo:
            raise InvalidRequestError("echo is not supported on chat completions; leave it out", param="echo")


class TokenizeCompletionRequest(BaseModel):
    """vLLM's POST /tokenize with a prompt."""
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatPrompt):
    """vLLM's POST /tokenize with messages: the prompt chat completions would run."""
    model: str | None = None
    add_special_tokens: bool = False  # the template places BOS
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    tokens: list[int]


@functools.cache
def _non_nullable_fields(model: type[BaseModel]) -> frozenset[str]:
    """The fields whose type has no None (null there means: the default)."""
    def nullable(annotation) -> bool:
        is_union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
        return annotation in (None, type(None)) or (is_union and type(None) in typing.get_args(annotation))
    return frozenset(name for name, f in model.model_fields.items() if not nullable(f.annotation))


def error_body(message: str, param: str | None = None, code: str | None = None,
               type: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
