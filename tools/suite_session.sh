#!/usr/bin/env bash
# The standard suite of `fmha bench`, split over the visible GPUs (one shard per GPU, run
# at once), then merged into one table/JSON/plot. Usage:
#   bash tools/suite_session.sh OUTDIR [extra fmha bench flags, e.g. --contenders fmha,cudnn,flash]
set -u
out=$1; shift
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-src}
n=$(nvidia-smi -L | wc -l)
fmha_cli() { python -c 'import sys; from fmha.cli import main; sys.exit(main(sys.argv[1:]))' "$@"; }
for i in $(seq 1 "$n"); do
  CUDA_VISIBLE_DEVICES=$((i - 1)) fmha_cli bench --shard "$i/$n" --json "$out/shard$i.json" --no-progress "$@" \
    > "$out/shard$i.log" 2>&1 &
done
wait
fmha_cli bench --merge "$out"/shard*.json --json "$out/suite.json" --plot "$out/suite.png" > "$out/suite.txt" 2>&1
cat "$out/suite.txt"
