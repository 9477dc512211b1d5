"""QK-norm written the way the paper's code does it, to show what the fused path buys: heads folded
into the batch, bmm, scores * g, masked_fill, softmax, dropout, bmm. Its incremental cache keeps
one copy of the encoder keys per hypothesis (no beamable cross attention). Masked scores get the
dtype's lowest value rather than the paper code's -1e9, which fp16 cannot hold."""

import torch
import torch.nn.functional as F

from fairseq_qknorm.qknorm_attention import QKNormAttention


class PlainQKNormAttention(QKNormAttention):
    """Same parameters as QKNormAttention(qk_norm="l2", qk_scale="learned"); forward only."""

    def forward(
        self,
        query,
        key,
        value,
        key_padding_mask=None,
        incremental_state=None,
        need_weights=False,
        static_kv=False,
        attn_mask=None,
        **unused,
    ):
        tgt_len, bsz, embed_dim = query.shape
        heads = self.num_heads

        def fold(x):  # (time, batch, embed) -> (batch * heads, time, head_dim)
            return x.reshape(x.size(0), bsz * heads, self.head_dim).transpose(0, 1)

        saved = self._get_input_buffer(incremental_state) if incremental_state is not None else None
        q = F.normalize(fold(self.q_proj(query)), dim=-1)
        if saved is not None and static_kv and "prev_key" in saved:
            k, v, key_padding_mask = saved["prev_key"], saved["prev_value"], saved["prev_key_padding_mask"]
        else:
            source = query if self.self_attention else key
            k = F.normalize(fold(self.k_proj(source)), dim=-1)
            v = fold(self.v_proj(source))
            if saved is not None:
                if "prev_key" in saved:
                    k = torch.cat([saved["prev_key"], k], dim=1)
                    v = torch.cat([saved["prev_value"], v], dim=1)
                saved.update(prev_key=k, prev_value=v, prev_key_padding_mask=key_padding_mask)
                self._set_input_buffer(incremental_state, saved)
        src_len = k.size(1)
        scores = torch.bmm(q, k.transpose(1, 2)) * self.qk_scale.g
        masked = torch.finfo(scores.dtype).min
        if attn_mask is not None:
            blocked = attn_mask if attn_mask.dtype == torch.bool else attn_mask < 0
            scores = scores.masked_fill(blocked, masked)
        if key_padding_mask is not None:
            scores = scores.view(bsz, heads, tgt_len, src_len)
            scores = scores.masked_fill(key_padding_mask[:, None, None, :].bool(), masked)
            scores = scores.view(bsz * heads, tgt_len, src_len)
        probs = self.dropout_module(F.softmax(scores, dim=-1))
        out = torch.bmm(probs, v).transpose(0, 1).reshape(tgt_len, bsz, embed_dim)
        return self.out_proj(out), None
