"""The `transformer_qknorm` model: fairseq's transformer with QKNormAttention in every attention
module, plus the paper's other switches (ScaleNorm, FixNorm, word dropout). Only the builders are
overridden; forward passes are fairseq's own."""

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

from .errors import QKNormConfigError
from .fixnorm import UnitNormEmbedding, UnitNormOutputProjection
from .qk_flags import WatchesG, add_qk_args, as_namespace, in_range, resolve_qk_scale_init, set_qk_defaults
from .qknorm_attention import BEAM_SIZE, QKNormAttention
from .scale_norm import use_scale_norm
from .word_dropout import word_dropout

NORM_TYPES = ("layernorm", "scalenorm")


@register_model("transformer_qknorm")
class TransformerQKNormModel(WatchesG, TransformerModel):
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
            type=in_range("--word-dropout"),
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
        return super().build_model(as_namespace(args), task)

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

    def reorder_encoder_out(self, encoder_out, new_order):
        """fairseq's reordering, which also marks the output with the beam size of the search.

        fairseq's SequenceGenerator starts every search by repeating each sentence's encoder
        output once per hypothesis (new_order = 0,0,..,1,1,..: BEAM times each) and then reorders
        it at every step within the same search. The output of that first call carries BEAM under
        BEAM_SIZE, and every later reordering keeps it: the decoder learns the beam size of the
        running search from its own encoder output (beamable cross attention), never from an
        earlier search."""
        reordered = super().reorder_encoder_out(encoder_out, new_order)
        beam = encoder_out.get(BEAM_SIZE) or beam_of_first_reordering(encoder_out, new_order)
        if beam:
            reordered[BEAM_SIZE] = beam
        return reordered


def beam_of_first_reordering(encoder_out, new_order):
    """[BEAM] when new_order repeats each sentence BEAM > 1 times in a row, else None."""
    if not encoder_out["encoder_out"]:
        return None
    sentences, hypotheses = encoder_out["encoder_out"][0].size(1), new_order.numel()
    if hypotheses <= sentences or hypotheses % sentences:
        return None
    beam = hypotheses // sentences
    repeated = torch.arange(sentences, device=new_order.device).repeat_interleave(beam)
    return [beam] if torch.equal(new_order, repeated) else None


def one_copy_per_sentence(encoder_out):
    """The encoder output with the BEAM_SIZE copies of each sentence (a search's) reduced to one:
    cross attention then projects and caches each sentence's keys and values once, shared by its
    hypotheses. Views, no copy."""
    beam = (encoder_out.get(BEAM_SIZE) or [1])[0]
    if beam == 1:
        return encoder_out
    return dict(
        encoder_out,
        encoder_out=[x[:, ::beam] for x in encoder_out["encoder_out"]],
        encoder_padding_mask=[m[::beam] for m in encoder_out["encoder_padding_mask"]],
    )


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

    def extract_features(self, prev_output_tokens, encoder_out=None, incremental_state=None, **kwargs):
        prev_output_tokens = word_dropout(prev_output_tokens, self.word_dropout, self.dictionary, self.training)
        if encoder_out is not None and incremental_state is not None and not self.cross_self_attention:
            # Beamable cross attention, in a search only (--cross-self-attention puts the encoder
            # output into self attention, one row per hypothesis).
            encoder_out = one_copy_per_sentence(encoder_out)
        return super().extract_features(prev_output_tokens, encoder_out, incremental_state, **kwargs)


@register_model_architecture("transformer_qknorm", "transformer_qknorm")
def qknorm_base_architecture(args):
    """fairseq's `transformer` (base dims, post-norm) with the paper's QK-norm in every attention.
    Also fills in the plugin's args for checkpoints that predate one of them."""
    set_qk_defaults(args)
    args.norm_type = getattr(args, "norm_type", "layernorm")
    args.fixnorm = getattr(args, "fixnorm", False)
    args.word_dropout = getattr(args, "word_dropout", 0.0)
    base_architecture(args)
