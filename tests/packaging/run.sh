#!/usr/bin/env bash
# Packaging test: installs accelerate-cpp from an existing build, runs the installed `accel-launch test` (every
# installed program must start from the prefix), then builds, links and runs a consumer project
# with find_package(accelerate_cpp) against the install; with add_subdirectory of the source tree it configures
# the consumer (the LibTorch version check runs there), reads main.cpp's compile command from the build graph
# (the subproject's include directory and LibTorch's definitions and headers come through the target), and
# compiles the consumer's torch-free unit for real. It builds neither the library a second time (the suite
# built it once; a second full build cost ~3 minutes of every CI run) nor main.cpp (the package build compiled
# it; LibTorch's headers cost ~35 s a time).
# Usage: run.sh SOURCE_DIR BUILD_DIR WORK_DIR TORCH_DIR
set -euo pipefail
src=$1 build=$2 work=$3 torch_dir=$4
rm -rf "$work" && mkdir -p "$work"
cmake --install "$build" --prefix "$work/prefix" >/dev/null
gen=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DTorch_DIR="$torch_dir")
command -v ccache >/dev/null && gen+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)

echo "== the installed accel-launch test runs from $work/prefix (accel-test-check finds LibTorch)"
ACCEL_CONFIG_FILE= "$work/prefix/bin/accel-launch" test --cpu --num_processes 2 --backend ddp \
  --main_process_port 0 >"$work/installed_test.log" 2>&1 || { cat "$work/installed_test.log"; exit 1; }

echo "== the installed accel-launch train -t TYPE reads the installed templates, also from a moved prefix"
# The prefix is copied elsewhere, as a user moves an install: the launcher must take the pair from the copy
# (PREFIX/share/accelerate_cpp/config_templates), never from this source tree it was built from.
cp -a "$work/prefix" "$work/moved"
ACCEL_CONFIG_FILE= ACCEL_TEMPLATES_DIR= "$work/moved/bin/accel-launch" train -t full --num_processes 1 \
  --main_process_port 0 /bin/echo >"$work/installed_train.log" 2>&1 || { cat "$work/installed_train.log"; exit 1; }
grep -q -F -- "--training_args $work/moved/share/accelerate_cpp/config_templates/trainer/full.yaml" \
  "$work/installed_train.log" || { echo "packaging: the moved prefix's launcher did not read its own templates:";
  cat "$work/installed_train.log"; exit 1; }
rm -rf "$work/moved"

echo "== find_package(accelerate_cpp) from $work/prefix"
cmake -S "$src/tests/packaging/consumer" -B "$work/package" "${gen[@]}" -DACCEL_MODE=package \
  -DCMAKE_PREFIX_PATH="$work/prefix" >"$work/package.log" 2>&1 || { cat "$work/package.log"; exit 1; }
cmake --build "$work/package" >>"$work/package.log" 2>&1 || { cat "$work/package.log"; exit 1; }
"$work/package/consumer"

echo "== add_subdirectory($src)"
cmake -S "$src/tests/packaging/consumer" -B "$work/subdir" "${gen[@]}" -DACCEL_MODE=subdirectory \
  -DACCEL_SOURCE_DIR="$src" >"$work/subdir.log" 2>&1 || { cat "$work/subdir.log"; exit 1; }
cmake --build "$work/subdir" --target CMakeFiles/consumer.dir/core.cpp.o >>"$work/subdir.log" 2>&1 ||
  { cat "$work/subdir.log"; exit 1; }
compile=$(ninja -C "$work/subdir" -t commands CMakeFiles/consumer.dir/main.cpp.o | tail -n 1)
for want in "-I$src/accelerate_cpp/include" "-DUSE_C10D_GLOO" "torch/csrc/api/include"; do
  grep -q -F -e "$want" <<<"$compile" ||
    { echo "packaging: main.cpp's compile command under add_subdirectory lacks $want: $compile"; exit 1; }
done
# The library targets are there and the consumer links against them (read from the generated build graph).
# (Read whole first: `grep -q` closing the pipe early would fail the pipeline under pipefail.)
inputs=$(ninja -C "$work/subdir" -t query consumer)
grep -q 'libaccelerate_cpp.a' <<<"$inputs" ||
  { echo "packaging: the add_subdirectory consumer does not link libaccelerate_cpp.a"; exit 1; }
echo "packaging: find_package builds and trains, add_subdirectory configures, carries the flags and compiles"
