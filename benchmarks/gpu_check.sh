#!/usr/bin/env bash
# A clean checkout on a bare GPU machine: install the project, then measure in what is left of 13 minutes.
set -euo pipefail; cd "$(dirname "$0")/.."; python3 -m pip install --quiet --progress-bar off -e ".[test]" && python3 benchmarks/gpu_check.py --total-s $((780 - SECONDS - 20)) "$@"
