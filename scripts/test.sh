#!/usr/bin/env bash
# Install triax with its test extras and run the whole suite (README: "Run the tests").
# torch is installed first and pinned, so pip never swaps in a CUDA build on a CPU machine;
# set TRIAX_TORCH_SPEC (e.g. "torch==2.13.0" from your CUDA index) to choose another build.
# Every other package is held at the version in tests/constraints.txt, so the suite runs tomorrow
# against what it ran against today (a new release of Accelerate or transformers changes nothing
# until that file is bumped).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q "${TRIAX_TORCH_SPEC:-torch==2.13.0}"
python3 -m pip install -q -c tests/constraints.txt -e ".[test]"
python3 -m pytest -q "$@"
