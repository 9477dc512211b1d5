"""QK-norm's normalizations as autograd functions that keep only their output for backward.

Each computes what qknorm_attention.scaled_norm specifies (g * F.normalize(x, dim=-1), or g times a
per-head LayerNorm / RMSNorm) with less memory: composed from torch ops, autograd keeps the
projection output, the normalized tensor and more for backward; these keep only y, the tensor
attention keeps anyway, and one float per row. tests/plugin/test_lean_norms.py checks their values
and gradients against the specification.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor, nn


def unit_norm(x: Tensor, g: Optional[Tensor]) -> Tensor:
    """g * x / ||x|| over the last dim (ScaledUnitNorm); without autograd's bookkeeping when no
    gradient is wanted (beam search: three times per layer and step)."""
    return ScaledUnitNorm.apply(x, g) if torch.is_grad_enabled() else ScaledUnitNorm.values(x, g)[0]


def affine_norm(x: Tensor, norm: nn.Module, g: Optional[Tensor]) -> Tensor:
    """g * norm(x), norm an nn.LayerNorm or nn.RMSNorm over the last dim (ScaledAffineNorm)."""
    eps = norm.eps
    if eps is None:  # nn.RMSNorm's default: the epsilon of the float type it computes in
        eps = torch.finfo(torch.promote_types(x.dtype, torch.float32)).eps
    args = (x, norm.weight, getattr(norm, "bias", None), g, eps, isinstance(norm, nn.LayerNorm))
    return ScaledAffineNorm.apply(*args) if torch.is_grad_enabled() else ScaledAffineNorm.values(*args)[0]


class ScaledUnitNorm(torch.autograd.Function):
    """y = g * x / ||x|| over the last dim, g a scalar, per-head g or None (= 1).

    Written out because of memory: composed from torch ops, autograd keeps x, x/||x|| and g*x/||x||
    for backward, three activations per projection where stock attention keeps one. Here only y
    (which attention keeps anyway: the same tensor) and the per-row scale g/||x|| are kept; backward
    recovers x/||x|| as y / g. Norms and products are taken in float32 (the sum of squares
    overflows fp16); eps keeps a zero vector at zero, not NaN.
    """

    EPS = 1e-6

    @staticmethod
    def values(x: Tensor, g: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        """(y, g/||x||), without autograd: what beam search calls, three times per layer and step."""
        acc = torch.promote_types(x.dtype, torch.float32)  # float32, or float64 for float64
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=acc).clamp_min_(ScaledUnitNorm.EPS)
        scale = norm.reciprocal_() if g is None else torch.div(g, norm)
        return (x.to(acc) * scale).to(x.dtype), scale

    @staticmethod
    def forward(ctx, x: Tensor, g: Optional[Tensor]) -> Tensor:
        y, scale = ScaledUnitNorm.values(x, g)
        ctx.save_for_backward(y, scale, g)
        return y

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        """dy/dx = (g / ||x||) (I - u u^T), u = x / ||x|| = y / g, row by row. That is the formula of
        torch's fused weight-norm backward, which for rows v, per-row factors s and norms n returns
        (s / n) (dy - v (v . dy) / n^2) and (v . dy) / n: with v = y and n = g, v / n is u, s = g^2/||x||
        gives x's gradient, and (v . dy) / n = u . dy is g's, per row. One kernel reads y and the
        gradient once, where the formula written as torch ops read them four times: on an AVX-512
        Xeon, forward and backward took 1.2 to 1.5 times as long that way (benchmarks/HISTORY.md)."""
        y, scale, g = ctx.saved_tensors
        acc, dim = scale.dtype, y.size(-1)
        # g == 0 makes y and the scale 0, and so x's gradient, whatever n is (1 keeps it finite);
        # g's own gradient, from y = 0, is lost.
        n = torch.ones_like(scale) if g is None else torch.where(g == 0, 1.0, g).expand_as(scale).contiguous()
        # The kernel reads its rows as dense memory: the gradient attention passes back is copied
        # (and cast) into y's layout, x's, and x's gradient comes out in it (a view of the projection's).
        dense_grad = torch.empty(y.shape, dtype=acc, device=y.device).copy_(grad_y)
        grad_x, grad_g = torch.ops.aten._weight_norm_interface_backward(
            dense_grad.view(-1, dim),
            y.to(acc).reshape(-1, dim),
            (scale * n).view(-1, 1),
            n.view(-1, 1),
            0,
        )
        grad_g = grad_g.view(scale.shape).sum_to_size(g.shape) if ctx.needs_input_grad[1] else None
        return grad_x.view(y.shape).to(y.dtype), grad_g


class ScaledAffineNorm(torch.autograd.Function):
    """y = g * (w * n(x) + b) over the last dim: n(x) = (x - mean) * rstd (LayerNorm, center=True)
    or x * rstd (RMSNorm), rstd = 1 / sqrt(mean of the squares of x - mean, or of x, + eps); bias
    None for RMSNorm, g a scalar, a per-head g that broadcasts against x, or None (= 1).

    Written out for ScaledUnitNorm's reason, memory: composed from nn.LayerNorm / nn.RMSNorm and a
    multiply by g, autograd keeps the projection output, the normalized tensor and (RMSNorm) two more
    intermediates besides y. Here only y, the tensor attention keeps anyway, and the per-row rstd are
    kept; backward recovers n(x) = (y / g - b) / w, as apex's memory-efficient LayerNorm does. That
    division is exact up to rounding unless a weight is near zero: there the output has lost n(x), and
    backward divides by a weight clamped to |w| >= eps instead (apex's choice too), which keeps the
    gradients finite. Sums and products in float32.

    Backward is torch's fused LayerNorm backward given n(x) as its input with mean 0 and rstd 1
    (its x-hat is then n(x)), and multiplied by rstd afterwards; RMSNorm's adds back the row mean
    LayerNorm's subtracts. Written as elementwise ops in attention's permuted layout instead, a
    forward and backward took 1.3 to 2.5 times the l2 norm's time on a CPU. `python -m
    benchmarks.norm_alone` times these functions against the l2 norm and the torch compositions.
    """

    @staticmethod
    def values(
        x: Tensor, weight: Tensor, bias: Optional[Tensor], g: Optional[Tensor], eps: float, center: bool
    ) -> Tuple[Tensor, Tensor]:
        """(y, rstd), without autograd: what beam search calls."""
        acc = torch.promote_types(x.dtype, torch.float32)
        w, b = weight.to(acc), None if bias is None else bias.to(acc)
        if g is not None and g.dim() == 0:  # a scalar g goes into the kernel's weight and bias
            w, b, g = w * g, None if b is None else b * g, None
        if center:  # one fused kernel, in float32 (CUDA's takes no float32 weight beside a half x)
            y, _, rstd = torch.native_layer_norm(x.to(acc), x.shape[-1:], w, b, eps)
            y = y.to(x.dtype)
        else:
            xf = x.to(acc)
            rstd = torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square_().div_(x.size(-1)).add_(eps).rsqrt_()
            y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            torch.mul(xf * rstd, w, out=y)
        if g is not None:  # per head
            y.mul_(g)
        return y, rstd

    @staticmethod
    def forward(ctx, x, weight, bias, g, eps, center):
        y, rstd = ScaledAffineNorm.values(x, weight, bias, g, eps, center)
        ctx.save_for_backward(y, rstd, weight, bias, g)
        ctx.eps, ctx.center = eps, center
        return y

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        y, rstd, weight, bias, g = ctx.saved_tensors
        acc = rstd.dtype
        # g goes into the incoming gradient: the kernel then sees weight w and bias b. dy is dense,
        # in y's layout, whatever the layout of the gradient attention passes back.
        dy = torch.empty(y.shape, dtype=acc, device=y.device)
        torch.mul(grad_y, 1.0 if g is None else g, out=dy)
        # n(x) = (y - g b) / (g w) = y / (g w) - b / w. g == 0 makes y and dy 0, and then every
        # gradient is 0 whatever n is (g's own is lost): n only needs to be finite.
        w, b = weight.to(acc), None if bias is None else bias.to(acc)
        clamped = w.abs().clamp_min(ctx.eps).copysign(w)
        safe_g = None if g is None else torch.where(g == 0, 1.0, g)
        inv_a = (clamped if g is None else safe_g * clamped).reciprocal()
        n = y * inv_a if b is None else torch.addcmul(-b / clamped, y, inv_a)
        want_w = ctx.needs_input_grad[1] or ctx.needs_input_grad[3]
        want_b = b is not None and (ctx.needs_input_grad[2] or ctx.needs_input_grad[3])
        rows = n.numel() // n.size(-1)
        grad_n, sum_w, sum_b = torch.ops.aten.native_layer_norm_backward(
            dy, n, n.shape[-1:], n.new_zeros(rows, 1), n.new_ones(rows, 1), w, b, [True, want_w, want_b]
        )
        if not ctx.center:  # RMSNorm: no mean subtracted in forward, none in backward
            grad_n += (dy @ w).unsqueeze_(-1).div_(n.size(-1))
        grad_x = grad_n.mul_(rstd).to(y.dtype)
        grad_w = sum_w.to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_b = sum_b.to(bias.dtype) if ctx.needs_input_grad[2] else None
        grad_g = None
        if ctx.needs_input_grad[3]:  # dL/dg = sum(grad_y * y) / g; sum_w and sum_b hold one g already
            if g.dim() == 0:
                grad_g = (w.dot(sum_w) if b is None else w.dot(sum_w) + b.dot(sum_b)) / safe_g
            else:
                grad_g = (dy * y).sum_to_size(g.shape) / (safe_g * safe_g)
        return grad_x, grad_w, grad_b, grad_g, None, None
