#!/usr/bin/env bash
# The GPU checks of ringplug's NCCL data plane, on a machine with one GPU: at most 8 minutes.
#
#   bash tests/gpu/check_gpu.sh                 (from anywhere; runs the package from src/)
#   bash tests/gpu/check_gpu.sh --device cpu    (the dry run: what can run on CPU tensors)
#   bash tests/gpu/check_gpu.sh --plan          (the steps and their timeouts)
#
# Needs Python with a CUDA build of torch (which brings NCCL) and, for the two-rank steps,
# mpi4py with an MPI library (ringplug[mpich]). Optional wheels in tests/gpu/wheels
# (tests/gpu/fetch_wheels.sh puts Lightning's there) are installed into a throwaway folder
# first. Each step runs under its own timeout (tests/gpu/run_checks.py, most informative
# first); the report is $OUT/gpu-report.json (or ./gpu-report.json); exits 1 if a step
# failed or ran out of time.
set -uo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
SITE=$(mktemp -d /tmp/ringplug-gpu-site.XXXXXX)
trap 'rm -rf "$SITE"' EXIT
# At most 45 s for the wheels, 420 s for the checks (their own timeouts add up to 400 s).
if compgen -G "tests/gpu/wheels/*.whl" >/dev/null; then
    timeout 45 "$PYTHON" -m pip install --quiet --no-deps --no-index --target "$SITE" \
        tests/gpu/wheels/*.whl 2>/dev/null \
        || echo "note: the wheels in tests/gpu/wheels did not install here; checks that need them skip"
fi
export PYTHONPATH="$PWD/src:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
nvidia-smi -L 2>/dev/null || echo "note: no nvidia-smi here"
exec timeout 420 "$PYTHON" tests/gpu/run_checks.py "$@"
