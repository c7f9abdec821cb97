#!/usr/bin/env bash
# accel::quant against bitsandbytes itself: bnb_4bit.py writes bitsandbytes' 4-bit codes, absmax and
# dequantised tensors for seeded inputs; the hidden Catch2 case "[.bnb]" recomputes and compares them.
# Usage: bnb_4bit.sh TORCH_TESTS_BINARY PYTHON. Exit 77 (skipped) when bitsandbytes is not importable.
set -u
tests_bin=$1
python=$2
dir=$(mktemp -d "${TMPDIR:-/tmp}/accel-bnb.XXXXXX")
trap 'rm -rf "$dir"' EXIT
OMP_NUM_THREADS=1 "$python" "$(dirname "$0")/bnb_4bit.py" "$dir"
rc=$?
[ $rc -eq 0 ] || exit $rc
ACCEL_BNB_DIR=$dir OMP_NUM_THREADS=1 "$tests_bin" "[.bnb]" --use-colour no
