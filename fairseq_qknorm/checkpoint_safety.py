"""Let fairseq checkpoints load under torch >= 2.6, whose torch.load defaults to weights_only=True.

fairseq's load_checkpoint_to_cpu calls torch.load without weights_only, so the safe unpickler
refuses the few non-tensor objects a fairseq checkpoint holds. They are allow-listed here, and only
they: weights_only stays on, and any other pickled object (a __reduce__ that runs code, say) is
still refused, with torch's message naming its class.
"""
import argparse
import collections
import typing

import numpy as np
import torch


def _numpy_globals():
    # numpy arrays in checkpoints come from --eval-bleu's statistics (int64; float64 after a
    # distributed run sums them over ranks); numpy 1 pickles the reconstructor as
    # numpy.core.multiarray, numpy 2 as numpy._core.multiarray.
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy 1
        from numpy.core.multiarray import _reconstruct
    names = ["numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct"]
    found = [(_reconstruct, name) for name in names]
    found += [np.ndarray, np.dtype]
    if hasattr(np, "dtypes"):
        found += [np.dtypes.Int64DType, np.dtypes.Float64DType]
    return found


def _distributed_resume_globals():
    # With several processes, rank 0 reads the checkpoint and broadcasts it, pickling the
    # omegaconf config and fairseq's tensor placeholders; the other ranks unpickle them safely.
    from fairseq.distributed.utils import _TensorPlaceholder
    from omegaconf import DictConfig, ListConfig
    from omegaconf.base import ContainerMetadata, Metadata
    from omegaconf.nodes import AnyNode

    return [DictConfig, ListConfig, ContainerMetadata, Metadata, AnyNode, typing.Any, dict, list, int,
            collections.defaultdict, _TensorPlaceholder]


def allow_fairseq_checkpoints() -> None:
    if hasattr(torch.serialization, "add_safe_globals"):
        torch.serialization.add_safe_globals(
            [argparse.Namespace] + _numpy_globals() + _distributed_resume_globals()
        )
