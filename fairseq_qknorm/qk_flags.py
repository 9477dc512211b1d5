"""The QK-norm flags, written once for the translation model (transformer_qknorm.py) and the language
model (transformer_lm_qknorm.py): the command-line flags and their checks, their defaults, `auto`
made a number from the training data, the configuration as fairseq's builders read it, the watch
on a learned g during training, and the g0 a loaded g started from."""

import argparse
import logging
import math

import torch
from fairseq import utils
from omegaconf import OmegaConf

from .errors import QKNormConfigError
from .length_prior import g0_for_length, g0_from_pairs, pairs_within, training_pairs
from .qknorm_attention import QK_NORMS, QK_SCALES, QKScale

logger = logging.getLogger(__name__)


def add_qk_args(parser, lengths):
    """The QK-norm flags; LENGTHS says what L is the percentile of. No defaults here: the
    architectures set them (fairseq's convention), through set_qk_defaults."""
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
        help="initial g (> 0); auto = log2(L^2 - L), L a percentile of " + lengths + " (over head_dim for "
        "--qk-norm layernorm/rmsnorm, whose outputs have length sqrt(head_dim))",
    )
    parser.add_argument(
        "--qk-length-percentile",
        type=in_range("--qk-length-percentile"),
        metavar="P",
        help=f"percentile of {lengths} that gives L for auto (default 97.5)",
    )
    parser.add_argument(
        "--qk-scale-per-head", action="store_true", help="one g per head instead of one per attention module"
    )


def set_qk_defaults(args):
    """The defaults of the QK-norm flags not given: the paper's QK-norm. Also fills them in for
    checkpoints that predate one of them."""
    args.qk_norm = getattr(args, "qk_norm", "l2")
    # --qk-norm none alone is fairseq's attention: a g on raw dot products only where asked for
    args.qk_scale = getattr(args, "qk_scale", "none" if args.qk_norm == "none" else "learned")
    args.qk_scale_init = getattr(args, "qk_scale_init", "auto")
    args.qk_length_percentile = getattr(args, "qk_length_percentile", 97.5)
    args.qk_scale_per_head = getattr(args, "qk_scale_per_head", False)


def _number(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan  # refused by every range check below


def _positive_g(value) -> bool:
    # g multiplies the cosine similarities: g <= 0 sends attention to the least similar keys, and
    # NaN or infinity make every attention weight NaN or one-hot from the first step.
    return math.isfinite(value) and value > 0


def _auto_or_float(value: str):
    if value == "auto":
        return value
    if not _positive_g(_number(value)):
        raise argparse.ArgumentTypeError(f"expected 'auto' or a positive finite number, got {value!r}")
    return float(value)


# The plugin's flags with a range: argparse checks them (their type), and check_qk_flags again for
# values that never went through argparse.
RANGES = {
    "--qk-length-percentile": ("a percentile in (0, 100]", lambda x: 0 < x <= 100),
    # The translation model's. p = 1 would replace every input token by <unk>: nothing would be left to translate.
    "--word-dropout": ("a probability in [0, 1)", lambda x: 0 <= x < 1),
}


def in_range(flag):
    """The argparse type of a flag of RANGES."""
    expected, ok = RANGES[flag]

    def parse(value: str) -> float:
        x = _number(value)
        if not ok(x):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value!r}")
        return x

    return parse


def check_qk_flags(args):
    """The checks of add_qk_args's types, again for values that never went through argparse
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
    training time; the number replaces `auto` in the saved args, so loading never needs the data.
    (The language model's `auto` is its own: transformer_lm_qknorm.resolve_lm_qk_scale_init.)"""
    check_qk_flags(args)
    value = args.qk_scale_init
    if args.qk_scale == "none":
        return value
    if value != "auto":
        if not _positive_g(_number(value)):
            raise QKNormConfigError(f"--qk-scale-init: expected 'auto' or a positive finite number, got {value!r}")
        if args.qk_norm != "none":
            warn_if_beyond_every_length(float(value), args)
        return float(value)
    if args.qk_norm == "none":
        return dot_product_g0(args)
    return for_the_norm(g0_from_training_pairs(args, task), args)


def g0_from_training_pairs(args, task) -> float:
    """The paper's g0 = log2(L^2 - L), L the --qk-length-percentile of the training pairs' lengths."""
    split = getattr(args, "train_subset", None) or "train"
    pairs = training_pairs(task, split)
    # Only the pairs fairseq-train keeps: it skips those longer than these (trainer.get_train_iterator).
    max_positions = utils.resolve_max_positions(
        task.max_positions(),
        (getattr(args, "max_source_positions", None), getattr(args, "max_target_positions", None)),
        getattr(args, "max_tokens", None),
    )
    kept, skipped = pairs_within(pairs, max_positions)
    if not any(len(src) for src, _ in kept.values()):
        raise QKNormConfigError(
            f"--qk-scale-init auto: every '{split}' pair is longer than the maximum positions {max_positions} "
            "(--max-source-positions, --max-target-positions, --max-tokens)"
        )
    length, g0 = g0_from_pairs(kept, args.qk_length_percentile)
    counts = ", ".join(
        f"{name} {len(kept[name][0])}" + (f" of {len(src)}" if skipped else "") for name, (src, _) in pairs.items()
    )
    if skipped:
        counts += (
            f"; {skipped} longer than the maximum positions {max_positions} are skipped, as fairseq-train skips them"
        )
    logger.info(
        f"qk-norm: L={length} ({args.qk_length_percentile:g}th percentile of the '{split}' pairs' lengths: "
        f"{counts}) g0=log2(L^2-L)={g0:.4f}"
    )
    return g0


AFFINE_NORMS = ("layernorm", "rmsnorm")


def for_the_norm(g0: float, args) -> float:
    """The paper's g0, meant for unit vectors, as g0 for --qk-norm. A LayerNorm or RMSNorm output has
    length sqrt(head_dim) (their gain starts at 1), so its dot products reach head_dim, not 1: g
    starts at g0 / head_dim, which gives the attention logits the l2 norm's initial range. With g0
    itself the softmax would start saturated, one-hot, with its small probabilities in denormal
    floats, which some CPUs compute on many times slower."""
    if args.qk_norm not in AFFINE_NORMS:
        return g0
    head_dim = one_head_dim(args, f"--qk-norm {args.qk_norm} --qk-scale-init auto")
    logger.info(f"qk-norm: {args.qk_norm} outputs have length sqrt({head_dim}): g0/head_dim={g0 / head_dim:.4f}")
    return g0 / head_dim


def head_dims(args) -> set:
    return {
        getattr(args, f"{side}_embed_dim") // getattr(args, f"{side}_attention_heads")
        for side in ("encoder", "decoder")
        if getattr(args, f"{side}_attention_heads", None)
    }


def norm_length2(args):
    """The squared length of a normalized q or k: 1 for the l2 norm, head_dim for LayerNorm and
    RMSNorm (their gain starts at 1); None where their heads differ in size by side."""
    if getattr(args, "qk_norm", "l2") not in AFFINE_NORMS:
        return 1
    dims = head_dims(args)
    return dims.pop() if len(dims) == 1 else None


def one_head_dim(args, flags: str) -> int:
    """The head dimension shared by every attention of the model, or a QKNormConfigError naming FLAGS."""
    dims = head_dims(args)
    if len(dims) != 1:
        raise QKNormConfigError(
            f"{flags}: the encoder and decoder heads differ in size {sorted(dims)}, "
            "so g0 would differ by side; pass --qk-scale-init FLOAT"
        )
    return dims.pop()


def warn_if_beyond_every_length(g0: float, args):
    """Log one line when a numeric --qk-scale-init lies outside what `auto` could give: log2(L^2 - L)
    for a length L from 2 to the longest the model takes, over head_dim for LayerNorm and RMSNorm
    (for_the_norm). g multiplies the normalized dot products: far above, attention starts one-hot
    and training can diverge; below the range, it starts nearly uniform."""
    positions = (getattr(args, k, None) for k in ("max_source_positions", "max_target_positions", "tokens_per_sample"))
    longest = max((p for p in positions if p), default=1024)  # fairseq's default positions
    per = norm_length2(args)
    if per is None:
        return  # no one range: it differs by side
    auto = "log2(L^2-L)/head_dim" if args.qk_norm in AFFINE_NORMS else "log2(L^2-L)"
    low, high = 1.0 / per, g0_for_length(longest) / per
    if not low <= g0 <= high:
        effect = "one-hot (training may diverge)" if g0 > high else "nearly uniform"
        logger.warning(
            f"qk-norm: --qk-scale-init {g0:g} is outside [{low:.4g}, {high:.4g}], the values {auto} of the "
            f"sentence lengths L from 2 to {longest} this model takes: attention starts {effect}"
        )


def dot_product_g0(args) -> float:
    """`auto` without a norm: g starts at fairseq's own factor 1/sqrt(head_dim), so that the model
    starts as stock attention and learns its temperature (log2(L^2 - L) suits unit vectors, whose
    dot products lie in [-1, 1], not raw ones)."""
    head_dim = one_head_dim(args, "--qk-norm none --qk-scale-init auto")
    g0 = head_dim**-0.5
    logger.info(
        f"qk-norm: no norm, g0=1/sqrt(head_dim)=1/sqrt({head_dim})={g0:.4f} (fairseq's scaling, learned from there)"
    )
    return g0


QK_PARAMETERS = (".qk_scale.", ".q_norm.", ".k_norm.")
G0 = ".qk_scale.g0"  # saved beside g; older checkpoints hold g alone (QKScale fills g0 in)


def check_qk_parameters(built, loaded):
    """One line, instead of fairseq's missing / unexpected keys traceback, when the QK-norm
    parameters of a checkpoint (LOADED) and of the model the flags build (BUILT) differ. g0 follows
    its g: a checkpoint with or without it is judged by its g."""

    def qk(keys):
        return [k for k in keys if any(p in k for p in QK_PARAMETERS) and not k.endswith(G0)]

    missing = [k for k in qk(built) if k not in loaded]
    if missing:
        raise QKNormConfigError(
            f"the checkpoint has no QK-norm parameters (e.g. {missing[0]}): it was trained without "
            "QK-norm or with other --qk-norm/--qk-scale flags; load it with the flags it was trained with"
        )
    unexpected = [k for k in qk(loaded) if k not in built]
    if unexpected:
        raise QKNormConfigError(
            f"the checkpoint has QK-norm parameters that these flags do not build (e.g. {unexpected[0]}): it "
            "was trained with other --qk-norm/--qk-scale flags; load it with the flags it was trained with"
        )


def as_namespace(args):
    """The configuration as fairseq's builders read it. fairseq-hydra-train passes a DictConfig, and
    TransformerConfig.from_namespace keeps the extra keys (the plugin's flags) of a Namespace only."""
    if OmegaConf.is_config(args):
        return argparse.Namespace(**OmegaConf.to_container(args, resolve=True))
    return args


class WatchesG:
    """For the plugin's models (listed first among the bases): the watch on a learned g, which
    fairseq's trainer runs before every update through set_num_updates, the one-line refusal of
    a checkpoint whose QK-norm parameters the flags do not build, and the g0 of a loaded g recorded
    in the config that is saved."""

    def load_state_dict(self, state_dict, strict=True, model_cfg=None, args=None):
        if strict:
            check_qk_parameters(self.state_dict(), state_dict)
        built = initial_g(self)
        loaded = super().load_state_dict(state_dict, strict=strict, model_cfg=model_cfg, args=args)
        record_loaded_g0(self, built, model_cfg)
        return loaded

    def set_num_updates(self, num_updates):
        super().set_num_updates(num_updates)
        warn_if_g_not_positive(self, num_updates)


def initial_g(model):
    """The g0 of the model's g (one flag sets them all), or None where it has no g."""
    return next((m.g0.item() for m in model.modules() if isinstance(m, QKScale)), None)


def record_loaded_g0(model, built, cfg):
    """After a checkpoint's state is loaded into MODEL, built with g0 BUILT: fairseq keeps the
    loaded g (--restore-file, a resume, --finetune-from-model), and with it the g0 it started from.
    CFG, the model's config as fairseq saves it in the next checkpoint, then names that g0, not this
    run's --qk-scale-init, so that g - g0 is what training did to g."""
    loaded = initial_g(model)
    if loaded == built or cfg is None:
        return
    logger.info(
        f"qk-norm: the loaded g started from g0={loaded:.4f}, not from this model's --qk-scale-init {built:g}; "
        f"the saved config records g0={loaded:.4f}"
    )
    cfg.qk_scale_init = loaded


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
