"""The QK-norm functions alone: `python -m benchmarks.norm_alone`.

Forward and backward of the normalization of q (with g), for the l2 norm (ScaledUnitNorm), LayerNorm
and RMSNorm (ScaledAffineNorm), against what they replace: the composition of torch ops
(`F.normalize`, `F.layer_norm`, `F.rms_norm`, then a multiply by g), and for the l2 norm also its own
code compiled by torch.compile (benchmarks.norm_bounds; a C++ compiler is needed). q comes as
attention normalizes it (the projection's output split into heads) and its gradient as attention
passes it back (SDPA's CPU backward's layout). Every function runs in one process, interleaved round
by round; the ratios are to the l2 norm of the paper, the medians of per-round pairs. With --profile,
torch's profiler then says which operators each function's time goes to."""

import argparse
import functools
import statistics

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from fairseq_qknorm.lean_norms import ScaledAffineNorm, ScaledUnitNorm

from . import cpu
from .arms import QK_SCALE_INIT, SIZES
from .norm_bounds import CompiledUnitNorm
from .report import pair_ratios
from .timing import timed

TOKENS = 4000  # about the training benchmark's largest batch


def functions(w, b, g):
    eps = 1e-5
    return {
        "l2": lambda x: ScaledUnitNorm.apply(x, g),
        "l2 composed": lambda x: F.normalize(x, dim=-1) * g,
        "l2 compiled": lambda x: CompiledUnitNorm.apply(x, g),
        "layernorm": lambda x: ScaledAffineNorm.apply(x, w, b, g, eps, True),
        "layernorm composed": lambda x: F.layer_norm(x, x.shape[-1:], w, b, eps) * g,
        "rmsnorm": lambda x: ScaledAffineNorm.apply(x, w, None, g, eps, False),
        "rmsnorm composed": lambda x: F.rms_norm(x, x.shape[-1:], w, eps) * g,
    }


def forward_backward(fn, x, grad):
    fn(x.detach().requires_grad_()).backward(grad)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.norm_alone", description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="+", choices=("small", "medium", "glen"), default=["small", "medium", "glen"])
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--profile", action="store_true", help="then profile 10 rounds of every function")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.threads < 1:
        p.error("--rounds, --threads: expected positive numbers")
    torch.set_num_threads(args.threads)
    print(f"Machine: {cpu.describe(cpu.record())}; torch {torch.__version__}, {args.threads} threads\n")
    print("| size | function | ms per forward + backward, median | time / l2 (median of pairs) |")
    print("|---|---|---:|---:|")
    profiles = []
    for size in args.sizes:
        heads, dim = SIZES[size].heads, SIZES[size].dim // SIZES[size].heads
        time_len = 25
        batch = TOKENS // time_len
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(time_len, batch, heads, dim, generator=gen)
        # SDPA's CPU backward returns q's gradient as (batch, time, heads, dim) in memory
        grad = torch.randn(batch, time_len, heads, dim, generator=gen).transpose(0, 1)
        w = (1 + 0.1 * torch.randn(dim, generator=gen)).requires_grad_()
        b = (0.1 * torch.randn(dim, generator=gen)).requires_grad_()
        g = torch.tensor(QK_SCALE_INIT, requires_grad=True)
        fns = {name: functools.partial(forward_backward, fn, x, grad) for name, fn in functions(w, b, g).items()}
        for fn in fns.values():  # the first calls compile, or warm the allocator
            fn()
        seconds = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                seconds[name].append(timed(fn, "cpu"))
        for name, values in seconds.items():
            ratio = statistics.median(pair_ratios(values, seconds["l2"]))
            print(f"| {size} (head dim {dim}) | {name} | {1000 * statistics.median(values):.3f} | {ratio:.2f} |")
        if args.profile:
            profiles += [(f"{size}, {name}", fn) for name, fn in fns.items()]
    for label, fn in profiles:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                fn()
        print(f"\n{label}, 10 forwards and backwards:")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=45))


if __name__ == "__main__":
    main()
