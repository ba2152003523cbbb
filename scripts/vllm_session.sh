#!/usr/bin/env bash
# On the CUDA machine: liteinfer and vLLM 0.26 measured in one sitting, each step named on the
# command line; logs and rows go under $OUT. vLLM travels as the chunks of
# ../shared/vllm/rebuild.sh (.vllm_whl/), which a run carries one or two at a time:
#   gather PATH...   copy carried chunk folders (and .gguf parts, .whl) to /tmp/vw
#   install          liteinfer's wheels and vLLM into /tmp/site and /tmp/vsite, and vLLM's smoke test
#   smollm2-spec     SmolLM2 (the GGUF from /tmp/vw) with ngram against vLLM's ngram, grounded
#                    prompts at 1, 8 and 32 in flight, SPEC_K (default 4) draft tokens in both
#   vllm-spec TOKENS vLLM's side of smollm2-spec alone, on the prompts (token ids) it wrote
#   timeline MODEL W...  liteinfer and vLLM at 128/256 at each width W, with run timelines
#   rows MODEL PRECISION  liteinfer and vLLM at 128/256: one request at a time (20 prompts), then
#                    32 and 128 in flight (200 prompts); PRECISION is bf16, fp8 (both engines'
#                    `quantization=fp8`) or int4 (ours at load against vLLM's AWQ-Marlin)
set -uo pipefail
OUT="${OUT:-/tmp/liteinfer-out}"; mkdir -p "$OUT"
W=/tmp/vw; mkdir -p $W
site() { export PYTHONPATH=/tmp/site:/tmp/vsite:/tmp/vsite/nvidia_cutlass_dsl/dsl_packages:$PWD \
  PYTHONUNBUFFERED=1; }
model_dir() {  # a directory holding a packaged config, for vLLM's dummy weights
  mkdir -p /tmp/models/$1; cp liteinfer/model_configs/$1.json /tmp/models/$1/config.json
  echo /tmp/models/$1; }
while [ $# -gt 0 ]; do
  case "$1" in
    gather) shift; while [ $# -gt 0 ] && [ -e "$1" ]; do cp -a "$1"/. $W/; shift; done ;;
    install) shift
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site $W/*.whl 2>&1 | tail -2
      (cd $W && sha256sum -c SHA256SUMS.req-parts | tail -1 && cat req.tar.xz.part-* | xz -dc -T0 \
        | tar -x -C $W) || exit 1
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vsite $W/whl/*.whl \
        2>&1 | tail -2
      cat $W/smol.part-* > $W/smollm2.gguf
      site; python3 .vllm_whl/box/preflight.py 2>&1 | tail -2 ;;
    smollm2-spec) shift; site
      export LITEINFER_COMMIT="${LITEINFER_COMMIT:-unknown}"
      python3 -m liteinfer.bench spec --model $W/smollm2.gguf --method ngram --widths 1 8 32 \
        --num-speculative-tokens ${SPEC_K:-4} --tokens-out $OUT/grounded-tokens.json \
        --out $OUT/spec-smollm2.jsonl 2>&1 | grep -v -i warn | tail -8
      set -- vllm-spec $OUT/grounded-tokens.json "$@" ;;
    vllm-spec) shift; site; tokens=$1; shift
      python3 scripts/gguf_to_hf.py $W/smollm2.gguf /tmp/smollm2-hf 2>&1 | tail -1
      python3 scripts/bench_vllm.py /tmp/smollm2-hf --out $OUT/vllm-spec-smollm2.jsonl \
        --real-weights --prompts-file $tokens --widths 1 8 32 \
        --speculative-config '{"method": "ngram", "num_speculative_tokens": '${SPEC_K:-4}',
                               "prompt_lookup_min": 2, "prompt_lookup_max": 5}' 2>&1 \
        | grep -v -i warn | tail -8 ;;
    timeline) shift; site; m=$1; shift; runs=(); widths=()
      while [ $# -gt 0 ] && [[ "$1" =~ ^[0-9]+$ ]]; do widths+=("$1"); runs+=("128:256:$1:200"); shift; done
      export LITEINFER_COMMIT="${LITEINFER_COMMIT:-unknown}"
      for w in "${widths[@]}"; do
        python3 -m liteinfer.bench run throughput --model $m --isl 128 --osl 256 --width $w \
          --prompts 200 --timeline $OUT/tl/ --out $OUT/results.jsonl 2>&1 | grep -v -i warn | tail -3
      done
      python3 scripts/bench_vllm.py $(model_dir $m) --out $OUT/vllm-rows.jsonl --runs "${runs[@]}" \
        --timeline $OUT/tlv/ 2>&1 | grep -v -i warn | tail -6 ;;
    rows) shift; site; m=$1 prec=$2; shift 2; ours=(); theirs=()
      case "$prec" in fp8) ours=(--set quantization=fp8); theirs=(--quantization fp8) ;;
        int4) ours=(--set quantization=int4); theirs=(--awq) ;; esac
      export LITEINFER_COMMIT="${LITEINFER_COMMIT:-unknown}"
      for run in "latency --prompts 20" "throughput --width 32 --prompts 200" \
                 "throughput --width 128 --prompts 200"; do
        python3 -m liteinfer.bench run $run --model $m --isl 128 --osl 256 "${ours[@]}" \
          --out $OUT/results.jsonl 2>&1 | grep -v -i warn | tail -2
      done
      python3 scripts/bench_vllm.py $(model_dir $m) --out $OUT/vllm-rows.jsonl "${theirs[@]}" \
        --latency 128:256:20 --runs 128:256:32:200 128:256:128:200 2>&1 | grep -v -i warn \
        | tail -6 ;;
    *) echo "unknown step $1"; exit 2 ;;
  esac
done
