"""FixNorm (Nguyen & Chiang, 2018): every word embedding has unit length, on input (then scaled
by sqrt(d) as usual) and in the tied output projection, whose logits become g * cos(h, e_w)
with g the final norm's scale."""
import torch.nn.functional as F
from torch import nn


class UnitNormEmbedding(nn.Embedding):
    def __init__(self, num_embeddings, embedding_dim, padding_idx):
        super().__init__(num_embeddings, embedding_dim, padding_idx=padding_idx)
        # Small uniform init as in Transformers without Tears: only the direction is used. The
        # padding row is not zeroed: the gradient of normalize() at a zero vector is 1/eps, and the
        # tied output projection does send gradient to it.
        nn.init.uniform_(self.weight, -0.01, 0.01)

    def unit_weight(self):
        return F.normalize(self.weight, dim=-1)

    def forward(self, tokens):
        return F.embedding(tokens, self.unit_weight(), self.padding_idx)


class UnitNormOutputProjection(nn.Module):
    """The decoder's output projection with unit-length rows; it keeps (and so shares, when
    tied) the weight of fairseq's projection."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight

    def forward(self, features):
        return F.linear(features, F.normalize(self.weight, dim=-1))
