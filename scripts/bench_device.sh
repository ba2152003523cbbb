#!/usr/bin/env bash
# The benchmark runs behind BENCHMARKS.md on a CUDA machine, most important first. Rows append
# to $OUT/results.jsonl as each run ends, so a run cut short keeps what it measured.
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/liteinfer-out}"; mkdir -p "$OUT"
bench() { python3 -m liteinfer.cli bench "$@" --out "$OUT/results.jsonl" 2>&1 \
  | grep -v -E "req/s\]|it/s\]" | grep -E "^(overlap|splitk|graphs|paged|sdpa|continuous|packed)" ; }
bench --all --config overlap --width 32
bench throughput --config overlap --isl 128 --osl 256 --width 4
bench throughput --config overlap graphs-b128 --isl 128 --osl 256 --width 128
bench throughput --config continuous sdpa paged-attn graphs splitk --isl 128 --osl 256
bench throughput --config packed graphs-mixed --isl mixed2048 --osl 128
bench latency --config graphs-16k splitk-16k --isl 15360 --osl 128
bench latency --config paged-attn graphs splitk --isl 128 --osl 256 --prompts 10
