"""Reads back what accelerate-cpp's trackers wrote, with TensorBoard's own event reader and Python's csv and
json modules, and checks every value against what the program logged.

    check_tracking.py <run_dir> <expected.txt> <backend>

expected.txt: one "<step> <name> <value>" line per logged value (value as %.17g).
"""
import csv
import glob
import json
import math
import os
import struct
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
# TensorBoard's own record reader (the package TensorBoard ships for running without TensorFlow installed;
# "tensorflow_stub" is its name): it verifies both CRCs of every record.
from tensorboard.compat.tensorflow_stub import errors
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import PyRecordReader_New

run_dir, expected_file, backend = sys.argv[1:4]
failures = []


def check(cond, message):
    if not cond:
        failures.append(message)


expected = {}  # name -> [(step, value)]
with open(expected_file) as f:
    for line in f:
        step, name, value = line.split()
        expected.setdefault(name, []).append((int(step), float(value)))

# TensorBoard: exactly one event file (the main process alone writes), read by TensorBoard's loader.
events = glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))
check(len(events) == 1, f"expected one event file in {run_dir}, found {events}")
acc = EventAccumulator(run_dir, size_guidance={"scalars": 0, "tensors": 0})
acc.Reload()
tags = acc.Tags()
check(sorted(tags["scalars"]) == sorted(expected), f"scalar tags {tags['scalars']} != {sorted(expected)}")
for name, points in expected.items():
    if name not in tags["scalars"]:
        continue
    got = [(e.step, e.value) for e in acc.Scalars(name)]
    check([s for s, _ in got] == [s for s, _ in points], f"tensorboard {name}: steps {got} != {points}")
    for (s, v), (_, w) in zip(got, points):
        # simple_value is a float32
        check(v == struct.unpack("f", struct.pack("f", w))[0], f"tensorboard {name} at step {s}: {v} != {w}")
check("hyperparameters" in tags["tensors"], f"no hyperparameters text summary; tensor tags {tags['tensors']}")
if "hyperparameters" in tags["tensors"]:
    text = acc.Tensors("hyperparameters")[0].tensor_proto.string_val[0].decode()
    for row in ("| lr | 0.05 |", "| batch | 4 |", f"| backend | {backend} |", "| fused | false |"):
        check(row in text, f"hyperparameters text lacks '{row}': {text!r}")
    meta = acc.SummaryMetadata("hyperparameters")
    check(meta.plugin_data.plugin_name == "text", f"hyperparameters plugin {meta.plugin_data.plugin_name!r}")

# The record framing itself: TensorBoard's record reader verifies both masked CRC-32Cs, so a flipped byte in
# the payload of the last record must be refused.
if events:
    with open(events[0], "rb") as f:
        data = bytearray(f.read())
    corrupt = os.path.join(os.path.dirname(expected_file), "corrupt.tfevents")
    data[-6] ^= 0xFF
    with open(corrupt, "wb") as f:
        f.write(data)
    reader = PyRecordReader_New(corrupt, 0, None)
    refused = False
    try:
        while True:
            reader.GetNext()
    except errors.DataLossError:
        refused = True
    except errors.OutOfRangeError:
        pass
    check(refused, "a corrupted record was accepted: the CRCs are not what TensorBoard checks")

# CSV: step,name,value rows, values exact (shortest round-trip decimal).
with open(os.path.join(run_dir, "metrics.csv"), newline="") as f:
    rows = list(csv.reader(f))
check(rows[0] == ["step", "name", "value"], f"csv header {rows[0]}")
got = {}
for step, name, value in rows[1:]:
    got.setdefault(name, []).append((int(step), float(value)))
check(got == expected, f"csv values {got} != {expected}")
with open(os.path.join(run_dir, "hparams.csv"), newline="") as f:
    hparams = dict(list(csv.reader(f))[1:])
check(hparams == {"lr": "0.05", "batch": "4", "backend": backend, "fused": "false"}, f"hparams.csv {hparams}")

# JSON lines: one object per log call.
got = {}
with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    for line in f:
        obj = json.loads(line)
        check(isinstance(obj.pop("_timestamp"), float), f"jsonl line without _timestamp: {line!r}")
        step = obj.pop("step")
        for name, value in obj.items():
            got.setdefault(name, []).append((step, value))
check(got == expected, f"jsonl values {got} != {expected}")
with open(os.path.join(run_dir, "hparams.json")) as f:
    hparams = json.load(f)
check(hparams == {"lr": 0.05, "batch": 4, "backend": backend, "fused": False}, f"hparams.json {hparams}")
check(not any(math.isnan(v) for pts in expected.values() for _, v in pts), "a logged value is NaN")

for failure in failures:
    print("check_tracking:", failure)
if failures:
    sys.exit(1)
print(f"check_tracking: tensorboard, csv and jsonl hold the {sum(map(len, expected.values()))} logged values")
