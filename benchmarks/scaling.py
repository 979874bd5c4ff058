"""Scaling on paper: fit the measured layouts of a run and extrapolate to a 70B model on 512 ranks.

    python benchmarks/scaling.py benchmarks/results/bench-<time>.json

Reads the JSON written by run.py (the "scaling", "dist" and "merge" groups) and prints markdown:
what was measured at each (size, world), a least-squares fit of the unickpt index size as
bytes per tensor + bytes per slice, and the extrapolation. Pure arithmetic, no torch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

GB = 1e9
GiB = 1 << 30

# Llama-2-70B shapes (hidden 8192, 80 layers, FFN 28672, vocab 32000, 8 KV heads of 128).
L70 = {"layers": 80, "hidden": 8192, "ffn": 28672, "vocab": 32000, "kv": 1024}


def llama70b_tensors() -> list[tuple[str, tuple[int, ...]]]:
    h, f, v, kv = L70["hidden"], L70["ffn"], L70["vocab"], L70["kv"]
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
    for i in range(L70["layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate_proj.weight", (f, h)),
            (p + "mlp.up_proj.weight", (f, h)),
            (p + "mlp.down_proj.weight", (h, f)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    return out


def _prod(s: tuple[int, ...]) -> int:
    n = 1
    for d in s:
        n *= d
    return n


def fit_index(layouts: list[dict[str, Any]]) -> tuple[float, float] | None:
    """Least squares meta_bytes = a * tensors + b * slices (no intercept)."""
    pts = [(x["tensors"], x["slices"], x["meta_bytes"]) for x in layouts if x.get("slices")]
    if len(pts) < 2:
        return None
    stt = sum(t * t for t, _, _ in pts)
    sss = sum(s * s for _, s, _ in pts)
    sts = sum(t * s for t, s, _ in pts)
    sty = sum(t * y for t, _, y in pts)
    ssy = sum(s * y for _, s, y in pts)
    det = stt * sss - sts * sts
    if abs(det) < 1e-9:
        return None
    return (sty * sss - ssy * sts) / det, (ssy * stt - sty * sts) / det


def main() -> None:
    rep = json.loads(Path(sys.argv[1]).read_text())
    rows = {r["key"]: r for r in rep["rows"] if r.get("status") == "ok"}
    lay = rep.get("layouts", {})
    print(
        "| size MiB | world | per-rank MiB | DCP save s | unickpt save s | unickpt/DCP speed | "
        "index KiB | tensors | slices | index parse ms |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    uni = []
    for tag, x in sorted(lay.items(), key=lambda kv: (kv[1].get("size_mb", 0), kv[1].get("world", 0))):
        u = x.get("unickpt") or {}
        d, us = rows.get(f"{tag}dcp_save"), rows.get(f"{tag}unickpt_save")
        sz, w = x.get("size_mb", 0), x.get("world", 1)
        sp = f"{d['median_s'] / us['median_s']:.2f}" if d and us else ""
        parse = f"{u['index_parse_s'] * 1e3:.1f}" if "index_parse_s" in u else ""
        print(
            f"| {sz:g} | {w} | {sz / w:.0f} | {d['median_s'] if d else float('nan'):.2f} | "
            f"{us['median_s'] if us else float('nan'):.2f} | {sp} | {u.get('meta_bytes', 0) / 1024:.0f} | "
            f"{u.get('tensors', '')} | {u.get('slices', '')} | {parse} |"
        )
        if u.get("slices"):
            uni.append(dict(u, parse=u.get("index_parse_s")))
    fit = fit_index(uni)
    t70 = llama70b_tensors()
    n70 = sum(_prod(s) for _, s in t70)
    ranks = 512
    slices70 = sum(min(ranks, s[0]) for _, s in t70)  # Shard(0): a rank with no rows stores nothing
    print()
    print(
        f"70B (Llama-2-70B shapes): {len(t70)} tensors, {n70 / 1e9:.1f} B parameters, "
        f"{n70 * 2 / GB:.0f} GB bf16; FSDP2 on {ranks} ranks -> {slices70} slices."
    )
    print(
        f"- per-rank bytes: model bf16 {n70 * 2 / ranks / 1e6:.0f} MB; AdamW fp32 exp_avg+exp_avg_sq "
        f"{n70 * 8 / ranks / 1e6:.0f} MB (+{n70 * 4 / ranks / 1e6:.0f} MB fp32 master weights if kept)"
    )
    big = max(t70, key=lambda t: _prod(t[1]))
    print(
        f"- largest tensor {big[0]} {big[1]}: {_prod(big[1]) * 2 / 1e6:.0f} MB bf16 "
        f"(the floor of a merge that streams by tensor)"
    )
    if fit:
        a, b = fit
        idx = a * len(t70) + b * slices70
        print(
            f"- index fit on this run: {a:.0f} B/tensor + {b:.0f} B/slice -> model index ~{idx / 1e6:.0f} MB "
            f"(names ~1.5x longer than ours: +~{0.5 * 30 * slices70 / 1e6:.0f} MB); optimizer index ~2x that"
        )
        per = [x["parse"] / x["slices"] for x in uni if x.get("parse")]
        if per:
            ps = max(per)
            print(
                f"- index parse+validate: {ps * 1e6:.1f} us/slice here -> ~{ps * slices70:.1f} s per process "
                f"that parses the model index"
            )
    for key, label in (
        ("merge", "unickpt merge"),
        ("consolidate", "consolidate_safetensors_files"),
        ("copy", "plain copy"),
    ):
        ms = [r for k, r in rows.items() if k.startswith(key + "_")]
        if ms:
            m = max(ms, key=lambda r: r["bytes"])
            t = n70 * 2 / (m["gib_s"] * GiB)
            print(
                f"- {label} at this run's {m['gib_s']:.2f} GiB/s: 70B bf16 in ~{t / 60:.0f} min "
                f"(one process; peak RSS here {m['rss_peak_mb']:.0f} MB at {m['bytes'] / 2**20:.0f} MiB)"
            )


if __name__ == "__main__":
    main()
