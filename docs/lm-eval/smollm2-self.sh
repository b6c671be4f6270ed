#!/usr/bin/env bash
# The table of docs/lm-eval.md: three harness tasks on SmolLM2-135M -> itself (the self pair), offline.
# Usage, from the repository root: bash docs/lm-eval/smollm2-self.sh target; ... transfer; then
#   python -m kvt.lm_eval retention runs/lmeval-smollm2-self/target runs/lmeval-smollm2-self/transfer
set -euo pipefail
cond=$1
out=runs/lmeval-smollm2-self
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
M="source=weights/smollm2-135m,target=weights/smollm2-135m,condition=$cond,out=$out"
M="$M,calib=../shared/data/calib/wikitext-2/valid.txt,calib_seqs=16,calib_len=256"   # the mapper, made once
run() { python -m kvt.lm_eval --include_path docs/lm-eval --device cpu --output_path "$out/$cond" --log_samples "$@"; }
run --model_args "$M,max_length=512,rolling_context=256" --tasks wikitext_local --limit 1
run --model_args "$M" --batch_size 4 --tasks mmlu_continuation_local \
    --samples "{\"mmlu_continuation_local\": $(python -c 'print(list(range(0, 14042, 703)))')}"
run --model_args "$M" --tasks gsm8k_local --limit 3 --gen_kwargs max_gen_toks=128
