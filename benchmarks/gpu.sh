#!/usr/bin/env bash
# The GPU comparisons of issue 25, as one short run: about 9-10 minutes on an H200 for the default
# parts (the sum of their times in separate calls there, 2026-11-27; finetune_graphs and Infinity's
# side of embed estimated). Not yet run as one: two calls of PARTS fit the device's per-call limit.
# Each part has its own limit, so one that hangs does not take the others with it.
#
#   bash benchmarks/gpu.sh [MINILM_DIR]
#   PARTS="a b" bash benchmarks/gpu.sh      # the named parts only, any of those below
#
# MINILM_DIR: an all-MiniLM-L6-v2 folder (default .gpu/minilm: a copy with fp16 weights, 45 MB,
# made by `make gpu-folder` so it can travel to a borrowed GPU machine that has no wheel of it).
# The default parts, in order: the machine and versions (machine); its measured ceilings,
# device-to-device copy and bf16 8192^3 products (ceilings); tests/jobs/test_cuda.py (test_cuda);
# BERT-base seq-128 bf16 pretraining against transformers' BertForMaskedLM (sdpa) as
# `train.compile: graphs` trains on one GPU, the whole model as CUDA graphs, at batch 32 (the
# issue's figure) and 256, with the share of each step the GPU is busy and its kernel time by kind
# (pretrain_b32_whole, pretrain_b256_whole); a fine-tuning step, MiniLM, padded batches, bf16, as
# `train.compile: graphs` fine-tunes on one GPU: rows cut to a multiple of 32, the whole task model
# as CUDA graphs (finetune_graphs); MiniLM sentence embeddings, float32 and float16, the replicas'
# `embed_now` (its passes as CUDA graphs, and eagerly) against sentence-transformers and Infinity's
# engine, then reranking in float16, our replica's /v1/rerank (graphs, eager) against
# sentence-transformers' CrossEncoder on the same weights (embed).
# Named only (the earlier sessions' steps, kept to compare against): the fine-tuning step with
# compiled blocks (finetune); pretraining with compiled blocks at batch 32
# (pretrain_b32_blocks), eager (pretrain_b32_eager), blocks as CUDA graphs (pretrain_b32_graphs);
# at batch 256 the blocks (pretrain_b256_blocks), with the bf16 residual stream
# (pretrain_b256_bf16res) and that without dropout (pretrain_b256_bf16res_nodrop); and inductor's
# GEMM autotuning, Triton templates with fused epilogues against cuBLAS (pretrain_b256_autotune);
# DDP and FSDP2 scaling over the machine's GPUs (scaling: benchmarks/gpu_scaling.py); the fine-tuning
# step at 128 rows a batch, bf16, ours eager and padded (finetune_b128_eager), then eager on the real
# tokens only as `train.unpad: true` runs it, attention over nested jagged tensors (finetune_b128_unpad).
# Logs go to $OUT/ when OUT is set. Wheels in .gpu/whl (`make gpu-folder`: pydantic, which the
# replica's settings need and the GPU machine's image lacks) are installed under /tmp/site first;
# .gpu/infinity.tar.xz (Infinity and the transformers<5 stack it pins) is unpacked into
# /tmp/infinity-site, which only gpu_embed.py's Infinity child puts on its path.
set -u
cd "$(dirname "$0")/.."
MINILM=${1:-.gpu/minilm}
LOGS=${OUT:-/tmp/gpu-logs}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
if ls .gpu/whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ -f .gpu/infinity.tar.xz ]; then
  mkdir -p /tmp/infinity-site && tar -xJf .gpu/infinity.tar.xz -C /tmp/infinity-site
fi

DEFAULT_PARTS="machine ceilings test_cuda pretrain_b32_whole pretrain_b256_whole finetune_graphs embed"
PARTS=${PARTS:-$DEFAULT_PARTS}  # names of the parts to run, space-separated

part() {  # part NAME SECONDS COMMAND...: run with a limit, log to $LOGS/NAME.log, go on either way
  local name=$1 limit=$2
  shift 2
  if [[ " $PARTS " != *" $name "* ]]; then return; fi
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
part test_cuda 260 $PY -m pytest tests/jobs/test_cuda.py -q -p no:cacheprovider
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
# data-parallel scaling, DDP and FSDP2 over the machine's GPUs (named only: the machines lent so far have one)
part scaling 400 $PY benchmarks/gpu_scaling.py --device cuda --preset base --steps 20
part finetune 90 $PY benchmarks/finetune_throughput.py --device cuda --precision bf16 --blocks --rounds 5 --threads 16 --model-dir "$MINILM"
part finetune_graphs 150 $PY benchmarks/finetune_throughput.py --device cuda --precision bf16 --graphs --rounds 5 --threads 16 --model-dir "$MINILM"
part finetune_b128_eager 90 $PY benchmarks/finetune_throughput.py --device cuda --precision bf16 --batch 128 --rounds 3 --threads 16 --model-dir "$MINILM"
part finetune_b128_unpad 90 $PY benchmarks/finetune_throughput.py --device cuda --precision bf16 --unpad --batch 128 --rounds 3 --threads 16 --model-dir "$MINILM"
# the peers' fast tokenizers on their default threads (TOKENIZERS_PARALLELISM unset), ours on its pool
part embed 240 env -u TOKENIZERS_PARALLELISM $PY benchmarks/gpu_embed.py --model-dir "$MINILM" --infinity-site /tmp/infinity-site
echo "=== summary"
grep -H "speedup_vs_transformers\|^mfu\|mfu_ceiling\|gpu_busy\|^kernels\|host syncs\|embed_vs\|graphs_speedup\|rerank_vs\|passed\|failed\|error" "$LOGS"/*.log | grep -v "^.*machine.log"
