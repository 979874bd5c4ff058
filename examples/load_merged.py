"""Load a merged (plain Hugging Face) checkpoint with ``safetensors`` and ``transformers``; no unickpt.

    .venv/bin/python examples/load_merged.py /tmp/unickpt-demo/hf [--expect-loss 2.786418]

Checks that ``LlamaForCausalLM.from_pretrained`` takes every tensor from the files (nothing
missing, nothing left over), that its weights are bit-identical to ``safetensors.load_file``,
that the head is still tied to the embedding, and prints the loss on the examples' fixed eval
batch (the same number the training script printed when it saved). Exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

# Python puts this script's directory on sys.path, so the examples' helpers import directly.
from _common import eval_batch, lm_loss
from safetensors.torch import load_file


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path", help="merged Hugging Face checkpoint directory (config.json + *.safetensors)")
    p.add_argument("--expect-loss", type=float, default=None, help="fail unless the eval loss matches (1e-5)")
    args = p.parse_args()

    import logging

    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    hf_logging.disable_progress_bar()
    files = sorted(glob.glob(os.path.join(args.path, "*.safetensors")))
    if not files:
        print(f"no .safetensors files in {args.path}", file=sys.stderr)
        return 1
    raw: dict[str, torch.Tensor] = {}
    for f in files:
        raw.update(load_file(f))
    model, info = LlamaForCausalLM.from_pretrained(args.path, output_loading_info=True)
    # The tied head is not stored (Hugging Face convention); everything else must come from the files.
    problems = {k: sorted(set(v) - {"lm_head.weight"}) for k, v in info.items() if v}
    problems = {k: v for k, v in problems.items() if v}
    if problems:
        print(f"transformers reported loading problems: {problems}", file=sys.stderr)
        return 1
    state = model.state_dict()
    for name, t in raw.items():
        if not torch.equal(state[name].view(torch.uint8), t.view(torch.uint8)):
            print(f"{name}: transformers' weights differ from the file", file=sys.stderr)
            return 1
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        print("lm_head is not tied to embed_tokens after loading", file=sys.stderr)
        return 1
    model.eval()
    tokens = eval_batch()
    with torch.no_grad():
        loss = float(lm_loss(model(input_ids=tokens).logits, tokens))
    n = sum(t.numel() for t in raw.values())
    print(
        f"transformers loaded {len(raw)} tensors ({n:,} values) from {len(files)} file(s), bit-identical "
        f"to safetensors.load_file, lm_head tied; eval loss {loss:.6f}"
    )
    if args.expect_loss is not None and abs(loss - args.expect_loss) > 1e-5:
        print(f"eval loss {loss:.6f} differs from the expected {args.expect_loss:.6f}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
