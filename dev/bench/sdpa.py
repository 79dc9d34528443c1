"""The anchor of `lar-bench attention`: PyTorch's SDPA timed in the same device call.

  python3 dev/bench/sdpa.py --json sdpa.json && build/lar-bench attention --sdpa sdpa.json

Times F.scaled_dot_product_attention(is_causal=True) on [B,H,T,D] bf16 at the bench's shapes
(CUDA events, median of 30 after 5 warm-ups; fwd and fwd+bwd) and writes
{"B,T,H,kv,d": {"fwd": ms, "fwd_bwd": ms}}. Needs PyTorch with CUDA (not part of the build).
"""
import argparse
import json

import torch
import torch.nn.functional as F

SHAPES = [(8, 4096, 16, 16, 64), (8, 4096, 16, 4, 64), (2, 16384, 16, 16, 64), (1, 32768, 16, 16, 64),
          (4, 4096, 16, 16, 128)]


def median_ms(f, reps=30, warmup=5):
    for _ in range(warmup):
        f()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        f()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True, help="where to write the times")
    a = ap.parse_args()
    torch.manual_seed(0)
    out = {}
    for B, T, H, kv, D in SHAPES:
        q = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(B, kv, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(B, kv, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dO = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
        gqa = {"enable_gqa": True} if kv != H else {}
        fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)  # noqa: E731
        t_f = median_ms(fwd)
        t_fb = median_ms(lambda: fwd().backward(dO))
        out[f"{B},{T},{H},{kv},{D}"] = {"fwd": t_f, "fwd_bwd": t_fb}
        print(f"sdpa B={B} T={T} H={H} kv={kv} d={D}: fwd {t_f:.3f} ms, fwd+bwd {t_fb:.3f} ms", flush=True)
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
