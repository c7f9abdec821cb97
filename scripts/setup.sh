#!/usr/bin/env bash
# One-command set-up for accelerate-cpp on Debian 12: installs what is missing (Debian packages, a
# project-local Python venv with torch==2.11.0), configures CMake against the wheel's LibTorch and builds.
# Idempotent and quiet when everything is already present. Environment knobs:
#   ACCEL_BUILD_DIR (default build), ACCEL_BUILD_TYPE (Release), ACCEL_WERROR (OFF; CI sets ON),
#   ACCEL_TORCH_PREFIX (a LibTorch you bring yourself, e.g. the unzipped official libtorch; skips the venv torch)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
build_dir=${ACCEL_BUILD_DIR:-build}
torch_version=2.11.0
log() { printf '[setup] %s\n' "$*" >&2; }

# 1. Debian packages (headers and tools). libgloo-dev gives the gloo headers the wheel lacks;
#    nlohmann-json3-dev is needed by c10d headers and by our safetensors reader; liburing-dev and libaio-dev
#    by bench_nvme_io only (the asynchronous I/O it compares for NVMe offload); libpcre2-dev (regexes with
#    Unicode properties, JIT) and libutf8proc-dev (NFC / NFKC) serve the LLM wing's tokenizers, as the peers'
#    pre-tokenizer patterns and normalizers need. libtcmalloc-minimal4: `accel-launch train` preloads it into
#    the ranks, as PyTorch's run_cpu does (less memory than glibc's malloc at the same speed; BENCHMARKS.md).
pkgs=(build-essential cmake ninja-build ccache clang-format pkg-config zlib1g-dev libcli11-dev libyaml-cpp-dev
  catch2 libgloo-dev nlohmann-json3-dev dataset-fashion-mnist python3 python3-venv liburing-dev libaio-dev
  libpcre2-dev libutf8proc-dev libtcmalloc-minimal4)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  log "installing Debian packages: ${missing[*]}"
  sudo_cmd=(); [[ $(id -u) -eq 0 ]] || sudo_cmd=(sudo)
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -qq
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# 2. Project-local venv with the pinned torch wheel (its LibTorch is what we link) and the Python
#    peers used by tests and benchmarks.
venv="$root/.venv"
py_pkgs=("torch==$torch_version" safetensors numpy tensorboard "peft==0.21.2" "bitsandbytes==0.50.2"
  "transformers==5.24.0" "tokenizers==0.23.3" "jinja2" "trl" "torchao==0.18.0")
if [[ -z ${ACCEL_TORCH_PREFIX:-} ]]; then
  if ! "$venv/bin/python" -c "import torch, safetensors, numpy, tensorboard, peft, bitsandbytes, transformers, tokenizers, jinja2, trl, torchao; assert torch.__version__.split('+')[0] == '$torch_version'" \
      2>/dev/null; then
    log "creating $venv with ${py_pkgs[*]} (first time: ~5 GB, mostly CUDA libraries)"
    venv_start=$SECONDS
    [[ -x $venv/bin/python ]] || python3 -m venv "$venv"
    # uv (from PyPI) installs the ~5 GB in ~2 s from its cache (~/.cache/uv; ~20 s downloading everything
    # here) where pip took ~90 s with every wheel already in its cache: it downloads in parallel and links
    # files from its cache instead of unpacking them again. pip's index and local wheel settings are passed
    # on; pip is the fallback when uv cannot be installed.
    # The bytecode is compiled at install (+26 s), as pip does by default: with PYTHONDONTWRITEBYTECODE set
    # (as on our CI machines) Python never writes it on import, and each of the suite's Python processes
    # compiled torch's and peft's modules again (~10 s each; the cross-checks against PEFT and bitsandbytes
    # took 24 s, 8 s with the bytecode).
    if "$venv/bin/python" -m pip install -q --disable-pip-version-check uv; then
      uv_args=()
      [[ -n ${PIP_INDEX_URL:-} ]] && uv_args+=(--index-url "$PIP_INDEX_URL")
      [[ -n ${PIP_FIND_LINKS:-} && -n $(ls -A "$PIP_FIND_LINKS" 2>/dev/null) ]] && uv_args+=(--find-links "$PIP_FIND_LINKS")
      "$venv/bin/uv" pip install -q --compile-bytecode --python "$venv/bin/python" "${uv_args[@]}" "${py_pkgs[@]}"
    else
      "$venv/bin/python" -m pip install -q --disable-pip-version-check "${py_pkgs[@]}"
    fi
    log "venv ready in $((SECONDS - venv_start)) s"
  fi
  torch_prefix=$("$venv/bin/python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)' 2>/dev/null)
else
  torch_prefix=$ACCEL_TORCH_PREFIX
fi

# 3. Configure (once) and build. ccache and precompiled headers keep rebuilds short.
if [[ ! -f $build_dir/CMakeCache.txt ]]; then
  log "configuring CMake in $build_dir"
  cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE="${ACCEL_BUILD_TYPE:-Release}" \
    -DCMAKE_PREFIX_PATH="$torch_prefix" -DACCEL_WERROR="${ACCEL_WERROR:-OFF}" \
    -DACCEL_PYTHON="$venv/bin/python" >"$build_dir.configure.log" 2>&1 ||
    { cat "$build_dir.configure.log" >&2; exit 1; }
fi
export CCACHE_SLOPPINESS=${CCACHE_SLOPPINESS:-pch_defines,time_macros,include_file_mtime,include_file_ctime}
# Paths inside the checkout are hashed relative to it, so another clone of the project (CI clones into a new
# folder each time) reuses the objects this machine's earlier builds cached.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$root}
# A build's four precompiled headers alone are 2.8 GB before compression; with ccache's default 5 GB a few builds
# evicted each other's objects before the next clone (CI) could reuse them.
export CCACHE_MAXSIZE=${CCACHE_MAXSIZE:-16G}
# Every LibTorch translation unit needs >1 GiB: two jobs fit the 2-core, 24 GiB machines we target.
build_start=$SECONDS
cmake --build "$build_dir" -j "${ACCEL_JOBS:-2}" | { grep -v -x 'ninja: no work to do.' || true; }
status=${PIPESTATUS[0]}
((SECONDS - build_start < 10)) || log "build finished in $((SECONDS - build_start)) s (status $status)"
exit "$status"
