#!/usr/bin/env bash
# The single-GPU benchmarks of issue 27, side by side in one run, with the ratios:
#  loop     samples/s of the bf16 training loop, accelerate-cpp vs PyTorch vs HF Accelerate, for the
#           Fashion-MNIST CNN and a small transformer (bench_gpu_train, bench/peers/gpu_train.py);
#  trainer  the same training through accel::Trainer vs HF's Trainer (both with LibTorch's / PyTorch's AdamW,
#           and both with the fused one), and accel::Trainer vs the hand-written accelerated loop on cuda
#           (bench_trainer_overhead --device cuda);
#  optim    fused AdamW (accel::optim) vs torch::optim::AdamW on CUDA (bench_optim --cuda 1);
#  offload  ZeRO-Offload on one GPU under a memory cap emulating an 8 GiB card vs the same model without the
#           cap (bench_gpu_offload);
#  lora     accel::peft's LoRA observer vs adapters written into the forward, on cuda (bench_lora).
#   bench/gpu_bench.sh BUILD_DIR [PYTHON [PARTS...]]   (PYTHON: one with torch, accelerate and transformers;
#                                                      default python3; PARTS: default all of the above)
set -uo pipefail
build=${1:?usage: gpu_bench.sh BUILD_DIR [PYTHON [PARTS...]]}
py=${2:-python3}
shift $(($# < 2 ? $# : 2))
parts=${*:-loop trainer optim offload lora}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
rate() { sed -n 's/.*samples\/s=\([0-9.]*\).*/\1/p' <<<"$1"; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a > 0 && b > 0) printf "%.2f", a / b; else printf "n/a" }'; }
want() { [[ " $parts " == *" $1 "* ]]; }

if want loop; then
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
fi

if want trainer; then
  for model in cnn transformer; do
    batch=256; [[ $model == transformer ]] && batch=64
    for optim in torch fused; do
      hf_optim=adamw_torch; [[ $optim == fused ]] && hf_optim=adamw_torch_fused
      ours=$("$build/bench/bench_gpu_train" --impl trainer --model "$model" --batch $batch --optim $optim 2>&1 |
        grep '^gpu_train')
      hf=$("$py" "$here/peers/gpu_train.py" --impl hf-trainer --model "$model" --batch $batch --optim $hf_optim 2>&1 |
        grep '^gpu_train')
      printf '%s\n' "$ours" "$hf"
      echo "ratio $model bf16 $hf_optim: accel::Trainer/HF Trainer $(ratio "$(rate "$ours")" "$(rate "$hf")")x"
    done
  done
  "$build/bench/bench_trainer_overhead" --device cuda --rounds 5 --steps 100 --batch-size 256 2>&1 |
    grep -v "^{'" | tail -3
fi

if want optim; then
  "$build/bench/bench_optim" --cuda 1 --steps 50 --warmup 5
fi

if want offload; then
  capped_gpu=$("$build/bench/bench_gpu_offload" --mode gpu --cap-gib 8)
  capped_off=$("$build/bench/bench_gpu_offload" --mode offload --cap-gib 8)
  free_gpu=$("$build/bench/bench_gpu_offload" --mode gpu --cap-gib 0)
  printf '%s\n' "$capped_gpu" "$capped_off" "$free_gpu"
  echo "ratio offload capped at 8 GiB / gpu-only uncapped: $(ratio "$(rate "$capped_off")" "$(rate "$free_gpu")")x"
fi

if want lora; then
  "$build/bench/bench_lora" --device cuda
  "$build/bench/bench_lora" --device cuda --width 2048 --batch 256
fi
