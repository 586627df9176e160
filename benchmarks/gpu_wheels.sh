#!/usr/bin/env bash
# The wheels a lent GPU machine lacks (it has torch, Triton, transformers and the usual
# scientific stack, no network), downloaded here into .whl/ for benchmarks/gpu_session.sh
# to install there: the project's dependencies and the test suite's, for CPython 3.12 on
# x86-64 Linux. Run from anywhere; pass the call `carry: [".whl"]`. See ../shared/GPU.md.
#
#   bash benchmarks/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl \
    lmdb zstandard blake3 msgspec pyzmq nvidia-ml-py "xgrammar>=0.2.8,<0.3" apache-tvm-ffi \
    fastapi starlette pydantic pydantic-core annotated-types typing-inspection uvicorn httptools uvloop valkey \
    opentelemetry-api typing-extensions \
    "openai<2" distro jiter sniffio jsonschema jsonschema-specifications referencing rpds-py attrs \
    2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
ls .whl | wc -l | xargs echo "wheels in .whl:"
# The machine has no redis-server either: this machine's (Debian's, installed by
# .ci/install-services), with the two libraries it needs that a CUDA image lacks, for the
# remote tier's cases and tests. gpu_session.sh puts it on PATH when it runs there.
server=$(command -v redis-server || command -v valkey-server || true)
if [ -n "$server" ]; then
    mkdir -p .whl/redis/lib
    cp -L "$server" .whl/redis/redis-server
    for lib in liblzf.so.1 libjemalloc.so.2; do
        path=$(ldd "$server" | awk -v lib="$lib" '$1 == lib {print $3}')
        if [ -n "$path" ]; then cp -L "$path" .whl/redis/lib/; fi
    done
    echo "redis-server in .whl/redis"
fi
