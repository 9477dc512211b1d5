"""The models compared. Every arm gets the same dimensions and the same flags (PreNorm, shared
embeddings, dropout); the arms differ only in what their architecture is about."""

import argparse
from dataclasses import dataclass

import torch
from fairseq.data import Dictionary
from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY
from fairseq.tasks.translation import TranslationConfig, TranslationTask

import fairseq_qknorm  # noqa: F401  (registers transformer_qknorm and its architectures)
from fairseq_qknorm.length_prior import g0_for_length
from fairseq_qknorm.qk_flags import AFFINE_NORMS

from .variants import QK_VARIANTS


@dataclass(frozen=True)
class Size:
    dim: int
    layers: int  # encoder and decoder each
    heads: int
    ffn: int
    vocab: int  # one joined dictionary, as with --share-all-embeddings


SIZES = {
    "glen": Size(dim=512, layers=4, heads=4, ffn=2048, vocab=8000),  # the paper's gl-en model
    # fairseq's transformer (Vaswani et al.'s base) and transformer_vaswani_wmt_en_de_big, with a
    # WMT-sized joined vocabulary: the GPU call's larger sizes (benchmarks/gpu_call.py)
    "base": Size(dim=512, layers=6, heads=8, ffn=2048, vocab=32000),
    "big": Size(dim=1024, layers=6, heads=16, ffn=4096, vocab=32000),
    "medium": Size(dim=256, layers=3, heads=4, ffn=1024, vocab=8000),  # head dim 64, between the two
    "small": Size(dim=128, layers=2, heads=4, ffn=512, vocab=2000),
    "tiny": Size(dim=32, layers=1, heads=2, ffn=64, vocab=64),  # --quick (the test)
}

# arm -> (--arch, the arm's own flags)
ARMS = {
    "stock": ("transformer", {}),
    "stock_control": ("transformer", {}),  # stock in a second process: the noise floor
    # Generation only: fairseq's transformer with the beamable cross attention (one copy of the
    # encoder's keys and values per sentence) that transformer_qknorm always uses in a search and
    # fairseq's transformer never (SequenceGenerator switches it on through set_beam_size, which
    # fairseq's transformer lacks; stock_beamable calls it by hand). The
    # like-for-like reference for what QK-norm itself costs in beam search.
    "stock_beamable": ("transformer", {}),
    **{name: ("transformer_qknorm", flags) for name, flags in QK_VARIANTS.items()},
    # The paper's baseline: ScaleNorm + FixNorm + scaled dot product.
    "scalenorm_paper": ("transformer_scalenorm_paper", {}),
    # The plugin's attention with neither the norm nor g (--qk-norm none --qk-scale none): set
    # against stock and the QK-norm arms in benchmarks.one_process, it parts what the attention code
    # around the norm costs from what the norm costs. Not one of the runner's arms.
    "no_qknorm": ("transformer_qknorm", {"qk_norm": "none", "qk_scale": "none", "qk_scale_per_head": False}),
}
# A number, so that no binarized data is needed: the paper's g0 for L = 60.
QK_SCALE_INIT = g0_for_length(60)


def scale_init(qk_norm: str, head_dim: int) -> float:
    """QK_SCALE_INIT as `auto` gives it to QK_NORM (qk_flags.for_the_norm): over head_dim for
    LayerNorm and RMSNorm. The value changes the speed on some CPUs: at g0 itself their softmax starts
    saturated, and the denormal floats it makes cost an Intel Xeon a third of a training step."""
    return QK_SCALE_INIT / head_dim if qk_norm in AFFINE_NORMS else QK_SCALE_INIT


def dictionary(vocab: int) -> Dictionary:
    d = Dictionary()
    for i in range(vocab - len(d)):
        d.add_symbol(f"w{i}")
    return d


def model_args(arm: str, size: Size) -> argparse.Namespace:
    arch, own = ARMS[arm]
    args = argparse.Namespace(
        arch=arch,
        encoder_embed_dim=size.dim,
        decoder_embed_dim=size.dim,
        encoder_ffn_embed_dim=size.ffn,
        decoder_ffn_embed_dim=size.ffn,
        encoder_layers=size.layers,
        decoder_layers=size.layers,
        encoder_attention_heads=size.heads,
        decoder_attention_heads=size.heads,
        encoder_normalize_before=True,
        decoder_normalize_before=True,
        share_all_embeddings=True,
        dropout=0.1,
        attention_dropout=0.0,
        activation_dropout=0.0,
        **own,
    )
    if arch != "transformer":
        args.word_dropout = 0.0
    ARCH_CONFIG_REGISTRY[arch](args)
    if arch != "transformer":
        args.qk_scale_init = scale_init(args.qk_norm, size.dim // size.heads)
    return args


def build_model(arm: str, size: Size, seed: int):
    """The same seed gives every arm the same weights wherever the parameters are the same: the
    QK-norm modules draw no random numbers, so stock and qknorm start from identical weights."""
    d = dictionary(size.vocab)
    task = TranslationTask(TranslationConfig(), d, d)
    args = model_args(arm, size)
    torch.manual_seed(seed)
    return ARCH_MODEL_REGISTRY[args.arch].build_model(args, task), task
