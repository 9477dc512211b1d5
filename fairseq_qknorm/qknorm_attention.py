"""Query-Key Normalization (Henry et al., 2020): softmax(g * norm(Q) norm(K)^T) V.

Per head, q and k are normalized along the head dimension and their dot products are multiplied by
a learned scalar g instead of 1/sqrt(d). V is untouched. QKNormAttention subclasses fairseq's
MultiheadAttention: its projections, parameters and incremental cache are fairseq's; beam search's
reordering of the cache is rewritten for keys shared by the hypotheses of one sentence.
"""

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from fairseq import utils
from fairseq.modules import MultiheadAttention
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from .errors import QKNormConfigError
from .lean_norms import affine_norm, unit_norm

QK_NORMS = ("l2", "layernorm", "rmsnorm", "none")
QK_SCALES = ("learned", "fixed", "none")
# The key of the cross-attention cache that holds how many hypotheses share one row.
BEAM_SIZE = "beam_size"
# The kernels the fused path may use: every one but cuDNN's. On a GPU with cuDNN attention (Hopper),
# SDPA picks it, and it builds a plan for every shape it has not seen, about 130 ms on an H200; a
# fairseq epoch brings a new (sentences, length) shape every few batches, and the gl-en 2x2's first
# epoch trained six times slower than its second. Memory-efficient attention takes the same inputs
# with no such cost, and was faster on a shape seen before too (benchmarks/sdpa_new_shapes.py).
FUSED_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def scaled_norm(x: Tensor, g: Optional[Tensor] = None, norm: Optional[nn.Module] = None) -> Tensor:
    """The specification: x normalized along its last (head) dimension, times g. norm None is the
    paper's L2 norm; else the per-head nn.LayerNorm or nn.RMSNorm. QKNormAttention computes exactly
    this with lean_norms, which keeps less for backward."""
    y = F.normalize(x, dim=-1) if norm is None else norm(x)
    return y if g is None else g * y


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

        q = self._split_heads(self.q_proj(query), "q")  # g * norm(q)
        k, v, key_padding_mask = self._keys_and_values(  # norm(k): from the cache, or normalized before it
            query, key, value, key_padding_mask, incremental_state, static_kv
        )
        scale = 1.0 if self.qk_scale is not None else self.head_dim**-0.5  # g replaces 1/sqrt(d)

        q, group = self._fold_hypotheses(q, k.size(0))
        mask = self._additive_mask(attn_mask, key_padding_mask, group, q.dtype)
        dropout_p = self.dropout_module.p if self.training or self.dropout_module.apply_during_inference else 0.0

        weights = None
        # The fused kernel, unless the weights are wanted or this is one decoding step: for a query
        # of length 1 to 5, SDPA's CPU kernel is slower than two matmuls (benchmarks/, measured).
        if not (need_weights or before_softmax or incremental_state is not None):
            with sdpa_kernel(FUSED_BACKENDS):
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

    def _normalize(self, x: Tensor, which: str) -> Tensor:
        """scaled_norm of x, "q" or "k", x (time, batch, heads, head_dim) as the projection's output
        lies in memory: the normalization runs over its rows, and x's gradient is then a view of the
        projection's. g, when there is one, goes into the queries: SDPA's scale is a Python float."""
        scale = self.qk_scale if which == "q" else None
        g = None if scale is None else scale.value
        if self.qk_norm == "l2":
            return unit_norm(x, g)
        if self.qk_norm in ("layernorm", "rmsnorm"):
            return affine_norm(x, getattr(self, which + "_norm"), g)
        return x if scale is None else scale(x)

    def _split_heads(self, x: Tensor, which: Optional[str] = None) -> Tensor:
        """(time, batch, embed) -> (batch, heads, time, head_dim); "q" or "k" normalized on the way."""
        t, b, _ = x.shape
        x = x.view(t, b, self.num_heads, self.head_dim)
        return (x if which is None else self._normalize(x, which)).permute(1, 2, 0, 3)

    def _keys_and_values(self, query, key, value, key_padding_mask, incremental_state, static_kv):
        """(k, v, key_padding_mask), k normalized, each (batch, heads, src, head_dim). While decoding
        step by step (incremental_state), from and into fairseq's cache: cross attention's keys are
        computed at the first step and read back at the next ones; self attention appends this step's."""
        bsz = query.size(1)
        saved = self._get_input_buffer(incremental_state) if incremental_state is not None else None
        if saved is not None and static_kv and "prev_key" in saved:
            return saved["prev_key"], saved["prev_value"], saved["prev_key_padding_mask"]
        if self.self_attention:
            key = value = query
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
            if static_kv:  # how many hypotheses share one row of this cache (see reorder_incremental_state)
                saved[BEAM_SIZE] = torch.tensor(bsz // k.size(0))
            self._set_input_buffer(incremental_state, saved)
        return k, v, key_padding_mask

    def _fold_hypotheses(self, q: Tensor, kv_bsz: int) -> Tuple[Tensor, int]:
        """(q, group): when the keys are shared by `group` hypotheses (beamable cross attention: the
        decoder passes one copy of the encoder output per sentence, see QKNormTransformerDecoder), the
        hypotheses are folded into the query time axis: (kv_bsz, heads, group * tgt, head_dim)."""
        bsz, heads, tgt_len, head_dim = q.shape
        group = bsz // kv_bsz
        if group * kv_bsz != bsz:
            raise ValueError(f"{bsz} queries cannot share {kv_bsz} rows of keys: not a multiple")
        if group > 1:
            q = q.view(kv_bsz, group, heads, tgt_len, head_dim).transpose(1, 2)
            q = q.reshape(kv_bsz, heads, group * tgt_len, head_dim)
        return q, group

    def reorder_incremental_state(
        self, incremental_state: Dict[str, Dict[str, Optional[Tensor]]], new_order: Tensor
    ) -> Dict[str, Dict[str, Optional[Tensor]]]:
        """Beam search's reordering of the cache. A cross-attention cache row may be shared by the
        BEAM_SIZE hypotheses of one sentence, stored with the cache by the search that filled it
        (fairseq's MultiheadAttention reads a beam size set on the module instead, which the next
        search may not reset). Hypotheses move within their sentence, where every row holds the
        same keys: the rows change only when sentences leave the search."""
        saved = self._get_input_buffer(incremental_state)
        if not saved:
            return incremental_state
        beam = int(saved.get(BEAM_SIZE, torch.tensor(1)))
        for name, value in saved.items():
            if value is None or name == BEAM_SIZE:
                continue
            if self.encoder_decoder_attention:
                if value.size(0) * beam == new_order.numel():
                    continue
                saved[name] = value.index_select(0, new_order.view(-1, beam)[:, 0] // beam)
            else:
                saved[name] = value.index_select(0, new_order)
        return self._set_input_buffer(incremental_state, saved)

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


class QKScale(nn.Module):
    """The scalar g (or one per head), kept in float32 whatever dtype the model is cast to:
    near g = 12 the spacing of fp16 is ~0.008 and of bf16 ~0.06, so small updates would vanish.

    g0, saved beside g, is the value g started from. fairseq loads a checkpoint's g into a model
    built with this run's --qk-scale-init (--restore-file, a resume, --finetune-from-model): g0 comes
    along with g, and qk_flags.WatchesG records it in the config saved with the model."""

    def __init__(self, init: float, num_heads: int, per_head: bool, learned: bool):
        super().__init__()
        g = torch.full((num_heads, 1, 1) if per_head else (), float(init))
        if learned:
            self.g = nn.Parameter(g)
        else:
            self.register_buffer("g", g)
        self.register_buffer("g0", torch.tensor(float(init)))
        self.register_load_state_dict_pre_hook(_g0_of_older_checkpoints)

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


def _g0_of_older_checkpoints(module, state_dict, prefix, *args):
    # A checkpoint saved before g0 was holds g alone: its g started, as far as anyone can tell, from
    # the --qk-scale-init of the model it is loaded into.
    if prefix + "g" in state_dict and prefix + "g0" not in state_dict:
        state_dict[prefix + "g0"] = module.g0.clone()
