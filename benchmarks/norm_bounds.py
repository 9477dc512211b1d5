"""Stand-ins for the l2 norm (ScaledUnitNorm) that bound what a faster one could gain in a training
step, for benchmarks.one_process. Each runs as the `qknorm` arm with ScaledUnitNorm replaced while
that arm's model is built and timed.

- `one_pass`: y = g * x, one elementwise pass forward and one backward, and g not trained: less work
  than any normalization does, so no kernel for one can be cheaper. Not a normalization at all.
- `l2_compiled`: the l2 norm's own code, ScaledUnitNorm.values forward and ScaledUnitNorm.backward,
  each fused by torch.compile (inductor writes and builds C++ for it, so a C++ compiler is
  needed; the first rounds pay the build)."""

import contextlib
import functools
import types

import torch

import fairseq_qknorm.lean_norms as lean_norms
from fairseq_qknorm.lean_norms import ScaledUnitNorm  # the real one, whatever stands in later


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


@functools.cache
def _compile(fn):
    """fn compiled once, on first use: importing this module (every one_process run does) stays cheap."""
    return torch.compile(fn, dynamic=True)


# ScaledUnitNorm.backward's code as a plain function: torch.compile then traces it as code (through
# the class, it would take it for an autograd call).
_UNIT_NORM_BACKWARD = ScaledUnitNorm.backward


def _unit_norm_backward(y, inv_norm, g, grad_y, want_g):
    """ScaledUnitNorm.backward on the tensors its forward saved, as a function of tensors alone:
    what torch.compile takes (an autograd context is not one)."""
    ctx = types.SimpleNamespace(saved_tensors=(y, inv_norm, g), needs_input_grad=(True, want_g))
    return _UNIT_NORM_BACKWARD(ctx, grad_y)


class CompiledUnitNorm(ScaledUnitNorm):
    """ScaledUnitNorm, its values and gradients each compiled. A subclass, so that the real code, which
    names ScaledUnitNorm, finds its constants in the stand-in while it stands in."""

    @staticmethod
    def values(x, g):
        return _compile(ScaledUnitNorm.values)(x, g)

    @staticmethod
    def forward(ctx, x, g):
        y, inv_norm = CompiledUnitNorm.values(x, g)
        ctx.save_for_backward(y, inv_norm, g)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        y, inv_norm, g = ctx.saved_tensors
        return _compile(_unit_norm_backward)(y, inv_norm, g, grad_y, ctx.needs_input_grad[1])


STAND_INS = {"one_pass": OnePass, "l2_compiled": CompiledUnitNorm}


@contextlib.contextmanager
def standing_in(arm):
    """ScaledUnitNorm replaced by the stand-in `arm` names; nothing changed for any other arm."""
    if arm not in STAND_INS:
        yield
        return
    lean_norms.ScaledUnitNorm = STAND_INS[arm]
    try:
        yield
    finally:
        lean_norms.ScaledUnitNorm = ScaledUnitNorm
