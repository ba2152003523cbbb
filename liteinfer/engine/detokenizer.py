"""Incremental detokenization for streaming, with stop strings that may span tokens.

Per-sequence state lives on the Sequence:
  output_text    text decoded so far (truncated at a stop string once one is hit)
  read_offset    index in token_ids of the first token not yet in output_text
  stream_offset  chars of output_text already returned by decode_new (never retracted)

Engine contract, per sampled token:
    seq.append_token(tok)
    <token stops: EOS unless ignore_eos, stop_token_ids, max_tokens → seq.finish_reason/stop_reason>
    new_text = detok.decode_new(seq, finished=seq.finish_reason is not None)
    if seq.finish_reason is None and (stop := detok.check_stop_strings(seq)) is not None:
        seq.finish_reason = "stop"       # stop_reason is already `stop`; new_text already ends at it
decode_new holds back text that could begin a stop string (and bytes of an unfinished
character); finished=True flushes them, so every sequence that ends for another reason (EOS,
stop token, length, abort) needs one decode_new(seq, finished=True) in its final step.
"""
from __future__ import annotations

from typing import Any

from liteinfer.engine.sequence import Sequence

# Tokens before read_offset decoded along with the new ones, so that merges and leading-space
# rules (e.g. SentencePiece's) give the same text as decoding the whole sequence.
_CONTEXT_TOKENS = 5


class Detokenizer:
    def __init__(self, tokenizer: Any):
        # A fast HF tokenizer's Rust backend decodes without Python overhead and never "cleans
        # up" spaces, so pieces concatenate to the full decode; a bare tokenizers.Tokenizer works.
        self._tok = getattr(tokenizer, "backend_tokenizer", tokenizer)

    def decode_new(self, seq: Sequence, finished: bool = False) -> str:
        """Decodes the tokens appended since the last call, matches stop strings, and returns
        the text that is now final: never cut later, never ending in a partial UTF-8 character.

        With finished=True the held-back text and any incomplete bytes are flushed. If the
        sequence stopped on a token (finish_reason "stop", stop_reason an id or None for EOS),
        that token's text is left out unless include_stop_str_in_output, as in vLLM.
        """
        if not isinstance(seq.stop_reason, str):  # text past a stop string is never decoded
            self._decode_tokens(seq, finished)
        stopped = self.check_stop_strings(seq) is not None
        end = len(seq.output_text)
        if not (finished or stopped):
            end = max(end - _holdback(seq), seq.stream_offset)
        new = seq.output_text[seq.stream_offset:end]
        seq.stream_offset = end
        return new

    def check_stop_strings(self, seq: Sequence) -> str | None:
        """Returns the stop string output_text reached (or None), truncating output_text before
        it (after it with include_stop_str_in_output). Idempotent: a hit is recorded in
        seq.stop_reason. Stop strings count only once more than min_tokens outputs exist (vLLM)."""
        if isinstance(seq.stop_reason, str):
            return seq.stop_reason
        hit = _find_stop(seq)
        if hit is None:
            return None
        cut, stop = hit
        seq.output_text = seq.output_text[:cut]
        seq.stop_reason = stop
        return stop

    def _decode_tokens(self, seq: Sequence, finished: bool) -> None:
        p = seq.sampling_params
        seq.read_offset = max(seq.read_offset, seq.num_prompt_tokens)
        end = len(seq.token_ids)
        stop_token = (finished and seq.finish_reason == "stop"
                      and not isinstance(seq.stop_reason, str))
        if stop_token and not p.include_stop_str_in_output:
            end -= 1
        if end <= seq.read_offset:
            return
        start = max(seq.read_offset - _CONTEXT_TOKENS, 0)
        skip = p.skip_special_tokens
        prefix = self._tok.decode(seq.token_ids[start:seq.read_offset], skip_special_tokens=skip)
        text = self._tok.decode(seq.token_ids[start:end], skip_special_tokens=skip)
        # A trailing U+FFFD is a multi-byte character whose remaining bytes are still to come.
        if text.endswith("\ufffd") and not finished:
            return
        seq.output_text += text[len(prefix):]
        seq.read_offset = end


def _holdback(seq: Sequence) -> int:
    """Chars that must stay unstreamed because they may begin a stop string. With
    include_stop_str_in_output the cut comes after the stop string, so nothing is held."""
    p = seq.sampling_params
    if not p.stop or p.include_stop_str_in_output:
        return 0
    return max(map(len, p.stop)) - 1


def _find_stop(seq: Sequence) -> tuple[int, str] | None:
    """(cut position, stop string) of the earliest stop string in the unchecked text."""
    p = seq.sampling_params
    if not p.stop or seq.num_output_tokens <= p.min_tokens:
        return None
    best: tuple[int, str] | None = None
    for stop in p.stop:
        # Excluded stops lie wholly in held-back text (the cut must not reach streamed text);
        # included ones only need to end there, so may begin in streamed text.
        back = len(stop) - 1 if p.include_stop_str_in_output else 0
        i = seq.output_text.find(stop, max(seq.stream_offset - back, 0))
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    if best is None:
        return None
    i, stop = best
    return (i + len(stop) if p.include_stop_str_in_output else i), stop
