#!/usr/bin/env bash
# Every GPU figure of BENCHMARKS.md in one command on a CUDA machine with nothing to download, in under 8 minutes:
# the CUDA tests, the train suite at a user's size, SFT (padded, packed, at a 128k vocabulary, the padded-shape
# comparison), GRPO, DPO at a 128k vocabulary, the
# contrastive step, in-context evaluation and --compile, each side's steps with MFU, the slowest steps' profiles.
#
#   bash benchmarks/gpu_run.sh [OUT_DIR]          # from the repository root; OUT_DIR defaults to $OUT, else gpu-out
#
# Python packages the machine lacks (or has in another version) come as wheels in .whl/ (an ignored folder), made
# where pip can download:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 -d .whl transformers==5.24.0 trl==1.16.0 datasets==5.2.0 dill==0.4.1 \
#     multiprocess==0.70.19 peft==0.21.2 sentence-transformers==6.2.0 regex==2026.11.19 \
#     liger-kernel==0.8.5  # transformers checks regex at import; liger-kernel for --use_liger_kernel's CUDA test
# They go into a folder put first on PYTHONPATH (over the machine's own versions; torch stays the machine's), then
# xgblora from this tree, --no-deps. DATA_DIR=DIR reads GSM8K, MultiRC and RTE/SST-2 rows from DIR (the layout of shared/data); without it
# the suite generates rows of the same lengths. BUDGET (seconds, default 380) is the suite's --gpu_budget_s: a part
# starts only while its estimate fits; the report is written after every part, so a run stopped at the hard limit
# (BUDGET + 60 s) keeps what it measured.
set -uo pipefail
out=${1:-${OUT:-gpu-out}}
budget=${BUDGET:-380}
mkdir -p "$out"
start=$(date +%s)

# a folder first on the path rather than a venv: the machine's python3 may itself be a venv, whose packages a
# --system-site-packages venv made from it would not see
py=${PYTHON:-python3}
site=/tmp/xgblora-gpu-site
rm -rf "$site"
if compgen -G ".whl/*.whl" > /dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl || exit 1
fi
"$py" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
    --target "$site" . 2> "$out/install.log" || { cat "$out/install.log"; exit 1; }
export PYTHONPATH="$site" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    "$py" - <<'EOF'
import importlib.metadata as md
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device")
for pkg in ("transformers", "accelerate", "peft", "trl", "datasets", "sentence-transformers", "xgblora"):
    print(pkg, md.version(pkg))
EOF
    echo "installs took $(( $(date +%s) - start )) s"
} 2>&1 | tee "$out/versions.txt"

data=()
if [ -n "${DATA_DIR:-}" ]; then data=(--data_dir "$DATA_DIR"); fi
timeout --signal=INT --kill-after=15 $(( budget + 60 )) \
    "$py" -m xgblora.cli bench --suite gpu --cuda_tests tests/test_cuda.py --gpu_budget_s "$budget" \
    "${data[@]}" --json "$out/gpu-suite.json" > "$out/gpu-suite.log" 2>&1
status=$?
tail -n 60 "$out/gpu-suite.log"
echo "gpu_run: exit $status after $(( $(date +%s) - start )) s; $out: $(ls "$out" | tr '\n' ' ')"
exit $status
