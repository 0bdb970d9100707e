#!/usr/bin/env bash
# The stronger pair in one GPU sitting (about 9 minutes on one H200):
#   1. the target on a corpus pack (stdlib + permissively licensed packages; build it on a CPU first:
#      python -m dflash_lab.train corpus --out .data/code.jsonl.xz)
#   2. one set of fresh self-distillation data from that target (half of the prefixes from the standard
#      library, where the held-out prompts come from; half from files the target never trained on)
#   3. the paper's drafter (full attention, non-causal) and Poolside's (sliding window 64, causal),
#      side by side on the same GPU, the same data and the same time budget
# Acceptance is measured afterwards on a CPU in float32 (python -m dflash_lab.train evaluate).
#
#   OUT=runs/pair scripts/train_pair_h200.sh .data/code.jsonl.xz
#
# Budgets (seconds) and sizes can be overridden from the environment, e.g. for a CPU dry run.
set -euo pipefail
PACK=${1:-.data/code.jsonl.xz}
OUT=${OUT:-runs/pair}
CK=${CK:-/tmp/dflash_ck}
TARGET_BUDGET=${TARGET_BUDGET:-165}
DISTILL_BUDGET=${DISTILL_BUDGET:-85}
DRAFTER_BUDGET=${DRAFTER_BUDGET:-235}
NUM_SEQUENCES=${NUM_SEQUENCES:-400000}
GEN_BATCH=${GEN_BATCH:-8192}
BATCH=${BATCH:-256}
LAYERS=${LAYERS:-4}
DEVICE=${DEVICE:-cuda}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PY=${PY:-python3}
mkdir -p "$OUT" "$CK"
T=$CK/laguna-tiny-code

$PY -m dflash_lab.train target --device "$DEVICE" --corpus "$PACK" --tokenizer checkpoints/laguna-tiny-code \
    --out "$T" --epochs 3 --time-budget "$TARGET_BUDGET" ${TARGET_ARGS:-} 2>&1 | tee "$OUT/target.log"
tar -C "$CK" -cf - laguna-tiny-code | split -b 15M - "$OUT/target.tar."

$PY -m dflash_lab.train distill --device "$DEVICE" --target "$T" --corpus "$PACK" --data "$CK/distill.safetensors" \
    --num-sequences "$NUM_SEQUENCES" --gen-batch "$GEN_BATCH" --time-budget "$DISTILL_BUDGET" \
    --prefix-sources distill=0.25,train=0.25,distill_stdlib=0.25,train_stdlib=0.25 ${DISTILL_ARGS:-} 2>&1 \
    | tee "$OUT/distill.log"

for attention in paper poolside; do
  $PY -m dflash_lab.train drafter --device "$DEVICE" --target "$T" --data "$CK/distill.safetensors" \
      --attention "$attention" --layers "$LAYERS" --batch-size "$BATCH" --lr 2e-3 --warmup 200 --steps 100000 \
      --short-block-share 0.3 --eval-prompts 0 --time-budget "$DRAFTER_BUDGET" \
      --out "$CK/laguna-tiny-code-dflash-$attention" ${DRAFTER_ARGS:-} > "$OUT/drafter-$attention.log" 2>&1 &
done
wait
tail -n 3 "$OUT"/drafter-*.log
tar -C "$CK" -cf "$OUT/drafters.tar" laguna-tiny-code-dflash-paper laguna-tiny-code-dflash-poolside
ls -la "$OUT"
