"""SamplingParams.bad_words: the words as token sequences, and which token each step must ban.

Owns vLLM's rule for both (vllm/sampling_params.py, v1/sample/ops/bad_words.py). Must not know
about tensors: the scheduler puts the bans in a step's plan, the sampler applies them.
"""

from collections.abc import Sequence


def bad_words_token_ids(tokenizer, bad_words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """SamplingParams.bad_words as token sequences, by vLLM's rule: each word (leading spaces
    stripped) as it is, and with one leading space when that spells it with another first token
    and as many tokens (the word in the middle of a text, for tokenizers that mark word starts)."""
    sequences: list[tuple[int, ...]] = []
    for word in bad_words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        sequences.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return tuple(sequences)


def bad_words_banned(bad_words: Sequence[Sequence[int]], output_tail: Sequence[int]) -> tuple[int, ...]:
    """The tokens that would complete a bad word now: each word's last token, where the output
    ends with the word's other tokens (a one-token word is always banned). output_tail: the output's
    last tokens, at least as many as the longest word's minus one (or all of them)."""
    banned = []
    for word in bad_words:
        prefix = len(word) - 1
        if prefix <= len(output_tail) and list(output_tail[len(output_tail) - prefix:]) == list(word[:-1]):
            banned.append(word[-1])
    return tuple(banned)
