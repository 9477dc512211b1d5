"""Incremental decoding (the cache of normalized keys) equals the full forward, step by step, for
every attention variant; beam reordering of the cache keeps it equal. In float64, so that the
1e-5 tolerance measures the cache, not float32 rounding of differently shaped matmuls."""

import pytest
import torch
from conftest import build_model

# Every QK-norm the flags allow (norm x g learned / fixed / none, per module or per head), no norm,
# and the paper's two architectures.
VARIANTS = {
    f"{norm}-{scale}{'-perhead' if per_head else ''}": dict(qk_norm=norm, qk_scale=scale, qk_scale_per_head=per_head)
    for norm in ("l2", "layernorm", "rmsnorm")
    for scale in ("learned", "fixed", "none")
    for per_head in (False, True)
    if not (scale == "none" and per_head)
}
VARIANTS.update(
    {
        "none": dict(qk_norm="none", qk_scale="none"),
        "paper": dict(arch="transformer_qknorm_paper", word_dropout=0.0),
        "baseline": dict(arch="transformer_scalenorm_paper", word_dropout=0.0),
    }
)
STEPS, BSZ = 6, 3


def batch(vocab):
    torch.manual_seed(0)
    eos, pad = 2, 1
    src = torch.randint(4, vocab, (BSZ, 7))
    src[:, -1] = eos
    src[1, :3] = pad  # left-padded source, as fairseq batches them
    src_lengths = (src != pad).sum(1)
    prev = torch.randint(4, vocab, (BSZ, STEPS))
    prev[:, 0] = eos
    return src, src_lengths, prev


def perturb(model):
    """Move every norm weight and g off its init so that a wrong cache would show."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".g") or name.endswith(".scale"):
                p.add_(torch.rand_like(p) * 0.3)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_incremental_equals_full_forward(name):
    model, d = build_model(**{"vocab": 40, **VARIANTS[name]})
    perturb(model)
    model.double().eval()
    src, src_lengths, prev = batch(len(d))
    enc = model.encoder(src, src_lengths=src_lengths)
    full, extra = model.decoder(prev, encoder_out=enc)
    state = {}
    for t in range(STEPS):
        step, step_extra = model.decoder(prev[:, : t + 1], encoder_out=enc, incremental_state=state)
        torch.testing.assert_close(step[:, -1], full[:, t], atol=1e-5, rtol=1e-5)
        # The last layer's cross-attention weights (fairseq asks for them as alignment) agree too:
        # (batch, 1, source) for the step, row t of (batch, target, source) for the full forward.
        torch.testing.assert_close(step_extra["attn"][0][:, -1], extra["attn"][0][:, t], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["l2-learned", "layernorm-learned", "rmsnorm-none", "paper"])
def test_beam_reordering_keeps_the_cache_equal(name):
    model, d = build_model(**{"vocab": 40, **VARIANTS[name]})
    perturb(model)
    model.double().eval()
    src, src_lengths, prev = batch(len(d))
    beam = 2
    # each sentence twice, as beam search starts: the decoder then caches one copy of the keys per sentence
    expand = torch.arange(BSZ).repeat_interleave(beam)
    enc = model.encoder.reorder_encoder_out(model.encoder(src, src_lengths=src_lengths), expand)
    prev = prev[expand].clone()
    prev[1::beam, 1:] = torch.randint(4, len(d), (BSZ, STEPS - 1))  # hypotheses diverge
    state, history, sentences = {}, prev[:, :1], BSZ
    for t in range(STEPS):
        step, _ = model.decoder(history, encoder_out=enc, incremental_state=state)
        full, _ = model.decoder(history, encoder_out=enc)
        torch.testing.assert_close(step[:, -1], full[:, -1], atol=1e-5, rtol=1e-5)
        if t + 1 < STEPS:
            # swap the two hypotheses of every sentence (after step 2, the first sentence leaves
            # the search, as a finished one does), then extend them
            keep = 1 if t == 2 else 0
            order = torch.arange(sentences * beam).view(sentences, beam)[keep:].flip(1).reshape(-1)
            sentences -= keep
            model.decoder.reorder_incremental_state_scripting(state, order)
            enc = model.encoder.reorder_encoder_out(enc, order)
            prev = prev[order]
            history = torch.cat([history[order], prev[:, t + 1 : t + 2]], dim=1)
