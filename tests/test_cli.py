"""`liteinfer generate` and `liteinfer chat` on the tiny model."""
from __future__ import annotations

import pytest

from liteinfer import SamplingParams
from liteinfer.cli import main


def args(model, *extra: str) -> list[str]:
    return ["--model", str(model), "--device", "cpu", "--max-tokens", "8", *extra]


def test_generate_prints_the_chat_reply(tiny_llama_dir, tiny_llm, capsys):
    main(["generate", *args(tiny_llama_dir, "--prompt", "hello there")])
    expected = tiny_llm.chat([{"role": "user", "content": "hello there"}],
                             SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    out = capsys.readouterr().out
    assert out.startswith("> hello there\n")
    assert expected[0].outputs[0].text.strip() in out


def test_chat_streams_each_reply(tiny_llama_dir, tiny_llm, capsys, monkeypatch):
    answers = iter(["hi", "and again", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(answers))
    main(["chat", *args(tiny_llama_dir)])
    first = tiny_llm.chat([{"role": "user", "content": "hi"}],
                          SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    out = capsys.readouterr().out
    assert out.count("model> ") == 2
    assert f"model> {first[0].outputs[0].text}\n" in out


def test_bad_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="error: .*no such path, and not a known model name"):
        main(["generate", "--model", str(tmp_path / "missing")])
