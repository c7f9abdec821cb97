#!/usr/bin/env bash
# A checkpoint written to a really full disk: mounts a small tmpfs (root, or CAP_SYS_ADMIN, is needed; without
# it the test is reported as skipped, exit 77) and runs the hidden Catch2 case "[.disk_full]" against it.
# Usage: disk_full.sh TORCH_TESTS_BINARY
set -u
tests_bin=$1
dir=$(mktemp -d "${TMPDIR:-/tmp}/accel-disk-full.XXXXXX")
if ! mount -t tmpfs -o size=2m,mode=0700 accel-disk-full "$dir" 2>/dev/null; then
  rmdir "$dir"
  echo "SKIPPED: cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN); the disk-full case did not run"
  exit 77
fi
trap 'umount "$dir" && rmdir "$dir"' EXIT
ACCEL_DISK_FULL_DIR=$dir OMP_NUM_THREADS=1 "$tests_bin" "[.disk_full]" --use-colour no
