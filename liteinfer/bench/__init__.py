"""Benchmark harness (`liteinfer bench`) and the report generator (`liteinfer report`)."""
