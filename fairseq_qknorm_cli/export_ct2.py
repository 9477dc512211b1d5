"""fairseq-qknorm-export-ct2: convert a `transformer_lm_qknorm` checkpoint to a CTranslate2 model.

  fairseq-qknorm-export-ct2 --model_path CKPT --data_dir DATA_BIN --output_dir DIR [--quantization int8]

The flags are those of CTranslate2's ct2-fairseq-converter, and so is everything but the
attention: fairseq's modules are mapped onto CTranslate2's decoder spec by that converter's own
functions. The checkpoint is read by fairseq with the plugin's safe loading (torch's
weights_only unpickler and the plugin's allow-list), never with the full unpickler.

Why the mapping is exact. CTranslate2's self attention normalizes each head's q and k with a
RMSNorm (or LayerNorm) carrying a weight of head_dim values shared by all heads, then scales q.k
by 1/sqrt(head_dim). QK-norm wants s * norm(q).norm(k), s = g (or 1/sqrt(head_dim) with
--qk-scale none). So CTranslate2's q must be s * sqrt(head_dim) * norm(q):
  l2       a unit vector is RMSNorm(x) / sqrt(head_dim): q weight s / sqrt(head_dim), k weight 1
  rmsnorm  q weight s * sqrt(head_dim) * w_q, k weight w_k
  layernorm  the same factor on the q norm's weight and bias
  none     no norm: the factor goes into the rows of the query projection (per head if need be)
One g per head fits only the last: a norm's weight is shared by the heads. Translation models are
refused: CTranslate2's cross attention normalizes the queries over the whole projection before
splitting heads, so per-head QKNorm there has no exact form.
"""

import argparse
import copy
import math
import os
import sys

import numpy as np

from fairseq_qknorm.errors import QKNormConfigError

LM_MODEL = "transformer_lm_qknorm"


def exportable(args):
    """Raise QKNormConfigError (one line) unless `args` (a checkpoint's model args) can be exported exactly."""
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY

    model = ARCH_MODEL_NAME_REGISTRY.get(getattr(args, "arch", None))
    if model == "transformer_qknorm":
        raise QKNormConfigError(
            f"{args.arch} is a translation model: CTranslate2's cross attention normalizes the queries over the "
            "whole projection before splitting heads, so per-head QKNorm there has no exact form; only "
            f"{LM_MODEL} models are exported"
        )
    if model != LM_MODEL:
        raise QKNormConfigError(
            f"architecture {getattr(args, 'arch', None)!r} is not a {LM_MODEL} model; "
            "stock fairseq models convert with CTranslate2's ct2-fairseq-converter"
        )


def scale_of(attn):
    """What QKNormAttention multiplies norm(q).norm(k) by: g (a scalar, or one per head), or 1/sqrt(head_dim)."""
    if attn.qk_scale is None:
        return np.float32(attn.head_dim**-0.5)
    return attn.qk_scale.g.detach().float().numpy().reshape(-1)


def with_qk_norm(attn):
    """A self-attention spec with q and k norms of attn's kind (none for --qk-norm none)."""
    from ctranslate2.specs import attention_spec

    return attention_spec.MultiHeadAttentionSpec(
        self_attention=True, qk_norm=attn.qk_norm != "none", qk_norm_rms=attn.qk_norm != "layernorm"
    )


def set_qk_norm(spec, attn):
    """Complete a with_qk_norm spec (projections already set by CTranslate2's converter) for attn."""
    factor = scale_of(attn) * math.sqrt(attn.head_dim)  # what CTranslate2's q must carry
    if attn.qk_norm == "none":
        rows = np.repeat(np.broadcast_to(factor, attn.num_heads), attn.head_dim).astype(np.float32)
        qkv = spec.linear[0]  # the fused q, k, v projection: q is the first embed_dim rows
        qkv.weight[: attn.embed_dim] *= rows[:, None]
        qkv.bias[: attn.embed_dim] *= rows
        return
    if factor.size > 1 and not np.all(factor == factor.flat[0]):
        raise QKNormConfigError(
            f"--qk-scale-per-head with --qk-norm {attn.qk_norm}: CTranslate2's q-norm weight is shared by all heads, "
            "so one g per head has no exact form there"
        )
    factor = np.float32(factor.flat[0])
    layernorm = attn.qk_norm == "layernorm"
    if attn.qk_norm == "l2":
        ones = np.ones(attn.head_dim, dtype=np.float32)
        spec.q_norm.gamma, spec.k_norm.gamma = ones * factor / attn.head_dim, ones
        return
    for norm_spec, module, f in ((spec.q_norm, attn.q_norm, factor), (spec.k_norm, attn.k_norm, np.float32(1))):
        norm_spec.gamma = module.weight.detach().float().numpy() * f
        if layernorm:
            norm_spec.beta = module.bias.detach().float().numpy() * f


def make_converter(model_path, data_dir):
    from ctranslate2.converters import fairseq as ct2_fairseq

    class QKNormLMConverter(ct2_fairseq.FairseqConverter):
        def _load(self):
            import torch
            from fairseq import checkpoint_utils, models, tasks

            import fairseq_qknorm  # noqa: F401  (registers the model; safe loading)

            state = checkpoint_utils.load_checkpoint_to_cpu(self._model_path)  # weights_only, allow-listed
            args = state["cfg"]["model"]
            exportable(args)
            args.data = self._data_dir
            # CTranslate2's checks and decoder spec for fairseq's transformer_lm: the same network but
            # for the attention, which set_qk_norm completes.
            stock = copy.copy(args)
            stock.arch = "transformer_lm"
            spec = ct2_fairseq._get_model_spec(stock)
            task = tasks.setup_task(args)
            model = models.build_model(args, task)
            model.load_state_dict(state["model"])
            model.eval().requires_grad_(False)
            for layer_spec, layer in zip(spec.decoder.layer, model.decoder.layers):
                layer_spec.self_attention = with_qk_norm(layer.self_attn)
            with torch.no_grad():
                ct2_fairseq.set_transformer_decoder(spec.decoder, model.decoder, with_encoder_attention=False)
                for layer_spec, layer in zip(spec.decoder.layer, model.decoder.layers):
                    set_qk_norm(layer_spec.self_attention, layer.self_attn)
            spec.register_vocabulary(ct2_fairseq._get_vocab(task.dictionary))
            if not args.add_bos_token:
                spec.config.bos_token = spec.config.eos_token
            return spec

    return QKNormLMConverter(model_path, data_dir)


def parse_args(argv=None):
    from ctranslate2.converters.converter import Converter

    parser = argparse.ArgumentParser(
        prog="fairseq-qknorm-export-ct2",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model_path", required=True, help="the transformer_lm_qknorm checkpoint (.pt)")
    parser.add_argument("--data_dir", required=True, help="the binarized data folder holding its dict.txt")
    Converter.declare_arguments(parser)  # --output_dir, --vocab_mapping, --quantization, --force
    return parser.parse_args(argv)


def main(argv=None):
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        sys.exit("error: fairseq-qknorm-export-ct2 needs CTranslate2: pip install ctranslate2==4.8.5")
    args = parse_args(argv)
    if not os.path.isfile(args.model_path):
        sys.exit(f"error: --model_path {args.model_path}: no such checkpoint")
    if not os.path.isfile(os.path.join(args.data_dir, "dict.txt")):
        sys.exit(f"error: --data_dir {args.data_dir}: no dict.txt (the binarized folder the model was trained on)")
    if os.path.exists(args.output_dir) and not args.force:
        sys.exit(f"error: --output_dir {args.output_dir} exists; pass --force to overwrite it")
    import fairseq_qknorm  # noqa: F401  (its excepthook prints a QKNormConfigError as one line)

    output = make_converter(args.model_path, args.data_dir).convert_from_args(args)
    print(output)


if __name__ == "__main__":
    main()
