"""Named settings for the model `transformer_qknorm`. Each only sets defaults: any flag given on
the command line wins. The paper's two arms differ only in the norm and the attention."""

from fairseq.models import register_model_architecture
from fairseq.models.transformer import transformer_iwslt_de_en

from .transformer_qknorm import qknorm_base_architecture


@register_model_architecture("transformer_qknorm", "transformer_qknorm_iwslt_de_en")
def qknorm_iwslt_de_en(args):
    """fairseq's transformer_iwslt_de_en (512/1024, 4 heads, 6+6 layers) with QK-norm."""
    transformer_iwslt_de_en(args)
    qknorm_base_architecture(args)


@register_model_architecture("transformer_qknorm", "transformer_qknorm_paper")
def qknorm_paper(args):
    """The paper's system: PreNorm + FixNorm + LayerNorm + QKNorm (l2, learned g from the data);
    6+6 layers, 512, 8 heads, FFN 2048, dropout 0.3, shared embeddings, word dropout 0.1."""
    args.dropout = getattr(args, "dropout", 0.3)
    args.attention_dropout = getattr(args, "attention_dropout", args.dropout)
    args.activation_dropout = getattr(args, "activation_dropout", args.dropout)
    args.encoder_normalize_before = getattr(args, "encoder_normalize_before", True)
    args.decoder_normalize_before = getattr(args, "decoder_normalize_before", True)
    args.share_all_embeddings = getattr(args, "share_all_embeddings", True)
    args.fixnorm = getattr(args, "fixnorm", True)
    args.word_dropout = getattr(args, "word_dropout", 0.1)
    qknorm_base_architecture(args)


@register_model_architecture("transformer_qknorm", "transformer_qknorm_paper_glen")
def qknorm_paper_glen(args):
    """The paper's gl-en setting: 4+4 layers, 4 heads, dropout 0.4."""
    _glen(args)
    qknorm_paper(args)


@register_model_architecture("transformer_qknorm", "transformer_scalenorm_paper")
def scalenorm_paper(args):
    """The paper's baseline (Nguyen & Salazar 2019): PreNorm + FixNorm + ScaleNorm + scaled dot."""
    args.norm_type = getattr(args, "norm_type", "scalenorm")
    args.qk_norm = getattr(args, "qk_norm", "none")
    args.qk_scale = getattr(args, "qk_scale", "none")
    qknorm_paper(args)


@register_model_architecture("transformer_qknorm", "transformer_scalenorm_paper_glen")
def scalenorm_paper_glen(args):
    _glen(args)
    scalenorm_paper(args)


def _glen(args):
    args.encoder_layers = getattr(args, "encoder_layers", 4)
    args.decoder_layers = getattr(args, "decoder_layers", 4)
    args.encoder_attention_heads = getattr(args, "encoder_attention_heads", 4)
    args.decoder_attention_heads = getattr(args, "decoder_attention_heads", 4)
    args.dropout = getattr(args, "dropout", 0.4)
