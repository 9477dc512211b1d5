"""The paper's other switches: ScaleNorm, FixNorm, word dropout."""

import torch
from conftest import build_model
from fairseq.data import Dictionary

import fairseq_qknorm  # noqa: F401
from fairseq_qknorm.fixnorm import UnitNormEmbedding, UnitNormOutputProjection
from fairseq_qknorm.scale_norm import ScaleNorm
from fairseq_qknorm.word_dropout import word_dropout


def test_scale_norm_is_g_times_x_over_its_norm():
    norm = ScaleNorm(16)
    assert norm.scale.item() == 4.0  # sqrt(d)
    with torch.no_grad():
        norm.scale.fill_(2.5)
    x = torch.randn(3, 5, 16)
    torch.testing.assert_close(norm(x), 2.5 * x / x.norm(dim=-1, keepdim=True))
    assert torch.isfinite(norm(torch.zeros(2, 16))).all()


def test_fixnorm_embeddings_and_tied_projection_are_unit_length():
    model, d = build_model("transformer_qknorm_paper", word_dropout=0.0)
    emb = model.encoder.embed_tokens
    assert isinstance(emb, UnitNormEmbedding) and model.decoder.embed_tokens is emb
    proj = model.decoder.output_projection
    assert isinstance(proj, UnitNormOutputProjection) and proj.weight is emb.weight  # tied
    tokens = torch.arange(len(d)).view(1, -1)
    torch.testing.assert_close(emb(tokens).norm(dim=-1), torch.ones(1, len(d)))
    features = torch.randn(2, 3, emb.embedding_dim)
    want = features @ (emb.weight / emb.weight.norm(dim=-1, keepdim=True)).T
    torch.testing.assert_close(proj(features), want)


def test_fixnorm_projection_caches_the_unit_matrix_only_while_the_weight_is_unchanged():
    from fairseq.optim.adam import Adam  # fairseq's own: it updates p.data, leaving p._version alone

    model, d = build_model("transformer_qknorm_paper", word_dropout=0.0)
    proj = model.decoder.output_projection
    features = torch.randn(2, 3, proj.weight.size(1))
    optimizer = Adam(model.parameters(), lr=0.1)

    def want():
        return features @ (proj.weight / proj.weight.norm(dim=-1, keepdim=True)).T

    def validate():  # as fairseq's trainer validates: eval mode, no gradients
        model.eval()
        with torch.no_grad():
            return proj(features)

    torch.testing.assert_close(validate(), want())
    cached = proj._unit_weight
    with torch.no_grad():
        proj(features)
    assert proj._unit_weight is cached  # not renormalized at every decoding step
    for _ in range(2):  # a training step, as fairseq's trainer takes it, then validation again
        model.train()
        out = proj(features)  # training: no cache, gradients flow to the weight
        out.pow(2).sum().backward()
        assert proj.weight.grad is not None
        optimizer.step()
        optimizer.zero_grad()
        torch.testing.assert_close(validate(), want())
    with torch.no_grad():
        model.load_state_dict(build_model("transformer_qknorm_paper", word_dropout=0.0)[0].state_dict())
        torch.testing.assert_close(proj(features), want())


def test_word_dropout_replaces_only_ordinary_tokens_and_only_in_training():
    d = Dictionary()
    for i in range(50):
        d.add_symbol(f"w{i}")
    torch.manual_seed(0)
    tokens = torch.randint(d.nspecial, len(d), (64, 40))
    tokens[:, 0] = d.eos()
    tokens[:5, -6:] = d.pad()
    out = word_dropout(tokens, 0.3, d, training=True)
    changed = out != tokens
    assert (out[changed] == d.unk()).all()
    assert not changed[tokens == d.pad()].any() and not changed[tokens == d.eos()].any()
    rate = changed.sum().item() / ((tokens != d.pad()) & (tokens != d.eos())).sum().item()
    assert 0.27 < rate < 0.33
    assert torch.equal(word_dropout(tokens, 0.3, d, training=False), tokens)
    assert torch.equal(word_dropout(tokens, 0.0, d, training=True), tokens)
