#!/usr/bin/env bash
# Runs a command in a fresh temporary directory (removed afterwards), for programs that write relative paths.
#   in_temp_dir.sh <command> [args...]
set -uo pipefail
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cd "$dir" && "$@"
