#!/usr/bin/env bash
# The first GPU check in one command: install a CUDA jax, run the compiled kernel tests,
# then `python -m benchmarks.kernels` (each kernel's GB/s beside a copy's and the XLA
# codec's, same run), each phase under its own time limit (8 min in all at most),
# writing what it found under $OUT. Made for a machine that gets a copy of the working
# tree and one bash command (H100/H200, Python 3.12, CUDA 12, package registries only).
#
#   bash scripts/gpu_check.sh            on a CUDA GPU (sm_90+ runs the Mosaic GPU kernels)
#   bash scripts/gpu_check.sh --dry-run  the same steps on a CPU, quickly: the kernels in
#                                        interpret mode, a few interpret tests, a tiny size
#
# Writes to $OUT (default ./gpu_check_out): summary.md (each phase's command, exit code
# and seconds, then the table), env.txt (python, jax, devices, nvidia-smi), setup.log,
# tests.log, tests.xml (junit), kernels.md (the benchmark's table, rewritten after each
# size, so a phase cut by its limit keeps what it measured) and bench.log.
# Environment:
#   OUT                  the output folder
#   JAXCOMP_GPU_PYTHON   an interpreter with jaxcomp and a CUDA jax already: no setup
#   JAXCOMP_GPU_VENV     the venv to create (default .venv-gpu in the checkout)
#   JAXCOMP_GPU_JAX      the jax to install (default jax[cuda12]==0.12.0.1, the jax the
#                        Mosaic GPU kernels are tested with on CPU)
#   JAXCOMP_GPU_LIMITS   seconds for setup, tests, benchmark (default "180 120 130")
#   JAXCOMP_GPU_SIZES    the benchmark's log2 sizes (default 20,24,27)
# Exit code: 0 when every phase passed, else 1 (the summary says which failed).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

dry_run=0
case "${1:-}" in
  "") ;;
  --dry-run) dry_run=1 ;;
  --setup) ;; # internal: the setup phase, run under `timeout` (below)
  *)
    echo "usage: bash scripts/gpu_check.sh [--dry-run]" >&2
    exit 2
    ;;
esac

# The setup phase: a venv with jaxcomp, a CUDA jax and the tests' packages; prints its
# python. Runs as `gpu_check.sh --setup` under `timeout` (which runs programs, not
# functions).
setup() {
  local venv="${JAXCOMP_GPU_VENV:-$root/.venv-gpu}"
  local jax_spec="${JAXCOMP_GPU_JAX:-jax[cuda12]==0.12.0.1}"
  # A Python >= 3.12 (jax 0.12 needs it): $JAXCOMP_PYTHON312, python3.12, pyenv's, python3.
  local python candidate
  for candidate in "${JAXCOMP_PYTHON312:-}" python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3 python3; do
    if [ -n "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info >= (3, 12)' 2> /dev/null; then
      python="$candidate"
      break
    fi
  done
  if [ -z "${python:-}" ]; then
    echo "error: no Python >= 3.12 found (set JAXCOMP_PYTHON312)" >&2
    return 1
  fi
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv" || return 1
  "$venv/bin/python" -m pip install --quiet --upgrade pip || return 1
  # What the kernel tests and the benchmark import, not the examples' or docs' extras.
  "$venv/bin/python" -m pip install --quiet -e "$root" "$jax_spec" chex pytest hypothesis \
    || return 1
  echo "$venv/bin/python"
}

if [ "${1:-}" = "--setup" ]; then
  setup
  exit
fi

out="${OUT:-$root/gpu_check_out}"
mkdir -p "$out"
read -r limit_setup limit_tests limit_bench <<< "${JAXCOMP_GPU_LIMITS:-180 120 130}"
summary="$out/summary.md"
status=0
{
  echo "# jaxcomp GPU check ($(date -u +%Y-%m-%dT%H:%M:%SZ), dry run: $dry_run)"
  echo
  echo "git: $(git rev-parse --short HEAD 2> /dev/null || echo unknown)" \
    "$(git status --porcelain 2> /dev/null | grep -q . && echo '(uncommitted changes)')"
  echo
  echo "| phase | exit | seconds | limit | command |"
  echo "|---|---:|---:|---:|---|"
} > "$summary"

# phase NAME LIMIT LOG CMD...: runs CMD under `timeout`, logs its output, adds a row.
phase() {
  local name="$1" limit="$2" log="$3"
  shift 3
  local start code
  start=$(date +%s)
  echo "== $name (limit ${limit}s): $*" >&2
  timeout --kill-after=5 "$limit" "$@" > "$log" 2>&1
  code=$?
  echo "| $name | $code$([ "$code" -eq 124 ] && echo ' (timed out)') |" \
    "$(($(date +%s) - start)) | $limit | \`$*\` |" >> "$summary"
  [ "$code" -eq 0 ] || status=1
  tail -n 5 "$log" >&2
  return "$code"
}

if [ -n "${JAXCOMP_GPU_PYTHON:-}" ]; then
  py="$JAXCOMP_GPU_PYTHON"
  echo "| setup | skipped | 0 | - | JAXCOMP_GPU_PYTHON=$py |" >> "$summary"
elif [ "$dry_run" -eq 1 ]; then
  py="$(bash "$root/scripts/setup.sh" 3.12)" || exit 1
  echo "| setup | skipped (dry run: scripts/setup.sh 3.12) | 0 | - | $py |" >> "$summary"
else
  if phase setup "$limit_setup" "$out/setup.log" bash "$root/scripts/gpu_check.sh" --setup; then
    py="$(tail -n 1 "$out/setup.log")"
  else
    echo "setup failed: see $out/setup.log" >&2
    exit 1
  fi
fi

if [ "$dry_run" -eq 1 ]; then
  export JAX_PLATFORMS=cpu
  select="interpret and (test_quantize_max_norm or (every_shape and 1000))"
  bench_args=(--interpret --sizes 12 --repeats 1 --ragged)
else
  # tests/conftest.py defaults JAX_PLATFORMS to cpu; the compiled tests need the GPU
  # first (and the 8 CPU devices it sets up besides).
  export JAX_PLATFORMS=cuda,cpu
  select="compiled"
  bench_args=(--sizes "${JAXCOMP_GPU_SIZES:-20,24,27}" --repeats 10 --ragged)
fi

{
  "$py" -c 'import sys, jax; print("python", sys.version.split()[0]); print("jax", jax.__version__); print("devices", jax.devices())' 2>&1
  nvidia-smi 2>&1 || echo "(no nvidia-smi)"
} > "$out/env.txt"

if [ "$dry_run" -eq 0 ]; then
  # Without a GPU every compiled test would be skipped and the benchmark refuse: say so.
  phase gpu 30 "$out/gpu.log" "$py" -c \
    'import jax; d = jax.devices()[0]; print(d, d.device_kind); assert d.platform == "gpu", d'
fi

# The compiled kernel tests (the `compiled` parameters of the kernel test files: Triton
# and Mosaic GPU against the XLA path), or in a dry run a few interpret-mode ones.
# XLA's default optimizations, as a user compiles (tests/conftest.py defaults to cheap
# compiles for the CPU suite).
phase tests "$limit_tests" "$out/tests.log" \
  env JAX_DISABLE_MOST_OPTIMIZATIONS=0 "$py" -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_mosaic_kernels.py \
  -k "$select" --junitxml="$out/tests.xml"

phase benchmark "$limit_bench" "$out/bench.log" \
  "$py" -m benchmarks.kernels "${bench_args[@]}" --out "$out/kernels.md"

{
  echo
  grep -h "passed\|failed\|error" "$out/tests.log" | tail -n 1
  echo
  [ -f "$out/kernels.md" ] && cat "$out/kernels.md"
} >> "$summary"
echo "results: $out (summary.md)" >&2
exit "$status"
