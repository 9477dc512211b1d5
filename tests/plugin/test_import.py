"""Importing the plugin from a Python program changes exactly what docs/what-importing-changes.md
lists: in a fresh process, every attribute of every module already imported, and of every class
such a module defines, is compared before and after `import fairseq_qknorm`."""

import json
import sys

import numpy as np
from conftest import run
from test_safe_loading import FAIRSEQ_CHECKPOINT_GLOBALS

# The modules the plugin imports are imported first, as a program using fairseq has them, so that
# what they do when first imported is not counted. (A module the plugin starts to import must be
# added here; otherwise its own import shows up below as a change.)
PROBE = """
import json, logging, os, sys, types, warnings

import numpy as np

import torch
import fairseq.checkpoint_utils, fairseq.data.data_utils, fairseq.data.token_block_dataset
import fairseq.dataclass.utils, fairseq.distributed.utils, fairseq.file_io, fairseq.utils
import fairseq.models.transformer, fairseq.models.transformer_lm, fairseq.modules
import fairseq.modules.checkpoint_activations, fairseq.modules.transformer_layer
import fairseq.optim.fp16_optimizer, fairseq.optim.lr_scheduler, fairseq.trainer
import omegaconf.base, omegaconf.nodes
from fairseq.models import ARCH_MODEL_REGISTRY, MODEL_REGISTRY
from fairseq.optim.lr_scheduler import LR_SCHEDULER_REGISTRY


def attributes():
    found = {}
    for name, module in list(sys.modules.items()):
        if isinstance(module, types.ModuleType) and name not in ("__main__", "__mp_main__"):
            for attr, value in list(vars(module).items()):
                found[name, attr] = value
                if isinstance(value, type) and value.__module__ == name:  # and the classes it defines
                    for class_attr, class_value in list(vars(value).items()):
                        found[name, f"{attr}.{class_attr}"] = class_value
    return found


def settings():
    # what a module can change in place, without rebinding any attribute
    loggers = logging.Logger.manager.loggerDict
    return dict(
        warnings=[repr(f) for f in warnings.filters],
        root_logger=[logging.root.level, *map(repr, logging.root.handlers)],
        logger_levels={name: getattr(logger, "level", None) for name, logger in loggers.items()},
        environ=dict(os.environ),
        sys_path=list(sys.path),
        meta_path=[repr(finder) for finder in sys.meta_path],
        torch=[torch.get_num_threads(), str(torch.get_default_dtype()), torch.is_grad_enabled()],
        numpy=[np.geterr(), repr(np.get_printoptions())],
    )


def safe_globals():  # by the names pickles give them: a class or function, or (object, name)
    return {g[1] if isinstance(g, tuple) else f"{g.__module__}.{g.__qualname__}" for g in torch.serialization.get_safe_globals()}


settings_before = settings()
before, safe_before = attributes(), safe_globals()
registries = dict(models=MODEL_REGISTRY, archs=ARCH_MODEL_REGISTRY, lr_schedulers=LR_SCHEDULER_REGISTRY)
registered_before = {name: set(registry) for name, registry in registries.items()}
import fairseq_qknorm

changed = sorted(
    f"{name}.{attr}"
    for (name, attr), value in attributes().items()
    if not name.startswith("fairseq_qknorm")
    # a value replaced, or a new attribute other than a newly imported submodule
    and (before[name, attr] is not value if (name, attr) in before else not isinstance(value, types.ModuleType))
)
settings_after = settings()
for name, logger in list(settings_after["logger_levels"].items()):  # the plugin's own loggers are new
    if name.startswith("fairseq_qknorm"):
        del settings_after["logger_levels"][name]
print(json.dumps(dict(
    changed=changed,
    settings_changed=sorted(k for k in settings_before if settings_before[k] != settings_after[k]),
    safe_globals_added=sorted(safe_globals() - safe_before),
    **{name: sorted(set(registry) - registered_before[name]) for name, registry in registries.items()},
)))
"""


def test_importing_the_plugin_changes_only_what_the_docs_list(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    result = json.loads(run([sys.executable, probe]).stdout.strip().splitlines()[-1])
    numbered = [
        "fairseq.checkpoint_utils.torch",  # 3. safe loading
        "fairseq.file_io.PathManager.copy",  # 4. atomic checkpoint copies
        "fairseq.distributed.utils.call_main",  # 5. --bf16 without a TPU
        "fairseq.distributed_utils.call_main",  # (fairseq's other name of the same module)
        "sys.excepthook",  # 6. one-line errors
        "torch._weights_only_unpickler._marked_safe_globals_set",  # 2. torch's allow-list
        "fairseq.trainer.Trainer._build_optimizer",  # 8. --fp16 on the CPU
        "fairseq.trainer.Trainer.train_step",  # 8., and 9. fp16's divergence error kept
        "fairseq.trainer.Trainer.load_checkpoint",  # 10. reduce_lr_on_plateau resumed
        "fairseq.optim.lr_scheduler.reduce_lr_on_plateau.ReduceLROnPlateauLRSchedule.state_dict",  # 10.
        "fairseq.optim.lr_scheduler.reduce_lr_on_plateau.ReduceLROnPlateauLRSchedule.load_state_dict",  # 10.
    ]
    if not hasattr(np, "compat"):
        numbered.append("fairseq.data.token_block_dataset.np")  # 7. numpy 2
    assert result["changed"] == sorted(numbered)
    assert result["settings_changed"] == []  # warnings, logging, environment, sys.path, torch, numpy
    assert set(result["safe_globals_added"]) == FAIRSEQ_CHECKPOINT_GLOBALS  # 2.
    assert result["models"] == ["transformer_lm_qknorm", "transformer_qknorm"]  # 1.
    assert {"transformer_qknorm_paper", "transformer_lm_qknorm_gpt"} <= set(result["archs"])
    assert result["lr_schedulers"] == ["paper_constant", "paper_warmup_flat"]
