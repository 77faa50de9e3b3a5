"""vLLM's per-token logprob dicts: token id -> Logprob(logprob, rank, decoded_token), the scored
token first, then the top n. The offline API returns them (`PromptOutput.prompt_logprobs`,
`CompletionOutput.logprobs`); the server writes them as JSON for `prompt_logprobs`."""

import itertools
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Logprob:
    """One token's entry in a logprobs dict (vLLM's Logprob)."""
    logprob: float
    rank: int | None = None  # among the whole vocabulary, 1 the most likely
    decoded_token: str | None = None  # the text the token adds (U+FFFD for part of a character)


# vLLM's SampleLogprobs / PromptLogprobs element: token id -> Logprob, the scored token first, then
# the top `logprobs` (`prompt_logprobs`) tokens, most likely first
TokenLogprobs = dict[int, Logprob]


class LogprobConverter:
    """The engine's logprob entries ({"token_id", "logprob", "rank", "top"}) as vLLM's dicts."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def all(self, entries: list[dict | None] | None, detokenize: bool = True) -> list[TokenLogprobs | None] | None:
        return None if entries is None else [None if e is None else self.one(e, detokenize) for e in entries]

    def one(self, entry: dict, detokenize: bool = True) -> TokenLogprobs:
        """As vLLM builds it: the scored token first; a top token's rank is its place in the top,
        also when it is the scored token (whose own rank counts ties against it). Without
        detokenize, no decoded_token (as vLLM)."""
        token = entry["token_id"]
        out = {token: Logprob(entry["logprob"], entry["rank"], self.text(token, detokenize))}
        for rank, (top_id, logprob) in enumerate(entry["top"].items(), 1):
            out[top_id] = Logprob(logprob, rank, self.text(top_id, detokenize))
        return out

    def text(self, token_id: int, detokenize: bool = True) -> str | None:
        if not detokenize:
            return None
        if token_id not in self._text:
            self._text[token_id] = self.tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")
        return self._text[token_id]

    def as_json(self, entries: list[dict | None], num_top: int) -> list[dict | None]:
        """`prompt_logprobs` as vLLM's server writes it: per token {"<id>": {"logprob", "rank",
        "decoded_token"}}, the top `num_top` of the engine's (which may hold more)."""
        return [None if e is None else {str(t): asdict(lp) for t, lp in self.one(with_top(e, num_top)).items()}
                for e in entries]


def with_top(entry: dict, n: int) -> dict:
    """An engine entry with its top cut to the n most likely: a prompt is scored once with the
    largest top any of its uses asks for (an echo's logprobs, prompt_logprobs)."""
    return entry | {"top": dict(itertools.islice(entry["top"].items(), n))}
