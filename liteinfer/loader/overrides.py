"""What a user may put in place of a model's own files: its chat template (`--chat-template`) and
its generation_config.json (`--generation-config`), with vLLM's meanings."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from liteinfer.loader import hf

GENERATION_CONFIG_CHOICES = "auto|vllm|DIR"


def load_chat_template(value: str) -> str:
    """A Jinja chat template: the contents of the file `value` names, or `value` itself when it
    is a template (vLLM's load_chat_template)."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"chat template {value!r}: no such file, and not a Jinja template")


def load_generation_config(value: str) -> dict[str, Any] | None:
    """The generation config that sets requests' default sampling (vLLM's --generation-config):
    "auto" the model's own generation_config.json (None), "vllm" none ({}: SamplingParams'
    defaults), else the generation_config.json of the directory `value`."""
    if value == "auto":
        return None
    if value == "vllm":
        return {}
    path = Path(value).expanduser() / "generation_config.json"
    if not path.is_file():
        raise ValueError(f"generation config {value!r}: expected {GENERATION_CONFIG_CHOICES}, "
                         f"and {path} does not exist")
    return hf.read_json(path)


@dataclass(frozen=True)
class ModelOverrides:
    """A chat template (load_chat_template's) and a generation config
    (load_generation_config's) to put in place of the model's; None keeps the model's."""

    chat_template: str | None = None
    generation_config: dict[str, Any] | None = None

    def apply(self, engine: Any) -> None:
        """On an engine (offline or served) with `tokenizer` and `generation_config`."""
        if self.chat_template is not None:
            if engine.tokenizer is None:
                raise ValueError("a chat template was given, but this model has no tokenizer")
            engine.tokenizer.chat_template = self.chat_template
        if self.generation_config is not None:
            engine.generation_config = self.generation_config
