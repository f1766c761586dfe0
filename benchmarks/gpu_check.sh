#!/usr/bin/env bash
# A clean checkout on a bare GPU machine: install the project, then measure in what is left of 13 minutes.
# With no package index there: GPU_CHECK_SITE=<archive from benchmarks/offline_site.py> is unpacked and put on
# PYTHONPATH instead (the image's own torch, numpy, pyarrow and OpenCV are used).
set -euo pipefail; cd "$(dirname "$0")/.."
if [[ -n "${GPU_CHECK_SITE:-}" ]]; then
  site=$(mktemp -d); python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='tar')" "$GPU_CHECK_SITE" "$site"
  export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  python3 -m pip install --quiet --progress-bar off -e ".[test]"
fi
python3 benchmarks/gpu_check.py --total-s "${GPU_CHECK_TOTAL_S:-$((780 - SECONDS - 20))}" "$@"
