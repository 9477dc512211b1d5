"""fairseq-qknorm: Query-Key Normalization (Henry et al., 2020) for fairseq.

Use as `--user-dir $(fairseq-qknorm-user-dir)` with any fairseq command; it registers the model
`transformer_qknorm` and its architectures (see architectures.py), and the language model
`transformer_lm_qknorm` and its architectures (see transformer_lm_qknorm.py), and the learning-rate
schedulers of the paper's own code, `paper_warmup_flat` and `paper_constant` (paper_lr_schedulers.py).
Importing it changes what docs/what-importing-changes.md lists, and nothing else (fairseq_patches.py).
"""

import os

__version__ = "0.1.3"
USER_DIR = os.path.dirname(os.path.abspath(__file__))

try:
    import fairseq  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"fairseq-qknorm needs fairseq, which failed to import ({e}); install it with "
        "`bash scripts/setup.sh`, or by the pip route in README.md (torch first, then "
        "`pip install --no-deps ve-fairseq==0.12.3`)"
    ) from None

from . import fairseq_patches  # noqa: E402

fairseq_patches.install()

from . import architectures, paper_lr_schedulers, transformer_lm_qknorm, transformer_qknorm  # noqa: E402,F401
