#!/usr/bin/env bash
# Packs the tritonserver of the nvidia-pytriton wheel installed in a venv into one tar.xz small
# enough to travel to a GPU machine with no network (about 27 MB; the wheel is 55 MB): the binary,
# the Python backend, the Python 3.12 stub and the libraries, without the bundled libpython3.13,
# which the server does not use. benchmarks/gpu_server.py --triton unpacks it.
# Usage: benchmarks/gpu/pack_triton.sh VENV OUT.tar.xz
set -euo pipefail
venv=${1:?venv}; out=$(realpath -m "${2:?out.tar.xz}")
site=$(ls -d "$venv"/lib/python3.*/site-packages | head -1)
cd "$site"
tar -cf - --exclude='libpython3-*' pytriton/tritonserver/bin pytriton/tritonserver/backends \
  pytriton/tritonserver/python_backend_stubs/3.12 nvidia_pytriton.libs | xz -T2 -6 > "$out"
ls -la "$out"
