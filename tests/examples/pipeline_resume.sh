#!/bin/sh
# Trains pipeline_example for STEPS steps under SAVE_YAML, saving after step SAVE_AT, then resumes from that
# checkpoint under RESUME_YAML (another number of stages or replicas) up to STEPS: the resumed run's weight
# checksum (the last one printed) must be that of an uninterrupted run.
#   pipeline_resume.sh ACCEL_LAUNCH EXAMPLE SAVE_YAML RESUME_YAML DIR SAVE_AT STEPS [ARGS...]
set -e
launch=$1 example=$2 save_yaml=$3 resume_yaml=$4 dir=$5 save_at=$6 steps=$7
shift 7
rm -rf "$dir"
"$launch" launch --config_file "$save_yaml" "$example" --steps "$steps" --save-at "$save_at" --checkpoint "$dir" "$@"
echo "---- resuming from $dir under $resume_yaml"
"$launch" launch --config_file "$resume_yaml" "$example" --steps "$steps" --resume "$dir" "$@"
rm -rf "$dir"
