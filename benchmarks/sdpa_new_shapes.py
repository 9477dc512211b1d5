"""SDPA on batch shapes it has not seen: `python -m benchmarks.sdpa_new_shapes --device cuda`.

fairseq's batches take a new (sentences, length) shape every few updates of the first epoch. On an
H200 the gl-en 2x2's first epoch trained six times slower than its second, with the same batches
(examples/ted/gl-en-2x2-gpu/README.md, Status): a backend that builds a plan for every new shape
would do that, and cuDNN's does, which is why the plugin keeps it out. For SDPA's default choice,
the plugin's choice and each backend SDPA can be held to, the forward and
backward of attention as the plugin trains it (an additive padding mask, dropout, 4 heads of 128)
at shapes of about 4,000 tokens: the first call of each shape, then the same shape once more. Every
backend has shapes of its own, so that none finds another's plans cached."""

import argparse
import contextlib
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fairseq_qknorm.qknorm_attention import FUSED_BACKENDS

from .timing import timed

BACKENDS = {
    "default": None,
    "plugin": FUSED_BACKENDS,  # what QKNormAttention's fused path may use: all but cuDNN
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def attention_step(batch, length, device, dtype, generator):
    """One forward and backward of SDPA as training calls it; returns its seconds."""
    heads, head_dim = 4, 128
    q, k, v = (
        torch.randn(batch, heads, length, head_dim, device=device, dtype=dtype, generator=generator).requires_grad_()
        for _ in range(3)
    )
    padded = torch.arange(length, device=device) >= length - length // 5  # the last fifth of every other row
    mask = torch.zeros(batch, 1, 1, length, device=device, dtype=dtype)
    mask[::2, ..., padded] = float("-inf")
    return timed(
        lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.1).sum().backward(), device
    )


def measure(backend, lengths, tokens, device, dtype):
    """Per shape: (seconds of its first call, seconds of the second); None if the backend cannot run it."""
    generator = torch.Generator(device=device).manual_seed(0)
    first, again = [], []
    held = BACKENDS[backend]
    with sdpa_kernel(held) if held is not None else contextlib.nullcontext():
        for length in lengths:
            try:
                first.append(attention_step(tokens // length, length, device, dtype, generator))
            except RuntimeError:  # this backend does not take these inputs here
                return None
            again.append(attention_step(tokens // length, length, device, dtype, generator))
    return first, again


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.sdpa_new_shapes", description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shapes", type=int, default=12, help="new shapes per backend (default 12)")
    p.add_argument("--tokens", type=int, default=4000, help="tokens per batch (default 4000)")
    args = p.parse_args(argv)
    if args.shapes < 1 or args.tokens < 100:
        p.error("--shapes: expected a positive number; --tokens: at least 100")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    dtype = torch.float16 if args.device == "cuda" else torch.float32
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}, {dtype}, {args.shapes} new shapes per backend of ~{args.tokens} tokens")
    print("| backend | first call of a shape, ms (median) | same shape again, ms (median) | first / again |")
    print("|---|---:|---:|---:|")
    backends = list(BACKENDS) if args.device == "cuda" else ["default", "plugin", "math"]
    # the process's one-time costs (CUDA context, library handles) on a length no backend uses
    attention_step(args.tokens // 8, 8, args.device, dtype, torch.Generator(device=args.device).manual_seed(1))
    for i, backend in enumerate(backends):
        lengths = [9 + i + len(backends) * j for j in range(args.shapes)]  # no length shared between backends
        result = measure(backend, lengths, args.tokens, args.device, dtype)
        if result is None:
            print(f"| {backend} | not available for these inputs | | |")
            continue
        first, again = (statistics.median(s) * 1000 for s in result)
        print(f"| {backend} | {first:.2f} | {again:.2f} | {first / again:.1f} |")


if __name__ == "__main__":
    main()
