"""The QK-norm functions alone: `python -m benchmarks.norm_alone`.

Forward and backward of the normalization of q (with g), for the l2 norm (ScaledUnitNorm), LayerNorm
and RMSNorm (ScaledAffineNorm), against what they replace: the composition of torch ops
(`F.normalize`, `F.layer_norm`, `F.rms_norm`, then a multiply by g). q comes as attention normalizes
it (the projection's output split into heads) and its gradient as attention passes it back (SDPA's
CPU backward's, permuted back). Every function runs in one process, interleaved round by round; the
ratios are to the l2 norm of the paper, the medians of per-round pairs."""

import argparse
import functools
import statistics

import torch
import torch.nn.functional as F

from fairseq_qknorm.lean_norms import ScaledAffineNorm, ScaledUnitNorm

from .arms import QK_SCALE_INIT, SIZES
from .report import pair_ratios
from .timing import timed

TOKENS = 4000  # about the training benchmark's largest batch


def functions(w, b, g):
    eps = 1e-5
    return {
        "l2": lambda x: ScaledUnitNorm.apply(x, g),
        "l2 composed": lambda x: F.normalize(x, dim=-1) * g,
        "layernorm": lambda x: ScaledAffineNorm.apply(x, w, b, g, eps, True),
        "layernorm composed": lambda x: F.layer_norm(x, x.shape[-1:], w, b, eps) * g,
        "rmsnorm": lambda x: ScaledAffineNorm.apply(x, w, None, g, eps, False),
        "rmsnorm composed": lambda x: F.rms_norm(x, x.shape[-1:], w, eps) * g,
    }


def forward_backward(fn, x, grad):
    fn(x).backward(grad)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.norm_alone", description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="+", choices=("small", "glen"), default=["small", "glen"])
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.threads < 1:
        p.error("--rounds, --threads: expected positive numbers")
    torch.set_num_threads(args.threads)
    print("| size | function | ms per forward + backward, median | time / l2 (median of pairs) |")
    print("|---|---|---:|---:|")
    for size in args.sizes:
        heads, dim = SIZES[size].heads, SIZES[size].dim // SIZES[size].heads
        time_len = 25
        batch = TOKENS // time_len
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(time_len, batch, heads, dim, generator=gen)
        grad = torch.randn(batch, heads, time_len, dim, generator=gen).permute(2, 0, 1, 3)
        w = (1 + 0.1 * torch.randn(dim, generator=gen)).requires_grad_()
        b = (0.1 * torch.randn(dim, generator=gen)).requires_grad_()
        g = torch.tensor(QK_SCALE_INIT, requires_grad=True)
        fns = functions(w, b, g)
        seconds = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                leaf = x.detach().requires_grad_()
                seconds[name].append(timed(functools.partial(forward_backward, fn, leaf, grad), "cpu"))
        for name, values in seconds.items():
            ratio = statistics.median(pair_ratios(values, seconds["l2"]))
            print(f"| {size} (head dim {dim}) | {name} | {1000 * statistics.median(values):.3f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
