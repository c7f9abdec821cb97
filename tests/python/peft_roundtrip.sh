#!/usr/bin/env bash
# LoRA adapters both ways between accelerate-cpp and Python's PEFT (the venv's peft package):
# accelerate-cpp writes an adapter, PEFT loads it onto the same architecture and must compute the same output;
# PEFT writes changed adapters, accelerate-cpp loads them and must compute PEFT's output.
#   peft_roundtrip.sh <accel_torch_tests> <python>       (exit 77 = skipped when peft is not importable)
set -euo pipefail
tests=$1 python=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
export ACCEL_PEFT_EXPORT_DIR=$dir
"$tests" "[.peft_export]" > "$dir/export.log" || { cat "$dir/export.log"; exit 1; }
# check_peft_adapter.py exits 77 when peft is not importable (set -e passes that on: skipped). It is the one
# Python start of the test: importing peft costs ~20 s here, and a separate probe paid it twice.
"$python" "$(dirname "$0")/check_peft_adapter.py" "$dir"
"$tests" "[.peft_import]" -s 2>&1 | grep -E "peft_import:|passed|failed|FAILED"
