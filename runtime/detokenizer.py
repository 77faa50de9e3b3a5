"""Incremental detokenization for streaming, and stop-string matching on the decoded text.

Owns turning one sequence's new token ids into new text, and finding stop strings in it.
Must not decide that a sequence finishes: it reports a matched stop string and the engine
calls `Scheduler.finish(seq_id, "stop")`.

Decoding token by token is wrong for byte-level BPE and byte-fallback vocabularies: one
character can span tokens, and a lone piece decodes to U+FFFD. So (as vLLM and TGI do) each
step decodes a short window twice and emits only the difference, once it is clean:

    ids:   ... [prefix_offset ....... read_offset ....... len(ids)]
                `-- prefix_text --'
                `-------------- new_text -------------------'
    emit new_text[len(prefix_text):] unless it ends in U+FFFD (an unfinished character);
    then prefix_offset, read_offset = read_offset, len(ids).

Decoding the prefix again supplies the context that decoders need at token boundaries (e.g. the
leading-space rule of SentencePiece's metaspace). Stop strings are matched on the accumulated
output text; while streaming, the last `max(len(stop)) - 1` characters are held back so a
client never sees the start of a stop string that is then cut off.
"""

from collections.abc import Sequence

# How many prompt tokens to decode as context for the first output token (vLLM uses 5).
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5
_REPLACEMENT_CHAR = "\ufffd"


def find_stop_string(text: str, num_new_chars: int, stop: Sequence[str],
                     include_stop_str: bool = False) -> tuple[str, int] | None:
    """Earliest stop string that ends within the last `num_new_chars` of `text`.

    Returns `(stop_string, truncate_to)`: keep `text[:truncate_to]`, which excludes the stop
    string unless `include_stop_str`. None when no stop string completed in the new text.
    """
    best: tuple[str, int] | None = None
    for stop_str in stop:
        # A match must end in the new text, so it starts at most len(stop_str) - 1 chars earlier.
        start = max(0, len(text) - num_new_chars - len(stop_str) + 1)
        index = text.find(stop_str, start)
        if index != -1 and (best is None or index < best[1]):
            best = (stop_str, index)
    if best is None:
        return None
    stop_str, index = best
    return stop_str, index + len(stop_str) if include_stop_str else index


class IncrementalDetokenizer:
    """One sequence's streaming text. `tokenizer` needs `decode(ids, skip_special_tokens=...)`,
    as `tokenizers.Tokenizer` has."""

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True,
                 stop: Sequence[str] = (), include_stop_str: bool = False, min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop)
        self.include_stop_str = include_stop_str
        self.min_tokens = min_tokens
        self._token_ids = list(prompt_token_ids)
        self.read_offset = len(self._token_ids)
        self.prefix_offset = self._initial_prefix_offset()
        self.output_text = ""
        self.num_output_tokens = 0
        self._num_chars_sent = 0
        self.stop_buffer_length = max(map(len, self.stop)) - 1 if self.stop and not include_stop_str else 0

    def update(self, new_token_ids: Sequence[int], is_final: bool = False) -> str | None:
        """Decode new tokens into `output_text`; return the stop string that ended it, if one did.

        `is_final`: the sequence ended for another reason, so flush an unfinished character
        (as U+FFFD) instead of waiting for tokens that will not come.
        """
        num_chars_before = len(self.output_text)
        for i, token_id in enumerate(new_token_ids):
            self._token_ids.append(int(token_id))
            self.num_output_tokens += 1
            self.output_text += self._decode_next(flush=is_final and i == len(new_token_ids) - 1)
        if not self.stop or self.num_output_tokens <= self.min_tokens:
            return None
        match = find_stop_string(self.output_text, len(self.output_text) - num_chars_before,
                                 self.stop, self.include_stop_str)
        if match is None:
            return None
        stop_str, truncate_to = match
        self.output_text = self.output_text[:truncate_to]
        return stop_str

    def finish_on_stop_token(self, token_id: int) -> None:
        """The sequence ended on EOS or one of its stop_token_ids, whose text is not output unless
        include_stop_str (vLLM's semantics, as for stop strings; a special token's text is then still
        skipped with skip_special_tokens): flush a character left unfinished before it."""
        if self.include_stop_str:
            self._token_ids.append(int(token_id))
            self.num_output_tokens += 1
        if self.read_offset < len(self._token_ids):
            self.output_text += self._decode_next(flush=True)

    def get_next_output_text(self, finished: bool) -> str:
        """Text not returned before; while not finished, hold back a possible stop-string prefix."""
        end = len(self.output_text) if finished else len(self.output_text) - self.stop_buffer_length
        if end <= self._num_chars_sent:
            return ""
        text = self.output_text[self._num_chars_sent:end]
        self._num_chars_sent = end
        return text

    def _initial_prefix_offset(self) -> int:
        """INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET prompt tokens back, moved further back while the
        window starts inside a character (at most the 3 continuation bytes of one UTF-8 character).
        A byte-fallback decoder (Llama-2, Mistral) renders a run of byte tokens that starts
        mid-character as one U+FFFD per byte, and output bytes that joined that run came out as
        U+FFFD too: prompt "中文" then output "字 hello" read "\ufffd\ufffd\ufffd hello".
        A prompt that ends inside a character starts the window on that character's lead byte."""
        unfinished = self._unfinished_character_start()
        if unfinished is not None:
            return unfinished
        start = max(self.read_offset - INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET, 0)
        for _ in range(3):
            if start == 0 or not self._decode(self._token_ids[start:self.read_offset]).startswith(_REPLACEMENT_CHAR):
                break
            start -= 1
        return start

    def _unfinished_character_start(self) -> int | None:
        """The prompt token holding the lead byte of a character the prompt leaves unfinished; None
        when it ends on a character boundary (or the tokenizer cannot spell its tokens' bytes).
        From there the window decodes that character's bytes alone: a byte-fallback decoder spells
        a whole run of byte tokens U+FFFD while any of it is unfinished, so a window reaching back
        into the prompt's complete characters turned them all into U+FFFD, and the output that
        finished the character then began with them."""
        token_bytes = getattr(self.tokenizer, "token_bytes", None)
        if token_bytes is None:
            return None
        needed = 0  # continuation bytes seen, walking back from the prompt's end
        for index in range(self.read_offset - 1, max(self.read_offset - 4, 0) - 1, -1):
            for byte in reversed(token_bytes(self._token_ids[index])):
                if 0x80 <= byte < 0xC0:  # a continuation byte: keep looking for its lead
                    needed += 1
                    continue
                length = 2 if 0xC0 <= byte < 0xE0 else 3 if 0xE0 <= byte < 0xF0 else 4 if byte >= 0xF0 else 1
                return index if needed + 1 < length else None
            if needed > 3:
                return None
        return None

    def _decode_next(self, flush: bool) -> str:
        ids = self._token_ids
        prefix_text = self._decode(ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(ids[self.prefix_offset:])
        start, stem = len(prefix_text), prefix_text.rstrip(_REPLACEMENT_CHAR)
        # A prompt that ends inside a character, which the output finishes: its U+FFFD becomes the
        # character, output text (it was dropped: as long as the U+FFFD, "nothing new").
        finishes_prompt_char = len(stem) < start and not new_text.startswith(prefix_text) and new_text.startswith(stem)
        if finishes_prompt_char:
            start = len(stem)
        if len(new_text) <= start:
            return ""  # e.g. a skipped special token: keep the window, decode it with the next one
        if new_text.endswith(_REPLACEMENT_CHAR) and not flush:
            return ""  # an unfinished multi-byte character: wait for its remaining bytes
        # The next window starts on a character: read_offset was inside the one just finished.
        self.prefix_offset = self.prefix_offset if finishes_prompt_char else self.read_offset
        self.read_offset = len(ids)
        return new_text[start:]

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)


class NoText:
    """A sequence's text with SamplingParams.detokenize off: none (token ids only, no stop strings,
    which detokenize=False refuses)."""
    output_text = ""

    def update(self, new_token_ids: Sequence[int], is_final: bool = False) -> None:
        return None

    def finish_on_stop_token(self, token_id: int) -> None:
        pass

    def get_next_output_text(self, finished: bool) -> str:
        return ""
