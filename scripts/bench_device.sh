#!/usr/bin/env bash
# The benchmark runs behind BENCHMARKS.md on a CUDA machine, most important first: every run of
# the default configuration, then the transformers baselines. Rows append to
# $OUT/results.jsonl as each run ends, so a run cut short keeps what it measured.
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/liteinfer-out}"; mkdir -p "$OUT"
bench() { python3 -m liteinfer.bench run "$@" --out "$OUT/results.jsonl" 2>&1 \
  | grep -v -E "req/s\]|it/s\]" ; }
bench --all --config default
bench --all --config nocache eager eager-b4
