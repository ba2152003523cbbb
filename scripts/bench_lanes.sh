#!/usr/bin/env bash
# The benchmark matrix side by side on a machine with several GPUs: one lane per GPU, each
# running `liteinfer-bench run --all` for its group of configs (one GPU per process, so lanes do
# not share a device and their timings stay independent). The word `gputests` in a group runs
# the GPU tests ($GPU_TESTS, default all) on that lane's GPU first. Rows append to
# $OUT/results-<gpu>.jsonl as each run ends; logs go to $OUT/lane-<gpu>.log. LANE_SECONDS
# bounds every lane (default 560).
# Usage: scripts/bench_lanes.sh "default" "gputests nocache eager eager-b4" ...
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TQDM_DISABLE=1
export LITEINFER_COMMIT="${LITEINFER_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}"
OUT="${OUT:-/tmp/liteinfer-out}"; mkdir -p "$OUT"
deadline=$((SECONDS + ${LANE_SECONDS:-560}))
lane() {
  local gpu=$1; shift
  local configs=()
  for word in "$@"; do
    if [ "$word" = gputests ]; then
      CUDA_VISIBLE_DEVICES=$gpu timeout $((deadline - SECONDS)) python3 -m pytest -m gpu -q \
        -p no:cacheprovider ${GPU_TESTS:-tests} 2>&1 | tail -15
    else
      configs+=("$word")
    fi
  done
  [ ${#configs[@]} -gt 0 ] && CUDA_VISIBLE_DEVICES=$gpu timeout $((deadline - SECONDS)) \
    python3 -m liteinfer.bench run --all --config "${configs[@]}" --out "$OUT/results-$gpu.jsonl"
}
gpu=0
for group in "$@"; do
  # shellcheck disable=SC2086  # a group is a space-separated list
  lane $gpu $group > "$OUT/lane-$gpu.log" 2>&1 &
  gpu=$((gpu + 1))
done
wait
for ((i = 0; i < gpu; i++)); do echo "== lane $i"; tail -40 "$OUT/lane-$i.log"; done
