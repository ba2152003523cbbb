"""The request path's shortcuts for token-id prompts give what the general checks give: a
completion's prompt validates as its declared union does, and the processor's vocabulary check
refuses exactly the ids it lists."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError, create_model

from liteinfer.engine.processor import InputProcessor
from liteinfer.entrypoints.openai.protocol import COUNT_MAX, CompletionRequest

VOCAB = 1000
# Ids around both ends of the vocabulary and of the 32-bit counts, and things that are not ids.
ITEMS = st.one_of(st.integers(-3, 3), st.integers(VOCAB - 2, VOCAB + 2),
                  st.integers(COUNT_MAX - 1, COUNT_MAX + 1), st.integers(0, VOCAB),
                  st.booleans(), st.floats(allow_nan=False, width=32), st.text(max_size=3),
                  st.lists(st.integers(0, 5), max_size=2))
PROMPTS = st.one_of(st.lists(ITEMS, max_size=6), st.lists(st.integers(0, COUNT_MAX), max_size=6),
                    st.text(max_size=4))
# The prompt field as declared, without the shortcut.
Plain = create_model("Plain", prompt=(CompletionRequest.model_fields["prompt"].annotation, ...))


def outcome(model, body: dict):
    try:
        return "ok", model.model_validate(body).prompt
    except ValidationError as e:
        return "error", [(err["type"], err["loc"]) for err in e.errors()]


@given(PROMPTS)
def test_completion_prompts_validate_as_the_union_does(prompt):
    assert outcome(CompletionRequest, {"model": "m", "prompt": prompt}) == outcome(
        Plain, {"prompt": prompt})


@given(st.lists(st.one_of(st.sampled_from([-1, 0, 1, VOCAB - 1, VOCAB, VOCAB + 1]),
                          st.integers(0, VOCAB - 1), st.booleans(), st.floats(width=32)),
                max_size=6))
def test_vocabulary_check_refuses_exactly_the_bad_ids(ids):
    processor = InputProcessor(SimpleNamespace(vocab_size=VOCAB), None, 64)
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < VOCAB]
    if bad:
        with pytest.raises(ValueError, match=r"outside the vocabulary") as e:
            processor.check_token_ids(ids, "prompt")
        assert str(bad[:5]) in str(e.value)
    else:
        processor.check_token_ids(ids, "prompt")
