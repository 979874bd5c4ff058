#!/usr/bin/env bash
# Save with FSDP2 on 4 processes, resume the same checkpoint with tensor parallelism on 2.
#
#   bash examples/resume_with_other_parallelism.sh [WORK_DIR]      (default build/resume-example)
#
# Environment: VENV (default .venv), SAVE_NPROC (4), RESUME_NPROC (2), STEPS (4).
set -euo pipefail

# Paths given on the command line are relative to where the script was started.
abspath() { case $1 in /*) printf '%s\n' "$1" ;; *) printf '%s\n' "$PWD/$1" ;; esac; }
WORK=$(abspath "${1:-build/resume-example}")
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BIN="${VENV:-.venv}/bin"
[[ -x "$BIN/torchrun" ]] || { echo "$BIN/torchrun not found; run \`make venv\` first" >&2; exit 2; }
SAVE_NPROC=${SAVE_NPROC:-4}
RESUME_NPROC=${RESUME_NPROC:-2}
STEPS=${STEPS:-4}
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TORCH_CPP_LOG_LEVEL=${TORCH_CPP_LOG_LEVEL:-ERROR}
rm -rf "$WORK"
mkdir -p "$WORK"

echo "== FSDP2 x$SAVE_NPROC: train $STEPS steps, save to $WORK/fsdp2"
"$BIN/torchrun" --standalone --nproc_per_node "$SAVE_NPROC" examples/train_fsdp2.py \
    --steps "$STEPS" --save-dir "$WORK/fsdp2" | tee "$WORK/fsdp2.log"

echo "== TP x$RESUME_NPROC: resume from $WORK/fsdp2 (latest step), train $STEPS more, save to $WORK/tp"
"$BIN/torchrun" --standalone --nproc_per_node "$RESUME_NPROC" examples/train_tp.py \
    --steps "$STEPS" --resume-from "$WORK/fsdp2" --save-dir "$WORK/tp" | tee "$WORK/tp.log"

saved=$(sed -n 's/^saved step .* eval loss \([0-9.]*\)$/\1/p' "$WORK/fsdp2.log")
resumed=$(sed -n 's/^resumed step .* eval loss \([0-9.]*\)$/\1/p' "$WORK/tp.log")
# Same weights, different parallel math: equal up to float reduction order (1e-5).
if [[ -z "$saved" || -z "$resumed" ]] || ! awk -v a="$saved" -v b="$resumed" 'BEGIN { d = a - b; exit !(d < 1e-5 && d > -1e-5) }'; then
    echo "FAILED: eval loss at save ($saved) and after resuming with TP ($resumed) differ" >&2
    exit 1
fi
echo "== OK: the TP x$RESUME_NPROC job resumed the FSDP2 x$SAVE_NPROC checkpoint exactly (eval loss $saved)"
