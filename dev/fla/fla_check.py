"""External check and anchor for the linear-mixer CUDA kernels (not part of the build).

  build/fla-dump DUMP [--gates strong]
  python3 dev/fla/fla_check.py --fla DIR --dump DUMP [--time [--json FILE]]

DIR holds the `fla` package of flash-linear-attention (fetched separately, never committed);
DUMP is the folder `fla-dump` (dev/fla/fla_dump.cpp) wrote: inputs, outputs and gradients of
gdn, deltanet, gla, kda and gdn2. Checks our outputs and gradients against fla's naive
PyTorch recurrences (fp32, autograd), then with --time measures fla's chunk kernels (bf16) at
the bench shapes with CUDA events (median of 20 after 3 warm-ups); --json FILE writes those
times as `lar-bench linear-cuda --fla FILE` reads them, {"mixer,B,T,H,dk,dv": {"fwd": ms,
"fwd_bwd": ms}}, so that the anchor beside our numbers is measured in the same device call.
fla refuses its gated backward on Hopper with Triton < 3.7.1 (numerically wrong there):
the guard is bypassed for timing only, its gradients are not used.
--key-dim / --value-dim time heads of dk × dv (CCQ's 256 × 512, CARVE's 128 × 128) at scale
1/sqrt(dk), the shapes `lar-bench linear-cuda --key-dim --value-dim` times.
"""
import argparse
import json
import os
import sys

import numpy as np
import torch


def rel_rms(a, b):
    a, b = a.double(), b.double()
    return (((a - b) ** 2).sum() / (b ** 2).sum().clamp_min(1e-300)).sqrt().item()


def check(dump, naive):
    B, T, H, D = 2, 300, 4, 64
    ok = True
    for case in ("gdn", "deltanet"):
        if not os.path.exists(os.path.join(dump, f"{case}_q")):
            print(f"fla naive vs ours, {case}: no dump (skipped)")
            continue

        def load(name, shape):
            x = np.fromfile(os.path.join(dump, f"{case}_{name}"), dtype=np.float32).reshape(shape)
            return torch.from_numpy(x).cuda()
        q, k, v, dO = (load(n, (B, T, H, D)) for n in ("q", "k", "v", "dO"))
        g, beta = load("g", (B, T, H)), load("beta", (B, T, H))
        S0, dST = load("S0", (B, H, D, D)), load("dST", (B, H, D, D))
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta)]
        h0 = S0.transpose(-1, -2).contiguous().requires_grad_(True)  # fla: [B,H,K,V]
        o, hT = naive(leaves[0], leaves[1], leaves[2], leaves[4], leaves[3], scale=0.125,
                      initial_state=h0, output_final_state=True)
        ((o * dO).sum() + (hT * dST.transpose(-1, -2)).sum()).backward()
        ref = {"o": o, "S": hT.transpose(-1, -2), "dq": leaves[0].grad, "dk": leaves[1].grad,
               "dv": leaves[2].grad, "dg": leaves[3].grad, "dbeta": leaves[4].grad,
               "dS0": h0.grad.transpose(-1, -2)}
        shapes = {"o": (B, T, H, D), "S": (B, H, D, D), "dq": (B, T, H, D), "dk": (B, T, H, D),
                  "dv": (B, T, H, D), "dg": (B, T, H), "dbeta": (B, T, H), "dS0": (B, H, D, D)}
        line = []
        for name, r in ref.items():
            if case == "deltanet" and name == "dg":
                continue
            e = rel_rms(load(name, shapes[name]), r.detach())
            tol = 5e-3 if name in ("o", "S") else 1e-2
            ok &= e <= tol
            line.append(f"{name} {e:.2e}{'' if e <= tol else ' FAIL'}")
        print(f"fla naive vs ours, {case} B={B} T={T} H={H}: " + ", ".join(line))
    return ok


def check_channel(dump, fla_ops):
    """gla, kda, gdn2 (per-key-channel log-gates) against fla's naive recurrences."""
    B, T, H, D = 2, 300, 4, 64
    ok = True
    for case in ("gla", "kda", "gdn2"):
        if not os.path.exists(os.path.join(dump, f"{case}_q")):
            print(f"fla naive vs ours, {case}: no dump")
            ok = False
            continue

        def load(name, shape):
            x = np.fromfile(os.path.join(dump, f"{case}_{name}"), dtype=np.float32).reshape(shape)
            return torch.from_numpy(x).cuda()
        x4 = (B, T, H, D)
        names = ["q", "k", "v", "g"] + {"gla": [], "kda": ["beta"], "gdn2": ["b", "w"]}[case]
        leaves = {n: load(n, (B, T, H) if n == "beta" else x4).requires_grad_(True) for n in names}
        dO = load("dO", x4)
        S0, dST = load("S0", (B, H, D, D)), load("dST", (B, H, D, D))
        h0 = S0.transpose(-1, -2).contiguous().requires_grad_(True)  # fla: [B,H,K,V]
        L = leaves
        if case == "gla":
            o, hT = fla_ops["gla"](L["q"], L["k"], L["v"], L["g"], initial_state=h0, output_final_state=True)
        elif case == "kda":
            o, hT = fla_ops["kda"](L["q"], L["k"], L["v"], L["g"], L["beta"], scale=0.125, initial_state=h0,
                                   output_final_state=True)
        else:
            o, hT = fla_ops["gdn2"](L["q"], L["k"], L["v"], L["g"], L["b"], L["w"], scale=0.125, initial_state=h0,
                                    output_final_state=True)
        ((o * dO).sum() + (hT * dST.transpose(-1, -2)).sum()).backward()
        ref = {"o": (o, x4), "S": (hT.transpose(-1, -2), (B, H, D, D)), "dS0": (h0.grad.transpose(-1, -2), (B, H, D, D))}
        for n in names:
            ref["d" + n] = (L[n].grad, (B, T, H) if n == "beta" else x4)
        line = []
        for name, (r, shape) in ref.items():
            e = rel_rms(load(name, shape), r.detach())
            tol = 5e-3 if name in ("o", "S") else 1e-2
            ok &= e <= tol
            line.append(f"{name} {e:.2e}{'' if e <= tol else ' FAIL'}")
        print(f"fla naive vs ours, {case} B={B} T={T} H={H}: " + ", ".join(line))
    return ok


def median_ms(f, reps=20, warmup=3):
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


def time_fla(shapes, mixers, V=64, times=None, D=64):
    import fla.ops.common.chunk_o as chunk_o
    from fla.ops.delta_rule import chunk_delta_rule
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.gdn2 import chunk_gdn2
    from fla.ops.gla import chunk_gla
    from fla.ops.kda import chunk_kda
    chunk_o.IS_NVIDIA_HOPPER = False  # timing only (see the module docstring)
    torch.manual_seed(0)
    scale = D ** -0.5
    for B, T, H in shapes:
        dev, bf = "cuda", torch.bfloat16
        q = torch.nn.functional.normalize(torch.randn(B, T, H, D, device=dev), dim=-1).to(bf)
        k = torch.nn.functional.normalize(torch.randn(B, T, H, D, device=dev), dim=-1).to(bf)
        v = torch.randn(B, T, H, V, device=dev, dtype=bf)
        dO = torch.randn(B, T, H, V, device=dev, dtype=bf)
        beta = (0.05 + 0.9 * torch.rand(B, T, H, device=dev)).to(bf)
        g = torch.log(0.9 + 0.1 * torch.rand(B, T, H, device=dev))
        gc = torch.log(0.9 + 0.1 * torch.rand(B, T, H, D, device=dev))
        eb = (0.05 + 0.9 * torch.rand(B, T, H, D, device=dev)).to(bf)  # gdn2's erase and write gates
        ew = (0.05 + 0.9 * torch.rand(B, T, H, V, device=dev)).to(bf)
        runs = {
            "deltanet": lambda *a: chunk_delta_rule(*a[:3], a[4], scale=scale)[0],
            "gdn": lambda *a: chunk_gated_delta_rule(*a[:3], a[3], a[4], scale=scale)[0],
            "gla": lambda *a: chunk_gla(*a[:3], a[5], scale=scale)[0],
            "kda": lambda *a: chunk_kda(*a[:3], a[5], a[4], scale=scale)[0],
            "gdn2": lambda *a: chunk_gdn2(*a[:3], a[5], a[6], a[7], scale=scale)[0],
        }
        for name, f in runs.items():
            if name not in mixers:
                continue
            xs = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, gc, eb, ew)]
            try:
                t_f = median_ms(lambda: f(*xs))
                t_fb = median_ms(lambda: f(*xs).backward(dO))
                print(f"fla {name} B={B} T={T} H={H} dk={D} dv={V}: fwd {t_f:.3f} ms, fwd+bwd {t_fb:.3f} ms", flush=True)
                if times is not None:
                    times[f"{name},{B},{T},{H},{D},{V}"] = {"fwd": t_f, "fwd_bwd": t_fb}
            except Exception as e:  # report, keep timing the others
                print(f"fla {name} B={B} T={T} H={H}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fla", required=True)
    ap.add_argument("--dump")
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--shapes", default="8x4096x16,1x32768x16", help="BxTxH,... to time")
    ap.add_argument("--mixers", default="deltanet,gdn,gla,kda,gdn2")
    ap.add_argument("--value-dim", type=int, default=64, help="value head dim of the timed shapes")
    ap.add_argument("--key-dim", type=int, default=64, help="key head dim of the timed shapes")
    ap.add_argument("--json", help="with --time: write the times here for `lar-bench linear-cuda --fla`")
    a = ap.parse_args()
    sys.path.insert(0, a.fla)
    ok = True
    if a.dump:
        from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
        from fla.ops.gdn2.naive import naive_recurrent_gdn2
        from fla.ops.gla.naive import naive_recurrent_gla
        from fla.ops.kda.naive import naive_recurrent_kda
        ok = check(a.dump, naive_recurrent_gated_delta_rule)
        ok &= check_channel(a.dump, {"gla": naive_recurrent_gla, "kda": naive_recurrent_kda,
                                     "gdn2": naive_recurrent_gdn2})
    if a.time:
        shapes = [tuple(int(x) for x in sh.split("x")) for sh in a.shapes.split(",")]
        times = {}
        try:
            time_fla(shapes, a.mixers.split(","), a.value_dim, times, a.key_dim)
        finally:  # what was timed before a time limit still counts
            if a.json:
                with open(a.json, "w") as f:
                    json.dump(times, f, indent=1)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
