#!/usr/bin/env bash
# The LLM demo, offline: sets everything up (scripts/setup.sh), then
#   1. makes a small Qwen2-architecture model (random weights) and a byte-level BPE tokenizer in Qwen2's layout
#      (ChatML tokens, Qwen2.5's chat template) trained on licence texts that ship with Debian and Python and on
#      the demo's arithmetic text (scripts/llm_demo.py make);
#   2. pretrains it with every parameter (accel-launch train -t full, 2 CPU ranks) on plain text: sums written
#      as prose, one a line ("What is 12 plus 7? 12 plus 7 equals 19."; --quick: several a line, mixed forms,
#      with licence prose): the base has never seen a chat;
#   3. asks it held-out chat questions ("What is 12 plus 7?", sums in neither training set) with
#      build/examples/llm/generate, before fine-tuning;
#   4. fine-tunes LoRA adapters (accel-launch train -t lora, 2 CPU ranks) on chat data
#      ("What is 12 plus 7?" -> "12 plus 7 is 19.", conversational prompt-completion: loss on the reply only;
#      embed_tokens trained with the adapters, PEFT's modules_to_save) and asks the same questions again with the adapter
#      (generate --adapter), then shows the accuracy before / after and the loss curves (ASCII here, SVG files).
# Usage: scripts/llm_demo.sh [--quick] [WORKDIR]   (WORKDIR: build/llm_demo; --quick: the test's tiny sizes)
# Environment: ACCEL_BUILD_DIR (build), ACCEL_DEMO_SKIP_SETUP=1 (do not run setup.sh), ACCEL_DEMO_BUILD (an
# absolute build directory) and ACCEL_DEMO_PYTHON (the Python with tokenizers + transformers): the ctest entry's.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
size=demo
if [[ ${1:-} == --quick ]]; then
  size=test
  shift
fi
[[ -n ${ACCEL_DEMO_SKIP_SETUP:-} ]] || "$root/scripts/setup.sh"
build=${ACCEL_DEMO_BUILD:-$root/${ACCEL_BUILD_DIR:-build}}
work=${1:-$build/llm_demo}
py=${ACCEL_DEMO_PYTHON:-$root/.venv/bin/python}
demo="$root/scripts/llm_demo.py"
launch="$build/launcher/accel-launch"
finetune="$build/examples/llm/finetune"
generate="$build/examples/llm/generate"
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error HF_HUB_DISABLE_PROGRESS_BARS=1 TQDM_DISABLE=1
for f in "$launch" "$finetune" "$generate"; do
  [[ -x $f ]] || { echo "llm_demo: $f is not built (run scripts/setup.sh)" >&2; exit 1; }
done

# Sizes of the two runs: demo (the README command) and test (the ctest entry, tiny).
if [[ $size == demo ]]; then
  # embed_tokens trains with the adapters (PEFT's modules_to_save, as for tokens a base never saw: the ChatML
  # tokens and the system prompt's words); frozen, the LoRA loss stayed at ~1.0 per reply token.
  pre_epochs=4 pre_lr=3e-3 pre_batch=64 lora_epochs=60 lora_lr=5e-3 lora_r=16 lora_batch=32 log=20
  save='[embed_tokens]'
else
  pre_epochs=8 pre_lr=5e-3 pre_batch=16 lora_epochs=10 lora_lr=1e-2 lora_r=16 lora_batch=16 log=5 save=null
fi
common=(--eval_strategy no --load_best_model_at_end false --save_strategy epoch --save_total_limit 1
  --report_to none --logging_steps "$log" --warmup_ratio 0.05 --lr_scheduler_type linear --seed 0)
section() { printf '\n==== %s\n' "$*"; }
elapsed() { printf '(%d s)\n' $((SECONDS - $1)); }
latest_state() {  # trainer_state.json of the run in $1 (output_dir, else its last checkpoint)
  if [[ -f $1/trainer_state.json ]]; then echo "$1/trainer_state.json"; return; fi
  ls -d "$1"/checkpoint-* 2>/dev/null | sort -t- -k2 -n | tail -1 | sed 's|$|/trainer_state.json|'
}
ask() {  # ask LABEL MODEL [--adapter DIR]: held-out questions, a few shown, then the accuracy
  local label=$1 model=$2
  shift 2
  "$generate" --model_name_or_path "$model" "$@" --prompts_file "$work/prompts.jsonl" --max_new_tokens 16 \
    >"$work/answers_$label.jsonl"
  "$py" - "$work/heldout.jsonl" "$work/answers_$label.jsonl" <<'EOF'
import json, sys
held = [json.loads(l) for l in open(sys.argv[1])]
answers = [json.loads(l) for l in open(sys.argv[2])]
for h, a in list(zip(held, answers))[:4]:
    print(f"  user: {h['question']:<22} model: {a.strip()!r}")
EOF
  "$py" "$demo" score "$work/heldout.jsonl" "$work/answers_$label.jsonl" | sed "s/^/  $label: /"
}

start=$SECONDS
section "1. a small Qwen2 model and its tokenizer ($work)"
t=$SECONDS
rm -rf "$work"
mkdir -p "$work"
"$py" "$demo" make "$work" --size "$size" 2>&1 | grep -v '^Writing model shards'
"$py" "$demo" prompts "$work/base" "$work/heldout.jsonl" "$work/prompts.jsonl"
elapsed $t

section "2. pretraining on plain text (accel-launch train -t full, 2 CPU ranks)"
t=$SECONDS
"$launch" train -t full "$finetune" --model_name_or_path "$work/base" --dataset "$work/pretrain.jsonl" \
  --max_length 128 --output_dir "$work/pretrain" --num_train_epochs "$pre_epochs" --learning_rate "$pre_lr" \
  --per_device_train_batch_size "$pre_batch" "${common[@]}" >"$work/pretrain.log" 2>&1 ||
  { tail -20 "$work/pretrain.log" >&2; exit 1; }
"$py" "$demo" plot "$(latest_state "$work/pretrain")" "$work/pretrain_loss.svg" "pretraining loss"
elapsed $t

section "3. before fine-tuning: held-out chat questions (build/examples/llm/generate)"
ask before "$work/pretrain/model"

section "4. LoRA fine-tuning on chat data (accel-launch train -t lora, 2 CPU ranks)"
t=$SECONDS
"$launch" train -t lora "$finetune" --model_name_or_path "$work/pretrain/model" --dataset "$work/chat.jsonl" \
  --max_length 128 --output_dir "$work/lora" --lora_target_modules all-linear --lora_modules_to_save "$save" \
  --lora_r "$lora_r" --lora_alpha $((2 * lora_r)) --lora_dropout 0.0 --num_train_epochs "$lora_epochs" \
  --learning_rate "$lora_lr" --per_device_train_batch_size "$lora_batch" "${common[@]}" \
  >"$work/lora.log" 2>&1 || { tail -20 "$work/lora.log" >&2; exit 1; }
"$py" "$demo" plot "$(latest_state "$work/lora")" "$work/lora_loss.svg" "LoRA fine-tuning loss"
elapsed $t

section "5. after fine-tuning: the same questions, with the adapter (generate --adapter $work/lora/adapter)"
ask after "$work/pretrain/model" --adapter "$work/lora/adapter"

section "done in $((SECONDS - start)) s"
echo "  logs: $work/pretrain.log, $work/lora.log; loss plots: $work/pretrain_loss.svg, $work/lora_loss.svg"
echo "  the adapter (PEFT format, tokenizer beside it): $work/lora/adapter"
