#!/usr/bin/env bash
# The Fashion-MNIST example on 2 ranks logs to TensorBoard: TensorBoard's own reader finds its training loss
# and the test accuracy it printed, in one event file (the main process alone writes).
#   fashion_tensorboard.sh <accel-launch> <fashion_mnist> <python>
set -euo pipefail
launch=$1 example=$2 python=$3
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
export ACCEL_CONFIG_FILE= OMP_NUM_THREADS=1
"$launch" launch --cpu --num_processes 2 --main_process_port 0 "$example" --epochs 1 --train-limit 4000 \
  --test-limit 500 --batch-size 16 --log-dir "$dir" | tee "$dir/out.txt"
accuracy=$(sed -n 's/.*test accuracy: \([0-9.]*\)%.*/\1/p' "$dir/out.txt")
"$python" - "$dir/fashion_mnist" "$accuracy" <<'PY'
import glob, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
run, printed = sys.argv[1], float(sys.argv[2])
files = glob.glob(run + "/events.out.tfevents.*")
assert len(files) == 1, files
acc = EventAccumulator(run, size_guidance={"scalars": 0})
acc.Reload()
loss = acc.Scalars("train/loss")
assert len(loss) == 1 and loss[0].step == 100, [(e.step, e.value) for e in loss]  # 4000 / (16 x 2) = 125
accuracy = acc.Scalars("test/accuracy")
assert len(accuracy) == 1 and abs(accuracy[0].value - printed) < 1e-3, (accuracy, printed)
print(f"fashion_tensorboard: train/loss at step 100 = {loss[0].value:.4f}, test/accuracy = {accuracy[0].value:.2f}")
PY
