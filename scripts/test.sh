#!/usr/bin/env bash
# Install triax with its test extras and run the whole suite (README: "Run the tests").
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e ".[test]"
python3 -m pytest -q "$@"
