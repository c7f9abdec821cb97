#!/usr/bin/env bash
# The cross-checks against Python's own libraries, in one Python start (python_crosschecks.py; importing peft
# and bitsandbytes costs ~25 s here, paid once):
# - LoRA adapters both ways with PEFT (the venv's peft): accelerate-cpp writes an adapter ([.peft_export]),
#   PEFT loads it onto the same architecture and must compute the same output, and writes changed adapters
#   that accelerate-cpp loads ([.peft_import]) and must compute PEFT's output;
# - accel::quant's 4-bit NF4/FP4 codes, absmax and dequantised values against bitsandbytes' for seeded
#   tensors (bnb_4bit.py writes them, [.bnb] compares);
# - LoRA's target_modules all-linear adapts the modules PEFT adapts on Qwen2-shaped trees (peft_all_linear.py
#   writes PEFT's choice, [.peft_all_linear] compares);
# - bitsandbytes' 8-bit AdamW on the CPU (bnb_adamw8bit.py, [.bnb_adamw8bit]) and transformers' Trainer's sample
#   order (hf_trainer_order.py, [.hf_order]);
# - a DeepSpeed JSON under the Trainer: transformers' HfTrainerDeepSpeedConfig fills and checks it, DeepSpeed's
#   schedules (hf_deepspeed_config.py, [.hf_deepspeed]).
#   python_crosschecks.sh <accel_torch_tests> <python>   (exit 77 = skipped when peft or bitsandbytes is not
#                                                          importable)
set -euo pipefail
tests=$1 python=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
mkdir -p "$dir/peft" "$dir/bnb"
ACCEL_PEFT_EXPORT_DIR=$dir/peft "$tests" "[.peft_export]" > "$dir/export.log" || { cat "$dir/export.log"; exit 1; }
# Exits 77 when a package is not importable (set -e passes that on: skipped). bitsandbytes' CPU kernels run
# eagerly (TORCH_COMPILE_DISABLE=1): torch.compile of dequantize_4bit took 8 s of every run and computes the
# same values.
TORCH_COMPILE_DISABLE=1 OMP_NUM_THREADS=1 "$python" "$(dirname "$0")/python_crosschecks.py" "$dir/peft" "$dir/bnb"
ACCEL_PEFT_EXPORT_DIR=$dir/peft "$tests" "[.peft_import]" -s 2>&1 | grep -E "peft_import:|passed|failed|FAILED"
ACCEL_PEFT_EXPORT_DIR=$dir/peft "$tests" "[.peft_all_linear]" -s --use-colour no 2>&1 | grep -E "peft_all_linear:|passed|failed|FAILED"
ACCEL_BNB_DIR=$dir/bnb OMP_NUM_THREADS=1 "$tests" "[.bnb]" --use-colour no
ACCEL_BNB_DIR=$dir/bnb OMP_NUM_THREADS=1 "$tests" "[.bnb_adamw8bit]" -s --use-colour no 2>&1 | grep -E "bnb_adamw8bit:|passed|failed|FAILED"
ACCEL_HF_ORDER_FILE=$dir/bnb/hf_order.txt OMP_NUM_THREADS=1 "$tests" "[.hf_order]" -s --use-colour no 2>&1 | grep -E "hf_order:|passed|failed|FAILED"
ACCEL_HF_DS_DIR=$dir/bnb/hf_deepspeed OMP_NUM_THREADS=1 "$tests" "[.hf_deepspeed]" -s --use-colour no 2>&1 | grep -E "hf_deepspeed:|passed|failed|FAILED"
