#!/usr/bin/env bash
# Continue training the shipped drafters in one GPU sitting (about 9 device-minutes on one H200):
#   1. fresh self-distillation data from the shipped target (a new seed: sequences the first run never saw),
#      kept in $CK so a second sitting on the same machine reuses it
#   2. the paper's drafter and Poolside's, side by side, each warm-started from $INIT/<drafter> and
#      reshaped on the way ($LAYERS layers, MLP width $WIDTH: see `reshape_drafter`), on the same data
#      and the same time budget
# Acceptance is measured afterwards on a CPU in float32 (python -m dflash_lab.train evaluate).
#
#   OUT=runs/continue INIT=checkpoints scripts/continue_pair_h200.sh .data/code.jsonl.xz
#   # a second sitting, from the first one's drafters and data:
#   OUT=runs/continue2 INIT=runs/ck/round1 ROUND=round2 LR=1e-3 WARMUP=50 scripts/continue_pair_h200.sh
set -euo pipefail
PACK=${1:-.data/code.jsonl.xz}
OUT=${OUT:-runs/continue}
CK=${CK:-runs/ck}
INIT=${INIT:-checkpoints}
ROUND=${ROUND:-round1}
TARGET=${TARGET:-checkpoints/laguna-tiny-code}
DISTILL_BUDGET=${DISTILL_BUDGET:-150}
DRAFTER_BUDGET=${DRAFTER_BUDGET:-360}
NUM_SEQUENCES=${NUM_SEQUENCES:-600000}
GEN_BATCH=${GEN_BATCH:-8192}
BATCH=${BATCH:-256}
LAYERS=${LAYERS:-3}
WIDTH=${WIDTH:-1024}
LR=${LR:-2e-3}
WARMUP=${WARMUP:-100}
LR_FLOOR=${LR_FLOOR:-0.05}
SEED=${SEED:-7}
DEVICE=${DEVICE:-cuda}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PY=${PY:-python3}
mkdir -p "$OUT" "$CK/$ROUND"

if [ ! -f "$CK/distill.safetensors" ]; then
  $PY -m dflash_lab.train distill --device "$DEVICE" --target "$TARGET" --corpus "$PACK" \
      --data "$CK/distill.safetensors" --seed "$SEED" --num-sequences "$NUM_SEQUENCES" --gen-batch "$GEN_BATCH" \
      --time-budget "$DISTILL_BUDGET" --prefix-sources distill=0.25,train=0.25,distill_stdlib=0.25,train_stdlib=0.25 \
      2>&1 | tee "$CK/distill.log"  # not in $OUT: what comes back from a GPU sitting is 8 files at most
fi

for name in dflash dflash-poolside; do
  $PY -m dflash_lab.train drafter --device "$DEVICE" --target "$TARGET" --data "$CK/distill.safetensors" \
      --init "$INIT/laguna-tiny-code-$name" --layers "$LAYERS" --intermediate-size "$WIDTH" --seed "$SEED" \
      --batch-size "$BATCH" --lr "$LR" --warmup "$WARMUP" --lr-floor "$LR_FLOOR" --steps 100000 --short-block-share 0.3 --eval-prompts 0 \
      --time-budget "$DRAFTER_BUDGET" --out "$CK/$ROUND/laguna-tiny-code-$name" > "$OUT/drafter-$name.log" 2>&1 &
done
wait
tail -n 3 "$OUT"/drafter-*.log
mkdir -p "$OUT/drafters"
cp -r "$CK/$ROUND"/laguna-tiny-code-* "$OUT/drafters/"
ls -la "$OUT" "$OUT/drafters"/*
