#!/usr/bin/env bash
# The GPU checks of ringplug's NCCL data plane: one GPU, one rank, under 5 minutes.
#
#   bash tests/gpu/check_gpu.sh            (from anywhere; runs the package from src/)
#
# Needs Python with a CUDA build of torch (which brings NCCL). No MPI is needed: one rank
# is a world of one. Optional wheels in tests/gpu/wheels (tests/gpu/fetch_wheels.sh puts
# Lightning's and Keras's there) are installed into a throwaway folder first. Prints PASS/FAIL/SKIP
# per check, then the GPU allreduce benchmark; exits non-zero if any check failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
SITE=$(mktemp -d /tmp/ringplug-gpu-site.XXXXXX)
trap 'rm -rf "$SITE"' EXIT
for wheel in tests/gpu/wheels/*.whl; do  # one at a time: one that does not fit skips alone
    [ -e "$wheel" ] || continue
    "$PYTHON" -m pip install --quiet --no-deps --no-index --target "$SITE" "$wheel" 2>/dev/null \
        || echo "note: $wheel does not install here; checks that need it will skip"
done
export PYTHONPATH="$PWD/src:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
failed=0

echo "== machine"
nvidia-smi -L || true
"$PYTHON" -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"

echo "== torch CUDA tensors through NCCL (tests/gpu/check_gpu.py)"
timeout 200 "$PYTHON" tests/gpu/check_gpu.py || failed=1

echo "== the CUDA runtime path without torch (tests/gpu/check_cudart.py)"
timeout 60 "$PYTHON" tests/gpu/check_cudart.py || failed=1

echo "== a Lightning fit on the GPU with ringplug's defaults (tests/gpu/check_fits.py lightning)"
timeout 120 "$PYTHON" tests/gpu/check_fits.py lightning || failed=1

echo "== a Keras fit on the GPU, JAX and torch backends (tests/gpu/check_fits.py keras)"
timeout 120 "$PYTHON" tests/gpu/check_fits.py keras --backend jax || failed=1
timeout 120 "$PYTHON" tests/gpu/check_fits.py keras --backend torch || failed=1

echo "== ringplug-bench allreduce --device cuda (ringplug vs torch.distributed NCCL, 1 rank)"
timeout 120 "$PYTHON" -m ringplug.bench.cli allreduce --device cuda --min-size 4K \
    --max-size 256M --budget 0.1 || failed=1

echo "== check_gpu.sh: $([ $failed = 0 ] && echo all passed || echo FAILURES above)"
exit $failed
