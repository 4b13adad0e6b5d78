#!/usr/bin/env bash
# The CUDA path on one GPU, in one prepared run of under 8 minutes on an H100 (bench/gpu_check.py):
# 2 groups x 1 rank on cuda:0 (gloo across groups), torchtitan's Llama 3 1B in bf16 with a tokenizer
# and data made from local text, a kill-heal, a hang and a corrupt drill; writes
# bench/results/gpu-check-*.json (and a copy into $OUT when set): step time, tokens/s, heal bytes and
# seconds, the drills' timelines, fingerprints and the data coverage.
#
#   bench/gpu_check.sh        # in the repository's root, on the GPU machine
#
# Needs python3 with torch==2.13.0 (a CUDA build), torchft 0.2.0, torchtitan 0.3.0 and this project's
# dependencies (pyproject.toml); on a machine without a package index, carry their wheels in .whl/:
# they are installed first.
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c 'import torch; assert torch.cuda.is_available(), "no GPU visible"; print(torch.__version__, torch.cuda.get_device_name(0))'
exec timeout 480 python3 -m bench.gpu_check ${OUT:+--out "$OUT"} "$@"
