#!/usr/bin/env bash
# MeZO-style launcher: the environment variables of MeZO's mezo.sh and the XGBLoRA fork, calling `xgblora mezo`
# (MeZO's run.py defaults; the results also land in result/<tag>-trainset<SEED>.json, as MeZO's do).
#   MODE=ft|lora|xgblora TASK=SST2 MODEL=facebook/opt-350m BS=16 LR=1e-5 EPS=1e-3 SEED=0 TRAIN=1000 DEV=500
#   (DEV: 100 for CB and Copa, as MeZO's)
#   STEPS=20000 EVAL_STEPS=4000 XGBLORA_STEPS=1000 PRECISION=float16|bfloat16|float32
#   bash examples/mezo.sh [extra xgblora train flags]
set -euo pipefail
MODE=${MODE:-ft}; TASK=${TASK:-SST2}; MODEL=${MODEL:-facebook/opt-350m}
BS=${BS:-16}; LR=${LR:-1e-5}; EPS=${EPS:-1e-3}; SEED=${SEED:-0}
TRAIN=${TRAIN:-1000}; EVAL=${EVAL:-1000}
STEPS=${STEPS:-20000}; EVAL_STEPS=${EVAL_STEPS:-4000}; XGBLORA_STEPS=${XGBLORA_STEPS:-1000}
PRECISION=${PRECISION:-float16}
case "$PRECISION" in
  float16) LOAD=(--load_float16) ;; bfloat16) LOAD=(--load_bfloat16) ;; float32) LOAD=() ;;
  *) echo "mezo.sh: PRECISION must be float16, bfloat16 or float32, got '$PRECISION'" >&2; exit 2 ;;
esac
# As MeZO's mezo.sh: cross-entropy over the candidates except on the tasks scored as generation or multiple choice
# of sentences; a dev set of 100 where the train split is under 1,000 rows.
TASK_ARGS=(--train_as_classification)
case "$TASK" in
  CB) DEV=${DEV:-100} ;;
  Copa) DEV=${DEV:-100}; TASK_ARGS+=(--train_as_classification False) ;;
  ReCoRD|DROP|SQuAD) TASK_ARGS+=(--train_as_classification False) ;;
esac
DEV=${DEV:-500}
MODEL_NAME=${MODEL##*/}
TAG=mezo-$MODE-$STEPS-$BS-$LR-$EPS-$SEED
case "$MODE" in
  ft) EXTRA=() ;;
  lora) EXTRA=(--lora) ;;
  xgblora) EXTRA=(--xgblora --xgblora_steps_per_iteration "$XGBLORA_STEPS") ;;
  *) echo "mezo.sh: MODE must be ft, lora or xgblora, got '$MODE'" >&2; exit 2 ;;
esac
exec xgblora mezo \
  --model_name "$MODEL" --task_name "$TASK" --output_dir "result/$TASK-$MODEL_NAME-$TAG" --tag "$TAG" \
  --train_set_seed "$SEED" --num_train "$TRAIN" --num_dev "$DEV" --num_eval "$EVAL" --logging_steps 10 \
  --max_steps "$STEPS" --trainer zo "${LOAD[@]}" --learning_rate "$LR" --zo_eps "$EPS" \
  --per_device_train_batch_size "$BS" --lr_scheduler_type constant --load_best_model_at_end \
  --evaluation_strategy steps --save_strategy steps --save_total_limit 1 --eval_steps "$EVAL_STEPS" \
  --save_steps "$EVAL_STEPS" "${TASK_ARGS[@]}" "${EXTRA[@]}" "$@"
