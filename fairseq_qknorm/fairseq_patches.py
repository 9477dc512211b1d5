"""Every change the plugin makes to fairseq's own behaviour, in one place. `install()` runs once,
when the plugin is imported (which `--user-dir` does); each patch is narrow and says why.
docs/what-importing-changes.md tells users what they change, and tests/plugin/test_import.py fails
when importing the plugin changes anything that page does not list.

1. Checkpoint loading: fairseq's checkpoint loaders always load with torch's safe unpickler
   (weights_only=True), whatever this fairseq passes; the few non-tensor classes a fairseq
   checkpoint holds are allow-listed, and only they. FAIRSEQ_QKNORM_TRUSTED_CHECKPOINT names files
   that may be loaded with the full unpickler instead.
2. Checkpoint copies: written to a temporary name and renamed, so a kill during the copy never
   leaves a truncated checkpoint under a final name.
3. `--bf16`: fairseq reads it as a TPU run; with --cpu, or without torch_xla, the TPU flag is
   cleared, so fairseq's own bf16 training runs on the CPU or the GPU.
4. Errors: the plugin's configuration errors and a refused checkpoint end the command with one
   line, not a traceback through fairseq (errors.one_line says which).
5. numpy 2: fairseq's TokenBlockDataset (--task language_modeling --sample-break-mode eos) uses
   `np.compat.long`, which numpy 2 removed; that module alone sees numpy with `compat` put back.
6. `--fp16` on the CPU, for testing: the two CUDA-only calls on fairseq's fp16 path (the flat fp32
   copy's device, the zero gradient norm of a skipped update) stay on the CPU while a CPU trainer
   builds its optimizer and takes a step; fairseq's FP16Optimizer, MemoryEfficientFP16Optimizer
   and loss scaler run unchanged. A GPU run never sees it.
7. fp16's divergence error kept: after "Minimum loss scale reached", fairseq re-runs the update
   under its NaN detector, whose backward hooks make torch raise StopIteration on the transformer
   encoder (its output is a dict without a tensor at the top); that StopIteration replaced
   fairseq's message. The message is raised again, after a warning naming what the re-run raised.
8. Validation scores for LR schedulers: fairseq-train gives a scheduler one score per epoch and no
   way to end training; a scheduler with `step_validation` (paper_lr_schedulers.py) gets every
   validation's score and may end training. Installed by those schedulers when built, not here.
9. fairseq's `reduce_lr_on_plateau`, resumed: its checkpoint keeps its count of validations without
   improvement, and a run resumed from an epoch's end takes the scheduler step of that epoch's
   validation, which fairseq-train takes after saving the checkpoint; so a resumed run decays when
   the same run uninterrupted would have.
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


class _ModuleView(types.ModuleType):
    """A module as one fairseq module sees it under its global name: the real module with a few
    attributes replaced. The module itself, and every other module using it, are left as they are."""

    def __init__(self, module, **replaced):
        super().__init__(module.__name__)
        self.__dict__.update(replaced)
        self._module = module

    def __getattr__(self, name):  # only for names not replaced
        return getattr(self._module, name)


# ------------------------------------------------------------------ 1. checkpoint loading
def _numpy_globals():
    # numpy arrays in checkpoints come from --eval-bleu's statistics (int64; float64 after a
    # distributed run sums them over ranks); numpy 1 pickles the reconstructor as
    # numpy.core.multiarray, numpy 2 as numpy._core.multiarray.
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy 1
        from numpy.core.multiarray import _reconstruct
    found = [
        (_reconstruct, "numpy.core.multiarray._reconstruct"),
        (_reconstruct, "numpy._core.multiarray._reconstruct"),
        np.ndarray,
        np.dtype,
    ]
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

    return [
        DictConfig,
        ListConfig,
        ContainerMetadata,
        Metadata,
        AnyNode,
        typing.Any,
        dict,
        list,
        int,
        collections.defaultdict,
        _TensorPlaceholder,
    ]


def fairseq_checkpoint_globals():
    """The non-tensor classes fairseq checkpoints hold: what torch's safe loader may build."""
    return [argparse.Namespace] + _numpy_globals() + _distributed_resume_globals()


def allow_fairseq_checkpoints():
    torch.serialization.add_safe_globals(fairseq_checkpoint_globals())


TRUSTED_CHECKPOINT_VARIABLE = "FAIRSEQ_QKNORM_TRUSTED_CHECKPOINT"


def trusted_checkpoints():
    """The files named in FAIRSEQ_QKNORM_TRUSTED_CHECKPOINT (several: separated by os.pathsep)."""
    names = os.environ.get(TRUSTED_CHECKPOINT_VARIABLE, "").split(os.pathsep)
    return {os.path.realpath(name) for name in names if name}


def load_checkpoint_safely(f, map_location=None, weights_only=None, **kwargs):
    """torch.load as fairseq's checkpoint loaders see it: weights_only=True whatever they pass
    (upstream fairseq main passes weights_only=False, under which no allow-list applies). Only a
    file the user named as trusted is loaded with the full unpickler, and the log says so."""
    path = f if isinstance(f, (str, os.PathLike)) else getattr(f, "name", None)  # fairseq passes open files
    if isinstance(path, (str, os.PathLike)) and os.path.realpath(path) in trusted_checkpoints():
        logger.warning(
            f"loading {path} with torch's full unpickler ({TRUSTED_CHECKPOINT_VARIABLE}): "
            "it can run any code it holds; trust only a file whose origin you know"
        )
        return torch.load(f, map_location=map_location, weights_only=False, **kwargs)
    return torch.load(f, map_location=map_location, weights_only=True, **kwargs)


def _fairseq_average_checkpoints():
    # fairseq's scripts/average_checkpoints.py is in no fairseq wheel; in a source checkout it is
    # importable as scripts.average_checkpoints. Only a `scripts` folder beside the fairseq package
    # in use counts (find_spec finds a top-level package without importing it).
    import importlib.util

    import fairseq

    spec = importlib.util.find_spec("scripts")
    fairseq_dir = os.path.realpath(os.path.dirname(fairseq.__file__))
    for location in (spec.submodule_search_locations or []) if spec else []:
        beside_fairseq = os.path.realpath(os.path.join(location, os.pardir, "fairseq")) == fairseq_dir
        if beside_fairseq and os.path.isfile(os.path.join(location, "average_checkpoints.py")):
            return importlib.import_module("scripts.average_checkpoints")
    return None


def load_checkpoints_safely():
    # Every checkpoint fairseq reads goes through checkpoint_utils (load_checkpoint_to_cpu:
    # fairseq-train's resume, fairseq-generate, fairseq-interactive, hub from_pretrained;
    # load_ema_from_checkpoint), or through the averaging script of a source checkout. Their global
    # `torch` is replaced, so their torch.load calls, whatever arguments they pass, reach
    # load_checkpoint_safely.
    from fairseq import checkpoint_utils

    for module in (checkpoint_utils, _fairseq_average_checkpoints()):
        if module is not None and module.torch is torch:
            module.torch = _ModuleView(torch, load=load_checkpoint_safely)


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


# ------------------------------------------------------------------ 3. --bf16 without a TPU
def allow_bf16_without_tpu():
    # fairseq 0.12's options.py sets --tpu whenever --bf16 is given, and on a machine without
    # torch_xla fairseq-train then dies looking for an XLA device. With --cpu, or where torch_xla is
    # not installed, there is no TPU to mean: the flag is cleared and fairseq's own bf16 training
    # (model in bfloat16, float32 master weights) runs on the CPU or the GPU.
    import importlib.util

    from fairseq.distributed import utils as distributed_utils

    fairseq_call_main = distributed_utils.call_main

    def call_main(cfg, main, **kwargs):
        common = cfg.common
        if common.bf16 and common.tpu and (common.cpu or importlib.util.find_spec("torch_xla") is None):
            common.tpu = False
            where = "the CPU" if common.cpu else "CUDA"
            logger.info(f"--bf16: bfloat16 on {where} (fairseq reads --bf16 as --tpu; not a TPU run)")
        return fairseq_call_main(cfg, main, **kwargs)

    distributed_utils.call_main = call_main


# ------------------------------------------------------------------ 4. errors
def install_excepthook():
    if sys.excepthook is not excepthook:
        sys.excepthook = excepthook


# ------------------------------------------------------------------ 5. numpy 2 and np.compat
def give_token_blocks_np_compat():
    # token_block_dataset.py builds its eos-mode index with np.zeros(..., dtype=np.compat.long): under
    # numpy 2 every `--sample-break-mode eos` run stopped there with an AttributeError. Only that
    # module's global `np` is replaced; numpy itself, and every other module, are left as they are.
    from fairseq.data import token_block_dataset

    if not hasattr(np, "compat") and token_block_dataset.np is np:
        # numpy 1 defined np.compat.long as int
        token_block_dataset.np = _ModuleView(np, compat=types.SimpleNamespace(long=int))


def install():
    global _installed
    if _installed:
        return
    allow_fairseq_checkpoints()
    load_checkpoints_safely()
    make_checkpoint_copies_atomic()
    allow_bf16_without_tpu()
    install_excepthook()
    give_token_blocks_np_compat()
    allow_fp16_on_cpu()
    keep_fp16_divergence_error()
    resume_reduce_lr_on_plateau()
    _installed = True


# ------------------------------------------------------------------ 6. --fp16 on the CPU
FP16_ON_CPU_NOTE = (
    "--fp16 on the CPU: fairseq's fp16 training (fp16 model, dynamic loss scaling) runs, for testing; "
    "it is several times slower than fp32 on a CPU"
)


def _tensor_kept_on_cpu(*args, **kwargs):
    # Trainer.train_step, after a gradient overflow: `grad_norm = torch.tensor(0.0).cuda()`.
    t = torch.tensor(*args, **kwargs)
    t.cuda = lambda *a, **k: t  # this one tensor only
    return t


def allow_fp16_on_cpu():
    # fairseq 0.12's fp16 path assumes CUDA in two places, and `--cpu --fp16` stopped there:
    # FP16Optimizer.build_fp32_params keys its flat fp32 copy by torch.cuda.current_device() (and
    # later looks the fp16 params up by p.device.index, which is None on the CPU); Trainer.train_step
    # moves the zero gradient norm of a skipped (overflowed) update to CUDA. While a CPU trainer
    # with --fp16 builds its optimizer or takes a step, those two modules see a torch whose
    # current_device is the CPU's index (None) and whose tensor(...).cuda() stays on the CPU;
    # everything else, and every GPU or bf16 run, is left as fairseq has it.
    from fairseq import trainer as trainer_module
    from fairseq.optim import fp16_optimizer

    cpu_views = {
        fp16_optimizer: _ModuleView(torch, cuda=_ModuleView(torch.cuda, current_device=lambda: None)),
        trainer_module: _ModuleView(torch, tensor=_tensor_kept_on_cpu),
    }
    Trainer = trainer_module.Trainer
    fairseq_build_optimizer, fairseq_train_step = Trainer._build_optimizer, Trainer.train_step

    def on_cpu(method):
        def wrapped(self, *args, **kwargs):
            if not (self.cfg.common.fp16 and self.device.type == "cpu"):
                return method(self, *args, **kwargs)
            swapped = [m for m in cpu_views if m.torch is torch]  # not already inside another call
            for m in swapped:
                m.torch = cpu_views[m]
            try:
                return method(self, *args, **kwargs)
            finally:
                for m in swapped:
                    m.torch = torch

        return wrapped

    def build_optimizer(self):
        if self.cfg.common.fp16 and self.device.type == "cpu" and not getattr(self, "_fp16_on_cpu_noted", False):
            logger.info(FP16_ON_CPU_NOTE)
            self._fp16_on_cpu_noted = True
        return on_cpu(fairseq_build_optimizer)(self)

    Trainer._build_optimizer = build_optimizer
    Trainer.train_step = on_cpu(fairseq_train_step)


# ------------------------------------------------------------------ 7. fp16's divergence error kept
def keep_fp16_divergence_error():
    # Trainer.train_step: `except FloatingPointError: ... with NanDetector(model): <the update
    # again>; raise`. With torch 2, a module's non-full backward hook needs a tensor in its output;
    # NanDetector hooks every module, and the encoder returns a dict of lists, so the re-run raises
    # StopIteration, which replaces the FloatingPointError users look up (on a GPU as on the CPU).
    from fairseq import trainer as trainer_module

    fairseq_train_step = trainer_module.Trainer.train_step

    def train_step(self, *args, **kwargs):
        try:
            return fairseq_train_step(self, *args, **kwargs)
        except Exception as e:
            if isinstance(e, FloatingPointError) or not isinstance(e.__context__, FloatingPointError):
                raise
            logger.warning(
                "fairseq's NaN detector could not re-run the failed update (%s: %s); the error it was re-run for:",
                type(e).__name__,
                e,
            )
            raise e.__context__ from None

    trainer_module.Trainer.train_step = train_step


# ------------------------------------------------------------------ 8. validation scores for LR schedulers
def _fairseq_train_modules():
    # fairseq-train runs fairseq_cli.train; `python -m fairseq_cli.train` runs a copy as __main__.
    import fairseq_cli.train

    yield fairseq_cli.train
    main = sys.modules.get("__main__")
    if main is not fairseq_cli.train and getattr(getattr(main, "__spec__", None), "name", None) == "fairseq_cli.train":
        yield main


def give_validation_scores_to_lr_scheduler():
    # fairseq-train steps its LR scheduler at an epoch's end with the epoch's last validation score,
    # and only its own stop conditions end training. The paper code decays and may stop after every
    # validation, which with --validate-interval-updates is several times an epoch. So the scheduler
    # of a validation's trainer, when it has `step_validation(score)`, gets the score (the first
    # --valid-subset's --best-checkpoint-metric) as soon as fairseq has it, before the checkpoint of
    # that validation is saved, and fairseq's should_stop_early, called next, also stops when the
    # scheduler's `should_stop()` says so. Every rank sees the same score (fairseq reduces the
    # metrics over ranks), so every rank decays and stops alike. Other schedulers see no change.
    for module in _fairseq_train_modules():
        if not getattr(module, "_qknorm_scores_to_lr_scheduler", False):
            _scores_to_lr_scheduler(module)
            module._qknorm_scores_to_lr_scheduler = True


def _scores_to_lr_scheduler(train):
    fairseq_validate = train.validate
    fairseq_should_stop_early = train.should_stop_early
    scored = []  # the scheduler that got the last validation's score, until should_stop_early asks it

    def validate(cfg, trainer, task, epoch_itr, subsets, *args, **kwargs):
        valid_losses = fairseq_validate(cfg, trainer, task, epoch_itr, subsets, *args, **kwargs)
        scheduler = trainer.lr_scheduler
        if hasattr(scheduler, "step_validation") and valid_losses and valid_losses[0] is not None:
            scheduler.step_validation(valid_losses[0])
            scored[:] = [scheduler]
        return valid_losses

    def should_stop_early(cfg, valid_loss):
        # fairseq's own keeps its state on `train.should_stop_early`, this function now: it still works
        stop = fairseq_should_stop_early(cfg, valid_loss)
        if scored and valid_loss is not None:
            stop = scored.pop().should_stop() or stop
        return stop

    train.validate = validate
    train.should_stop_early = should_stop_early


# ------------------------------------------------------------------ 9. reduce_lr_on_plateau, resumed
# torch's ReduceLROnPlateau keeps these besides the best score, which is all fairseq saves
PLATEAU_COUNTERS = ("num_bad_epochs", "cooldown_counter")


def resume_reduce_lr_on_plateau():
    # fairseq-train saves an epoch's checkpoint, then steps reduce_lr_on_plateau with that epoch's
    # score. The checkpoint kept the best score but not the count of validations without
    # improvement, and a run resumed from it never took that last step: each resume forgot up to
    # --lr-patience bad validations and the last one. Measured on fairseq-train with patience 1 and
    # a validation that never improves: resumed after epoch 3, the run decayed after epochs 5 and 7
    # where the same run uninterrupted decayed after 4 and 6. Now the counts are saved beside the
    # best score (a checkpoint without them resumes with fairseq's zero), and a run resumed from an
    # epoch's end takes the missed step with the score the checkpoint kept (fairseq's `val_loss`:
    # the --best-checkpoint-metric the step would have had).
    from fairseq import trainer as trainer_module
    from fairseq.optim.lr_scheduler.reduce_lr_on_plateau import ReduceLROnPlateauLRSchedule

    fairseq_state_dict = ReduceLROnPlateauLRSchedule.state_dict
    fairseq_load_state_dict = ReduceLROnPlateauLRSchedule.load_state_dict
    fairseq_load_checkpoint = trainer_module.Trainer.load_checkpoint

    def state_dict(self):
        return {**fairseq_state_dict(self), **{k: getattr(self.lr_scheduler, k) for k in PLATEAU_COUNTERS}}

    def load_state_dict(self, state_dict):
        fairseq_load_state_dict(self, state_dict)
        for k in PLATEAU_COUNTERS:
            if k in state_dict:
                setattr(self.lr_scheduler, k, state_dict[k])

    def load_checkpoint(self, filename, reset_optimizer=False, reset_lr_scheduler=False, *args, **kwargs):
        extra_state = fairseq_load_checkpoint(self, filename, reset_optimizer, reset_lr_scheduler, *args, **kwargs)
        extra = extra_state or {}
        itr, score = extra.get("train_iterator") or {}, extra.get("val_loss")
        at_epoch_end = itr.get("version", 1) >= 2 and itr.get("iterations_in_epoch") == 0
        # the cheap checks first: self.lr_scheduler builds the optimizer when there is none yet
        if (
            score is not None
            and at_epoch_end
            and not (reset_optimizer or reset_lr_scheduler)
            and isinstance(self.lr_scheduler, ReduceLROnPlateauLRSchedule)
        ):
            bad = self.lr_scheduler.lr_scheduler.num_bad_epochs
            if "num_bad_epochs" in (self._optim_history[-1].get("lr_scheduler_state") or {}):
                count = f"{bad} validation(s) without improvement"
            else:
                count = (
                    "its count of validations without improvement is not in this checkpoint "
                    "(saved without the plugin): 0"
                )
            self.lr_step(itr["epoch"] - 1, score)  # the state dict says "epoch" E + 1 after epoch E
            logger.info(
                f"reduce_lr_on_plateau resumed: {count} before the checkpoint's, whose score ({float(score):g}) "
                f"it now takes; lr {self.get_lr():g}"
            )
        return extra_state

    ReduceLROnPlateauLRSchedule.state_dict = state_dict
    ReduceLROnPlateauLRSchedule.load_state_dict = load_state_dict
    trainer_module.Trainer.load_checkpoint = load_checkpoint
