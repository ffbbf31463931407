#!/usr/bin/env bash
# Every GPU check of the open issues in one run, for a lent GPU machine (one H200 / H100 class device; the
# device tool allows 10 minutes a command): the gpu-marked tests, then each bench/gpu_*.py with a budget.
# Results and logs go under $OUT (default ./gpu_out); bench/RESULTS.md gets the figures by hand afterwards.
#   bash scripts/gpu_all.sh            # ~9 min in all
#   bash scripts/gpu_all.sh --dry-run  # each script's plan only (no GPU needed)
set -u
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
if ! python -c "import lightning_scale.kernels" 2>/dev/null; then  # not installed: run from the tree
    [ -e lightning_scale/kernels ] || ln -s ../kernels lightning_scale/kernels
    # the package alone on the path, not the repository root: the root's kernels/ would shadow the PyPI package
    # `kernels` that transformers imports, and every Hugging Face model of the benches would fail to build
    PKG_PATH="$(mktemp -d)"
    ln -s "$PWD/lightning_scale" "$PKG_PATH/lightning_scale"
    export PYTHONPATH="$PKG_PATH${PYTHONPATH:+:$PYTHONPATH}"
fi
step() {  # step NAME SECONDS CMD...: run with a hard limit, log to $OUT/NAME.log, never stop the whole script
    local name=$1 limit=$2; shift 2
    echo "=== $name (limit ${limit}s): $*" | tee -a "$OUT/summary.txt"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "    rc=$rc after $((SECONDS - t0))s; last lines:" | tee -a "$OUT/summary.txt"
    tail -n 25 "$OUT/$name.log" | tee -a "$OUT/summary.txt"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/device.txt" 2>&1
python -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())" \
    >> "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"
if [ "${1:-}" = "--dry-run" ]; then
    for s in gpu_zero gpu_models gpu_checkpoint gpu_long_sequence; do python "bench/$s.py" --dry-run; done
    exit 0
fi
step tests_gpu 100 python -m pytest -q -m gpu -p no:cacheprovider -o addopts="" tests/kernels tests/dist/test_zero3.py tests/unit/test_tiled_attention.py tests/dist/test_tune_probe.py
step gpu_zero 140 python bench/gpu_zero.py --compile --rounds 1 --steps 10 --budget-s 90 --out "$OUT/gpu_zero"
# the autotuner's CLI probing on the GPU (nccl, the GPU's bytes vs the device prediction), one rank
step tune_cli 40 python -m lightning_scale.tune --model gpt_small --devices 1 --memory-budget 8GiB --device cuda --max-probes 4 --confirm 0 --budget-s 30 --results "$OUT/tune.jsonl"
step gpu_sparse_attention 60 python bench/gpu_sparse_attention.py --rounds 1 --lengths 4096 16384 --head-dims 64
step gpu_long_sequence 80 python bench/gpu_long_sequence.py --systems dense,ac_offload_chunked_tiled_heads,rotary_ac_offload_chunked_tiled_heads --out "$OUT/gpu_long_sequence"
step gpu_models 80 python bench/gpu_models.py --rounds 1 --steps 5 --out "$OUT/gpu_models"
step gpu_checkpoint 50 python bench/gpu_checkpoint.py --rounds 1 --out "$OUT/gpu_checkpoint"
# one tp rank's mixture-of-experts work, every expert split vs the experts placed (expert_parallel), tp 2 / 4 / 8;
# and Llama 4 Scout's MoE layer, transformers' dense path vs routed (tensor_parallel/routed_experts.py); and litgpt's
# LLaMAMoE at Qwen3-30B-A3B's layer, its own loop vs the routed list (tensor_parallel/expert_lists.py; rows flushed one
# by one, so a limit hit keeps the rows done)
step gpu_experts 45 python bench/gpu_experts.py --reps 3 --llama4 scout --litgpt qwen3_30b
# bench/gpu_tensor_parallel.py needs 2 or more GPUs (torchrun --nproc-per-node N); not run on one device.
echo "done; see $OUT/summary.txt"
