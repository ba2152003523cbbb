"""Structured outputs: the request's constraint (params), its grammar compiled with xgrammar
(backend), and the per-request matchers and token bitmasks the engine core uses (manager)."""
from liteinfer.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
