#!/usr/bin/env bash
# GPU check of the Triton backend (tests + timing table); see tests/gpu_check.py --help.
cd "$(dirname "$0")/.." && exec python tests/gpu_check.py "$@"
