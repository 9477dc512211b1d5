"""fairseq-qknorm: Query-Key Normalization (Henry et al., 2020) for fairseq.

Use as `--user-dir $(fairseq-qknorm-user-dir)` with any fairseq command; it registers the model
`transformer_qknorm` and its architectures (see architectures.py).
"""
import os

__version__ = "0.1.0"
USER_DIR = os.path.dirname(os.path.abspath(__file__))

try:
    import fairseq  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"fairseq-qknorm needs fairseq, which failed to import ({e}); install it with "
        "`pip install fairseq-qknorm[fairseq]` or `bash scripts/setup.sh`"
    ) from None

from .atomic_checkpoint_copy import make_checkpoint_copies_atomic  # noqa: E402
from .checkpoint_safety import allow_fairseq_checkpoints  # noqa: E402
from .errors import install_excepthook  # noqa: E402

allow_fairseq_checkpoints()
make_checkpoint_copies_atomic()
install_excepthook()

from . import architectures, cpu_bf16, transformer_qknorm  # noqa: E402,F401
