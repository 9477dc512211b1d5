"""Stand-ins for the l2 norm (ScaledUnitNorm) that bound what a faster one could gain in a training
step, for benchmarks.one_process. Each runs as the `qknorm` arm with ScaledUnitNorm replaced while
that arm's model is built and timed.

- `one_pass`: y = g * x, one elementwise pass forward and one backward, and g not trained: less work
  than any normalization does, so no kernel for one can be cheaper. Not a normalization at all.
- `l2_compiled`: the l2 norm's own math, forward and backward each fused by torch.compile (inductor
  writes and builds C++ for it, so a C++ compiler is needed; the first rounds pay the build)."""

import contextlib

import torch

import fairseq_qknorm.qknorm_attention as qknorm_attention

EPS = qknorm_attention.ScaledUnitNorm.EPS


class OnePass(torch.autograd.Function):
    @staticmethod
    def values(x, g):
        return x * (1.0 if g is None else g), None

    @staticmethod
    def forward(ctx, x, g):
        ctx.save_for_backward(g)
        return OnePass.values(x, g)[0]

    @staticmethod
    def backward(ctx, grad_y):
        (g,) = ctx.saved_tensors
        return grad_y * (1.0 if g is None else g), None


def l2_forward(x, g):
    """(g x / ||x||, 1 / ||x||), as ScaledUnitNorm.values in float32; g a tensor (1 for none)."""
    inv_norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(EPS).reciprocal()
    return x * (inv_norm * g), inv_norm


def l2_backward(y, grad_y, inv_norm, g):
    """(grad_x, grad_g) from y, as ScaledUnitNorm.backward."""
    dot = (y * grad_y).sum(-1, keepdim=True)
    safe_g = torch.where(g == 0, 1.0, g)
    grad_x = grad_y * (inv_norm * g) - y * (dot * (inv_norm / safe_g))
    return grad_x, dot.sum_to_size(g.shape) / safe_g


_compiled = {}


def _compile(fn):
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=True)
    return _compiled[fn]


class CompiledUnitNorm(torch.autograd.Function):
    @staticmethod
    def values(x, g):
        return _compile(l2_forward)(x, torch.ones((), dtype=x.dtype, device=x.device) if g is None else g)

    @staticmethod
    def forward(ctx, x, g):
        ctx.has_g = g is not None
        g = torch.ones((), dtype=x.dtype, device=x.device) if g is None else g
        y, inv_norm = _compile(l2_forward)(x, g)
        ctx.save_for_backward(y, inv_norm, g)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        y, inv_norm, g = ctx.saved_tensors
        grad_x, grad_g = _compile(l2_backward)(y, grad_y, inv_norm, g)
        return grad_x, grad_g if ctx.has_g else None


STAND_INS = {"one_pass": OnePass, "l2_compiled": CompiledUnitNorm}


@contextlib.contextmanager
def standing_in(arm):
    """ScaledUnitNorm replaced by the stand-in `arm` names; nothing changed for any other arm."""
    if arm not in STAND_INS:
        yield
        return
    real = qknorm_attention.ScaledUnitNorm
    qknorm_attention.ScaledUnitNorm = STAND_INS[arm]
    try:
        yield
    finally:
        qknorm_attention.ScaledUnitNorm = real
