"""`--cpu --bf16`: bfloat16 training on the CPU.

fairseq 0.12 reads --bf16 as a TPU run (options.py sets --tpu whenever --bf16 is given), so on a
machine without torch_xla fairseq-train dies looking for an XLA device. With --cpu there is no TPU
to mean, so the flag is cleared before training starts; fairseq's own bf16 path (the model cast to
bfloat16, float32 master weights in its FP16Optimizer, batches cast) then runs as it is.
Only that combination of flags is touched.
"""
import logging

from fairseq.distributed import utils as distributed_utils

logger = logging.getLogger(__name__)
_fairseq_call_main = distributed_utils.call_main


def call_main(cfg, main, **kwargs):
    common = cfg.common
    if common.cpu and common.bf16 and common.tpu:
        common.tpu = False
        logger.info("--cpu --bf16: bfloat16 on the CPU (fairseq reads --bf16 as --tpu; not a TPU run)")
    return _fairseq_call_main(cfg, main, **kwargs)


distributed_utils.call_main = call_main
