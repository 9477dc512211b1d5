"""The `transformer_lm_qknorm` model: fairseq's decoder-only `transformer_lm` (--task
language_modeling) with QKNormAttention in every self attention, and the QK-norm flags of
qk_flags.py. Only the model builder is overridden; forward passes are fairseq's own.

For `--qk-scale-init auto`, L is the length of the samples the task trains on: with
`--sample-break-mode none` every block holds --tokens-per-sample tokens; with eos, complete or
complete_doc, L is the --qk-length-percentile of the training samples' lengths.
"""

import argparse
import logging

from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import TransformerConfig
from fairseq.models.transformer_lm import (
    TransformerLanguageModel,
    TransformerLanguageModelConfig,
    base_lm_architecture,
    transformer_lm_gpt,
    transformer_lm_gpt2_tiny,
)

from .errors import QKNormConfigError
from .length_prior import g0_for_length, length_percentile
from .qk_flags import (
    WatchesG,
    add_qk_args,
    as_namespace,
    check_qk_flags,
    for_the_norm,
    resolve_qk_scale_init,
    set_qk_defaults,
)
from .transformer_qknorm import QKNormTransformerDecoder

logger = logging.getLogger(__name__)

# The translation model's other switches, which the language model does not offer: the decoder
# it reuses reads them, so they are fixed to "off" in the configuration it is built from.
TRANSLATION_ONLY = dict(norm_type="layernorm", fixnorm=False, word_dropout=0.0)


@register_model("transformer_lm_qknorm")
class TransformerLMQKNormModel(WatchesG, TransformerLanguageModel):
    @classmethod
    def add_args(cls, parser):
        # Registered without a dataclass, so that the checkpoint keeps its args as a Namespace, as
        # the translation model's does; fairseq's LM flags come from fairseq's LM dataclass, without
        # defaults (as fairseq adds them) so that the architectures set them.
        gen_parser_from_dataclass(parser, TransformerLanguageModelConfig(), delete_default=True)
        add_qk_args(parser, "the training sample lengths (--sample-break-mode none: --tokens-per-sample)")

    @classmethod
    def build_model(cls, args, task):
        qknorm_lm_base_architecture(args)
        args.qk_scale_init = resolve_lm_qk_scale_init(args, task)  # in the config that is saved
        args = as_namespace(args)
        # fairseq's builder makes the input embeddings (plain, character or adaptive) and checks
        # their flags, but builds its decoder inline, with no hook: its stock decoder is dropped
        # for one with QK-norm layers around the same embeddings.
        stock = super().build_model(args, task)
        cfg = TransformerConfig.from_namespace(argparse.Namespace(**{**vars(args), **TRANSLATION_ONLY}))
        return cls(
            QKNormTransformerDecoder(cfg, task.target_dictionary, stock.decoder.embed_tokens, no_encoder_attn=True)
        )


def resolve_lm_qk_scale_init(args, task) -> float:
    """--qk-scale-init as a number; `auto` takes L from the samples the task builds (read once, at
    training time: the number replaces `auto` in the saved args)."""
    if args.qk_scale == "none" or args.qk_scale_init != "auto" or args.qk_norm == "none":
        return resolve_qk_scale_init(args, task)
    check_qk_flags(args)
    split = getattr(args, "train_subset", None) or "train"
    break_mode = getattr(task.args, "sample_break_mode", None) or "none"
    if break_mode == "none":
        length, source = task.args.tokens_per_sample, f"--tokens-per-sample, --sample-break-mode {break_mode}"
    else:
        lengths = sample_lengths(task, split)
        length = length_percentile(lengths, args.qk_length_percentile)
        source = (
            f"{args.qk_length_percentile:g}th percentile of the {len(lengths)} '{split}' samples, "
            f"--sample-break-mode {break_mode}"
        )
    if getattr(task.args, "add_bos_token", False):
        length += 1  # the task puts <s> in front of every sample
        source += ", +1 for the <s> of --add-bos-token"
    g0 = g0_for_length(length)
    logger.info(f"qk-norm: L={length} ({source}) g0=log2(L^2-L)={g0:.4f}")
    return for_the_norm(g0, args)


def sample_lengths(task, split):
    """Lengths of the samples the task builds from `split` (its TokenBlockDataset's blocks)."""
    loaded = split in task.datasets
    if not loaded:
        try:
            task.load_dataset(split, epoch=1)
        except FileNotFoundError:
            raise QKNormConfigError(
                f"--qk-scale-init auto: no '{split}' split in {task.args.data}; binarize the training "
                "text with fairseq-preprocess --only-source, or pass --qk-scale-init FLOAT"
            ) from None
    lengths = task.dataset(split).sizes
    if not loaded:  # fairseq-train loads the training split itself, later, for its first epoch
        del task.datasets[split]
    return lengths


@register_model_architecture("transformer_lm_qknorm", "transformer_lm_qknorm")
def qknorm_lm_base_architecture(args):
    """fairseq's LM defaults (base_lm_architecture: 512, 6 layers, 8 heads, FFN 2048, pre-norm, as
    every named fairseq LM architecture) with the paper's QK-norm in every self attention. (fairseq's
    own `--arch transformer_lm` skips base_lm_architecture and is post-norm.) Also fills in the
    plugin's args for checkpoints that predate one."""
    set_qk_defaults(args)
    base_lm_architecture(args)


@register_model_architecture("transformer_lm_qknorm", "transformer_lm_qknorm_gpt")
def qknorm_lm_gpt(args):
    """fairseq's transformer_lm_gpt: GPT-2 small's sizes (768, 12 layers, 12 heads, FFN 3072,
    GELU). (fairseq's transformer_lm_gpt2_small is 1024 wide and 24 deep: GPT-2 medium's sizes.)"""
    transformer_lm_gpt(args)
    qknorm_lm_base_architecture(args)


@register_model_architecture("transformer_lm_qknorm", "transformer_lm_qknorm_gpt2_tiny")
def qknorm_lm_gpt2_tiny(args):
    """fairseq's transformer_lm_gpt2_tiny (64, 2 layers, 1 head, FFN 64): for tests and the CPU."""
    transformer_lm_gpt2_tiny(args)
    qknorm_lm_base_architecture(args)
