"""The memory-lean normalizations (fairseq_qknorm/lean_norms.py) against the specification they
compute, qknorm_attention.scaled_norm: values and gradients (gradcheck in float64, then float32 and
bfloat16), and the layouts attention relies on."""

import itertools

import pytest
import torch
from torch import nn

from fairseq_qknorm.lean_norms import ScaledAffineNorm, ScaledUnitNorm, affine_norm, unit_norm
from fairseq_qknorm.qknorm_attention import scaled_norm

E, H, T, S, B = 32, 4, 6, 7, 3
D = E // H


def sdpa_gradient(dtype=torch.float32):
    """A gradient for (time, batch, heads, dim) as attention passes one back: SDPA's, for
    (batch, heads, time, dim), permuted back."""
    return torch.randn(B, H, T, D, dtype=dtype).permute(2, 0, 1, 3)


@pytest.mark.parametrize("g_shape", [None, (), (H, 1)], ids=["no-g", "scalar-g", "per-head-g"])
def test_scaled_unit_norm_has_the_gradients_of_g_x_over_norm_x(g_shape):
    """x as attention normalizes it (the projection's output, split into heads), g as QKScale.value."""
    torch.manual_seed(0)
    x = torch.randn(T, B, H, D, dtype=torch.float64, requires_grad=True)
    g = None if g_shape is None else (torch.rand(g_shape, dtype=torch.float64) * 10 + 0.5).requires_grad_()
    assert torch.autograd.gradcheck(ScaledUnitNorm.apply, (x, g))
    # and the same values and gradients as the specification, in float32
    x32 = x.detach().float().requires_grad_()
    g32 = None if g is None else g.detach().float().requires_grad_()
    grad = sdpa_gradient()
    ours = ScaledUnitNorm.apply(x32, g32)
    want = scaled_norm(x32, g32)
    torch.testing.assert_close(ours, want)
    inputs = [x32] + ([] if g32 is None else [g32])
    got = torch.autograd.grad(ours, inputs, grad)
    for a, b in zip(got, torch.autograd.grad(want, inputs, grad)):
        torch.testing.assert_close(a, b)
    # x's gradient comes dense, in x's layout: the projection's gradient is then a view, not a copy
    assert got[0].stride() == x32.stride()


@pytest.mark.parametrize("layout", ["sdpa-cpu", "heads-first", "expanded"])
def test_scaled_unit_norm_reads_its_gradient_in_any_layout(layout):
    """Backward's kernel reads rows as dense memory: the gradient SDPA passes back on the CPU
    (batch, time, heads, dim in memory), another permuted one, or one that autograd expands from a
    sum (stride 0) must each count as the tensor it is, not as its memory read in x's order."""
    torch.manual_seed(0)
    x = torch.randn(T, B, H, D, requires_grad=True)
    g = torch.tensor(7.5, requires_grad=True)
    grad = {
        "sdpa-cpu": torch.randn(B, T, H, D).transpose(0, 1),
        "heads-first": torch.randn(B, H, T, D).permute(2, 0, 1, 3),
        "expanded": torch.randn(D).expand(T, B, H, D),
    }[layout]
    got = torch.autograd.grad(ScaledUnitNorm.apply(x, g), (x, g), grad)
    for a, b in zip(got, torch.autograd.grad(scaled_norm(x, g), (x, g), grad.contiguous())):
        torch.testing.assert_close(a, b)


def plain_norm(x, weight, bias, g, eps, center):
    """The specification (scaled_norm) with a per-head nn.LayerNorm (center) or nn.RMSNorm whose
    weight and bias are these tensors, so that their gradients reach them."""
    norm = nn.LayerNorm(x.size(-1), eps=eps) if center else nn.RMSNorm(x.size(-1), eps=eps)
    for name, tensor in (("weight", weight), ("bias", bias)):
        if hasattr(norm, name):
            delattr(norm, name)  # the parameter, replaced by the tensor
            setattr(norm, name, tensor)
    return scaled_norm(x, g, norm)


AFFINE_CASES = list(itertools.product([True, False], [None, (), (H, 1)]))


def affine_ids(case):
    center, g_shape = case
    return f"{'layernorm' if center else 'rmsnorm'}-{'no-g' if g_shape is None else 'per-head-g' if g_shape else 'g'}"


def affine_inputs(center, g_shape, seed=0):
    """float64 x (as attention normalizes it), weight, bias (LayerNorm only), g (as QKScale.value)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, B, H, D, generator=gen, dtype=torch.float64)
    w = torch.rand(D, generator=gen, dtype=torch.float64) + 0.5
    b = torch.randn(D, generator=gen, dtype=torch.float64) if center else None
    g = None if g_shape is None else torch.rand(g_shape, generator=gen, dtype=torch.float64) * 10 + 0.5
    return x, w, b, g


def values_and_grads(fn, tensors, grad, center):
    """fn's output and its gradients for every tensor given (g kept float32, as QKScale keeps it)."""
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in tensors]
    y = fn(*leaves, 1e-5, center)
    return [y] + list(torch.autograd.grad(y, [t for t in leaves if t is not None], grad.to(y.dtype)))


@pytest.mark.parametrize("case", AFFINE_CASES, ids=affine_ids)
def test_scaled_affine_norm_equals_layernorm_or_rmsnorm_times_g(case):
    center, g_shape = case
    x, w, b, g = affine_inputs(center, g_shape)
    for t in (x, w, b, g):
        if t is not None:
            t.requires_grad_()
    assert torch.autograd.gradcheck(lambda *a: ScaledAffineNorm.apply(*a, 1e-5, center), (x, w, b, g))
    y = ScaledAffineNorm.apply(x, w, b, g, 1e-5, center)
    grad = sdpa_gradient(torch.float64)
    # y and x's gradient in x's layout: attention's output then reshapes for out_proj without a
    # copy, and the projection's gradient is a view
    assert y.stride() == x.stride() and torch.autograd.grad(y, x, grad)[0].stride() == x.stride()
    exact = values_and_grads(plain_norm, (x, w, b, g), grad, center)

    def cast(dtype):
        return [None if t is None else t.detach().to(torch.float32 if t is g else dtype) for t in (x, w, b, g)]

    # float32: the same values and gradients as the specification, to float32 rounding (of sums over
    # rows, for the weight, bias and g)
    for a, want in zip(
        values_and_grads(ScaledAffineNorm.apply, cast(torch.float32), grad, center),
        values_and_grads(plain_norm, cast(torch.float32), grad, center),
    ):
        torch.testing.assert_close(a, want, atol=1e-5, rtol=1e-5)
    # bfloat16: ours recovers n(x) from a bfloat16 y, the specification keeps x. Both are as close to
    # the float64 values as bfloat16 allows (its resolution is 2**-8); elementwise they can differ
    # by more than that where a gradient is a difference of nearly equal terms.
    ours = values_and_grads(ScaledAffineNorm.apply, cast(torch.bfloat16), grad, center)
    plain = values_and_grads(plain_norm, cast(torch.bfloat16), grad, center)
    for a, p, want in zip(ours, plain, exact):

        def error(t, want=want):
            return ((t.double() - want).norm() / want.norm()).item()

        assert error(a) <= max(error(p), 2**-8) * 4, (error(a), error(p))


@pytest.mark.parametrize("case", AFFINE_CASES[1:3] + AFFINE_CASES[4:], ids=affine_ids)
def test_scaled_affine_norm_gives_g_its_gradient_with_the_norm_weights_frozen(case):
    """Backward takes g's gradient from the sums it computes for the weight and bias: it must
    compute them when only g wants a gradient."""
    center, g_shape = case
    x, w, b, g = affine_inputs(center, g_shape)
    x, g = x.requires_grad_(), g.requires_grad_()
    grad = torch.randn(x.shape, dtype=torch.float64)
    frozen = torch.autograd.grad(ScaledAffineNorm.apply(x, w, b, g, 1e-5, center), (x, g), grad)
    w, b = w.requires_grad_(), None if b is None else b.requires_grad_()
    learned = torch.autograd.grad(ScaledAffineNorm.apply(x, w, b, g, 1e-5, center), (x, g), grad)
    for a, want in zip(frozen, learned):  # the second is gradchecked above
        torch.testing.assert_close(a, want)


@pytest.mark.parametrize("which", ["l2", "layernorm", "rmsnorm"])
@pytest.mark.parametrize("grad_enabled", [True, False], ids=["training", "no-grad"])
def test_what_attention_calls_equals_the_specification(which, grad_enabled):
    """unit_norm and affine_norm, as QKNormAttention calls them (with autograd, and without it as
    beam search does), for a module norm at its default eps (nn.RMSNorm's None included)."""
    torch.manual_seed(0)
    x, g = torch.randn(T, B, H, D), torch.rand(H, 1) * 10 + 0.5
    norm = None if which == "l2" else (nn.LayerNorm if which == "layernorm" else nn.RMSNorm)(D)
    if norm is not None:
        with torch.no_grad():  # weights away from their init, so that they matter
            for p in norm.parameters():
                p.add_(torch.rand_like(p))
    with torch.set_grad_enabled(grad_enabled):
        ours = unit_norm(x, g) if norm is None else affine_norm(x, norm, g)
    torch.testing.assert_close(ours, scaled_norm(x, g, norm).detach())
