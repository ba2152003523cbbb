#!/usr/bin/env bash
# On one CUDA machine, in one command of under 10 minutes: liteinfer offline, `liteinfer serve`
# and `vllm serve` on the Llama-3.2-1B config (dummy bf16 weights), 128/256, greedy, forced
# length, at 1, 32 and 128 streams, measured by the same load generator (liteinfer-bench serve).
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PYTHONPATH; OUT=... bash scripts/bench_serving.sh
#
# .whl/ comes from scripts/fetch_wheels.sh and the model's tokenizer.json (which vllm serve needs;
# it is ignored by git, so carry it) from scripts/fetch_llama3_tokenizer.sh; vLLM from
# ../shared/vllm/README.md, in $VLLM_SITE (default /tmp/vsite; the vLLM phase is skipped
# without it). Every phase has a timeout and a log, and a failing phase does not stop the
# others. Under $OUT: rows.jsonl (every row), bench.log (offline and load-generator output),
# liteinfer-serve.log, vllm-serve.log, env.txt, summary.txt (printed last).
#
# Prompt counts: WORKLOADS.md's 50 at 1 stream (its TTFT p50 is held to within 1.5 ms of the
# offline one), and fewer than its 200 at 32 and 128 streams so that all fits: 128 and 512 (4 per
# stream); the same counts offline. Each run warms up first on other prompts (WORKLOADS.md).
#
# PHASES (default "offline liteinfer vllm") picks phases, so that one run may span several
# commands of under 10 minutes each; give them one RUN_ID (the report compares rows of a run).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT="${OUT:-/tmp/liteinfer-out}"; mkdir -p "$OUT"
export LITEINFER_COMMIT="${LITEINFER_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
MODEL_DIR="$PWD/benchmarks/models/llama-3.2-1b-instruct"
NAME=llama-3.2-1b-instruct
VLLM_SITE="${VLLM_SITE:-/tmp/vsite}"
BUDGET_S="${BUDGET_S:-570}"  # the whole script; each phase gets what is left, at most its own
STREAMS=(1 32 128); PROMPTS=(50 128 512)
ROWS="$OUT/rows.jsonl"; LOG="$OUT/bench.log"
RUN_ID="${RUN_ID:-serving-$(date -u +%Y-%m-%dT%H:%M:%S)}"
PHASES="${PHASES:-offline liteinfer vllm}"
want() { [[ " $PHASES " == *" $1 "* ]]; }
PORT_LITEINFER=8011; PORT_VLLM=8012

left() { echo $(( BUDGET_S - SECONDS )); }
# cap SECONDS: the smaller of a phase's own limit and the time left (at least 1)
cap() { local l; l=$(left); (( l < $1 )) && echo $(( l > 1 ? l : 1 )) || echo "$1"; }
say() { echo "[$(date -u +%H:%M:%S) +${SECONDS}s] $*" | tee -a "$LOG"; }

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton, transformers as t; print(torch.__version__, triton.__version__,
    t.__version__)"
  nproc; echo "commit $LITEINFER_COMMIT run $RUN_ID"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
[ -f "$MODEL_DIR/tokenizer.json" ] \
  || say "warning: no tokenizer.json in $MODEL_DIR (scripts/fetch_llama3_tokenizer.sh)"

# (a) offline: one engine for the three widths, rows like `liteinfer-bench run`'s with the
# run's id (the report's offline tables leave a serving run's baseline out)
offline() {
  say "offline liteinfer"
  timeout "$(cap 170)" python3 - "$MODEL_DIR" "$ROWS" "$RUN_ID" >> "$LOG" 2>&1 <<'EOF' \
    || say "offline failed ($?)"
import sys
from pathlib import Path

from liteinfer.bench import cli, registry
from liteinfer.bench.workloads import HEADLINE

config = registry.get(registry.DEFAULT)
runs = [config.run("latency", HEADLINE, 1, 50), config.run("throughput", HEADLINE, 32, 128),
        config.run("throughput", HEADLINE, 128, 512)]
cli._measure_group(config, runs, sys.argv[1], {}, Path(sys.argv[2]), run_id=sys.argv[3])
EOF
}
want offline && offline

# wait_health URL PID SECONDS: 0 once /health answers 200; 1 if the server exits or time runs out
wait_health() {
  local deadline=$(( SECONDS + $3 ))
  while (( SECONDS < deadline )); do
    kill -0 "$2" 2>/dev/null || return 1
    python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" \
      "$1/health" 2>/dev/null && return 0
    sleep 1
  done
  return 1
}

# stop PID: SIGTERM to the server, then its whole process group once the grace has passed
stop() {
  kill -TERM "$1" 2>/dev/null
  for _ in $(seq 30); do kill -0 "$1" 2>/dev/null || break; sleep 0.5; done
  kill -KILL -- "-$1" 2>/dev/null
  wait "$1" 2>/dev/null
}

# serve_phase ENGINE PORT START_LIMIT_S SERVER_LOG COMMAND...: start, wait, measure, stop
serve_phase() {
  local engine=$1 port=$2 start_s=$3 log=$4; shift 4
  say "$engine serve: starting"
  setsid "$@" > "$log" 2>&1 &
  local pid=$!
  if wait_health "http://127.0.0.1:$port" "$pid" "$(cap "$start_s")"; then
    say "$engine serve: up"
    for i in "${!STREAMS[@]}"; do
      timeout "$(cap 90)" python3 -m liteinfer.bench serve --base-url "http://127.0.0.1:$port" \
        --model "$NAME" --engine "$engine" --shape 128/256 --concurrency "${STREAMS[$i]}" \
        --prompts "${PROMPTS[$i]}" --processes 4 --run-id "$RUN_ID" --out "$ROWS" \
        >> "$LOG" 2>&1 || say "$engine serve: ${STREAMS[$i]} streams failed ($?)"
      tail -n 2 "$LOG" | head -n 1
      # The server's own TTFT (arrival to first token in its front end) after the 1-stream
      # run, beside the load generator's: what HTTP and the client add.
      (( i == 0 )) && python3 -c "import sys, urllib.request
text = urllib.request.urlopen(sys.argv[1], timeout=5).read().decode()
v = {l.split('{')[0].split(' ')[0]: float(l.rsplit(' ', 1)[1]) for l in text.splitlines()
     if l.startswith(('vllm:time_to_first_token_seconds_', 'liteinfer:time_to_first_token_seconds_'))
     and ('_sum' in l or '_count' in l) and 'le=' not in l}
s = [k for k in v if k.endswith('_sum')]
print('server-side TTFT mean over', int(v[s[0][:-4] + '_count']), 'requests:',
      round(1e3 * v[s[0]] / v[s[0][:-4] + '_count'], 3), 'ms')" "http://127.0.0.1:$port/metrics" \
        2>&1 | tee -a "$LOG"
    done
  else
    say "$engine serve: not up (see $(basename "$log"))"
  fi
  stop "$pid"
  say "$engine serve: stopped"
}

# (b) liteinfer serve: four API-server processes (its default on 16 cores) on one engine core;
# vLLM's and the offline rows' context (16,384)
want liteinfer && serve_phase liteinfer "$PORT_LITEINFER" 150 "$OUT/liteinfer-serve.log" \
  python3 -m liteinfer.cli serve --model "$MODEL_DIR" --load-format dummy --dtype bfloat16 \
  --port "$PORT_LITEINFER" --served-model-name "$NAME" --api-server-count "${API_SERVERS:-4}" \
  --max-model-len 16384

# (c) vllm serve: its defaults (prefix caching on; dev mode lets the load generator empty the
# cache before each measured run, as bench_vllm.py does offline), 128 sequences as liteinfer's
if ! want vllm; then
  :
elif [ -d "$VLLM_SITE" ]; then
  serve_phase vllm "$PORT_VLLM" 300 "$OUT/vllm-serve.log" \
    env PYTHONPATH="$VLLM_SITE:$VLLM_SITE/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH" \
    VLLM_SERVER_DEV_MODE=1 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
    python3 -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" --load-format dummy \
    --dtype bfloat16 --port "$PORT_VLLM" --served-model-name "$NAME" --max-num-seqs 128 \
    --max-model-len 16384 --seed 0
else
  say "vllm serve: skipped, no $VLLM_SITE"
fi

# (d) the rows side by side
python3 -m liteinfer.bench serve --summary "$ROWS" > "$OUT/summary.txt" 2>&1
say "done"
cat "$OUT/summary.txt"
