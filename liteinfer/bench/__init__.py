"""Benchmark harness (`liteinfer-bench run`) and the report generator (`liteinfer-bench report`).
It sits on top of the engine: it drives `LLM`, and nothing in the engine imports it."""
