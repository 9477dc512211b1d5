"""Query-Key Normalization (Henry et al., 2020): softmax(g * norm(Q) norm(K)^T) V.

Per head, q and k are normalized along the head dimension and the dot products are multiplied by a
learnable scalar g instead of 1/sqrt(d). V is untouched. Everything else (projections, masks, the
incremental cache and its beam reordering) is fairseq's MultiheadAttention, which this subclasses.
"""

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from fairseq import utils
from fairseq.modules import MultiheadAttention
from torch import Tensor, nn

from .errors import QKNormConfigError

QK_NORMS = ("l2", "layernorm", "rmsnorm", "none")
QK_SCALES = ("learned", "fixed", "none")


class ScaledUnitNorm(torch.autograd.Function):
    """y = g * x / ||x|| over the last dim, g a scalar, per-head g or None (= 1).

    Written out because of memory: composed from torch ops, autograd keeps x, x/||x|| and g*x/||x||
    for backward, three activations per projection where stock attention keeps one. Here only y
    (which attention keeps anyway: the same tensor) and the per-row 1/||x|| are kept; backward
    recovers x/||x|| as y / g. Norms and products are taken in float32 (the sum of squares
    overflows fp16); eps keeps a zero vector at zero, not NaN.
    """

    EPS = 1e-6

    @staticmethod
    def values(x: Tensor, g: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        """(y, 1/||x||), without autograd: what beam search calls, three times per layer and step."""
        acc = torch.promote_types(x.dtype, torch.float32)  # float32, or float64 for float64
        inv_norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=acc)
        inv_norm = inv_norm.clamp_min_(ScaledUnitNorm.EPS).reciprocal_()
        y = (x.to(acc) * (inv_norm if g is None else inv_norm * g)).to(x.dtype)
        return y, inv_norm

    @staticmethod
    def forward(ctx, x: Tensor, g: Optional[Tensor]) -> Tensor:
        y, inv_norm = ScaledUnitNorm.values(x, g)
        ctx.save_for_backward(y, inv_norm, g)
        return y

    @staticmethod
    def gradients(y: Tensor, grad_y: Tensor, inv_norm: Tensor, g: Optional[Tensor], want_g: bool):
        """(grad_x, grad_g or None) from what forward kept.

        dy/dx = (g / ||x||) (I - u u^T), u = x / ||x|| = y / g. In y, with two passes over it:
        grad_x = grad_y * g / ||x|| - y (y . grad_y) / (g ||x||);  grad_g = (y . grad_y) / g."""
        dtype = y.dtype
        y, grad_y = y.to(inv_norm.dtype), grad_y.to(inv_norm.dtype)  # no-ops in float32
        dot = torch.linalg.vecdot(y, grad_y).unsqueeze_(-1)
        # g == 0 makes y == 0: grad_x is 0 (the factor g), whatever the division by g gives; grad_g is lost.
        safe_g = None if g is None else torch.where(g == 0, 1.0, g)
        # grad_x dense, in y's layout (x's), whatever the layout of the gradient attention passes back:
        # the gradient then reaches the projection as a view, and the second pass runs over one layout.
        grad_x = torch.empty_like(y)
        torch.mul(grad_y, inv_norm if g is None else inv_norm * g, out=grad_x)
        grad_x.addcmul_(y, dot * (inv_norm if g is None else inv_norm / safe_g), value=-1.0)
        grad_g = dot.sum_to_size(g.shape) / safe_g if want_g else None
        return grad_x.to(dtype), grad_g

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        y, inv_norm, g = ctx.saved_tensors
        return ScaledUnitNorm.gradients(y, grad_y, inv_norm, g, ctx.needs_input_grad[1])


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
        if center:  # one fused kernel, in float32 for a bfloat16 x too (its mixed-type path)
            y, _, rstd = torch.native_layer_norm(x, x.shape[-1:], w, b, eps)
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


class QKScale(nn.Module):
    """The scalar g (or one per head), kept in float32 whatever dtype the model is cast to:
    near g = 12 the spacing of fp16 is ~0.008 and of bf16 ~0.06, so small updates would vanish."""

    def __init__(self, init: float, num_heads: int, per_head: bool, learned: bool):
        super().__init__()
        g = torch.full((num_heads, 1, 1) if per_head else (), float(init))
        if learned:
            self.g = nn.Parameter(g)
        else:
            self.register_buffer("g", g)

    def _apply(self, fn, recurse=True):
        # Follow .to(device) / .cuda(), but not .half() / .bfloat16() / .to(dtype).
        def keep_float32(t):
            return t.to(device=fn(t.new_empty(0)).device)

        return super()._apply(keep_float32, recurse)

    @property
    def value(self) -> Tensor:
        """g as it broadcasts against (time, batch, heads, head_dim): a scalar, or (heads, 1)."""
        return self.g if self.g.dim() == 0 else self.g.view(-1, 1)

    def forward(self, x: Tensor) -> Tensor:
        return (x.float() * self.value).type_as(x)


class QKNormAttention(MultiheadAttention):
    """fairseq MultiheadAttention with normalized queries and keys and a learned temperature.

    qk_norm: "l2" (the paper), "layernorm" / "rmsnorm" per head (ViT-22B, OLMo 2, Qwen3), "none".
    qk_scale: "learned" g, "fixed" g (the paper's "no g" ablation is fixed at 1), or "none" for the
    usual 1/sqrt(head_dim).
    """

    def __init__(
        self,
        embed_dim,
        num_heads,
        qk_norm="l2",
        qk_scale="learned",
        qk_scale_init=None,
        qk_scale_per_head=False,
        **kwargs,
    ):
        if kwargs.get("add_bias_kv") or kwargs.get("add_zero_attn"):
            raise QKNormConfigError("QKNormAttention does not support add_bias_kv / add_zero_attn")
        super().__init__(embed_dim, num_heads, **kwargs)
        if qk_norm not in QK_NORMS:
            raise QKNormConfigError(f"--qk-norm: expected one of {', '.join(QK_NORMS)}, got {qk_norm!r}")
        if qk_scale not in QK_SCALES:
            raise QKNormConfigError(f"--qk-scale: expected one of {', '.join(QK_SCALES)}, got {qk_scale!r}")
        self.qk_norm = qk_norm
        if qk_norm in ("layernorm", "rmsnorm"):
            # Affine norms are not idempotent: keys are normalized once, before the cache.
            norm = nn.LayerNorm if qk_norm == "layernorm" else nn.RMSNorm
            self.q_norm, self.k_norm = norm(self.head_dim), norm(self.head_dim)
        if qk_scale == "none":
            self.qk_scale = None
        else:
            if qk_scale_init is None:
                raise QKNormConfigError(f"--qk-scale {qk_scale} needs a numeric --qk-scale-init")
            self.qk_scale = QKScale(qk_scale_init, num_heads, qk_scale_per_head, qk_scale == "learned")

    def _normalize(self, x: Tensor, which: str) -> Tensor:
        """x: (time, batch, heads, head_dim), the projection's output as it lies in memory: the
        normalization kernels run over its rows, and x's gradient is then a view of the projection's.
        g, when there is one, goes into the queries: SDPA's scale is a Python float, g a tensor."""
        scale = self.qk_scale if which == "q" else None
        if self.qk_norm == "none":
            return x if scale is None else scale(x)
        g = None if scale is None else scale.value
        if self.qk_norm == "l2":
            args = (x, g)
            norm = ScaledUnitNorm
        else:
            module = getattr(self, which + "_norm")
            eps = module.eps
            if eps is None:  # nn.RMSNorm's default: the epsilon of the float type it computes in
                eps = torch.finfo(torch.promote_types(x.dtype, torch.float32)).eps
            args = (x, module.weight, getattr(module, "bias", None), g, eps, self.qk_norm == "layernorm")
            norm = ScaledAffineNorm
        return norm.apply(*args) if torch.is_grad_enabled() else norm.values(*args)[0]

    def _split_heads(self, x: Tensor, which: Optional[str] = None) -> Tensor:
        """(time, batch, embed) -> (batch, heads, time, head_dim); "q" or "k" normalized on the way."""
        t, b, _ = x.shape
        x = x.view(t, b, self.num_heads, self.head_dim)
        return (x if which is None else self._normalize(x, which)).permute(1, 2, 0, 3)

    def forward(
        self,
        query: Tensor,
        key: Optional[Tensor],
        value: Optional[Tensor],
        key_padding_mask: Optional[Tensor] = None,
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
        need_weights: bool = True,
        static_kv: bool = False,
        attn_mask: Optional[Tensor] = None,
        before_softmax: bool = False,
        need_head_weights: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        need_weights = need_weights or need_head_weights
        tgt_len, bsz, embed_dim = query.shape
        saved = self._get_input_buffer(incremental_state) if incremental_state is not None else None

        q = self._split_heads(self.q_proj(query), "q")  # g included

        if saved is not None and static_kv and "prev_key" in saved:
            # Cross attention after the first step: keys and values come from the cache.
            k, v = saved["prev_key"], saved["prev_value"]
            key_padding_mask = saved["prev_key_padding_mask"]
        else:
            if self.self_attention:
                key = value = query
            elif saved is not None and self.encoder_decoder_attention and self.beam_size > 1 and key.size(1) == bsz:
                # Beamable cross attention, as in fairseq: every hypothesis of one sentence shares
                # the encoder output, so keep one copy per sentence. Only while decoding step by
                # step: beam_size stays set after a validation's beam search, and a training
                # batch is not made of beams.
                key = value = key[:, :: self.beam_size]
                if key_padding_mask is not None:
                    key_padding_mask = key_padding_mask[:: self.beam_size]
            k = self._split_heads(self.k_proj(key), "k")
            v = self._split_heads(self.v_proj(value))
            if saved is not None:
                if "prev_key" in saved:  # decoder self attention: append this step
                    k = torch.cat([saved["prev_key"], k], dim=2)
                    v = torch.cat([saved["prev_value"], v], dim=2)
                key_padding_mask = self._append_prev_key_padding_mask(
                    key_padding_mask, saved.get("prev_key_padding_mask"), k.size(0), k.size(2), static_kv
                )
                # Cached keys are already normalized: no step normalizes them again.
                saved["prev_key"], saved["prev_value"] = k, v
                saved["prev_key_padding_mask"] = key_padding_mask
                self._set_input_buffer(incremental_state, saved)

        # When the keys are shared by `group` hypotheses, fold them into the query time axis.
        kv_bsz = k.size(0)
        group = bsz // kv_bsz
        if group > 1:
            q = q.view(kv_bsz, group, self.num_heads, tgt_len, self.head_dim).transpose(1, 2)
            q = q.reshape(kv_bsz, self.num_heads, group * tgt_len, self.head_dim)
        mask = self._additive_mask(attn_mask, key_padding_mask, group, q.dtype)
        scale = 1.0 if self.qk_scale is not None else self.head_dim**-0.5
        dropout_p = self.dropout_module.p if self.training or self.dropout_module.apply_during_inference else 0.0

        weights = None
        # The fused kernel, unless the weights are wanted or this is one decoding step: for a query
        # of length 1 to 5, SDPA's CPU kernel is slower than two matmuls (benchmarks/, measured).
        if not (need_weights or before_softmax or incremental_state is not None):
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)
        else:
            scores = torch.matmul(q, k.transpose(-1, -2))
            if scale != 1.0:  # with g, g is in q already
                scores = scores * scale
            if mask is not None:
                scores = scores + mask
            if before_softmax:
                return self._unfold(scores, group, tgt_len).flatten(0, 1), v.flatten(0, 1)
            weights = utils.softmax(scores, dim=-1, onnx_trace=self.onnx_trace)  # float32
            if mask is not None:  # a query that may see no key gets zeros, as from SDPA, not NaN
                weights = weights.masked_fill(torch.isneginf(mask).all(-1, keepdim=True), 0.0)
            attn = torch.matmul(self.dropout_module(weights.type_as(q)), v)
            if need_weights:
                weights = self._unfold(weights, group, tgt_len).transpose(0, 1)  # (heads, bsz, tgt, src)
                weights = weights if need_head_weights else weights.mean(dim=0)
            else:
                weights = None

        attn = self._unfold(attn, group, tgt_len)  # (bsz, heads, tgt, head_dim)
        attn = attn.permute(2, 0, 1, 3).reshape(tgt_len, bsz, embed_dim)
        return self.out_proj(attn), weights

    def _unfold(self, x: Tensor, group: int, tgt_len: int) -> Tensor:
        """Undo the folding of hypotheses into time: (kv_bsz, H, group*T, S) -> (bsz, H, T, S)."""
        if group == 1:
            return x
        kv_bsz, heads, _, last = x.shape
        return x.view(kv_bsz, heads, group, tgt_len, last).transpose(1, 2).reshape(-1, heads, tgt_len, last)

    @staticmethod
    def _additive_mask(
        attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor], group: int, dtype: torch.dtype
    ) -> Optional[Tensor]:
        """One additive mask (batch or 1, 1, group*tgt, src): fairseq's attn_mask (float -inf, or
        bool True = blocked) plus key padding (nonzero = pad) as -inf."""
        mask = None
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                attn_mask = torch.zeros_like(attn_mask, dtype=dtype).masked_fill(attn_mask, float("-inf"))
            mask = attn_mask.to(dtype).repeat(group, 1)[None, None]
        if key_padding_mask is not None:
            pad = key_padding_mask.bool()[:, None, None, :]
            base = mask if mask is not None else torch.zeros((), dtype=dtype, device=pad.device)
            mask = torch.where(pad, torch.tensor(float("-inf"), dtype=dtype, device=pad.device), base)
        return mask
