#!/usr/bin/env bash
# Merge a unickpt checkpoint (any plugin, any world size) into a plain Hugging Face checkpoint, offline,
# and check the result: verify both, diff them by fingerprint, load the merged one with transformers.
#
#   bash examples/merge_to_hf.sh SRC OUT
#
# SRC: a CheckpointManager directory (its latest step is used), one step-<N> directory, or a model
# checkpoint directory. OUT must not exist (or be empty). When a config.json is found next to the
# checkpoint (the example training scripts write one into their --save-dir), it is copied into OUT
# and the merged model is loaded with LlamaForCausalLM.from_pretrained.
set -euo pipefail

# Paths given on the command line are relative to where the script was started.
abspath() { case $1 in /*) printf '%s\n' "$1" ;; *) printf '%s\n' "$PWD/$1" ;; esac; }
if [[ $# -ne 2 ]]; then
    echo "usage: $0 SRC OUT" >&2
    exit 2
fi
SRC=$(abspath "$1")
OUT=$(abspath "$2")
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BIN="${VENV:-.venv}/bin"
[[ -x "$BIN/unickpt" ]] || { echo "$BIN/unickpt not found; run \`make venv\` first" >&2; exit 2; }
export HF_HUB_OFFLINE=1

# Resolve SRC to the model checkpoint directory.
if [[ -f "$SRC/latest" ]]; then
    step=$("$BIN/python" -c 'import json,sys; print(json.load(open(sys.argv[1]))["step"])' "$SRC/latest")
    MODEL="$SRC/step-$step/model"
elif [[ -d "$SRC/model" ]]; then
    MODEL="$SRC/model"
else
    MODEL="$SRC"
fi
config=""
for c in "$MODEL/config.json" "$MODEL/../config.json" "$MODEL/../../config.json"; do
    if [[ -f "$c" ]]; then config=$c; break; fi
done

echo "== verify $MODEL (rehash every stored slice)"
"$BIN/unickpt" verify -q "$MODEL"
echo "OK"
echo "== merge $MODEL -> $OUT"
"$BIN/unickpt" merge -q "$MODEL" "$OUT"
if [[ -n "$config" && ! -f "$OUT/config.json" ]]; then
    cp "$config" "$OUT/config.json"
fi
ls -l "$OUT" | sed 1d
echo "== verify $OUT"
"$BIN/unickpt" verify -q "$OUT"
echo "OK"
echo "== diff $MODEL $OUT (layout-invariant fingerprints, index files only)"
"$BIN/unickpt" diff "$MODEL" "$OUT"
if [[ -f "$OUT/config.json" ]]; then
    echo "== load $OUT with transformers"
    "$BIN/python" examples/load_merged.py "$OUT"
else
    echo "(no config.json found next to $MODEL: skipped loading with transformers)"
fi
echo "== OK: $OUT is a plain Hugging Face checkpoint with the same weights as $MODEL"
