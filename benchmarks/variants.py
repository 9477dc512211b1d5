"""The QK-norm variants the benchmark compares, by arm name. Plain Python: the runner checks its
flags before it imports torch and fairseq (tests/experiments/test_benchmark.py checks these against the plugin's
own lists of norms and scales)."""

import itertools

NORMS = ("l2", "layernorm", "rmsnorm")  # --qk-norm, without "none" (no QK-norm)
SCALES = ("learned", "fixed", "none")  # --qk-scale


def qk_variants():
    """arm -> flags of every QK-norm the flags allow: g learned / fixed / none (1/sqrt(d)), g per
    module or per head. `qknorm` is the paper's: l2, one learned g per module."""
    out = {}
    for norm, scale, per_head in itertools.product(NORMS, SCALES, (False, True)):
        if scale == "none" and per_head:
            continue  # no g to have per head
        name = (
            "qknorm"
            if (norm, scale, per_head) == ("l2", "learned", False)
            else f"qknorm_{norm}_{scale}{'_perhead' if per_head else ''}"
        )
        out[name] = {"qk_norm": norm, "qk_scale": scale, "qk_scale_per_head": per_head}
    return out


QK_VARIANTS = qk_variants()
