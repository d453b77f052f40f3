#!/usr/bin/env bash
# The GPU checks of issue 14, for a machine with CUDA GPUs (run by a session through `device`).
# Wheels for what the machine's Python lacks travel in .whl (see docs/benchmarks.md, "The NCCL path").
# Every figure and log lands in $OUT (default ./out/gpu).
set -u
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/tmp/site" OMP_NUM_THREADS=4
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
step() { echo "=== $1"; }
{
    step environment
    nvidia-smi -L
    python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count(), 'megatron-core', m.__version__)"
    python3 -m liver.cli.main data prepare --input examples/data/corpus.txt --output-prefix /tmp/gc/corpus
    n=$(python3 -c "import torch; print(torch.cuda.device_count())")
    step "the example job on 1 GPU, NCCL, moving live to the same layout after step 3 (stream on the GPU)"
    timeout 180 torchrun --nproc-per-node 1 examples/your_own_job.py --data /tmp/gc/corpus --steps 6 \
        --reshard-at 3 --reshard-to 1,1,1 --backend nccl --json; echo "rc=$?"
    step "the example job on 1 GPU with the distributed optimizer"
    timeout 180 torchrun --nproc-per-node 1 examples/your_own_job.py --data /tmp/gc/corpus --steps 6 \
        --reshard-at 3 --reshard-to 1,1,1 --backend nccl --distributed-optimizer --json; echo "rc=$?"
    if [ "$n" -ge 2 ]; then
        step "TP1,PP1,DP2 -> TP2,PP1,DP1 on 2 GPUs, NCCL"
        timeout 300 torchrun --nproc-per-node 2 examples/your_own_job.py --data /tmp/gc/corpus --steps 6 \
            --reshard-at 3 --reshard-to 2,1,1 --backend nccl --json; echo "rc=$?"
    else
        step "two NCCL ranks on one GPU (NCCL refuses a GPU shared by two ranks of a communicator)"
        timeout 120 python3 scripts/nccl_two_ranks_one_gpu.py; echo "rc=$?"
    fi
} 2>&1 | tee "$OUT/gpu_check.log"
