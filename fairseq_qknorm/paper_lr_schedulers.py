"""The learning-rate schedules of the paper's own code (CyndxAI/QKNorm, `controller.py`), as fairseq
LR schedulers (`--lr-scheduler NAME`):

    paper_warmup_flat  its QKNorm system's schedule (`UPFLAT_WU`): linear warm-up over
                       --warmup-updates to --lr, then flat. The paper code's peak is
                       d^-0.5 * warmup^-0.5 (4.94e-4 at d = 512 and 8,000 updates): pass it as --lr.
    paper_constant     its ScaleNorm baseline's (`NO_WU`): --lr (3e-4) from the first update.

Both decay and stop as the paper code does, after every validation:
- decay: the rate is multiplied by --lr-shrink (0.8) when the validation's score is worse than each
  of the --lr-patience (3) scores before it (below their minimum, for BLEU); never during warm-up;
- stop: training ends at the validation where the rate is below --stop-lr (after warm-up).
The score is fairseq's --best-checkpoint-metric: dev BLEU with `--eval-bleu --best-checkpoint-metric
bleu --maximize-best-checkpoint-metric` (the paper code decays on dev BLEU). The paper code's
"epoch" is a fixed number of updates followed by a validation: `--validate-interval-updates N`
without validations at fairseq's epoch ends; its epoch cap is `--max-update` (epochs x N).

fairseq gives a scheduler only the last score of each of its own epochs, and a scheduler cannot end
training: section 8 of fairseq_patches.py hands these schedulers every validation's score, before
that validation's checkpoint is saved (a resumed run keeps its history), and their stop.
"""

import logging
from dataclasses import dataclass, field
from typing import List

from fairseq.dataclass import FairseqDataclass
from fairseq.optim.lr_scheduler import FairseqLRScheduler, register_lr_scheduler
from omegaconf import II

from . import fairseq_patches
from .errors import QKNormConfigError

logger = logging.getLogger(__name__)


@dataclass
class PaperConstantConfig(FairseqDataclass):
    lr_shrink: float = field(
        default=0.8, metadata={"help": "multiply the rate by this at each decay (the paper code's lr_decay)"}
    )
    lr_patience: int = field(
        default=3,
        metadata={
            "help": "decay when a validation's score is worse than each of the N validations' before it "
            "(the paper code's patience)"
        },
    )
    stop_lr: float = field(
        default=5e-5,
        metadata={
            "help": "stop training at the validation where the rate is below this, after warm-up (the paper "
            "code's stop_lr); fairseq's --stop-min-lr is not used with this scheduler"
        },
    )
    lr: List[float] = II("optimization.lr")
    stop_min_lr: float = II("optimization.stop_min_lr")
    maximize_best_checkpoint_metric: bool = II("checkpoint.maximize_best_checkpoint_metric")


@dataclass
class PaperWarmupFlatConfig(PaperConstantConfig):
    warmup_updates: int = field(
        default=8000, metadata={"help": "rise linearly to --lr over the first N updates, then stay there"}
    )


@register_lr_scheduler("paper_constant", dataclass=PaperConstantConfig)
class PaperConstantSchedule(FairseqLRScheduler):
    """--lr from the first update, with the paper code's decay and stop (module docstring)."""

    name = "paper_constant"

    def __init__(self, cfg, optimizer):
        super().__init__(cfg, optimizer)
        flag = f"--lr-scheduler {self.name}"
        if len(cfg.lr) != 1:
            raise QKNormConfigError(f"{flag}: expected one --lr, got {list(cfg.lr)}")
        if not 0 < cfg.lr_shrink < 1:
            raise QKNormConfigError(f"{flag}: --lr-shrink must be between 0 and 1, got {cfg.lr_shrink}")
        if cfg.lr_patience < 1:
            raise QKNormConfigError(f"{flag}: --lr-patience must be 1 or more, got {cfg.lr_patience}")
        if cfg.stop_min_lr > 0:
            # fairseq compares it with the rate at every epoch start, warm-up included: it would stop
            # a warm-up before it has begun.
            raise QKNormConfigError(f"{flag}: use --stop-lr to stop at a rate, not --stop-min-lr")
        self.peak = cfg.lr[0]
        self.dev_scores = []  # one per validation, in order
        self.decays = 0
        self.num_updates = 0
        fairseq_patches.give_validation_scores_to_lr_scheduler()
        self.optimizer.set_lr(self.rate(0))

    # The paper code counts its updates from 1 and sets the rate before each one: fairseq calls
    # step_update(n) after n updates, for update n + 1.
    def warmup_rate(self, num_updates):
        return self.peak

    def rate(self, num_updates):
        return self.warmup_rate(num_updates) * self.cfg.lr_shrink**self.decays

    def may_decay(self):
        return True

    def may_stop(self):
        return True

    def step_update(self, num_updates):
        self.num_updates = num_updates
        lr = self.rate(num_updates)
        self.optimizer.set_lr(lr)
        return lr

    def step(self, epoch, val_loss=None):
        # An epoch's end: its validations' scores came through step_validation already.
        return self.optimizer.get_lr()

    def worse_than_each(self, score, previous):
        if self.cfg.maximize_best_checkpoint_metric:
            return score < min(previous)
        return score > max(previous)

    def step_validation(self, score):
        """The paper code's decay rule, after a validation whose --best-checkpoint-metric is SCORE."""
        score = float(score)  # fairseq's BLEU may be a numpy float: the checkpoint keeps plain floats
        previous = self.dev_scores[-self.cfg.lr_patience :]
        self.dev_scores.append(score)
        if self.may_decay() and len(previous) == self.cfg.lr_patience and self.worse_than_each(score, previous):
            old = self.rate(self.num_updates)
            self.decays += 1
            self.optimizer.set_lr(self.rate(self.num_updates))
            logger.info(
                f"dev score {score:g} worse than each of the previous {self.cfg.lr_patience} "
                f"({', '.join(f'{s:g}' for s in previous)}): lr {old:.4g} -> {self.rate(self.num_updates):.4g}"
            )

    def should_stop(self):
        """The paper code's stop, asked after each validation."""
        lr = self.rate(self.num_updates)
        if self.may_stop() and lr < self.cfg.stop_lr:
            logger.info(
                f"stopping training because the learning rate ({lr:.4g}) is below --stop-lr ({self.cfg.stop_lr:g})"
            )
            return True
        return False

    def state_dict(self):
        return {"best": self.best, "dev_scores": list(self.dev_scores), "decays": self.decays}

    def load_state_dict(self, state_dict):
        self.best = state_dict.get("best")
        self.dev_scores = list(state_dict.get("dev_scores", []))
        self.decays = state_dict.get("decays", 0)


@register_lr_scheduler("paper_warmup_flat", dataclass=PaperWarmupFlatConfig)
class PaperWarmupFlatSchedule(PaperConstantSchedule):
    """Linear warm-up to --lr, then flat, with the paper code's decay and stop (module docstring).
    The paper code's flat rate is its last warm-up rate, (warmup - 1) / warmup of the peak: 1e-4
    lower by 1/8,000 of the rate at 8,000 warm-up updates, which is left out here."""

    name = "paper_warmup_flat"

    def __init__(self, cfg, optimizer):
        if cfg.warmup_updates < 1:
            raise QKNormConfigError(
                f"--lr-scheduler {self.name}: --warmup-updates must be 1 or more, got {cfg.warmup_updates} "
                "(without warm-up: --lr-scheduler paper_constant)"
            )
        super().__init__(cfg, optimizer)

    def warmup_rate(self, num_updates):
        return self.peak * min(num_updates + 1, self.cfg.warmup_updates) / self.cfg.warmup_updates

    # As the paper code: no decay before warm-up has ended, and no stop until an update after it.
    def may_decay(self):
        return self.num_updates >= self.cfg.warmup_updates

    def may_stop(self):
        return self.num_updates > self.cfg.warmup_updates
