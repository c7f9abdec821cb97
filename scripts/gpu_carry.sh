#!/usr/bin/env bash
# Packs what a GPU machine without package registries needs to run this checkout's build (issue 27) into
# .gpu_carry/ (git-ignored through .git/info/exclude): the build outputs without objects (stripped, xz), the
# Debian packages whose headers a build there needs, libyaml-cpp's shared library, and Fashion-MNIST. Run after
# building ./build here (same torch 2.11.0+cu130 wheel as the GPU machine's); then, on the GPU machine, from the
# checkout's root with .gpu_carry carried along: `bash scripts/gpu_run.sh [setup gpu suite bench probe]`.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
carry=.gpu_carry
grep -qx "/$carry/" .git/info/exclude 2>/dev/null || echo "/$carry/" >>.git/info/exclude
mkdir -p $carry/debs $carry/lib $carry/fashion-mnist
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
find build -type f ! -path '*/CMakeFiles/*' ! -name '*.o' ! -name '*.a' ! -name '.ninja*' ! -name '*.pch' \
  ! -name '*.gch' ! -path 'build/tests/packaging/*' ! -path '*/_deps/*' |
  grep -v -E '^build/(Testing|tests/gan_|tests/fs_probe_tree)' >"$stage/files"
tar -cf - -T "$stage/files" | tar -xf - -C "$stage"
while IFS= read -r f; do
  if file -b "$stage/$f" | grep -q ELF; then strip --strip-unneeded "$stage/$f"; fi
done <"$stage/files"
tar -C "$stage" -cf - build | xz -T0 -6 >$carry/build.tar.xz
(cd $carry/debs && apt-get download -q catch2 libcli11-dev libgloo-dev libyaml-cpp-dev libyaml-cpp0.7 \
  nlohmann-json3-dev zlib1g-dev >/dev/null)
cp -L /usr/lib/x86_64-linux-gnu/libyaml-cpp.so.0.7 $carry/lib/
cp /usr/share/datasets/fashion-mnist/*.gz $carry/fashion-mnist/
du -sh $carry
