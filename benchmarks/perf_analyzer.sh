#!/usr/bin/env bash
# Triton's perf_analyzer against teacher-server: gRPC sync, gRPC async (-a), gRPC streaming
# (--streaming) and HTTP, each printing the tool's own "Throughput: ..." lines.
#
#   benchmarks/perf_analyzer.sh                 # RefTeacher (examples.refteacher), batch 8, concurrency 4
#   BATCH=1 CONCURRENCY=8 WINDOW_MS=5000 benchmarks/perf_analyzer.sh
#   benchmarks/perf_analyzer.sh --setup         # only install perf_analyzer (the test suite does this)
#
# perf_analyzer ships as bin/perf_analyzer in the tritonclient 2.48 wheel. It is installed into its
# own virtualenv outside the repository (created once, then reused), never into the project's: it
# pulls in the CUDA runtime wheel (libcudart.so.12, needed even on CPU) and it needs libb64.so.0d
# (Debian/Ubuntu: libb64-0d), which is installed with apt-get when this runs as root.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PA_VENV="${PA_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/distill-mesh/perf-analyzer-venv}"
PY="${PY:-$REPO/.venv/bin/python}"
MODEL="${MODEL:-examples.refteacher:build}"
NAME="${NAME:-ref_teacher}"
BATCH="${BATCH:-8}"
CONCURRENCY="${CONCURRENCY:-4}"
WINDOW_MS="${WINDOW_MS:-3000}"
INSTANCES="${INSTANCES:-0}"  # 0: the server's default (one per core on CPU)
MODES="${MODES:-sync async streaming http}"

# ---- perf_analyzer's private virtualenv (idempotent) ------------------------------------------
if [ ! -x "$PA_VENV/bin/perf_analyzer" ]; then
    echo "installing perf_analyzer into $PA_VENV" >&2
    python3 -m venv "$PA_VENV"
    "$PA_VENV/bin/pip" install -q 'tritonclient[all]==2.48.*' nvidia-cuda-runtime-cu12
fi
CUDART_DIR="$(ls -d "$PA_VENV"/lib/python3*/site-packages/nvidia/cuda_runtime/lib | head -n1)"
export LD_LIBRARY_PATH="$CUDART_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if ! ldconfig -p | grep -q 'libb64\.so\.0d'; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        # A fresh machine may have no package lists yet: update them once if the install fails.
        apt-get install -y -q libb64-0d >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q libb64-0d >/dev/null; }
    else
        echo "perf_analyzer needs libb64.so.0d: install libb64-0d (apt-get install libb64-0d) and run again" >&2
        exit 1
    fi
fi
PA="$PA_VENV/bin/perf_analyzer"
if [ "${1:-}" = "--setup" ]; then
    echo "$PA"
    exit 0
fi

# ---- a teacher on free ports, stopped on exit ---------------------------------------------------
WORK="$(mktemp -d)"
TEACHER_PID=""
cleanup() {
    if [ -n "$TEACHER_PID" ] && kill -0 "$TEACHER_PID" 2>/dev/null; then
        kill -TERM "$TEACHER_PID"
        wait "$TEACHER_PID" || true
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT
(cd "$REPO" && PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" -m teacher_server --model "$MODEL" \
    --name "$NAME" --device cpu --instances "$INSTANCES" --port 0 --http-port 0 \
    --ready-file "$WORK/ready.json" --log-level WARNING) &
TEACHER_PID=$!
for _ in $(seq 120); do
    [ -f "$WORK/ready.json" ] && break
    kill -0 "$TEACHER_PID" 2>/dev/null || { echo "teacher-server exited before it was ready" >&2; exit 1; }
    sleep 0.5
done
[ -f "$WORK/ready.json" ] || { echo "teacher-server not ready after 60 s" >&2; exit 1; }
GRPC_URL="$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["endpoint"])' "$WORK/ready.json")"
HTTP_URL="127.0.0.1:$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["http_port"])' "$WORK/ready.json")"

# ---- the runs -----------------------------------------------------------------------------------
# -s 50: a shared CPU machine rarely gives three windows within perf_analyzer's default 10%.
COMMON=(-m "$NAME" -b "$BATCH" --concurrency-range "$CONCURRENCY" --measurement-interval "$WINDOW_MS" -s 50)
status=0
for mode in $MODES; do
    case "$mode" in
        sync) args=(-i grpc -u "$GRPC_URL") ;;
        async) args=(-i grpc -u "$GRPC_URL" -a) ;;
        streaming) args=(-i grpc -u "$GRPC_URL" --streaming) ;;
        http) args=(-i http -u "$HTTP_URL") ;;
        *) echo "unknown mode $mode (sync, async, streaming, http)" >&2; exit 2 ;;
    esac
    echo "== $mode: perf_analyzer ${args[*]} ${COMMON[*]}"
    if ! "$PA" "${args[@]}" "${COMMON[@]}" > "$WORK/$mode.log" 2>&1; then
        status=1
        echo "perf_analyzer failed in mode $mode:" >&2
        tail -n 20 "$WORK/$mode.log" >&2
        continue
    fi
    grep -E 'Throughput:|Avg latency:|p99 latency:' "$WORK/$mode.log"
done
exit "$status"
