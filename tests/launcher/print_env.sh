#!/usr/bin/env bash
# Fake rank for launcher_test.cpp: prints what accel-launch gave it, then its config file, then exits 0.
set -eu
if [ -n "${MARKER_DIR:-}" ]; then touch "$MARKER_DIR/started.$RANK"; fi
echo "RANK=$RANK"
echo "LOCAL_RANK=$LOCAL_RANK"
echo "WORLD_SIZE=$WORLD_SIZE"
echo "LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE"
echo "GROUP_RANK=$GROUP_RANK"
echo "MASTER_ADDR=$MASTER_ADDR"
echo "MASTER_PORT=$MASTER_PORT"
echo "ACCEL_LAUNCHED=$ACCEL_LAUNCHED"
echo "TORCHELASTIC_RESTART_COUNT=$TORCHELASTIC_RESTART_COUNT"
echo "TORCHELASTIC_MAX_RESTARTS=$TORCHELASTIC_MAX_RESTARTS"
echo "ACCEL_CONSOLE_TTY=$ACCEL_CONSOLE_TTY"
echo "TORCHELASTIC_RUN_ID=$TORCHELASTIC_RUN_ID"
echo "OMP_NUM_THREADS=${OMP_NUM_THREADS:-unset}"
echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-unset}"
echo "ACCEL_CONFIG_FILE=$ACCEL_CONFIG_FILE"
echo "ACCEL_CONFIG_SOURCE=${ACCEL_CONFIG_SOURCE:-unset}"
echo "ARGS=$*"
echo "stderr of rank $RANK" >&2
sed 's/^/config: /' "$ACCEL_CONFIG_FILE"
printf 'no newline at the end'
