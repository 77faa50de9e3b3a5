"""`Sequence`: the engine's record of one generation in flight (not the user's `Request`).

Owns the token list (prompt then outputs), the count of tokens whose KV is already in the
cache (`num_computed_tokens`), the lifecycle status and the finish reason. Must not know about
blocks or tensors: the KV manager keeps block tables keyed by `seq_id`.

Invariants:
- `token_ids == prompt_token_ids + output_token_ids`; tokens are only appended.
- `0 <= num_computed_tokens <= num_tokens`; between steps a running sequence has at least one
  token not yet computed (the last sampled one, or the rest of its prompt).
- `finish_reason` is set exactly when `status.is_finished`.
"""

import enum
import itertools
from dataclasses import dataclass, field

from qkiln.runtime.sampling_params import SamplingParams

_arrival_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again after its blocks were taken; will recompute
    FINISHED_STOPPED = "stop"  # EOS, a stop token id, or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or the model's context length
    FINISHED_ABORTED = "abort"  # cancelled by the client

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @classmethod
    def from_finish_reason(cls, reason: str) -> "SequenceStatus":
        status = cls(reason)
        assert status.is_finished, f"{reason!r} is not a finish reason"
        return status


_FINISHED = frozenset({SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                       SequenceStatus.FINISHED_ABORTED})


@dataclass(eq=False)
class Sequence:
    """One prompt and its generated continuation, as the scheduler and the KV manager see it."""

    seq_id: int | str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    arrival_order: int = field(default_factory=lambda: next(_arrival_counter))
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # the prompt's prefix-cache hit when first admitted
    num_preemptions: int = 0
    # SamplingParams.bad_words as token ids (bad_words.bad_words_token_ids)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self):
        self.prompt_token_ids = list(self.prompt_token_ids)
        # One growing list so `token_ids` is O(1); outputs are the slice after the prompt.
        self._token_ids = list(self.prompt_token_ids)

    @property
    def token_ids(self) -> list[int]:
        """Prompt then outputs. Read-only by convention: append through `append_token`."""
        return self._token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self._token_ids[len(self.prompt_token_ids):]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for the prompt's logprobs and not yet past the prompt: every prompt position must
        then be computed (no prefix-cache hit), and the rows that score it kept."""
        return self.sampling_params.prompt_logprobs is not None and len(self._token_ids) == len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._token_ids) - len(self.prompt_token_ids)

    @property
    def last_token_id(self) -> int:
        return self._token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_token(self, token_id: int) -> None:
        self._token_ids.append(int(token_id))

    def set_finished(self, reason: str) -> None:
        self.status = SequenceStatus.from_finish_reason(reason)
        self.finish_reason = reason
