#!/usr/bin/env bash
# Download the wheels the GPU checks can use (Lightning, Keras and what they import) for
# the GPU machine's Python 3.12 into tests/gpu/wheels (git-ignored; carried to the machine).
set -euo pipefail
cd "$(dirname "$0")"
mkdir -p wheels
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --implementation cp -d wheels \
    lightning==2.6.6 lightning-utilities torchmetrics fsspec tqdm pyyaml packaging \
    typing-extensions keras==3.15.1 absl-py namex rich markdown-it-py mdurl pygments optree h5py
ls wheels
