#!/usr/bin/env bash
# Downloads into .whl/ the wheels that the engine, `liteinfer serve` and `liteinfer-bench serve`
# need and the CUDA machine lacks (it has no package registry): the ASGI stack, pydantic, ZeroMQ,
# msgspec, orjson, xgrammar, compressed-tensors and gguf, and the `openai` client that the
# GPU server tests drive (with its HTTP stack and a newer anyio), pytest-xdist for the kernel
# tests' parallel compiles, for CPython 3.12 on x86_64 Linux,
# without their dependencies (those the machine has: click, h11, httpx, uvloop,
# prometheus-client, psutil, pyyaml, requests). pydantic needs a
# newer typing-extensions than the machine's torch image may hold, so that one travels too.
# On that machine:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PYTHONPATH
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(
  starlette==1.10.0 pydantic==2.14.4
  pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
  uvicorn==0.54.0 httptools==0.7.1 pyzmq==27.3.0 msgspec==0.23.0 orjson==3.13.0
  xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 compressed-tensors==0.20.1 loguru==0.7.3
  gguf==0.19.0
  openai==3.63.0 httpx2==2.17.0 httpcore2==2.17.0 truststore==0.10.5 jiter==0.19.0 sniffio==1.3.1
  anyio==4.16.0 pytest-xdist==3.8.0 execnet==2.1.2
)
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp "${platforms[@]}" -d .whl "${WHEELS[@]}"
ls .whl
