#!/usr/bin/env bash
# The LLM demo, offline: sets everything up (scripts/setup.sh), then
#   1. makes a small Qwen2-architecture model (random weights) and a byte-level BPE tokenizer in Qwen2's layout
#      (ChatML tokens, Qwen2.5's chat template) trained on licence texts that ship with Debian and Python and on
#      the demo's text (scripts/llm_demo.py make);
#   2. pretrains it with every parameter (accel-launch train -t full, 2 CPU ranks, packed rows) on plain text:
#      every sum a + b of the demo's range written as prose, one a line ("What is 12 plus 7? 12 plus 7 is 19."),
#      and generic ChatML conversations (Qwen2.5's system prompt, licence prose in the user and assistant
#      turns): the base reads every sum, but never a sum in a chat turn;
#   3. asks it held-out questions ("What is 12 plus 7?", pairs kept out of the chat data) with
#      build/examples/llm/generate, as plain text (the base knows the sums) and as a chat (it does not answer);
#   4. fine-tunes LoRA adapters (accel-launch train -t lora, 2 CPU ranks, all linear layers, nothing else
#      trained) on chat data ("What is 12 plus 7?" -> "12 plus 7 is 19.", conversational prompt-completion: loss
#      on the reply only) and asks the same chat questions again with the adapter (generate --adapter), then
#      shows the accuracy before / after and the loss curves (ASCII here, SVG files). Fine-tuning teaches the
#      chat task; a held-out reply is right when the model uses in the chat what it read in pretraining (the
#      held-out sums are in the pretraining text: the demo does not show that it learned arithmetic).
# Usage: scripts/llm_demo.sh [--quick] [WORKDIR]   (WORKDIR: build/llm_demo; --quick: the test's tiny sizes)
# Environment: ACCEL_BUILD_DIR (build), ACCEL_DEMO_SKIP_SETUP=1 (do not run setup.sh), ACCEL_DEMO_BUILD (an
# absolute build directory) and ACCEL_DEMO_PYTHON (the Python with tokenizers + transformers): the ctest entry's;
# ACCEL_DEMO_SEED (0: the training runs' --seed); ACCEL_DEMO_REUSE_PRETRAIN=1 (keep WORKDIR's pretrained model and
# data, run steps 3-5 only: another fine-tuning seed in a few minutes).
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

# Sizes of the two runs: demo (the README command) and test (the ctest entry, tiny). Pretraining packs its
# lines into rows of 128 tokens (TRL's bfd packing: each line attends to itself only, positions from 0).
if [[ $size == demo ]]; then
  pre_epochs=5 pre_lr=3e-3 pre_batch=8 lora_epochs=16 lora_lr=5e-3 lora_r=16 lora_batch=16 log=10
else
  pre_epochs=8 pre_lr=5e-3 pre_batch=4 lora_epochs=10 lora_lr=1e-2 lora_r=16 lora_batch=16 log=5
fi
seed=${ACCEL_DEMO_SEED:-0}
common=(--eval_strategy no --load_best_model_at_end false --save_strategy epoch --save_total_limit 1
  --report_to none --logging_steps "$log" --warmup_ratio 0.05 --lr_scheduler_type linear --seed "$seed")
section() { printf '\n==== %s\n' "$*"; }
elapsed() { printf '(%d s)\n' $((SECONDS - $1)); }
latest_state() {  # trainer_state.json of the run in $1 (output_dir, else its last checkpoint)
  if [[ -f $1/trainer_state.json ]]; then echo "$1/trainer_state.json"; return; fi
  ls -d "$1"/checkpoint-* 2>/dev/null | sort -t- -k2 -n | tail -1 | sed 's|$|/trainer_state.json|'
}
ask() {  # ask LABEL PROMPTS MODEL [--adapter DIR]: held-out questions, a few shown, then the accuracy
  local label=$1 prompts=$2 model=$3 who=user prose=
  shift 3
  if [[ $label == prose ]]; then who=text prose=--prose; fi
  "$generate" --model_name_or_path "$model" "$@" --prompts_file "$prompts" --max_new_tokens 16 \
    >"$work/answers_$label.jsonl"
  "$py" - "$work/heldout.jsonl" "$work/answers_$label.jsonl" "$who" <<'EOF'
import json, sys
held = [json.loads(l) for l in open(sys.argv[1])]
answers = [json.loads(l) for l in open(sys.argv[2])]
for h, a in list(zip(held, answers))[:4]:
    print(f"  {sys.argv[3]}: {h['question']:<22} model: {a.strip()[:48]!r}")
EOF
  "$py" "$demo" score "$work/heldout.jsonl" "$work/answers_$label.jsonl" $prose | sed "s/^/  $label: /"
}

start=$SECONDS
if [[ -z ${ACCEL_DEMO_REUSE_PRETRAIN:-} ]]; then
  section "1. a small Qwen2 model and its tokenizer ($work)"
  t=$SECONDS
  rm -rf "$work"
  mkdir -p "$work"
  "$py" "$demo" make "$work" --size "$size" 2>&1 | grep -v '^Writing model shards'
  elapsed $t

  section "2. pretraining on plain text (accel-launch train -t full, 2 CPU ranks)"
  t=$SECONDS
  "$launch" train -t full "$finetune" --model_name_or_path "$work/base" --dataset "$work/pretrain.jsonl" \
    --max_length 128 --packing true --output_dir "$work/pretrain" --num_train_epochs "$pre_epochs" \
    --learning_rate "$pre_lr" --per_device_train_batch_size "$pre_batch" "${common[@]}" >"$work/pretrain.log" 2>&1 ||
    { tail -20 "$work/pretrain.log" >&2; exit 1; }
  "$py" "$demo" plot "$(latest_state "$work/pretrain")" "$work/pretrain_loss.svg" "pretraining loss"
  elapsed $t
else
  [[ -d $work/pretrain/model ]] || { echo "llm_demo: no $work/pretrain/model to reuse" >&2; exit 1; }
  rm -rf "$work/lora"
fi

section "3. before fine-tuning: the held-out questions as plain text, then as a chat (build/examples/llm/generate)"
echo "  (the base has read these sums in prose, never a sum in a chat)"
ask prose "$work/prose_prompts.jsonl" "$work/pretrain/model"
ask before "$work/prompts.jsonl" "$work/pretrain/model"

section "4. LoRA fine-tuning on chat data (accel-launch train -t lora, 2 CPU ranks)"
t=$SECONDS
"$launch" train -t lora "$finetune" --model_name_or_path "$work/pretrain/model" --dataset "$work/chat.jsonl" \
  --max_length 128 --output_dir "$work/lora" --lora_target_modules all-linear \
  --lora_r "$lora_r" --lora_alpha $((2 * lora_r)) --lora_dropout 0.0 --num_train_epochs "$lora_epochs" \
  --learning_rate "$lora_lr" --per_device_train_batch_size "$lora_batch" "${common[@]}" \
  >"$work/lora.log" 2>&1 || { tail -20 "$work/lora.log" >&2; exit 1; }
"$py" "$demo" plot "$(latest_state "$work/lora")" "$work/lora_loss.svg" "LoRA fine-tuning loss"
elapsed $t

section "5. after fine-tuning: the same chat questions, with the adapter (generate --adapter $work/lora/adapter)"
ask after "$work/prompts.jsonl" "$work/pretrain/model" --adapter "$work/lora/adapter"
echo "  fine-tuning taught the chat task (question -> 'a plus b is c.') on other pairs only; the held-out sums were"
echo "  in the pretraining prose: a right reply uses in a chat what the model read as text (no claim that it learned"
echo "  arithmetic: every sum it is asked is one it read)"

section "done in $((SECONDS - start)) s"
echo "  logs: $work/pretrain.log, $work/lora.log; loss plots: $work/pretrain_loss.svg, $work/lora_loss.svg"
echo "  the adapter (PEFT format, tokenizer beside it): $work/lora/adapter"
