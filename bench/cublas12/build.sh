#!/bin/bash
# Build the two CUDA-12 cuBLAS stand-ins (cublas12_shim.c) into $1 (default /tmp/cublas12).
set -e
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-/tmp/cublas12}
mkdir -p "$out"
gcc -O2 -shared -fPIC -Wl,-soname,libcublas.so.12 -Wl,--version-script="$here/cublas12.map" "$here/cublas12_shim.c" -o "$out/libcublas.so.12" -ldl
echo 'void qrag_cublaslt12_stand_in(void) {}' > "$out/lt.c"
gcc -O2 -shared -fPIC -Wl,-soname,libcublasLt.so.12 -Wl,--version-script="$here/cublaslt12.map" "$out/lt.c" -o "$out/libcublasLt.so.12"
echo "$out"
