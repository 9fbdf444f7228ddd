#!/usr/bin/env bash
# The GPU checks and benchmarks the notes report, each under a time limit, results in $OUT (default ./bench-out).
#   bash tests/bench/gpu_all.sh tests decode generate      # GPU tests, decode benchmark, generate.py
#   bash tests/bench/gpu_all.sh profile                    # decode benchmark + per-kernel profile
#   bash tests/bench/gpu_all.sh compile                    # medium forward+backward, regional, opaque KDA core
#   bash tests/bench/gpu_all.sh compile-chunk              # the same with the KDA core traced by Inductor
#   bash tests/bench/gpu_all.sh compile-triton             # the same with the KDA state pass in Triton
#   bash tests/bench/gpu_all.sh train                      # compiled training step at K3.1 Pro widths, 1 x 4096
#                                                          # (1 and 4 micro-batches per optimizer step), profiled
#   bash tests/bench/gpu_all.sh train-2048                 # the same at 1 x 2048 (the SFT recipe's rows), 1 and 8
#                                                          # micro-batches
#   bash tests/bench/gpu_all.sh train-attn                 # the training step on attn gather / triton / cudnn, eager
#   bash tests/bench/gpu_all.sh train-chunk                # the same with the KDA state pass as a scan
#   bash tests/bench/gpu_all.sh recompute                  # activation checkpointing: 1 x 4096 without and with
#   bash tests/bench/gpu_all.sh recompute-long             # with it: 1 x 8192, 1 x 16384
#   bash tests/bench/gpu_all.sh sparse-tests               # the Triton indexer and sparse MLA tests at real sizes
#   bash tests/bench/gpu_all.sh sparse                     # those kernels against the torch references and cuDNN
#                                                          # (tests/bench/sparse_kernels.py, 8K and 32K)
#   bash tests/bench/gpu_all.sh sparse-tune                # their launch sweep (tests/bench/sparse_tune.py, 8K)
#   bash tests/bench/gpu_all.sh sparse-l2                  # Nsight Compute's speed-of-light and memory sections of the
#                                                          # sparse forward and ds/p/dlatent kernels at 8K: are they
#                                                          # L2-bound (docs/performance.md, sparse round 12)?
#   bash tests/bench/gpu_all.sh cudnn-tests                # attn='cudnn' on the real kernels (cuDNN Frontend installed)
#   bash tests/bench/gpu_all.sh kda-triton-tests           # the Triton KDA kernels (forward, backward, decode) at
#                                                          # real sizes
#   bash tests/bench/gpu_all.sh kda-rows                   # the KDA core against fla's safe gate, one shape a part
#                                                          # (8192x96, 32768x32, 65536x8), then the decode step
#   bash tests/bench/gpu_all.sh kda-train                  # the compiled training step, kda triton and chunk_triton
#   bash tests/bench/gpu_all.sh kda                        # the KDA core and decode step against fla (tests/bench/kda.py)
#   bash tests/bench/gpu_all.sh kda-quick                  # the same without fla's chunk_kda (its autotuning is slow)
#   bash tests/bench/gpu_all.sh kda-decode-sweep           # the decode kernels' launch sweep
#   bash tests/bench/gpu_all.sh decode-graphs              # the decode step in CUDA graphs (kda chunk and triton)
#   bash tests/bench/gpu_all.sh fsdp-eager                 # 2 GPUs (FSDP2) against 1: loss per step, tokens/s
#   bash tests/bench/gpu_all.sh fsdp                       # the same compiled (two medium compiles)
#   bash tests/bench/gpu_all.sh fsdp-fp32                  # fsdp-eager in fp32 without TF32: parity to rounding
#   bash tests/bench/gpu_all.sh long-prefill               # generate's compiled prefill of 131,072 tokens, profiled
#   bash tests/bench/gpu_all.sh long-train                 # 1 x 32768, 64 experts top 16, LoRA, recompute, profiled
#   bash tests/bench/gpu_all.sh long-train-64k             # the same at 1 x 65536, not profiled
# Each part prints "<part> rc=<exit code> <seconds> s" at the end of its file; rc 124 means it hit its limit.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONWARNINGS=ignore   # keeps an installed carry's path
# a Triton cache carried in .dev-b/tcache (kept from earlier calls' $OUT): fla's autotuning results are reused
# (TRITON_CACHE_AUTOTUNING), saving the minutes a shape costs the first time on a fresh machine
if [ -d .dev-b/tcache ] && [ -z "${TRITON_CACHE_DIR:-}" ]; then
  export TRITON_CACHE_DIR=$PWD/.dev-b/tcache TRITON_CACHE_AUTOTUNING=1
fi
run() {  # run <part> <seconds> <command...>
  local part=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$part.txt" 2>&1
  echo "$part rc=$? $(( $(date +%s) - t0 )) s" >> "$OUT/$part.txt"
  tail -n 12 "$OUT/$part.txt"
}
for part in "$@"; do
  case $part in
    tests) run tests 560 python -m pytest -q -x tests/test_delta_rule_triton.py tests/test_experts_triton.py \
             tests/test_gpu.py tests/test_decode.py::test_decode_step_cuda_graphs tests/test_delta_rule.py \
             -k "not test_delta_rule.py or triton" ;;
    decode) run decode 120 python -W ignore tests/bench/decode.py ;;
    profile) run profile 220 python -W ignore tests/bench/decode.py --profile ;;
    generate)
      python -c "import kimi; c = kimi.preset('tiny'); kimi.save_checkpoint('$OUT/tiny-ckpt', c, kimi.init_params(c, seed=0))" \
        2>/dev/null || true
      run generate 150 python -W ignore generate.py --checkpoint "$OUT/tiny-ckpt" --prompt "def forward(" \
        --max-new-tokens 300 --sampling.temperature 0 ;;
    compile) run compile 400 python -W ignore tests/bench/compile.py --presets medium --devices cuda --batch 2 \
               --regional --passes forward+backward --kda chunk_opaque ;;
    compile-chunk) run compile-chunk 560 python -W ignore tests/bench/compile.py --presets medium --devices cuda \
                     --batch 2 --regional --passes forward+backward --kda chunk ;;
    compile-triton) run compile-triton 560 python -W ignore tests/bench/compile.py --presets medium --devices cuda \
                      --batch 2 --regional --passes forward+backward --kda chunk_triton ;;
    train) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
             run train 560 python -W ignore tests/bench/train.py --warmup 2 --steps 3 --accum 1 4 --profile ;;
    train-2048) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
                  run train-2048 560 python -W ignore tests/bench/train.py --seq 2048 --warmup 2 --steps 3 --accum 1 8 ;;
    train-attn)   # the training step on each sparse path, eager (no compile; the KDA core recomputed in its
                  # backward, as eager chunk intermediates of 4 layers do not fit beside AdamW), 1 x 4096
      for attn in gather triton cudnn; do
        PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True run "train-$attn" 200 python -W ignore tests/bench/train.py \
          --warmup 1 --steps 2 --no-compile --kda chunk_opaque --attn "$attn"
      done ;;
    train-chunk) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
                   run train-chunk 560 python -W ignore tests/bench/train.py --warmup 2 --steps 3 --kda chunk ;;
    recompute|recompute-long)
      if [ "$part" = recompute ]; then shapes=("--seq 4096" "--seq 4096 --recompute")
      else shapes=("--seq 8192 --recompute" "--seq 16384 --recompute"); fi
      for args in "${shapes[@]}"; do
        PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True run "train${args//[^0-9a-z]/-}" 280 \
          python -W ignore tests/bench/train.py --warmup 2 --steps 3 $args
      done ;;
    sparse-tests) run sparse-tests 300 python -m pytest -q -x tests/test_sparse_mla_triton.py \
                    tests/test_indexer_triton.py -m gpu ;;
    sparse) run sparse 400 python -W ignore tests/bench/sparse_kernels.py ;;
    sparse-l2) run sparse-l2 400 ncu --kernel-name regex:'_fwd_chunks_kernel|_bwd_pds_kernel' --launch-count 4 \
                 --section SpeedOfLight --section MemoryWorkloadAnalysis \
                 --metrics lts__t_bytes.sum,lts__t_bytes.sum.per_second \
                 python -W ignore tests/bench/sparse_kernels.py --tokens 8192 --iters 1 --no-indexer ;;
    sparse-tune) run sparse-tune 400 python -W ignore tests/bench/sparse_tune.py --tokens 8192 ;;
    cudnn-tests) run cudnn-tests 400 python -m pytest -q -x -rP tests/test_cudnn_backend.py -m gpu ;;
    kda-triton-tests) run kda-triton-tests 400 python -m pytest -q tests/test_kda_triton.py \
                        tests/test_kda_bwd_triton.py tests/test_kda_decode_triton.py -m gpu ;;
    kda-rows)   # each shape under its own limit (fla autotunes its chunk_kda once a shape: minutes where uncached)
      for shape in 8192x96 32768x32 65536x8; do
        run "kda-$shape" 240 python -W ignore tests/bench/kda.py --shapes "$shape" --iters 10 --no-decode \
          --fla-safe-only --variants defaults
      done
      run kda-decode 120 python -W ignore tests/bench/kda.py --shapes --iters 20 ;;
    kda-train)
      for kda in triton chunk_triton; do
        PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True run "train-kda-$kda" 280 python -W ignore \
          tests/bench/train.py --warmup 2 --steps 3 --kda "$kda"
      done ;;
    kda) run kda 400 python -W ignore tests/bench/kda.py ;;
    decode-graphs) run decode-graphs 200 python -m pytest -q -x tests/test_decode.py -m gpu ;;
    kda-quick) run kda-quick 150 python -W ignore tests/bench/kda.py --no-fla-chunk ;;
    kda-decode-sweep) run kda-decode-sweep 300 python -W ignore tests/bench/kda.py --shapes --decode-sweep ;;
    fsdp) run fsdp 580 python -W ignore tests/bench/fsdp.py ;;
    fsdp-eager) run fsdp-eager 580 python -W ignore tests/bench/fsdp.py --compile off ;;
    fsdp-fp32) run fsdp-fp32 580 python -W ignore tests/bench/fsdp.py --compile off --dtype float32 --no-tf32 \
                 --steps 12 ;;
    long-prefill) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
                    run long-prefill 300 python -W ignore tests/bench/dsa.py --tokens --prefill 131072 --profile ;;
    long-train|long-train-64k)   # the long-context issue's training rows: LoRA over a frozen bf16 base
      if [ "$part" = long-train ]; then args=(--seq 32768 --profile); else args=(--seq 65536); fi
      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True run "$part" 330 python -W ignore tests/bench/train.py \
        --experts 64 --topk 16 --lora-rank 16 --recompute --warmup 1 --steps 2 "${args[@]}" ;;
    *) echo "unknown part $part (tests, decode, profile, generate, compile, compile-chunk, compile-triton, train, train-2048, train-attn, train-chunk, recompute, recompute-long, sparse-tests, sparse, sparse-tune, sparse-l2, cudnn-tests, kda-triton-tests, kda-rows, kda-train, kda, kda-quick, kda-decode-sweep, decode-graphs, fsdp, fsdp-eager, fsdp-fp32, long-prefill, long-train, long-train-64k)"; exit 2 ;;
  esac
done
