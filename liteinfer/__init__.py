"""liteinfer: a small, fast LLM inference engine for Llama-family models."""
from liteinfer.llm import LLM
from liteinfer.outputs import CompletionOutput, RequestOutput
from liteinfer.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
