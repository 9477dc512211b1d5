"""Every change the plugin makes to fairseq's own behaviour, in one place. `install()` runs once,
when the plugin is imported (which `--user-dir` does); each patch is narrow and says why.

1. Checkpoint loading: torch >= 2.6 loads with weights_only=True; the few non-tensor classes a
   fairseq checkpoint holds are allow-listed, and only they.
2. Checkpoint copies: written to a temporary name and renamed, so a kill during the copy never
   leaves a truncated checkpoint under a final name.
3. `--cpu --bf16`: fairseq reads --bf16 as a TPU run; with --cpu the TPU flag is cleared, so
   fairseq's own bf16 training runs on the CPU.
4. Errors: the plugin's configuration errors and a refused checkpoint end the command with one
   line, not a traceback through fairseq (errors.one_line says which).
5. numpy 2: fairseq's TokenBlockDataset (--task language_modeling --sample-break-mode eos) uses
   `np.compat.long`, which numpy 2 removed; that module alone sees numpy with `compat` put back.
"""
import argparse
import collections
import logging
import os
import sys
import types
import typing

import numpy as np
import torch

from .errors import excepthook

logger = logging.getLogger(__name__)
_installed = False


# ------------------------------------------------------------------ 1. checkpoint loading
def _numpy_globals():
    # numpy arrays in checkpoints come from --eval-bleu's statistics (int64; float64 after a
    # distributed run sums them over ranks); numpy 1 pickles the reconstructor as
    # numpy.core.multiarray, numpy 2 as numpy._core.multiarray.
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy 1
        from numpy.core.multiarray import _reconstruct
    found = [(_reconstruct, "numpy.core.multiarray._reconstruct"), (_reconstruct, "numpy._core.multiarray._reconstruct"),
             np.ndarray, np.dtype]
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


def fairseq_checkpoint_globals():
    """The non-tensor classes fairseq checkpoints hold: what torch's safe loader may build."""
    return [argparse.Namespace] + _numpy_globals() + _distributed_resume_globals()


def allow_fairseq_checkpoints():
    if hasattr(torch.serialization, "add_safe_globals"):
        torch.serialization.add_safe_globals(fairseq_checkpoint_globals())


# ------------------------------------------------------------------ 2. checkpoint copies
def make_checkpoint_copies_atomic():
    # fairseq's save_checkpoint writes the first file of a save atomically (NAME.pt.tmp, then a
    # rename) but copies it to its other names in place (checkpoint_best.pt to checkpoint_last.pt):
    # killed during that copy, training left a truncated checkpoint_last.pt that every rerun then
    # failed to resume from.
    from fairseq.file_io import PathManager

    fairseq_copy = PathManager.copy

    def atomic_copy(src_path, dst_path, overwrite=False):
        if not PathManager.supports_rename(dst_path):  # a remote path (iopath): as fairseq does
            return fairseq_copy(src_path, dst_path, overwrite=overwrite)
        copied = fairseq_copy(src_path, dst_path + ".tmp", overwrite=True)
        os.replace(dst_path + ".tmp", dst_path)
        return copied

    PathManager.copy = staticmethod(atomic_copy)


# ------------------------------------------------------------------ 3. --cpu --bf16
def allow_cpu_bf16():
    # fairseq 0.12's options.py sets --tpu whenever --bf16 is given, and on a machine without
    # torch_xla fairseq-train then dies looking for an XLA device. Only --cpu --bf16 is touched.
    from fairseq.distributed import utils as distributed_utils

    fairseq_call_main = distributed_utils.call_main

    def call_main(cfg, main, **kwargs):
        common = cfg.common
        if common.cpu and common.bf16 and common.tpu:
            common.tpu = False
            logger.info("--cpu --bf16: bfloat16 on the CPU (fairseq reads --bf16 as --tpu; not a TPU run)")
        return fairseq_call_main(cfg, main, **kwargs)

    distributed_utils.call_main = call_main


# ------------------------------------------------------------------ 4. errors
def install_excepthook():
    if sys.excepthook is not excepthook:
        sys.excepthook = excepthook


# ------------------------------------------------------------------ 5. numpy 2 and np.compat
class _NumpyWithCompat(types.ModuleType):
    """numpy, plus the `np.compat.long` that numpy 1 defined as `int` (numpy 2 has no np.compat)."""

    compat = types.SimpleNamespace(long=int)

    def __getattr__(self, name):
        return getattr(np, name)


def give_token_blocks_np_compat():
    # token_block_dataset.py builds its eos-mode index with np.zeros(..., dtype=np.compat.long): under
    # numpy 2 every `--sample-break-mode eos` run stopped there with an AttributeError. Only that
    # module's global `np` is replaced; numpy itself, and every other module, are left as they are.
    from fairseq.data import token_block_dataset

    if not hasattr(np, "compat") and token_block_dataset.np is np:
        token_block_dataset.np = _NumpyWithCompat("numpy")


def install():
    global _installed
    if _installed:
        return
    allow_fairseq_checkpoints()
    make_checkpoint_copies_atomic()
    allow_cpu_bf16()
    install_excepthook()
    give_token_blocks_np_compat()
    _installed = True
