#!/usr/bin/env bash
# accel::llm models against transformers (tests/llm/models_reference.py all), in five steps of one Python
# process (a second start cost ~5 s of CPU importing torch and transformers again):
# 1. Python makes tiny random Llama / Qwen2 / Qwen3 models and what transformers computes on them;
# 2. accel_llm_models_tests "[.hf]" (run by it) loads them, compares logits, loss and greedy tokens, and
#    save_pretrained's each model again (cpp_saved);
# 3. Python loads those with transformers and compares their logits with the reference;
# 4. fused_loss_reference.py (same process): accel_llm_fused_loss_tests "[.hf]" against transformers' loss and
#    every gradient on tiny Qwen2 models it makes;
# 5. estimate_memory_check.py (same process): accel-launch estimate-memory's counts against transformers' and
#    PEFT's on real shapes.
# and, given the generate program, (in step 1) its --print_ids output on a tiny model and tokenizer equals
# transformers'.
#   models_crosscheck.sh <accel_llm_models_tests> <python> <accel_llm_fused_loss_tests> <accel-launch> [<generate>]
#                                          (exit 77 = skipped: transformers or PEFT not importable)
set -euo pipefail
tests=$1 python=$2 fused_tests=$3 launch=$4
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
script=$(dirname "$0")/models_reference.py
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error ACCEL_CONFIG_FILE=
"$python" "$script" all "$dir" "$tests" "$fused_tests" "$launch" "${@:5}"
