#!/usr/bin/env bash
# Builds llama.cpp's llama-server, llama-quantize and llama-gguf-split (CPU only) for the test that checks weft
# against it (crates/weft/tests/moe_llamacpp.rs), and prints their directory on its last line;
# everything else goes to stderr. Idempotent: the build is cached under
# ${WEFT_LLAMACPP_CACHE:-~/.cache/weft/llama.cpp} and redone only when missing or made from
# another source or flags. A directory that already holds both binaries can be given as
# WEFT_LLAMACPP_DIR, and is then printed as it is.
# The source is the llama.cpp that the llama-cpp-python sdist on PyPI vendors, at a pinned
# version so that the cache stays valid; building it takes 5-10 minutes on 2 cores.
set -euo pipefail
exec 3>&1 1>&2

bins=(llama-server llama-quantize llama-gguf-split)
has_bins() { local b; for b in "${bins[@]}"; do [ -x "$1/$b" ] || return 1; done; }

if [ -n "${WEFT_LLAMACPP_DIR:-}" ]; then
  if has_bins "$WEFT_LLAMACPP_DIR"; then
    echo "$WEFT_LLAMACPP_DIR" >&3
    exit 0
  fi
  echo "WEFT_LLAMACPP_DIR=$WEFT_LLAMACPP_DIR lacks ${bins[*]}: building into the cache"
fi

version=0.3.36
cache=${WEFT_LLAMACPP_CACHE:-$HOME/.cache/weft/llama.cpp}
bin=$cache/build/bin
flags=(-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF
  -DLLAMA_USE_PREBUILT_UI=OFF
  # Without AMX: on Sapphire Rapids VMs here llama.cpp 0.3.36's AMX matmul loads a tile
  # configuration whose reserved bytes are not zeroed and dies of SIGILL on the first prompt.
  # Built without it, llama.cpp runs its AVX-512 VNNI kernels, which weft is compared with.
  "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
# What the cached binaries were built from: a build with another stamp is redone.
stamp="llama_cpp_python $version ${flags[*]} ${bins[*]}"
if has_bins "$bin" && [ "$(cat "$cache/stamp" 2>/dev/null)" = "$stamp" ]; then
  echo "$bin" >&3
  exit 0
fi

start=$SECONDS
if ! command -v cmake >/dev/null; then
  sudo=; [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get update -q && $sudo apt-get install -y -q cmake
fi
command -v c++ >/dev/null || { echo "no C++ compiler (c++) to build llama.cpp with" >&2; exit 1; }
mkdir -p "$cache/sdist"
sdist=$cache/sdist/llama_cpp_python-$version.tar.gz
if [ ! -f "$sdist" ]; then
  # Only llama-cpp-python itself from source: ':all:' would make pip compile cmake too.
  python3 -m pip download -q --disable-pip-version-check --no-deps \
    --no-binary llama-cpp-python "llama-cpp-python==$version" -d "$cache/sdist"
fi
rm -rf "$cache/src" "$cache/stamp"
mkdir -p "$cache/src"
tar -xzf "$sdist" -C "$cache/src"
src=$cache/src/llama_cpp_python-$version/vendor/llama.cpp
[ -f "$src/CMakeLists.txt" ] || { echo "no llama.cpp in $sdist" >&2; exit 1; }
cmake -S "$src" -B "$cache/build" "${flags[@]}" >/dev/null
cmake --build "$cache/build" -j"$(nproc)" --target "${bins[@]}"
has_bins "$bin" || { echo "the build left no ${bins[*]} in $bin" >&2; exit 1; }
echo "$stamp" >"$cache/stamp"
echo "built llama.cpp (llama-cpp-python $version) in $((SECONDS - start)) s"
echo "$bin" >&3
