#!/usr/bin/env bash
# Download the pure-Python wheels the GPU checks can use (Lightning and what it imports) for
# the GPU machine's Python 3.12 into tests/gpu/wheels (git-ignored; carried to the machine).
set -euo pipefail
cd "$(dirname "$0")"
mkdir -p wheels
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --implementation cp -d wheels \
    lightning==2.6.6 lightning-utilities torchmetrics fsspec tqdm pyyaml packaging \
    typing-extensions
ls wheels
