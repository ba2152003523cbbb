"""Model loading: Hugging Face safetensors directories, llama.cpp GGUF files, packaged configs."""
from liteinfer.loader.source import (
                                     LOAD_FORMATS,
                                     ModelSource,
                                     known_models,
                                     load_model_source,
                                     smollm2_gguf_path,
)

__all__ = ["LOAD_FORMATS", "ModelSource", "known_models", "load_model_source", "smollm2_gguf_path"]
