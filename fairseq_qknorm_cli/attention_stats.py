"""What every attention module of a fairseq encoder-decoder does during an ordinary forward pass:
its per-head weights and pre-softmax logits, and the statistics of softmax saturation computed
from them (entropy, maximum weight, share of rows whose maximum exceeds 0.9, logit range).

Nothing of fairseq's attention is reimplemented: each module is called through its own forward,
asked for per-head weights (need_head_weights) and, in a second call, for its logits
(before_softmax). This works for QKNormAttention and for fairseq's stock MultiheadAttention alike.
"""

import contextlib
import inspect
import math
import re
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch
from fairseq.modules import MultiheadAttention
from torch import Tensor

SATURATION = 0.9  # a query row whose largest weight exceeds this counts as saturated
KINDS = ("encoder self", "decoder self", "decoder cross")
_KIND = {
    ("encoder", "self_attn"): "encoder self",
    ("decoder", "self_attn"): "decoder self",
    ("decoder", "encoder_attn"): "decoder cross",
}
# Allow wrappers (activation checkpointing, FSDP) between the layer and its attention module.
_ATTENTION_NAME = re.compile(r"^(encoder|decoder)\.layers\.(\d+)\.(?:.*\.)?(self_attn|encoder_attn)$")

Where = Tuple[str, int]  # (kind, layer), e.g. ("decoder cross", 1)


def attention_module(name: str) -> Optional[Where]:
    """('decoder cross', 1) for 'decoder.layers.1.encoder_attn'; None for any other module name."""
    match = _ATTENTION_NAME.match(name)
    if match is None:
        return None
    side, layer, attn = match.groups()
    return _KIND[(side, attn)], int(layer)


def sort_key(where: Where):
    """Encoder self, decoder self, decoder cross, each by layer."""
    return KINDS.index(where[0]), where[1]


@contextlib.contextmanager
def recording_attention(model, on_attention: Callable[[Where, Tensor, Tensor], None]):
    """While active, every attention module of `model` also hands its weights and logits, both
    (batch, heads, tgt, src), to on_attention(where, weights, logits). What the model computes and
    returns is unchanged. Step-by-step (incremental) decoding is not recorded."""
    wrapped = []
    for name, module in model.named_modules():
        where = attention_module(name)
        if where is None or not isinstance(module, MultiheadAttention):
            continue
        wrapped.append((module, module.skip_embed_dim_check))
        module.forward = _recording_forward(module.forward, where, on_attention)
        # fairseq's stock attention otherwise takes torch's fused path, which ignores
        # before_softmax and averages the weights over heads; this switch turns that path off.
        module.skip_embed_dim_check = True
    try:
        yield
    finally:
        for module, skip in wrapped:
            del module.forward  # the class's forward again
            module.skip_embed_dim_check = skip


def _recording_forward(forward, where: Where, on_attention):
    signature = inspect.signature(forward)

    def recording(*args, **kwargs):
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        a = call.arguments
        if a["before_softmax"] or a["incremental_state"] is not None:
            return forward(*args, **kwargs)
        logits, _ = forward(**{**a, "before_softmax": True})  # (batch*heads, tgt, src)
        out, weights = forward(**{**a, "need_weights": True, "need_head_weights": True})
        weights = weights.transpose(0, 1)  # (heads, batch, tgt, src) -> (batch, heads, tgt, src)
        on_attention(where, weights, logits.view(weights.shape))
        # Return exactly what the caller asked for.
        if a["need_head_weights"]:
            return out, weights.transpose(0, 1)
        if a["need_weights"]:
            return out, weights.mean(dim=1)
        return out, None

    return recording


def query_and_key_mask(where: Where, src_valid: Tensor, tgt_valid: Tensor) -> Tuple[Tensor, Tensor]:
    """Which query rows and which keys are real tokens (not padding), each (batch, length)."""
    kind = where[0]
    if kind == "encoder self":
        return src_valid, src_valid
    if kind == "decoder self":
        return tgt_valid, tgt_valid
    return tgt_valid, src_valid


@dataclass
class AttentionStats:
    """Running sums over the query rows (every head, every real query with at least two real keys)
    of one module."""

    rows: int = 0
    entropy_sum: float = 0.0
    max_weight_sum: float = 0.0
    saturated_rows: int = 0
    logit_min: float = math.inf
    logit_max: float = -math.inf
    head_rows: Optional[Tensor] = None  # per head: rows, and the sum of their entropies
    head_entropy_sum: Optional[Tensor] = None

    def add(self, weights: Tensor, logits: Tensor, query_valid: Tensor, key_valid: Tensor) -> None:
        """weights, logits: (batch, heads, tgt, src); query_valid (batch, tgt), key_valid (batch, src)."""
        weights = weights.float()
        # The keys a query really chooses among: not padding, not masked (-inf, e.g. the future).
        real_keys = key_valid[:, None, None, :] & torch.isfinite(logits)
        # Rows of real queries with a choice: the decoder's first position sees one key only and
        # would count as saturated whatever the model learned.
        rows = query_valid[:, None, :] & (real_keys.sum(dim=-1) >= 2)  # (batch, heads, tgt)
        # Masked keys have weight exactly 0, and xlogy(0, 0) = 0: they add nothing to the entropy.
        # Summed per head (where, not a product: a row with no real key can hold NaN weights).
        entropy = torch.where(rows, -torch.special.xlogy(weights, weights).sum(dim=-1), 0).double()
        head_entropy = entropy.sum(dim=(0, 2))
        head_rows = rows.sum(dim=(0, 2)).double()
        max_weight = weights.max(dim=-1).values[rows]
        self.rows += int(rows.sum())
        self.head_rows = head_rows if self.head_rows is None else self.head_rows + head_rows
        self.head_entropy_sum = head_entropy if self.head_entropy_sum is None else self.head_entropy_sum + head_entropy
        self.entropy_sum += float(head_entropy.sum())
        self.max_weight_sum += float(max_weight.double().sum())
        self.saturated_rows += int((max_weight > SATURATION).sum())
        real = rows[..., None] & real_keys
        if real.any():
            self.logit_min = min(self.logit_min, float(logits[real].min()))
            self.logit_max = max(self.logit_max, float(logits[real].max()))

    def min_head_entropy(self) -> float:
        """The smallest per-head mean entropy (nats): the most concentrated head."""
        return float((self.head_entropy_sum / self.head_rows.clamp_min(1)).min())

    def summary(self) -> Dict[str, float]:
        n = max(self.rows, 1)
        return {
            "rows": self.rows,
            "entropy": self.entropy_sum / n,
            "max_weight": self.max_weight_sum / n,
            "saturated": self.saturated_rows / n,
            "logit_min": self.logit_min,
            "logit_max": self.logit_max,
        }


def forward_with_stats(
    model,
    stats: Dict[Where, AttentionStats],
    src_tokens: Tensor,
    src_lengths: Tensor,
    prev_output_tokens: Tensor,
    pad: int,
) -> None:
    """One teacher-forced forward pass; adds every module's attention to stats[(kind, layer)]."""
    src_valid, tgt_valid = src_tokens.ne(pad), prev_output_tokens.ne(pad)

    def on_attention(where, weights, logits):
        query_valid, key_valid = query_and_key_mask(where, src_valid, tgt_valid)
        stats.setdefault(where, AttentionStats()).add(weights, logits, query_valid, key_valid)

    with torch.no_grad(), recording_attention(model, on_attention):
        model(src_tokens, src_lengths, prev_output_tokens)


def sentence_attention(model, src_tokens: Tensor, prev_output_tokens: Tensor) -> Dict[Where, Tensor]:
    """Attention of one sentence pair (1-D token tensors, no padding), averaged over heads:
    {(kind, layer): (tgt, src) weights}."""
    maps = {}

    def on_attention(where, weights, logits):
        maps[where] = weights[0].float().mean(dim=0).cpu()

    with torch.no_grad(), recording_attention(model, on_attention):
        model(src_tokens[None], torch.tensor([len(src_tokens)], device=src_tokens.device), prev_output_tokens[None])
    return maps
