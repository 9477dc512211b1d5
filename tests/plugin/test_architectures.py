"""Every translation architecture the plugin registers builds at its own size and trains one
update; the language-model architectures are registered (tests/plugin/test_lm.py trains the tiny one)."""

import pytest
import torch
from conftest import build_model, train_each
from fairseq.models import ARCH_MODEL_REGISTRY

import fairseq_qknorm  # noqa: F401
from fairseq_qknorm.qknorm_attention import QKNormAttention
from fairseq_qknorm.scale_norm import ScaleNorm
from fairseq_qknorm.transformer_qknorm import TransformerQKNormModel

PLUGIN_ARCHS = sorted(a for a, m in ARCH_MODEL_REGISTRY.items() if m.__module__.startswith("fairseq_qknorm"))
ARCHS = [a for a in PLUGIN_ARCHS if ARCH_MODEL_REGISTRY[a] is TransformerQKNormModel]


def test_the_expected_architectures_are_registered():
    assert sorted(set(PLUGIN_ARCHS) - set(ARCHS)) == [
        "transformer_lm_qknorm",
        "transformer_lm_qknorm_gpt",
        "transformer_lm_qknorm_gpt2_tiny",
    ]
    assert ARCHS == [
        "transformer_qknorm",
        "transformer_qknorm_iwslt_de_en",
        "transformer_qknorm_paper",
        "transformer_qknorm_paper_glen",
        "transformer_scalenorm_paper",
        "transformer_scalenorm_paper_glen",
    ]


@pytest.fixture(scope="module")
def one_update_each(toy_bin, tmp_path_factory):
    """{arch: its fairseq-train output}: one update at the architecture's own size (no model flags),
    each into a save dir of its own, all in one process."""
    save = tmp_path_factory.mktemp("archs")
    extra = ["--max-tokens", "400", "--no-save", "--disable-validation"]
    return train_each(
        {
            arch: dict(data_bin=toy_bin / "bin", save_dir=save / arch, arch=arch, model=(), max_update=1, extra=extra)
            for arch in ARCHS
        }
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_trains_one_update_at_its_own_size(arch, one_update_each):
    out = one_update_each[arch]
    assert "num_updates 1" in out, out[-3000:]


def test_paper_arms_differ_only_in_norm_and_attention():
    # the architectures' own layers, heads and dropout; paper width
    paper = dict(encoder_embed_dim=512, decoder_embed_dim=512, encoder_ffn_embed_dim=2048, decoder_ffn_embed_dim=2048)
    own = dict.fromkeys(
        ["encoder_layers", "decoder_layers", "encoder_attention_heads", "decoder_attention_heads", "dropout"]
    )
    qk, _ = build_model("transformer_qknorm_paper_glen", qk_scale_init=12.0, **paper, **own)
    base, _ = build_model("transformer_scalenorm_paper_glen", qk_scale_init=12.0, **paper, **own)
    for model in (qk, base):
        assert len(model.encoder.layers) == 4 and len(model.decoder.layers) == 4
        assert model.encoder.layers[0].self_attn.num_heads == 4
        assert model.decoder.embed_tokens is model.encoder.embed_tokens  # shared embeddings
        assert model.encoder.layers[0].normalize_before and model.decoder.layers[0].normalize_before
    attn = [m for m in qk.modules() if isinstance(m, QKNormAttention)]
    assert len(attn) == 4 + 4 * 2 and all(a.qk_norm == "l2" and a.qk_scale.g.item() == 12.0 for a in attn)
    assert not any(isinstance(m, ScaleNorm) for m in qk.modules())
    base_attn = [m for m in base.modules() if isinstance(m, QKNormAttention)]
    assert all(a.qk_norm == "none" and a.qk_scale is None for a in base_attn)
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in base.modules())
    assert sum(isinstance(m, ScaleNorm) for m in base.modules()) == 4 * 2 + 4 * 3 + 2
