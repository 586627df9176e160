#!/usr/bin/env bash
# The GPU checks of the open work in one command, each stage under its own time limit so a
# call fits the device's per-command limit (10 minutes); see ../shared/GPU.md.
#
#   bash benchmarks/gpu_session.sh [STAGE...]        (default: tests engine tiers)
#
# Stages, in the order they matter:
#   tests    pytest -m cuda (every Triton kernel compiled on the GPU against its reference)
#   suite    the whole test suite with CUDA visible (8 workers), as CI runs it on a CPU
#   engine   engine_throughput.py, 1B shape, beside compiled transformers
#   tiers    gpu_tiers.py, 1B shape, 2K/8K/32K prefixes, raw/zstd/kivi4
#   tiers8b  gpu_tiers.py, 8B shape, 8K/32K prefixes (no remote case)
#   disk     disk_restore.py, 1B and 8B blocks
#   write    disk_write.py, 8B blocks: a 32K prompt saved at prefill pace, all on disk? (no GPU used)
#   qa       multi_round_qa.py --shape 1b: tiers against GPU-only prefix caching over HTTP
#   probe    hit_profile.py, 1B shape: host launches, syncs and kernels of a hit and a miss
#   serve    serve_stream.py, 1B shape: the HTTP server's tokens/s streamed and not, beside the engine
# A stage's limit is LIMIT_<stage> seconds (defaults below). Logs and JSON go to $OUT
# (default benchmarks/results/gpu); each stage prints its log's tail. Wheels the machine
# lacks are installed from .whl/ when it is there: `bash benchmarks/gpu_wheels.sh` fills it.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps .whl/*.whl 2>&1 | tail -n 3
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# A carried redis-server (gpu_wheels.sh) serves the remote tier's benchmark cases and tests.
if ! command -v redis-server >/dev/null && [ -x .whl/redis/redis-server ]; then
    export PATH="$PWD/.whl/redis:$PATH" LD_LIBRARY_PATH="$PWD/.whl/redis/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
redis-server --version 2>&1 | head -n 1 || echo "no redis-server: the remote cases are skipped"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'triton', triton.__version__)" | tee -a "$OUT/device.txt"

run_stage() {  # name, default limit in seconds, command...
    local name=$1 default=$2
    shift 2
    local var="LIMIT_$name" start=$SECONDS rc
    local limit=${!var:-$default}
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    echo "== $name: exit $rc after $((SECONDS - start)) s (limit $limit s; 124: timed out)"
    tail -n "${TAIL:-30}" "$OUT/$name.log"
}

stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(tests engine tiers)
for stage in "${stages[@]}"; do
    case $stage in
        tests) run_stage tests 180 python3 -m pytest -m cuda -q -p no:cacheprovider tests ;;
        suite) run_stage suite 420 python3 -m pytest -q -p no:cacheprovider -n 8 tests ;;
        # eager transformers left out (33 s of device time, measured before): the bar is compiled
        engine) run_stage engine 200 python3 benchmarks/engine_throughput.py --device cuda \
            --shape 1b --workloads 1x16x256,32x512x128,128x256x128 --engines engine,engine-sync,compiled \
            --out "$OUT/engine_throughput_1b.json" ;;
        tiers) run_stage tiers 200 python3 benchmarks/gpu_tiers.py --device cuda --shapes 1b \
            --prefixes 2K,8K,32K --codecs raw,zstd,kivi4 --out "$OUT/gpu_tiers_1b.json" ;;
        tiers8b) run_stage tiers8b 300 python3 benchmarks/gpu_tiers.py --device cuda --shapes 8b \
            --prefixes 8K,32K --codecs raw,zstd,kivi4 --skip remote --out "$OUT/gpu_tiers_8b.json" ;;
        disk) run_stage disk 200 python3 benchmarks/disk_restore.py --device cuda --shapes 1b,8b \
            --codecs raw,zstd,kivi4 --read-threads 1,4,8 --out "$OUT/disk_restore.json" ;;
        write) run_stage write 120 python3 benchmarks/disk_write.py --shape 8b --tokens 32768 \
            --rounds 2 --out "$OUT/disk_write_8b.json" ;;
        qa) run_stage qa 240 python3 benchmarks/multi_round_qa.py --shape 1b \
            --out "$OUT/multi_round_qa_1b.json" --plot "$OUT/multi_round_qa_1b.png" ;;
        probe) run_stage probe 120 python3 benchmarks/hit_profile.py --device cuda --shape 1b \
            --prefix 1024,8192 --out "$OUT/hit_profile_1b.json" ;;
        serve) run_stage serve 240 python3 benchmarks/serve_stream.py --shape 1b --device cuda \
            --batch 128 --new 256 --out "$OUT/serve_stream_1b.json" ;;
        *) echo "unknown stage $stage (tests, suite, engine, tiers, tiers8b, disk, write, qa, probe, serve)" >&2; exit 2 ;;
    esac
done
