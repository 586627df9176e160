# tiered-kv server image: `tiered-kv serve` on port 8000, KV cache under /var/lib/tiered-kv.
# The torch wheel brings its own CUDA libraries; the CUDA base image provides the matching
# user-space pieces the NVIDIA container runtime expects.
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH \
    TIERED_KV_HOME=/var/lib/tiered-kv

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

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
