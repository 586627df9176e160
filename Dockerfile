# tiered-kv server image: `tiered-kv serve` on port 8000, KV cache under /var/lib/tiered-kv.
# torch 2.13.0 from PyPI is built for CUDA 13 and brings its own CUDA libraries; the CUDA 13
# base image makes the NVIDIA container runtime check that the host driver is new enough
# (580 or later) before the container starts.
FROM nvidia/cuda:13.0.2-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH \
    TIERED_KV_HOME=/var/lib/tiered-kv

# Triton compiles a small C launcher for each kernel when it first runs: it needs a C
# compiler and the headers of the Python that runs it (python3-dev for this python3).
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv \
    && printf '#include <Python.h>\nint main(void) { return 0; }\n' \
       | gcc -x c -fsyntax-only -I"$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" -

WORKDIR /src
# Dependencies first: this layer is rebuilt only when the pins change.
COPY pyproject.toml constraints.txt README.md ./
COPY engine ./engine
COPY storage ./storage
COPY tiered_kv ./tiered_kv
RUN pip install -c constraints.txt . && rm -rf /src

# An unprivileged user owns the state directory; a named volume mounted on kv_cache
# inherits this ownership when it is first created.
RUN useradd --system --uid 1000 --user-group --home-dir /var/lib/tiered-kv tiered-kv \
    && mkdir -p /var/lib/tiered-kv/kv_cache /models \
    && chown -R tiered-kv:tiered-kv /var/lib/tiered-kv \
    && chmod 0700 /var/lib/tiered-kv/kv_cache
USER tiered-kv
WORKDIR /var/lib/tiered-kv

EXPOSE 8000
# Loading a large checkpoint takes a while: the start period covers it.
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
# SIGTERM lets the tier manager write what is queued to disk before exiting.
STOPSIGNAL SIGTERM
ENTRYPOINT ["tiered-kv", "serve"]
CMD ["--host", "0.0.0.0", "--port", "8000", "--kv-cache-dir", "/var/lib/tiered-kv/kv_cache"]
