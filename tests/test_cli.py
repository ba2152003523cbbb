"""`liteinfer generate`, `chat` and `serve` on the tiny model: model arguments, engine flags,
chat template and generation config overrides."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from fixtures import LISTENING_URL
from liteinfer import SamplingParams
from liteinfer.cli import build_parser, engine_kwargs, main
from liteinfer.config import EngineConfig
from liteinfer.entrypoints.arg_utils import field_help, flag_name
from liteinfer.entrypoints.openai.cli_args import (
    ServerArgs,
    default_api_server_count,
    server_args,
)

# A template unlike the tiny tokenizer's ChatML one.
PLAIN_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant:{% endif %}")


def args(model, *extra: str) -> list[str]:
    return ["--model", str(model), "--device", "cpu", "--max-tokens", "8", *extra]


def greedy(n: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n)


def test_generate_prints_the_chat_reply(tiny_llama_dir, tiny_llm, capsys):
    main(["generate", *args(tiny_llama_dir, "--prompt", "hello there")])
    expected = tiny_llm.chat([{"role": "user", "content": "hello there"}], greedy(),
                             use_tqdm=False)
    out = capsys.readouterr().out
    assert out.startswith("> hello there\n")
    assert expected[0].outputs[0].text.strip() in out


def test_chat_streams_each_reply(tiny_llama_dir, tiny_llm, capsys, monkeypatch):
    answers = iter(["hi", "and again", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(answers))
    main(["chat", *args(tiny_llama_dir)])
    first = tiny_llm.chat([{"role": "user", "content": "hi"}], greedy(), use_tqdm=False)
    out = capsys.readouterr().out
    assert out.count("model> ") == 2
    assert f"model> {first[0].outputs[0].text}\n" in out


def test_bad_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match=r"error: .*no such path, not a Hugging Face model id"):
        main(["generate", "--model", str(tmp_path / "missing")])
    with pytest.raises(SystemExit, match="error: two models given"):
        main(["generate", "a-model", "--model", "another"])


def serve_help(capsys) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_every_engine_field_is_a_flag(capsys):
    parser = build_parser()
    help_text = serve_help(capsys)
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        assert flag in help_text, flag
        if f.type == "bool":
            on = parser.parse_args(["serve", flag])
            off = parser.parse_args(["serve", "--no-" + flag[2:]])
            assert (getattr(on, f.name), getattr(off, f.name)) == (True, False), flag
    assert "--enable-prefix-caching, --no-enable-prefix-caching" in help_text
    # The help of a field is its comment in liteinfer/config.py.
    assert field_help(EngineConfig)["gpu_memory_utilization"] == \
        "fraction of free device memory given to the KV pool"
    assert field_help(EngineConfig)["gpu_memory_utilization"] in help_text
    assert engine_kwargs(parser.parse_args(["serve", "m"])) == {}  # EngineConfig's defaults


def test_engine_flags_and_set_become_engine_config():
    parsed = build_parser().parse_args([
        "serve", "org/model", "--max-num-seqs", "64", "--no-enable-prefix-caching",
        "--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.5",
        "--num-kv-blocks", "none", "--max-model-len", "4096", "--dtype", "float16",
        "--set", "block_size=32", "--set", "max_num_seqs=8"])
    assert parsed.model_tag == "org/model"
    kwargs = engine_kwargs(parsed)
    assert kwargs == {"max_num_seqs": 64, "enable_prefix_caching": False,
                      "tensor_parallel_size": 2, "gpu_memory_utilization": 0.5,
                      "num_kv_blocks": None, "max_model_len": 4096, "dtype": "float16",
                      "block_size": 32}
    EngineConfig(**kwargs).validate()


def test_every_server_field_is_a_flag(capsys, monkeypatch):
    """ServerArgs' flags come from its fields as EngineConfig's do: each has one, its comment
    is the help, and the flags parse into ServerArgs."""
    monkeypatch.delenv("LITEINFER_API_KEY", raising=False)
    help_text = serve_help(capsys)
    for f in dataclasses.fields(ServerArgs):
        assert flag_name(f) in help_text, f.name
    assert "larger request bodies get a 413 (default: 8388608)" in help_text
    parser = build_parser()
    parsed = parser.parse_args(["serve", "--max-body-bytes", "100", "--shutdown-grace", "1.5",
                                "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes",
                                "--metrics-need-key", "--api-server-count", "3"])
    assert server_args(parsed) == ServerArgs(
        max_body_bytes=100, shutdown_grace_s=1.5, reasoning_parser="qwen3",
        tool_call_parser="hermes", metrics_need_key=True, api_server_count=3)
    # Unset, each is the dataclass's default, but for the command line's own API-server count.
    assert server_args(parser.parse_args(["serve"])) == ServerArgs(
        api_server_count=default_api_server_count())
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--tool-call-parser", "nonesuch"])
    assert "invalid choice: 'nonesuch'" in capsys.readouterr().err


def test_serve_passes_model_engine_config_and_overrides(monkeypatch, tmp_path):
    seen: dict[str, Any] = {}
    monkeypatch.setattr("liteinfer.entrypoints.openai.api_server.run_server",
                        lambda *a, **kw: seen.update(args=a, kwargs=kw))
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    main(["serve", "org/model", "--port", "9001", "--max-num-seqs", "4",
          "--chat-template", PLAIN_TEMPLATE, "--generation-config", str(tmp_path)])
    assert seen["args"][:3] == ("org/model", "127.0.0.1", 9001)
    assert seen["kwargs"] == {"max_num_seqs": 4}
    from liteinfer.loader.overrides import ModelOverrides
    assert seen["args"][6] == ModelOverrides(PLAIN_TEMPLATE, {"temperature": 0.3})
    with pytest.raises(SystemExit, match="no such file, and not a Jinja template"):
        main(["serve", "org/model", "--chat-template", str(tmp_path / "absent.jinja")])
    with pytest.raises(SystemExit, match=r"expected auto\|vllm\|DIR"):
        main(["serve", "org/model", "--generation-config", str(tmp_path / "nowhere")])


def test_generate_with_chat_template_file(tiny_llama_dir, tiny_llm, capsys, tmp_path):
    template = tmp_path / "plain.jinja"
    template.write_text(PLAIN_TEMPLATE)
    main(["generate", str(tiny_llama_dir), "--device", "cpu", "--max-tokens", "8",
          "--chat-template", str(template), "--prompt", "hello there"])
    prompt = tiny_llm.tokenizer.encode("user: hello there\nassistant:", add_special_tokens=False)
    expected = tiny_llm.generate([prompt], greedy(), use_tqdm=False)[0].outputs[0].text.strip()
    chatml = tiny_llm.chat([{"role": "user", "content": "hello there"}], greedy(),
                           use_tqdm=False)[0].outputs[0].text.strip()
    assert expected != chatml
    assert capsys.readouterr().out == f"> hello there\n{expected}\n\n"


def test_generation_config_sets_the_offline_defaults(tiny_llama_dir, tiny_llm, capsys,
                                                     tmp_path):
    # A model-stated temperature of 0 with top_k 1 is greedy too; "vllm" drops it, so the
    # command's own default (greedy) applies: both print the greedy reply.
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    reply = tiny_llm.chat([{"role": "user", "content": "hi"}], greedy(),
                          use_tqdm=False)[0].outputs[0].text.strip()
    for choice in (str(tmp_path), "vllm"):
        main(["generate", *args(tiny_llama_dir, "--prompt", "hi", "--generation-config",
                                choice)])
        assert capsys.readouterr().out == f"> hi\n{reply}\n\n"
    # A seeded temperature-1 sampler from the directory's config differs from greedy.
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 1.0}))
    main(["generate", *args(tiny_llama_dir, "--prompt", "hi", "--generation-config",
                            str(tmp_path), "--seed", "3")])
    sampled = tiny_llm.chat([{"role": "user", "content": "hi"}],
                            SamplingParams(temperature=1.0, seed=3, max_tokens=8),
                            use_tqdm=False)[0].outputs[0].text.strip()
    assert capsys.readouterr().out == f"> hi\n{sampled}\n\n"


def test_serve_over_http_uses_the_chat_template(tiny_llama_dir, tiny_llm, tmp_path):
    """A real `liteinfer serve MODEL` process: the chat template given replaces the model's in
    /tokenize and chat completions, and serving never imports the benchmark harness."""
    code = ("import atexit, sys\n"
            "atexit.register(lambda: print('bench modules:', sorted(m for m in sys.modules "
            "if m.startswith('liteinfer.bench')), flush=True))\n"
            "from liteinfer.cli import main\nmain(sys.argv[1:])\n")
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "serve", str(tiny_llama_dir), "--port", "0",
         "--device", "cpu", "--max-model-len", "256", "--chat-template", PLAIN_TEMPLATE],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": str(Path.cwd())})
    try:
        url = None
        while url is None and (line := proc.stdout.readline()):
            url = (found := LISTENING_URL.search(line)) and found[1]
        assert url, "the server exited before listening"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            time.sleep(0.5)
        messages = [{"role": "user", "content": "hello there"}]
        tokens = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()["tokens"]
        assert tiny_llm.tokenizer.decode(tokens) == "user: hello there\nassistant:"
        body = {"messages": messages, "max_tokens": 8, "temperature": 0}
        reply = httpx.post(f"{url}/v1/chat/completions", json=body).json()
        expected = tiny_llm.generate([tokens], greedy(), use_tqdm=False)[0].outputs[0].text
        assert reply["choices"][0]["message"]["content"] == expected
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert "bench modules: []" in out


def test_bench_on_cpu_refuses_triton_and_runs_the_default(tiny_llama_dir, tmp_path, capsys,
                                                          monkeypatch):
    from liteinfer.bench.cli import main as bench_main

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # a CPU without Triton's interpreter
    run = ["run", "latency", "--model", str(tiny_llama_dir), "--prompts", "2", "--isl", "16",
           "--osl", "4", "--out", str(tmp_path / "rows.jsonl")]
    with pytest.raises(SystemExit, match="default with attention_backend=triton runs "
                                         "Triton kernels, which need a CUDA GPU"):
        bench_main([*run, "--set", "attention_backend=triton"])
    bench_main(run)
    out = capsys.readouterr().out
    assert "default: the prefix cache is emptied before each measured run" in out
    assert "1 row(s) appended" in out


def test_liteinfer_bench_is_the_benchmark_harness(capsys):
    from liteinfer.cli import main

    main(["bench", "run", "--dry-run", "--config", "default", "--quick"])
    planned = capsys.readouterr().out
    assert "default" in planned and "128" in planned


def test_log_level_reaches_every_process(monkeypatch):
    """--log-level sets this process's level and the environment that the processes it
    spawns (engine core, API servers, grammar process, workers) configure theirs from."""
    import logging

    from liteinfer.logger import LOGGING_LEVEL_ENV

    monkeypatch.delenv(LOGGING_LEVEL_ENV, raising=False)
    seen = []
    monkeypatch.setattr("liteinfer.entrypoints.openai.api_server.run_server", lambda *a, **kw:
                        seen.append((os.environ[LOGGING_LEVEL_ENV],
                                     logging.getLogger("liteinfer").level,
                                     logging.getLogger("uvicorn").level)))
    before = {name: logging.getLogger(name).level for name in ("liteinfer", "uvicorn")}
    try:
        main(["serve", "--log-level", "warning"])
    finally:
        for name, level in before.items():
            logging.getLogger(name).setLevel(level)
    assert seen == [("warning", logging.WARNING, logging.WARNING)]
