#!/usr/bin/env bash
# The single-GPU benchmarks of issue 27, side by side in one run, with the ratios:
#  1. samples/s of the bf16 training loop, accelerate-cpp vs PyTorch vs HF Accelerate, for the Fashion-MNIST
#     CNN and a small transformer (bench_gpu_train, bench/peers/gpu_train.py);
#  2. fused AdamW (accel::optim) vs torch::optim::AdamW on CUDA (bench_optim --cuda 1);
#  3. ZeRO-Offload on one GPU under a memory cap emulating an 8 GiB card vs the same model without the cap
#     (bench_gpu_offload).
#   bench/gpu_bench.sh BUILD_DIR [PYTHON]     (PYTHON: one with torch and accelerate; default python3)
set -uo pipefail
build=${1:?usage: gpu_bench.sh BUILD_DIR [PYTHON]}
py=${2:-python3}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
rate() { sed -n 's/.*samples\/s=\([0-9.]*\).*/\1/p' <<<"$1"; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a > 0 && b > 0) printf "%.2f", a / b; else printf "n/a" }'; }

for model in cnn transformer; do
  batch=256; [[ $model == transformer ]] && batch=64
  ours=$("$build/bench/bench_gpu_train" --model "$model" --batch $batch)
  ours_lib=$("$build/bench/bench_gpu_train" --model "$model" --batch $batch --optim torch)
  torch_line=$("$py" "$here/peers/gpu_train.py" --impl torch --model "$model" --batch $batch)
  hf_line=$("$py" "$here/peers/gpu_train.py" --impl accelerate --model "$model" --batch $batch)
  printf '%s\n' "$ours" "$ours_lib" "$torch_line" "$hf_line"
  echo "ratio $model bf16: accelerate-cpp/pytorch $(ratio "$(rate "$ours")" "$(rate "$torch_line")")x," \
    "accelerate-cpp/hf-accelerate $(ratio "$(rate "$ours")" "$(rate "$hf_line")")x"
done

"$build/bench/bench_optim" --cuda 1 --steps 50 --warmup 5

capped_gpu=$("$build/bench/bench_gpu_offload" --mode gpu --cap-gib 8)
capped_off=$("$build/bench/bench_gpu_offload" --mode offload --cap-gib 8)
free_gpu=$("$build/bench/bench_gpu_offload" --mode gpu --cap-gib 0)
printf '%s\n' "$capped_gpu" "$capped_off" "$free_gpu"
echo "ratio offload capped at 8 GiB / gpu-only uncapped: $(ratio "$(rate "$capped_off")" "$(rate "$free_gpu")")x"
