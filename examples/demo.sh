#!/usr/bin/env bash
# The unickpt demo (`make demo`): train with FSDP2 on 4 processes, save a sliced checkpoint with
# hashes, resume it with tensor parallelism on 2 processes, then inspect, verify, merge to a plain
# Hugging Face checkpoint, load that with transformers, and diff it against the sliced original.
#
# CPU only (gloo), about 1-3 minutes on 2 cores. Everything lands in $DEMO_DIR (default build/demo,
# wiped first). Run from anywhere: bash examples/demo.sh
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${VENV:-.venv}
BIN="$VENV/bin"
for tool in python torchrun unickpt; do
    if [[ ! -x "$BIN/$tool" ]]; then
        echo "demo: $BIN/$tool not found; run \`make venv\` first (or set VENV=/path/to/venv)" >&2
        exit 2
    fi
done

DEMO_DIR=${DEMO_DIR:-build/demo}
FSDP_STEPS=${FSDP_STEPS:-6}
TP_STEPS=${TP_STEPS:-4}
rm -rf "$DEMO_DIR"
mkdir -p "$DEMO_DIR"
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export TORCH_CPP_LOG_LEVEL=${TORCH_CPP_LOG_LEVEL:-ERROR}
START=$SECONDS

if [[ -t 1 ]]; then BOLD=$'\033[1m' PLAIN=$'\033[0m'; else BOLD="" PLAIN=""; fi
headline() {
    printf '\n%s[%3ss] %s%s\n' "$BOLD" "$((SECONDS - START))" "$*" "$PLAIN"
}
# torchrun on a free port (--standalone), so the demo does not collide with another job on 29500.
launch() {
    local n=$1
    shift
    "$BIN/torchrun" --standalone --nproc_per_node "$n" "$@"
}

FSDP_CKPT="$DEMO_DIR/fsdp2-run"
TP_CKPT="$DEMO_DIR/tp-run"
HF_OUT="$DEMO_DIR/hf"
MODEL_DIR="$FSDP_CKPT/step-$FSDP_STEPS/model"

headline "1/7  Train a tiny Llama (37-token vocab, tied head) with FSDP2 on 4 processes, save a sliced checkpoint"
echo "     Each rank holds uneven row blocks (37 rows -> 10/10/10/7) and writes only its own blocks,"
echo "     with an xxh3 hash per block; rank 0 commits the index last."
launch 4 examples/train_fsdp2.py --steps "$FSDP_STEPS" --save-dir "$FSDP_CKPT" | tee "$DEMO_DIR/fsdp2.log"
SAVED_LOSS=$(sed -n 's/^saved step .* eval loss \([0-9.]*\)$/\1/p' "$DEMO_DIR/fsdp2.log")
[[ -n "$SAVED_LOSS" ]] || { echo "demo: the FSDP2 run did not report its eval loss" >&2; exit 1; }

headline "2/7  Resume that checkpoint with tensor parallelism on 2 processes and train on"
echo "     Same checkpoint, different parallelism and world size: each TP rank reads only the byte"
echo "     ranges of its own heads / MLP columns; AdamW state and the data position come along."
launch 2 examples/train_tp.py --steps "$TP_STEPS" --resume-from "$FSDP_CKPT" --save-dir "$TP_CKPT" \
    | tee "$DEMO_DIR/tp.log"
RESUMED_LOSS=$(sed -n 's/^resumed step .* eval loss \([0-9.]*\)$/\1/p' "$DEMO_DIR/tp.log")
# Same weights, different parallel math: equal up to float reduction order (1e-5).
if [[ -z "$RESUMED_LOSS" ]] || ! awk -v a="$SAVED_LOSS" -v b="$RESUMED_LOSS" 'BEGIN { d = a - b; exit !(d < 1e-5 && d > -1e-5) }'; then
    echo "demo: eval loss after resuming under TP ($RESUMED_LOSS) differs from FSDP2's at save ($SAVED_LOSS)" >&2
    exit 1
fi
echo "---> the TP x2 job sees the same model the FSDP2 x4 job saved: eval loss $SAVED_LOSS at save, $RESUMED_LOSS after resuming,"
echo "     and its losses continue the FSDP2 curve from step $((FSDP_STEPS + 1))."

headline "3/7  unickpt inspect: what the FSDP2 checkpoint holds (from its index alone; first rows)"
INSPECT=$("$BIN/unickpt" inspect "$MODEL_DIR")
printf '%s\n' "$INSPECT" | sed -n '1,12p'
echo "     ... ($(printf '%s\n' "$INSPECT" | grep -c ' F32 ') tensors in all; \`unickpt inspect --slices\` lists every block)"

headline "4/7  unickpt verify: rehash every stored block of the model and optimizer checkpoints"
"$BIN/unickpt" verify -q "$MODEL_DIR"
echo "OK: $MODEL_DIR"
"$BIN/unickpt" verify -q "$FSDP_CKPT/step-$FSDP_STEPS/optimizer"
echo "OK: $FSDP_CKPT/step-$FSDP_STEPS/optimizer"

headline "5/7  unickpt merge: offline (no process group) into a plain Hugging Face checkpoint, then load it"
"$BIN/unickpt" merge -q "$MODEL_DIR" "$HF_OUT"
# The training script saved the model's config beside its checkpoints; HF loaders need it.
cp "$FSDP_CKPT/config.json" "$HF_OUT/config.json"
ls -l "$HF_OUT" | sed 1d
"$BIN/python" examples/load_merged.py "$HF_OUT" --expect-loss "$SAVED_LOSS"
echo "---> LlamaForCausalLM.from_pretrained on the merged files reproduces the saved eval loss $SAVED_LOSS."

headline "6/7  unickpt diff: sliced FSDP2 checkpoint vs merged HF checkpoint (fingerprints from the index files)"
"$BIN/unickpt" diff "$MODEL_DIR" "$HF_OUT"
echo "---> identical weights, established without reading a single tensor byte."
echo "     And against the TP run's later checkpoint (trained $TP_STEPS more steps), every tensor differs:"
set +e
"$BIN/unickpt" diff "$MODEL_DIR" "$TP_CKPT/step-$((FSDP_STEPS + TP_STEPS))/model" >"$DEMO_DIR/diff-tp.txt"
rc=$?
set -e
if [[ $rc -ne 1 ]]; then
    echo "demo: expected \`unickpt diff\` to report differences (exit 1), got exit $rc" >&2
    cat "$DEMO_DIR/diff-tp.txt" >&2
    exit 1
fi
sed -n '1,4p' "$DEMO_DIR/diff-tp.txt"
echo "     ... (exit code 1: the checkpoints differ; full report in $DEMO_DIR/diff-tp.txt)"

headline "7/7  What hashes buy: flip one byte in a copy of the FSDP2 checkpoint and verify again"
BROKEN="$DEMO_DIR/broken-copy"
cp -r "$MODEL_DIR" "$BROKEN"
"$BIN/python" - "$BROKEN/model-00003-of-00004.safetensors" <<'PY'
import sys
path = sys.argv[1]
with open(path, "r+b") as f:
    f.seek(-100, 2)  # inside the data section, near the end of rank 2's file
    b = f.read(1)
    f.seek(-100, 2)
    f.write(bytes([b[0] ^ 0x01]))
print(f"flipped the lowest bit of the byte 100 bytes before the end of {path}")
PY
set +e
"$BIN/unickpt" verify -q "$BROKEN" 2>"$DEMO_DIR/verify-broken.txt"
rc=$?
set -e
if [[ $rc -ne 1 ]]; then
    echo "demo: expected \`unickpt verify\` to fail with exit 1 on the corrupted copy, got exit $rc" >&2
    exit 1
fi
sed -n '/^FAILED/,$p' "$DEMO_DIR/verify-broken.txt"
echo "---> exit code 1, naming the damaged tensor, its block and its file (the other blocks are intact)."

headline "Done in $((SECONDS - START)) s. Files are in $DEMO_DIR:"
printf '  %-36s %s\n' \
    "$FSDP_CKPT/step-$FSDP_STEPS" "FSDP2 x4 checkpoint (model/, optimizer/, train_state/, COMMIT)" \
    "$TP_CKPT/step-$((FSDP_STEPS + TP_STEPS))" "TP x2 checkpoint after resuming" \
    "$HF_OUT" "merged Hugging Face checkpoint (config.json + model.safetensors)"
