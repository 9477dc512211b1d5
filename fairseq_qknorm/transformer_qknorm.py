"""The `transformer_qknorm` model: fairseq's transformer with QKNormAttention in every attention
module, plus the paper's other switches (ScaleNorm, FixNorm, word dropout). Only the builders are
overridden; forward passes are fairseq's own."""

import argparse
import logging
import math

import torch
from fairseq.distributed import fsdp_wrap
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import (
    TransformerConfig,
    TransformerDecoderBase,
    TransformerEncoderBase,
    TransformerModel,
    base_architecture,
)
from fairseq.modules.checkpoint_activations import checkpoint_wrapper
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase
from omegaconf import OmegaConf

from .errors import QKNormConfigError
from .fixnorm import UnitNormEmbedding, UnitNormOutputProjection
from .length_prior import g0_from_data
from .qknorm_attention import QK_NORMS, QK_SCALES, QKNormAttention
from .scale_norm import use_scale_norm
from .word_dropout import word_dropout

logger = logging.getLogger(__name__)

NORM_TYPES = ("layernorm", "scalenorm")


@register_model("transformer_qknorm")
class TransformerQKNormModel(TransformerModel):
    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        add_qk_args(parser, "the training sentence lengths")
        parser.add_argument(
            "--norm-type", choices=NORM_TYPES, help="sublayer norm: layernorm, or scalenorm (Nguyen & Salazar 2019)"
        )
        parser.add_argument("--fixnorm", action="store_true", help="unit-length word embeddings (FixNorm)")
        parser.add_argument(
            "--word-dropout",
            type=_in_range("--word-dropout"),
            metavar="P",
            help="replace input tokens by <unk> with probability P while training",
        )

    @classmethod
    def build_model(cls, args, task):
        qknorm_base_architecture(args)
        if args.share_all_embeddings and task.source_dictionary != task.target_dictionary:
            raise QKNormConfigError(
                "--share-all-embeddings (set by the paper architectures) needs one "
                "dictionary for both sides: binarize with fairseq-preprocess --joined-dictionary"
            )
        args.qk_scale_init = resolve_qk_scale_init(args, task)  # in the config that is saved
        if OmegaConf.is_config(args):
            # fairseq-hydra-train: TransformerConfig.from_namespace keeps a Namespace's extra keys
            # (the plugin's flags), not a DictConfig's.
            args = argparse.Namespace(**OmegaConf.to_container(args, resolve=True))
        return super().build_model(args, task)

    def set_num_updates(self, num_updates):
        super().set_num_updates(num_updates)  # fairseq's trainer calls this before every update
        warn_if_g_not_positive(self, num_updates)

    def set_beam_size(self, beam_size):
        """fairseq's SequenceGenerator calls this on models that have it (fairseq's transformer has
        not): cross attention then projects and caches the encoder output once per sentence
        instead of once per hypothesis, and beam reordering leaves that cache alone."""
        self.decoder.set_beam_size(beam_size)

    def load_state_dict(self, state_dict, strict=True, model_cfg=None, args=None):
        qk_params = (".qk_scale.", ".q_norm.", ".k_norm.")
        missing = [k for k in self.state_dict() if any(p in k for p in qk_params) and k not in state_dict]
        if strict and missing:
            raise QKNormConfigError(
                f"the checkpoint has no QK-norm parameters (e.g. {missing[0]}): it was trained without "
                "QK-norm or with other --qk-norm/--qk-scale flags; load it with the flags it was trained with"
            )
        return super().load_state_dict(state_dict, strict=strict, model_cfg=model_cfg, args=args)

    @classmethod
    def build_embedding(cls, args, dictionary, embed_dim, path=None):
        if not getattr(args, "fixnorm", False):
            return super().build_embedding(args, dictionary, embed_dim, path)
        if path:
            raise QKNormConfigError("--fixnorm cannot be combined with pretrained embeddings (--*-embed-path)")
        return UnitNormEmbedding(len(dictionary), embed_dim, dictionary.pad())

    @classmethod
    def build_encoder(cls, args, src_dict, embed_tokens):
        return QKNormTransformerEncoder(TransformerConfig.from_namespace(args), src_dict, embed_tokens)

    @classmethod
    def build_decoder(cls, args, tgt_dict, embed_tokens):
        cfg = TransformerConfig.from_namespace(args)
        return QKNormTransformerDecoder(cfg, tgt_dict, embed_tokens, no_encoder_attn=cfg.no_cross_attention)


def _number(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan  # refused by every range check below


def _positive_g(value) -> bool:
    # g multiplies the cosine similarities: g <= 0 sends attention to the least similar keys, and
    # NaN or infinity make every attention weight NaN or one-hot from the first step.
    return math.isfinite(value) and value > 0


def add_qk_args(parser, lengths):
    """The QK-norm flags, shared by the translation and language models; LENGTHS says what L is
    the percentile of. No defaults here: the architectures set them (fairseq's convention)."""
    parser.add_argument(
        "--qk-norm", choices=QK_NORMS, help="normalize q and k per head: l2 (the paper), layernorm, rmsnorm, none"
    )
    parser.add_argument(
        "--qk-scale", choices=QK_SCALES, help="scale of q.k: a learned scalar g, a fixed g, or none (1/sqrt(head_dim))"
    )
    parser.add_argument(
        "--qk-scale-init",
        metavar="auto|FLOAT",
        type=_auto_or_float,
        help="initial g (> 0); auto = log2(L^2 - L), L a percentile of " + lengths,
    )
    parser.add_argument(
        "--qk-length-percentile",
        type=_in_range("--qk-length-percentile"),
        metavar="P",
        help=f"percentile of {lengths} that gives L for auto (default 97.5)",
    )
    parser.add_argument(
        "--qk-scale-per-head", action="store_true", help="one g per head instead of one per attention module"
    )


def _auto_or_float(value: str):
    if value == "auto":
        return value
    if not _positive_g(_number(value)):
        raise argparse.ArgumentTypeError(f"expected 'auto' or a positive finite number, got {value!r}")
    return float(value)


# The flags with a range: argparse checks them (their type), and check_qk_flags again for values
# that never went through argparse.
RANGES = {
    "--qk-length-percentile": ("a percentile in (0, 100]", lambda x: 0 < x <= 100),
    # p = 1 would replace every input token by <unk>: nothing would be left to translate.
    "--word-dropout": ("a probability in [0, 1)", lambda x: 0 <= x < 1),
}


def _in_range(flag):
    """The argparse type of a flag of RANGES."""
    expected, ok = RANGES[flag]

    def parse(value: str) -> float:
        x = _number(value)
        if not ok(x):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value!r}")
        return x

    return parse


def check_qk_flags(args):
    """The checks of add_args's types, again for values that never went through argparse
    (fairseq-hydra-train's config, a saved Namespace), and those that need two flags."""
    for flag, (expected, ok) in RANGES.items():
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None and not ok(_number(value)):
            raise QKNormConfigError(f"{flag}: expected {expected}, got {value!r}")
    if getattr(args, "qk_scale_per_head", False):
        if args.qk_scale == "none":
            raise QKNormConfigError(
                "--qk-scale-per-head: there is no g with --qk-scale none; "
                "use --qk-scale learned or fixed, or drop --qk-scale-per-head"
            )
        heads = [getattr(args, f"{side}_attention_heads", None) for side in ("encoder", "decoder")]
        if max((h for h in heads if h is not None), default=None) == 1:
            raise QKNormConfigError(
                "--qk-scale-per-head: every attention has one head, so one g per head "
                "is one g per module; drop --qk-scale-per-head"
            )


def resolve_qk_scale_init(args, task) -> float:
    """--qk-scale-init as a number. `auto` reads L from the binarized training split once, at
    training time; the number replaces `auto` in the saved args, so loading never needs the data."""
    check_qk_flags(args)
    value = args.qk_scale_init
    if args.qk_scale == "none":
        return value
    if value != "auto":
        if not _positive_g(_number(value)):
            raise QKNormConfigError(f"--qk-scale-init: expected 'auto' or a positive finite number, got {value!r}")
        return float(value)
    data = getattr(getattr(task, "cfg", None), "data", None)
    if not data:
        raise QKNormConfigError("--qk-scale-init auto needs the task's binarized training data; pass a number instead")
    split = getattr(args, "train_subset", None) or "train"
    length, g0 = g0_from_data(data, split, task.cfg.source_lang, task.cfg.target_lang, args.qk_length_percentile)
    logger.info(
        f"qk-norm: L={length} ({args.qk_length_percentile:g}th percentile of '{split}' lengths) g0=log2(L^2-L)={g0:.4f}"
    )
    return g0


def warn_if_g_not_positive(model, num_updates):
    """Log once per learned g that has reached g <= 0: the flags only guard its initial value, and
    training (a high learning rate, weight decay) can still push it there."""
    gs = {name: p for name, p in model.named_parameters() if name.endswith("qk_scale.g")}
    if not gs or torch.stack([g.detach().min() for g in gs.values()]).min().item() > 0:  # one sync an update
        return
    warned = model.__dict__.setdefault("_warned_nonpositive_g", set())
    for name, g in gs.items():
        if name not in warned and g.detach().min().item() <= 0:
            warned.add(name)
            logger.warning(
                f"qk-norm: the learned g {name} is {g.detach().min().item():.4g} at update "
                f"{num_updates}: g <= 0 turns attention towards the least similar keys (lower the "
                "learning rate, or the weight decay on g)"
            )


def build_attention(embed_dim, num_heads, cfg, **kwargs):
    return QKNormAttention(
        embed_dim,
        num_heads,
        qk_norm=cfg.qk_norm,
        qk_scale=cfg.qk_scale,
        qk_scale_init=cfg.qk_scale_init,
        qk_scale_per_head=cfg.qk_scale_per_head,
        dropout=cfg.attention_dropout,
        q_noise=cfg.quant_noise.pq,
        qn_block_size=cfg.quant_noise.pq_block_size,
        **kwargs,
    )


def wrap_layer(layer, cfg):
    """What fairseq's build_encoder_layer / build_decoder_layer do around a new layer."""
    if cfg.checkpoint_activations:
        layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
    return fsdp_wrap(layer, min_num_params=0 if cfg.checkpoint_activations else cfg.min_params_to_wrap)


class QKNormEncoderLayer(TransformerEncoderLayerBase):
    def __init__(self, cfg, return_fc=False):
        super().__init__(cfg, return_fc)
        if cfg.norm_type == "scalenorm":
            use_scale_norm(self, ("self_attn_layer_norm", "final_layer_norm"))

    def build_self_attention(self, embed_dim, cfg):
        return build_attention(embed_dim, cfg.encoder.attention_heads, cfg, self_attention=True)


class QKNormDecoderLayer(TransformerDecoderLayerBase):
    def __init__(self, cfg, no_encoder_attn=False):
        super().__init__(cfg, no_encoder_attn)
        if cfg.norm_type == "scalenorm":
            use_scale_norm(self, ("self_attn_layer_norm", "encoder_attn_layer_norm", "final_layer_norm"))

    def build_self_attention(self, embed_dim, cfg, add_bias_kv=False, add_zero_attn=False):
        return build_attention(
            embed_dim,
            cfg.decoder.attention_heads,
            cfg,
            add_bias_kv=add_bias_kv,
            add_zero_attn=add_zero_attn,
            self_attention=not cfg.cross_self_attention,
        )

    def build_encoder_attention(self, embed_dim, cfg):
        return build_attention(
            embed_dim,
            cfg.decoder.attention_heads,
            cfg,
            kdim=cfg.encoder.embed_dim,
            vdim=cfg.encoder.embed_dim,
            encoder_decoder_attention=True,
        )


class QKNormTransformerEncoder(TransformerEncoderBase):
    def __init__(self, cfg, dictionary, embed_tokens):
        super().__init__(cfg, dictionary, embed_tokens)
        self.word_dropout = cfg.word_dropout
        if cfg.norm_type == "scalenorm":
            use_scale_norm(self, ("layer_norm", "layernorm_embedding"))

    def build_encoder_layer(self, cfg):
        return wrap_layer(QKNormEncoderLayer(cfg), cfg)

    def forward_embedding(self, src_tokens, token_embedding=None):
        src_tokens = word_dropout(src_tokens, self.word_dropout, self.dictionary, self.training)
        return super().forward_embedding(src_tokens, token_embedding)


class QKNormTransformerDecoder(TransformerDecoderBase):
    def __init__(self, cfg, dictionary, embed_tokens, no_encoder_attn=False):
        super().__init__(cfg, dictionary, embed_tokens, no_encoder_attn=no_encoder_attn)
        self.word_dropout = cfg.word_dropout
        if cfg.norm_type == "scalenorm":
            use_scale_norm(self, ("layer_norm", "layernorm_embedding"))

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        return wrap_layer(QKNormDecoderLayer(cfg, no_encoder_attn), cfg)

    def build_output_projection(self, cfg, dictionary, embed_tokens):
        super().build_output_projection(cfg, dictionary, embed_tokens)
        if cfg.fixnorm and self.adaptive_softmax is None:
            self.output_projection = UnitNormOutputProjection(self.output_projection.weight)

    def extract_features(self, prev_output_tokens, *args, **kwargs):
        prev_output_tokens = word_dropout(prev_output_tokens, self.word_dropout, self.dictionary, self.training)
        return super().extract_features(prev_output_tokens, *args, **kwargs)


@register_model_architecture("transformer_qknorm", "transformer_qknorm")
def qknorm_base_architecture(args):
    """fairseq's `transformer` (base dims, post-norm) with the paper's QK-norm in every attention.
    Also fills in the plugin's args for checkpoints that predate one of them."""
    args.qk_norm = getattr(args, "qk_norm", "l2")
    args.qk_scale = getattr(args, "qk_scale", "learned")
    args.qk_scale_init = getattr(args, "qk_scale_init", "auto")
    args.qk_length_percentile = getattr(args, "qk_length_percentile", 97.5)
    args.qk_scale_per_head = getattr(args, "qk_scale_per_head", False)
    args.norm_type = getattr(args, "norm_type", "layernorm")
    args.fixnorm = getattr(args, "fixnorm", False)
    args.word_dropout = getattr(args, "word_dropout", 0.0)
    base_architecture(args)
