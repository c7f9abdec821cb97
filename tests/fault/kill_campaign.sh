#!/usr/bin/env bash
# kill -9 of a rank at a random moment (odd trials: during a random one of the first 10 saves, as soon as its
# temporary directory appears) of a Trainer run that saves a checkpoint every 2 steps (issue 30's
# "kill -9 during save" trials), then `--resume latest`: the resumed run must load the newest complete
# checkpoint and end exactly where the uninterrupted run ends (the final evaluation's loss and accuracy).
# A one-off measurement (about 8 s a trial on 2 cores), not part of the suite (kill_during_save.sh and the
# Trainer's restart test are):
#   tests/fault/kill_campaign.sh build/launcher/accel-launch build/examples/trainer/fashion_mnist_trainer [N]
# Prints one line a trial and, last:
#   kill campaign: N trials, K killed during a run (M left a save unfinished), ..., R resumed exactly, 0 wrong,
#   0 unloadable
set -uo pipefail
launch=$1 program=$2 trials=${3:-48}
seed=${KILL_CAMPAIGN_SEED:-1}
RANDOM=$seed
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export ACCEL_CONFIG_FILE= OMP_NUM_THREADS=1
args=(--num_train_epochs 1 --train-limit 1600 --test-limit 400 --per_device_train_batch_size 32
  --save_strategy steps --save_steps 2 --save_total_limit 2 --eval_strategy no --load_best_model_at_end false
  --report_to none --logging_steps 5 --disable_tqdm --learning_rate 3e-3)
run() {  # run OUTPUT_DIR LOG [extra args...]
  local out=$1 log=$2
  shift 2
  "$launch" launch --cpu --num_processes 2 --main_process_port 0 "$program" --output_dir "$out" "${args[@]}" "$@" \
    > "$log" 2>&1
}
result_of() { grep -o "'eval_accuracy': [^}]*" "$1" | tail -1; }

start=$(date +%s%N)
run "$work/straight" "$work/straight.log" || { cat "$work/straight.log"; exit 1; }
length_ms=$((($(date +%s%N) - start) / 1000000))
want=$(result_of "$work/straight.log")
echo "kill campaign: seed $seed, uninterrupted run ${length_ms} ms: $want"
killed=0 exact=0 wrong=0 unloadable=0 early=0 mid_save=0
for ((i = 0; i < trials; ++i)); do
  out=$work/t$i
  rank=$((RANDOM % 2))
  delay_ms=$((1000 + RANDOM % (length_ms > 1200 ? length_ms - 1000 : 200)))
  run "$out" "$work/t$i.log" &
  launcher=$!
  moment="after $delay_ms ms"
  if ((i % 2 == 1)); then
    # Odd trials: during the n-th save, as soon as its temporary directory appears.
    nth=$((1 + RANDOM % 10)) seen=0 last=
    moment="during save $nth"
    while kill -0 "$launcher" 2> /dev/null; do
      tmp=$(compgen -G "$out/checkpoint-*.tmp-*" | head -1)
      if [ -n "$tmp" ] && [ "$tmp" != "$last" ]; then
        seen=$((seen + 1)) last=$tmp
        [ "$seen" -ge "$nth" ] && break
      fi
    done
  else
    sleep "$(printf '%d.%03d' $((delay_ms / 1000)) $((delay_ms % 1000)))"
  fi
  victim=$(pgrep -f "^$program --output_dir $out " | sort -n | sed -n "$((rank + 1))p")
  if [ -n "$victim" ] && kill -KILL "$victim" 2> /dev/null; then
    killed=$((killed + 1))
  fi
  wait "$launcher"
  compgen -G "$out/checkpoint-*.tmp-*" > /dev/null && mid_save=$((mid_save + 1))
  left=$(ls "$out" 2> /dev/null | tr '\n' ' ')
  if ! ls "$out" 2> /dev/null | grep -q '^checkpoint-'; then
    early=$((early + 1))
    echo "  trial $i: rank $rank killed $moment, before the first checkpoint (left: ${left:-nothing})"
    continue
  fi
  if ! run "$out" "$work/r$i.log" --resume latest; then
    unloadable=$((unloadable + 1))
    echo "  trial $i: rank $rank killed $moment (left: $left): resume FAILED: $(grep -m1 -i error "$work/r$i.log")"
    continue
  fi
  got=$(result_of "$work/r$i.log")
  from=$(grep -o 'resumed from [^ ]* at step [0-9]*' "$work/r$i.log" | head -1)
  if [ "$got" = "$want" ]; then
    exact=$((exact + 1))
    echo "  trial $i: rank $rank killed $moment (left: $left): ${from:-ran to the end}, exact"
  else
    wrong=$((wrong + 1))
    echo "  trial $i: rank $rank killed $moment (left: $left): ${from:-?}: WRONG: $got"
  fi
done
echo "kill campaign: $trials trials, $killed killed during a run ($mid_save left a save unfinished), $early before the first checkpoint, $exact resumed exactly, $wrong wrong, $unloadable unloadable"
