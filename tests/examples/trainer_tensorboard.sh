#!/usr/bin/env bash
# The Trainer version of the Fashion-MNIST example on 2 ranks with report_to: tensorboard. TensorBoard's own
# reader finds train/loss at the logging steps and eval/accuracy, with the values of trainer_state.json's
# log_history (the checkpoint the Trainer wrote), and the accuracy the program printed.
#   trainer_tensorboard.sh <accel-launch> <fashion_mnist_trainer> <python> <training-args.yaml>
set -euo pipefail
launch=$1 example=$2 python=$3 args=$4
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
export ACCEL_CONFIG_FILE= OMP_NUM_THREADS=1
# 2000 samples / (64 x 2 ranks) = 16 steps in the one epoch: logs at 5, 10, 15; evaluation at step 16.
"$launch" launch --cpu --num_processes 2 --main_process_port 0 "$example" --training_args "$args" \
  --output_dir "$dir/out" --num_train_epochs 1 --logging_steps 5 --train-limit 2000 --test-limit 500 \
  --disable_tqdm | tee "$dir/out.txt"
accuracy=$(sed -n 's/.*test accuracy: \([0-9.]*\)%.*/\1/p' "$dir/out.txt")
"$python" - "$dir/out" "$accuracy" <<'PY'
import glob, json, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
out, printed = sys.argv[1], float(sys.argv[2])
state = json.load(open(out + "/checkpoint-16/trainer_state.json"))
assert state["global_step"] == 16 and state["max_steps"] == 16, state["global_step"]
history = state["log_history"]
losses = [(e["step"], e["loss"]) for e in history if "loss" in e]
evals = [(e["step"], e["eval_accuracy"]) for e in history if "eval_accuracy" in e]
assert [s for s, _ in losses] == [5, 10, 15], losses
assert [s for s, _ in evals] == [16], evals
run = out + "/runs/trainer"
files = glob.glob(run + "/events.out.tfevents.*")
assert len(files) == 1, files
acc = EventAccumulator(run, size_guidance={"scalars": 0})
acc.Reload()
tb = [(e.step, e.value) for e in acc.Scalars("train/loss")]
assert [s for s, _ in tb] == [5, 10, 15], tb
for (s, v), (_, want) in zip(tb, losses):
    assert abs(v - want) <= 1e-6 * max(1.0, abs(want)), (s, v, want)
tb_acc = acc.Scalars("eval/accuracy")
assert len(tb_acc) >= 1 and tb_acc[0].step == 16 and abs(tb_acc[0].value - evals[0][1]) < 1e-4, tb_acc
assert abs(evals[0][1] - printed) < 1e-3, (evals, printed)  # one epoch: the best is the last
print(f"trainer_tensorboard: train/loss at steps 5, 10, 15 = {[round(v, 4) for _, v in tb]}, "
      f"eval/accuracy at step 16 = {tb_acc[0].value:.2f}, as in trainer_state.json")
PY
