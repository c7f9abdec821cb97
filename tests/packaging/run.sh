#!/usr/bin/env bash
# Packaging test: installs accelerate-cpp from an existing build, then builds and runs a consumer project twice,
# with find_package(accelerate_cpp) against the install and with add_subdirectory of the source tree.
# Usage: run.sh SOURCE_DIR BUILD_DIR WORK_DIR TORCH_DIR
set -euo pipefail
src=$1 build=$2 work=$3 torch_dir=$4
rm -rf "$work" && mkdir -p "$work"
cmake --install "$build" --prefix "$work/prefix" >/dev/null
gen=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DTorch_DIR="$torch_dir")
command -v ccache >/dev/null && gen+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)

echo "== find_package(accelerate_cpp) from $work/prefix"
cmake -S "$src/tests/packaging/consumer" -B "$work/package" "${gen[@]}" -DACCEL_MODE=package \
  -DCMAKE_PREFIX_PATH="$work/prefix" >"$work/package.log" 2>&1 || { cat "$work/package.log"; exit 1; }
cmake --build "$work/package" >>"$work/package.log" 2>&1 || { cat "$work/package.log"; exit 1; }
"$work/package/consumer"

echo "== add_subdirectory($src)"
cmake -S "$src/tests/packaging/consumer" -B "$work/subdir" "${gen[@]}" -DACCEL_MODE=subdirectory \
  -DACCEL_SOURCE_DIR="$src" >"$work/subdir.log" 2>&1 || { cat "$work/subdir.log"; exit 1; }
cmake --build "$work/subdir" >>"$work/subdir.log" 2>&1 || { cat "$work/subdir.log"; exit 1; }
"$work/subdir/consumer"
echo "packaging: both ways build and train"
