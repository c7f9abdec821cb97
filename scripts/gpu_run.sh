#!/usr/bin/env bash
# Runs this checkout's build on a GPU machine (issue 27): the binaries built on the CPU machine (g++ 12, the
# same torch 2.11.0+cu130 wheel; packed by scripts/gpu_carry.sh into .gpu_carry/), run against the GPU machine's
# own LibTorch (its python3's torch). From the checkout's root, with .gpu_carry carried along:
#   bash scripts/gpu_run.sh [SECTION...]     sections: setup gpu ranks examples suite bench probe (default: all)
#   setup  links /work/main to this checkout and .venv to the machine's Python, unpacks the build and data
#   gpu    accel_gpu_tests;  suite  the whole suite but the packaging test (ctest -j12 -LE packaging)
#   ranks  tests/gpu/ranks_share_gpu.sh: the backends on GPU ranks that share the GPU through Gloo
#   examples  the examples (Fashion-MNIST, GAN 2 ranks vs 1, the Trainer, LoRA/QLoRA) on 2 GPU ranks
#   bench  bench/gpu_bench.sh's trainer and lora parts (BENCH_PARTS overrides: loop trainer optim offload lora)
#   probe  how the machine's g++ links std::filesystem against the torch wheel (configure + one link)
# Logs go to $OUT (the device tool's folder that comes back), else /tmp/out.
set -u
R=$PWD
T0=$(date +%s)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
sections=${*:-setup gpu ranks examples suite bench probe}
want() { [[ " $sections " == *" $1 "* ]]; }
el() { echo "[+$(($(date +%s) - T0)) s] $*"; }
PY=$(python3 -c "import sys;print(sys.executable)")
SITE=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
TL=$SITE/torch/lib
export LD_LIBRARY_PATH=$R/.gpu_carry/lib ACCEL_CONFIG_FILE=

if want setup; then
  el "host"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nproc
  python3 -c "import torch,accelerate,transformers,peft,sys;print(sys.version.split()[0], torch.__version__, torch.version.cuda, 'accelerate', accelerate.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
  mkdir -p /work
  [ -e /work/main ] || ln -s "$R" /work/main
  mkdir -p .venv/bin .venv/lib/python3.11
  ln -sfn "$SITE" .venv/lib/python3.11/site-packages
  rm -f .venv/bin/python
  printf '#!/bin/sh\nexec %s "$@"\n' "$PY" >.venv/bin/python
  chmod +x .venv/bin/python
  [ -e /usr/bin/cmake ] || ln -s "$(command -v cmake)" /usr/bin/cmake
  [ -e /usr/bin/ctest ] || ln -s "$(command -v ctest)" /usr/bin/ctest
  tar -xJf .gpu_carry/build.tar.xz
  mkdir -p /usr/share/datasets && cp -r .gpu_carry/fashion-mnist /usr/share/datasets/
  ldd build/tests/accel_gpu_tests build/tests/dist_worker build/bench/bench_gpu_train | grep -i "not found"
fi

if want gpu; then
  el "gpu tests"
  timeout 150 build/tests/accel_gpu_tests --use-colour no -d yes >"$OUT/gpu_tests.log" 2>&1
  echo "rc=$?"
  grep -v "^{" "$OUT/gpu_tests.log" | grep -v "frame #" | tail -25 | cut -c1-300
fi

if want ranks; then
  el "backends on GPU ranks sharing the GPU through Gloo (tests/gpu/ranks_share_gpu.sh)"
  OMP_NUM_THREADS=1 timeout 400 bash tests/gpu/ranks_share_gpu.sh build/launcher/accel-launch \
    build/tests/accel_gpu_tests build/tests/dist_worker \
    build/tests/tensor_parallel_worker >"$OUT/ranks.log" 2>&1
  echo "rc=$?"
  tail -22 "$OUT/ranks.log" | cut -c1-300
fi

if want examples; then
  # The examples on 2 GPU ranks sharing the GPU: the config templates with use_cpu false.
  el "examples on GPU ranks (ACCEL_CUDA_COLLECTIVES=gloo)"
  export ACCEL_CUDA_COLLECTIVES=gloo OMP_NUM_THREADS=1
  cfg=/tmp/gpucfg
  mkdir -p $cfg/trainer
  for f in config_templates/*.yaml; do sed 's/^use_cpu: true/use_cpu: false/' "$f" >"$cfg/${f##*/}"; done
  for f in config_templates/trainer/*; do sed 's/^use_cpu: true/use_cpu: false/' "$f" >"$cfg/trainer/${f##*/}"; done
  L=build/launcher/accel-launch
  ex=build/examples
  # Which processes held GPU memory while the examples ran (evidence that the ranks ran on the GPU).
  (while true; do nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader 2>/dev/null; sleep 1; done) \
    >/tmp/smi.log &
  sampler=$!
  {
    for t in ddp_cpu zero_stage3 fsdp_full_shard; do
      out=$(timeout 120 $L launch --config_file $cfg/$t.yaml $ex/fashion_mnist/fashion_mnist --epochs 1 \
        --train-limit 6000 --test-limit 1000 2>&1)
      echo "fashion_mnist $t rc=$? $(echo "$out" | grep -o 'test accuracy: .*' | tail -1)"
      echo "$out" | grep -i -E "error|device" | head -3
    done
    out=$(timeout 120 cmake "-DFIRST=$L;launch;--config_file;$cfg/ddp_cpu.yaml;$ex/gan/gan;--epochs;1;--train-limit;2048;--batch-size;32" \
      "-DSECOND=$ex/gan/gan;--epochs;1;--train-limit;2048;--batch-size;64" -DRTOL=1e-3 -P tests/examples/compare_outputs.cmake 2>&1)
    echo "gan 2 ddp GPU ranks x 32 vs 1 GPU process x 64: rc=$? $(echo "$out" | tail -3 | tr '\n' ' ' | cut -c1-400)"
    for sched in 1f1b; do
      out=$(timeout 120 cmake "-DFIRST=$L;launch;--config_file;$cfg/pipeline_1f1b.yaml;$ex/pipeline/pipeline_example;--steps;20" \
        "-DSECOND=$L;launch;--num_processes;1;$ex/pipeline/pipeline_example;--steps;20" "-DLINE=weight checksum -?[0-9][0-9.e+-]*" \
        -DRTOL=1e-5 -P tests/examples/compare_outputs.cmake 2>&1)
      echo "pipeline_example 2 GPU stages ($sched) vs 1 GPU process: rc=$? $(echo "$out" | tail -3 | tr '\n' ' ' | cut -c1-400)"
    done
    for t in stage3 stage2_offload; do
      d=$(mktemp -d) && out=$(cd "$d" && timeout 150 "$R/$L" train --templates $cfg -t $t "$R/$ex/trainer/fashion_mnist_trainer" \
        --num_train_epochs 1 --train-limit 2000 --test-limit 500 --disable_tqdm 2>&1)
      echo "trainer $t rc=$? $(echo "$out" | grep -o 'test accuracy: .*' | tail -1)"
      echo "$out" | grep -i -E "error" | head -3
    done
    for t in lora qlora; do
      d=$(mktemp -d) && out=$(cd "$d" && timeout 150 "$R/$L" train --templates $cfg -t $t "$R/$ex/trainer/finetune" \
        --num_train_epochs 1 --train-limit 2000 --test-limit 500 --disable_tqdm \
        --model_config "$R/examples/trainer/fashion_$t.model.yaml" 2>&1)
      echo "finetune $t rc=$? $(echo "$out" | grep -o "$t test accuracy: .*" | tail -1)"
      echo "$out" | grep -i -E "error" | head -3
    done
    kill $sampler 2>/dev/null
    echo "GPU processes seen by nvidia-smi: $(sort -u /tmp/smi.log | wc -l) distinct ($(sort -u /tmp/smi.log | awk -F, '{print $2}' | sort | uniq -c | tr -s ' ' | tr '\n' ';'))"
  } >"$OUT/examples.log" 2>&1
  cat "$OUT/examples.log" | cut -c1-300
  unset ACCEL_CUDA_COLLECTIVES
fi

if want suite; then
  el "suite (all but packaging)"
  (cd build && timeout 180 ctest -j12 -LE "packaging|gpu" --timeout 150 >"$OUT/suite.log" 2>&1)
  echo "rc=$?"
  grep -E "tests passed|\*\*\*|Total Test|Skipped" "$OUT/suite.log" | cut -c1-220 | tail -20
fi

if want bench; then
  el "benchmarks: ${BENCH_PARTS:-trainer lora}"
  timeout 300 bash bench/gpu_bench.sh build python3 ${BENCH_PARTS:-trainer lora} >"$OUT/bench.log" 2>&1
  echo "rc=$?"
  grep -v "^{'" "$OUT/bench.log" | cut -c1-420 | tail -30
fi

if want probe; then
  el "probe: how this g++ links std::filesystem against the torch wheel"
  g++ --version | head -1
  echo "driver adds: $(g++ -### -x c++ /dev/null -o /tmp/x 2>&1 | grep -o -- '--as-needed\|--no-as-needed' | sort | uniq -c | tr '\n' ' ')"
  cat >/tmp/fs.cpp <<'EOF'
#include <cstdint>
#include <cstdio>
#include <filesystem>
int main() {
  namespace fs = std::filesystem;
  fs::create_directories("/tmp/fsx/a/b");
  const auto n = fs::remove_all("/tmp/fsx");
  std::printf("removed %ju\n", static_cast<std::uintmax_t>(n));
  return n == 3 ? 0 : 1;
}
EOF
  g++ -O1 -c /tmp/fs.cpp -o /tmp/fs.o
  for variant in plain guard; do
    flags=""
    [ $variant = guard ] && flags="-Wl,--push-state,--no-as-needed,-lstdc++,--pop-state"
    g++ $flags /tmp/fs.o -o /tmp/fs_$variant "$TL/libtorch.so" -Wl,--no-as-needed "$TL/libtorch_cpu.so" "$TL/libc10.so" -Wl,-rpath,"$TL"
    echo "$variant: NEEDED $(readelf -d /tmp/fs_$variant | sed -n 's/.*NEEDED.*\[\(.*\)\]/\1/p' | tr '\n' ' ')"
    echo "  $(nm -D --undefined-only /tmp/fs_$variant | grep filesystem | tr -s ' ' | tr '\n' ';')"
    timeout 10 /tmp/fs_$variant
    echo "  $variant rc=$?"
  done
  mkdir -p /tmp/deps && for f in .gpu_carry/debs/*.deb; do dpkg -x "$f" /tmp/deps; done
  TP=$(python3 -c "import torch.utils;print(torch.utils.cmake_prefix_path)")
  export CPATH=/tmp/deps/usr/include LIBRARY_PATH=/tmp/deps/usr/lib/x86_64-linux-gnu
  timeout 120 cmake -S . -B /tmp/bd -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$TP;/tmp/deps/usr" >"$OUT/configure.log" 2>&1
  echo "configure rc=$? ($(cmake --version | head -1))"
  grep -E "CMAKE_CXX_COMPILER(_ID)?:|CMAKE_LINKER:" /tmp/bd/CMakeCache.txt
  cmd=$(cd /tmp/bd && ninja -t commands tests/accel_gpu_tests | tail -1)
  echo "$cmd" >"$OUT/link_command.txt"
  echo "link flags: $(echo "$cmd" | tr ' ' '\n' | grep -n -E 'stdc|as-needed|push-state|libtorch\.so|yaml' | tr '\n' ' ' | cut -c1-900)"
  probe=$(echo "$cmd" | sed -E 's#[^ ]*\.o( |$)# #g; s#[^ ]*\.a( |$)# #g; s#-o tests/accel_gpu_tests#-o /tmp/fs_cmake /tmp/fs.o#')
  (cd /tmp/bd && eval "$probe") >"$OUT/probe_link.log" 2>&1
  echo "cmake-flag link rc=$?: NEEDED $(readelf -d /tmp/fs_cmake 2>/dev/null | sed -n 's/.*NEEDED.*\[\(.*\)\]/\1/p' | tr '\n' ' ')"
  echo "  undefined std::filesystem references: $(nm -D --undefined-only /tmp/fs_cmake | grep -c filesystem)"
  timeout 10 /tmp/fs_cmake
  echo "  cmake-flag rc=$?"
  (cd /tmp/bd && timeout 60 ninja accel_fs_probe_static >/dev/null 2>&1 && timeout 30 ctest -R "link: a toolchain" 2>&1 | grep -E "Test +#|tests passed")
  tail -3 "$OUT/probe_link.log" | cut -c1-300
fi
el "done"
