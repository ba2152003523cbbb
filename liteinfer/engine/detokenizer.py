"""Incremental detokenization for streaming, with stop strings that may span tokens.

One `IncrementalDetokenizer` per request, in the front end. Per step the driver hands it the
request's new token ids:
    new_text = detok.update(new_ids, finished=..., stopped_on_token=...)
    if detok.stop_string is not None: the request stopped on a stop string (abort it in the
    core); new_text already ends at it.
`update` holds back text that could begin a stop string (and bytes of an unfinished
character); finished=True flushes them, so a request that ends for another reason (EOS, stop
token, length, abort) needs one update(..., finished=True) with its last tokens.
"""
from __future__ import annotations

from typing import Any

from liteinfer.sampling_params import SamplingParams

# Tokens before read_offset decoded along with the new ones, so that merges and leading-space
# rules (e.g. SentencePiece's) give the same text as decoding the whole sequence.
_CONTEXT_TOKENS = 5


def backend_tokenizer(tokenizer: Any) -> Any:
    """A fast HF tokenizer's Rust backend, which decodes without Python overhead and never
    "cleans up" spaces, so pieces concatenate to the full decode; a bare tokenizers.Tokenizer
    is returned as it is."""
    return getattr(tokenizer, "backend_tokenizer", tokenizer)


class IncrementalDetokenizer:
    """A request's text so far.

    output_text    text decoded so far (truncated at a stop string once one is hit)
    read_offset    index in token_ids of the first token not yet in output_text
    stream_offset  chars of output_text already returned by update (never retracted)
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams):
        self._tok = backend_tokenizer(tokenizer)
        self.params = params
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.output_text = ""
        self.read_offset = self.num_prompt_tokens
        self.stream_offset = 0
        self.stop_string: str | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def update(self, new_token_ids: list[int], finished: bool = False,
               stopped_on_token: bool = False) -> str:
        """Decodes the new tokens, matches stop strings, and returns the text that is now final:
        never cut later, never ending in a partial UTF-8 character.

        With finished=True the held-back text and any incomplete bytes are flushed. If the
        request stopped on a token (EOS or a stop token id: stopped_on_token), that token's text
        is left out unless include_stop_str_in_output, as in vLLM.
        """
        if self.stop_string is not None:  # text past a stop string is never decoded
            return ""
        self.token_ids += new_token_ids
        self._decode_tokens(finished, stopped_on_token)
        stopped = self._check_stop_strings()
        end = len(self.output_text)
        if not (finished or stopped):
            end = max(end - self._holdback(), self.stream_offset)
        new = self.output_text[self.stream_offset:end]
        self.stream_offset = end
        return new

    def _decode_tokens(self, finished: bool, stopped_on_token: bool) -> None:
        p = self.params
        end = len(self.token_ids)
        if finished and stopped_on_token and not p.include_stop_str_in_output:
            end -= 1
        if end <= self.read_offset:
            return
        start = max(self.read_offset - _CONTEXT_TOKENS, 0)
        skip = p.skip_special_tokens
        prefix = self._tok.decode(self.token_ids[start:self.read_offset],
                                  skip_special_tokens=skip)
        text = self._tok.decode(self.token_ids[start:end], skip_special_tokens=skip)
        # A trailing U+FFFD is a multi-byte character whose remaining bytes are still to come.
        if text.endswith("\ufffd") and not finished:
            return
        self.output_text += text[len(prefix):]
        self.read_offset = end

    def _holdback(self) -> int:
        """Chars that must stay unstreamed because they may begin a stop string. With
        include_stop_str_in_output the cut comes after the stop string, so nothing is held."""
        p = self.params
        if not p.stop or p.include_stop_str_in_output:
            return 0
        return max(map(len, p.stop)) - 1

    def _check_stop_strings(self) -> bool:
        """Truncates output_text at the earliest stop string in the unchecked text (after it
        with include_stop_str_in_output) and records it. Stop strings count only once more than
        min_tokens outputs exist (vLLM)."""
        p = self.params
        if not p.stop or self.num_output_tokens <= p.min_tokens:
            return False
        best: tuple[int, str] | None = None
        for stop in p.stop:
            # Excluded stops lie wholly in held-back text (the cut must not reach streamed
            # text); included ones only need to end there, so may begin in streamed text.
            back = len(stop) - 1 if p.include_stop_str_in_output else 0
            i = self.output_text.find(stop, max(self.stream_offset - back, 0))
            if i != -1 and (best is None or i < best[0]):
                best = (i, stop)
        if best is None:
            return False
        i, stop = best
        self.output_text = self.output_text[:i + len(stop) if p.include_stop_str_in_output
                                            else i]
        self.stop_string = stop
        return True
