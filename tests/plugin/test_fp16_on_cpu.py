"""fairseq's fp16 training on the CPU (fairseq_patches.py, "--fp16 on the CPU"), for every --qk-norm
variant and for transformer_lm_qknorm: fairseq-train with FP16Optimizer (flat and per-parameter fp32
copies) and MemoryEfficientFP16Optimizer; g kept in float32 in the model and the checkpoint; an
overflowing update skipped; the loss scale restored on resume; the first updates against fp32; and
fairseq-generate and the hub on an fp16-trained checkpoint.

One run goes through the fairseq-train command; the others call fairseq-train's own main function
(fairseq_cli.train.main, what the command runs after parsing its flags) in this process, and the
update-level checks use fairseq's Trainer built from fairseq-train flags: starting a process costs
more than a tiny model's training. What a CPU cannot reach is the CUDA side of the same path:
fairseq's fused Adam and multi_tensor_l2norm, and torch's CUDA fp16 kernels (tests/plugin/
test_mixed_precision.py runs fairseq-train --fp16 on CUDA where a GPU is present)."""

import logging
import math
import re
import shutil

import pytest
import torch
from conftest import COMMON_TRAIN_FLAGS, TINY_MODEL, TRAIN_FLAGS, USER_DIR, decode, train, train_in_this_process

import fairseq_qknorm  # noqa: F401  (registers the models, installs the CPU fp16 route)
from fairseq_qknorm import fairseq_patches
from fairseq_qknorm.qknorm_attention import QKScale

# The per-head LayerNorm / RMSNorm give q and k a norm of about sqrt(head_dim): times the auto g0
# (about 8 on the toy corpus) their first logits saturate the softmax. g0 = 2 keeps these tiny
# models well conditioned; l2 takes the paper's auto g0. `none` is a learned g on raw q.k (without
# --qk-scale learned, --qk-norm none is stock attention, which has no g to keep in float32).
# fmt: off
VARIANTS = {
    "l2": ["--arch", "transformer_qknorm", *TINY_MODEL, "--qk-norm", "l2"],
    "layernorm": ["--arch", "transformer_qknorm", *TINY_MODEL, "--qk-norm", "layernorm", "--qk-scale-init", "2"],
    "rmsnorm": ["--arch", "transformer_qknorm", *TINY_MODEL, "--qk-norm", "rmsnorm", "--qk-scale-init", "2"],
    "none": ["--arch", "transformer_qknorm", *TINY_MODEL, "--qk-norm", "none", "--qk-scale", "learned", "--qk-scale-init", "2"],
    "lm": [
        "--task", "language_modeling", "--arch", "transformer_lm_qknorm_gpt2_tiny", "--decoder-attention-heads", "4",
        "--tokens-per-sample", "48", "--sample-break-mode", "none", "--dropout", "0", "--attention-dropout", "0",
        "--max-tokens", "1024",
    ],
}
PRECISIONS = {
    "fp16": ["--fp16"],  # FP16Optimizer, one flat fp32 copy of the parameters
    "fp16-no-flatten": ["--fp16", "--fp16-no-flatten-grads"],  # FP16Optimizer, one fp32 copy per parameter
    "memory-efficient": ["--memory-efficient-fp16"],  # MemoryEfficientFP16Optimizer: no fp32 copy
}
# fmt: on
# A CPU's fp16 step takes several times fp32's, and grows with the batch: the runs that overflow (each
# overflow costs one more step) train on batches of a few hundred tokens, whose gradients fit in fp16
# under a loss scale of 4,096 or less (measured, every model here). 2**14 overflows the first updates
# of them all, four times over the largest: fairseq halves it, update after update, until they fit.
SMALL_BATCHES = ["--max-tokens", "400"]
OVERFLOWING_SCALE = 2.0**14
OVERFLOWING = ["--fp16-init-scale", str(int(OVERFLOWING_SCALE)), *SMALL_BATCHES]


@pytest.fixture(scope="module")
def data(toy_bin, tmp_path_factory):
    """The binarized toy corpus, and its target side as a language-modelling corpus (the same
    binarized files under the names --task language_modeling reads)."""
    bin_dir = toy_bin / "bin"
    lm = tmp_path_factory.mktemp("fp16_lm_bin")
    shutil.copy(bin_dir / "dict.tgt.txt", lm / "dict.txt")
    for split in ("train", "valid", "test"):
        for ext in ("bin", "idx"):
            shutil.copy(bin_dir / f"{split}.src-tgt.tgt.{ext}", lm / f"{split}.{ext}")
    return {"translation": bin_dir, "lm": lm}


def fairseq_train_flags(data, variant, save_dir, *extra):
    task = "lm" if variant == "lm" else "translation"
    # The translation flags warm up from lr 0, which would make the first update a no-op.
    common = COMMON_TRAIN_FLAGS if task == "lm" else [*TRAIN_FLAGS, "--warmup-init-lr", "1e-4"]
    return [str(data[task]), "--user-dir", USER_DIR, *VARIANTS[variant], *common, "--save-dir", str(save_dir), *extra]


def config(argv):
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    return convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), argv))


def trainer_for(argv):
    """fairseq's Trainer as fairseq-train builds it from ARGV, and its first training batches."""
    from fairseq import tasks, utils
    from fairseq.logging import metrics
    from fairseq.trainer import Trainer

    cfg = config(argv)
    metrics.reset()
    utils.set_torch_seed(cfg.common.seed)
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    trainer = Trainer(cfg, task, model, task.build_criterion(cfg.criterion))
    batches = list(trainer.get_train_iterator(epoch=1).next_epoch_itr(shuffle=False))
    return trainer, batches


def g_values(model):
    return [s.g for s in model.modules() if isinstance(s, QKScale)]


def saved(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def saved_g0(state):
    """The initial g the checkpoint's model was built with (`auto` is saved as its number)."""
    model_cfg = state["cfg"]["model"]
    return float(model_cfg["qk_scale_init"] if isinstance(model_cfg, dict) else model_cfg.qk_scale_init)


def assert_float32_only(g, g0=None):
    """Values a float32 g holds after a few Adam steps and an fp16 g could not: fairseq saves every
    tensor as float32, so only the values tell (an fp16 g is a value fp16 can represent; a trained
    float32 one almost never is: about 1 in 8,192 near g = 2..16)."""
    assert g and all(torch.isfinite(v).all() and (v.half().float() != v).all() for v in g), g
    if g0 is not None:
        assert all((v != g0).all() for v in g), (g, g0)


# ---------------------------------------------------------------------------------------------
# The fairseq-train command
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fp16_checkpoint(toy_bin, tmp_path_factory):
    """fairseq-train --cpu --fp16, the paper's system (tiny), run as a user runs it: (save dir, log)."""
    save = tmp_path_factory.mktemp("fp16_cli")
    extra = ["--fp16", *OVERFLOWING, "--log-interval", "1"]
    proc = train(toy_bin / "bin", save, arch="transformer_qknorm_paper", extra=extra, max_update=6)
    return save, proc.stdout + proc.stderr


def test_fairseq_train_cpu_fp16_command_trains_and_logs_the_loss_scale(fp16_checkpoint):
    save, log = fp16_checkpoint
    assert log.count(fairseq_patches.FP16_ON_CPU_NOTE) == 1
    assert f"gradient overflow detected, ignoring gradient, setting loss scale to: {OVERFLOWING_SCALE / 2}" in log
    inner = [line for line in log.splitlines() if "train_inner" in line]
    assert [int(re.search(r"num_updates=(\d+)", line).group(1)) for line in inner] == [1, 2, 3, 4, 5, 6]
    scales = [float(re.search(r"loss_scale=([\d.]+)", line).group(1)) for line in inner]
    assert all(s < OVERFLOWING_SCALE and math.log2(OVERFLOWING_SCALE / s).is_integer() for s in scales), scales
    losses = [float(re.search(r" loss=([\d.]+)", line).group(1)) for line in inner]
    assert all(math.isfinite(x) for x in losses) and "done training" in log
    state = saved(save / "checkpoint_last.pt")
    assert state["last_optimizer_state"]["loss_scale"] == scales[-1]
    g = [v for k, v in state["model"].items() if k.endswith("qk_scale.g")]
    assert len(g) == 3 * 2  # encoder self, decoder self, cross; 2 layers
    assert_float32_only(g, g0=saved_g0(state))


def test_fairseq_generate_and_hub_on_an_fp16_trained_checkpoint(fp16_checkpoint, toy_bin, toy_raw):
    save, _ = fp16_checkpoint
    proc = decode(
        "fairseq-generate",
        toy_bin / "bin",
        save / "checkpoint_last.pt",
        "--beam 2 --max-len-b 30 --batch-size 16 --required-batch-size-multiple 1 --cpu --remove-bpe sentencepiece",
    )
    hypotheses = [line for line in proc.stdout.splitlines() if line.startswith("H-")]
    assert len(hypotheses) == len((toy_raw / "test.src").read_text().splitlines())
    assert all(math.isfinite(float(line.split("\t")[1])) for line in hypotheses)
    assert "BLEU" in proc.stdout

    from fairseq.models.transformer import TransformerModel

    hub = TransformerModel.from_pretrained(
        str(save),
        checkpoint_file="checkpoint_last.pt",
        data_name_or_path=str(toy_bin / "bin"),
        user_dir=USER_DIR,
        bpe="sentencepiece",
        sentencepiece_model=str(toy_bin / "spm.model"),
        source_lang="src",
        target_lang="tgt",
    )
    sentence = (toy_raw / "test.src").read_text().splitlines()[0]
    assert hub.translate(sentence, beam=2).strip()
    assert_float32_only(g_values(hub.models[0]), g0=float(hub.cfg.model.qk_scale_init))
    # in half precision, as a user may run it after fp16 training: g stays float32
    half = hub.half()
    assert all(v.dtype == torch.float32 for v in g_values(half.models[0]))
    assert half.translate(sentence, beam=2).strip()


# ---------------------------------------------------------------------------------------------
# fairseq-train's main: every variant, both fp16 optimizers; an overflow, then a resume
# ---------------------------------------------------------------------------------------------
RUNS = [(v, p) for v in VARIANTS for p in ("fp16", "memory-efficient")] + [
    ("l2", "fp16-no-flatten"),
    ("lm", "fp16-no-flatten"),
]


@pytest.mark.parametrize("variant, precision", RUNS)
def test_fp16_training_through_fairseq_train_and_its_resume(data, tmp_path, caplog, variant, precision):
    caplog.set_level(logging.INFO)
    extra = [*PRECISIONS[precision], *OVERFLOWING, "--log-interval", "1"]
    train_in_this_process(fairseq_train_flags(data, variant, tmp_path, *extra, "--max-update", "3"))
    first = [r.getMessage() for r in caplog.records]
    assert sum(fairseq_patches.FP16_ON_CPU_NOTE in m for m in first) == 1
    overflows = [m for m in first if "gradient overflow detected" in m]
    state = saved(tmp_path / "checkpoint_last.pt")
    scale = state["last_optimizer_state"]["loss_scale"]
    # Every overflow halved the scale, was skipped, and training went on to its 3 updates.
    assert overflows and scale == OVERFLOWING_SCALE / 2 ** len(overflows)
    assert state["optimizer_history"][-1]["num_updates"] == 3
    assert all(torch.isfinite(v).all() for v in state["model"].values())
    g = [v for k, v in state["model"].items() if k.endswith("qk_scale.g")]
    assert len(g) == (2 if variant == "lm" else 6)
    assert_float32_only(g, g0=saved_g0(state))

    # Resume with a far larger --fp16-init-scale: the saved scale must win. The resumed updates may
    # overflow again (each halves the scale): its last scale is the saved one halved that often.
    caplog.clear()
    extra[extra.index("--fp16-init-scale") + 1] = str(int(OVERFLOWING_SCALE) * 1024)
    train_in_this_process(fairseq_train_flags(data, variant, tmp_path, *extra, "--max-update", "5"))
    resumed = [r.getMessage() for r in caplog.records]
    assert any("Loaded checkpoint" in m and "@ 3 updates" in m for m in resumed)
    state = saved(tmp_path / "checkpoint_last.pt")
    assert state["optimizer_history"][-1]["num_updates"] == 5
    overflows = [m for m in resumed if "gradient overflow detected" in m]
    assert state["last_optimizer_state"]["loss_scale"] == scale / 2 ** len(overflows), overflows


# ---------------------------------------------------------------------------------------------
# Update by update, with fairseq's Trainer
# ---------------------------------------------------------------------------------------------
def fp32_master(trainer):
    """The optimizer's float32 copy of the parameters (FP16Optimizer), or None (MemoryEfficient)."""
    params = getattr(trainer.optimizer, "fp32_params", None)
    if params is None:
        return None
    return [p.detach().clone() for p in (params.values() if isinstance(params, dict) else params)]


@pytest.mark.parametrize("variant, precision", RUNS)
def test_an_overflowing_update_is_skipped_and_training_goes_on(data, tmp_path, variant, precision):
    argv = fairseq_train_flags(data, variant, tmp_path, *PRECISIONS[precision], *OVERFLOWING)
    trainer, batches = trainer_for(argv)
    model, scaler = trainer.get_model(), trainer.optimizer.scaler
    g = g_values(model)
    assert g and all(v.dtype == torch.float32 for v in g)
    assert {p.dtype for p in model.parameters()} == {torch.float16, torch.float32}
    if precision == "memory-efficient":  # the optimizer steps g itself: it must be the float32 tensor
        optimized = [p for group in trainer.optimizer.optimizer.param_groups for p in group["params"]]
        assert all(any(v is p for p in optimized) for v in g)

    before = {k: v.clone() for k, v in model.state_dict().items()}
    master = fp32_master(trainer)
    assert trainer.train_step([batches[0]]) is None  # skipped
    assert scaler.loss_scale == OVERFLOWING_SCALE / 2 and trainer.get_num_updates() == 0
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # g among them
    if master is not None:
        assert all(torch.equal(a, b) for a, b in zip(master, fp32_master(trainer)))

    for i in range(1, 30):  # training goes on: the next batches, at half the scale each time
        if trainer.train_step([batches[i % len(batches)]]) is not None:
            break
    assert trainer.get_num_updates() == 1, "no update applied within 30 batches"
    assert math.log2(OVERFLOWING_SCALE / scaler.loss_scale).is_integer()
    assert all(v.dtype == torch.float32 for v in g_values(model))
    g_before = [before[k] for k in before if k.endswith("qk_scale.g")]
    assert all((v != v0).all() for v, v0 in zip(g_values(model), g_before))


def test_a_diverged_fp16_run_ends_with_fairseqs_minimum_loss_scale_error(data, tmp_path, caplog):
    # The first overflow halves the scale to the minimum: fairseq raises its FloatingPointError,
    # then re-runs the update under its NaN detector (which, unpatched, raised StopIteration).
    scale = str(int(OVERFLOWING_SCALE))
    argv = fairseq_train_flags(data, "l2", tmp_path, "--fp16", *OVERFLOWING, "--min-loss-scale", scale)
    trainer, batches = trainer_for(argv)
    with caplog.at_level(logging.WARNING), pytest.raises(FloatingPointError, match="Minimum loss scale reached"):
        trainer.train_step([batches[0]])
    reruns = [r.getMessage() for r in caplog.records if "NaN detector could not re-run" in r.getMessage()]
    assert reruns and "StopIteration" in reruns[0], reruns


def forward_losses(trainer, batches):
    """The forward loss (per token) of each update, and whether fairseq applied it."""
    losses = []
    task_step = trainer.task.train_step

    def recording(sample, *args, **kwargs):
        loss, sample_size, logging_output = task_step(sample, *args, **kwargs)
        losses.append(float(loss.detach()) / sample_size)
        return loss, sample_size, logging_output

    trainer.task.train_step = recording
    applied = [trainer.train_step([b]) is not None for b in batches]
    return losses, applied


@pytest.mark.parametrize("variant", VARIANTS)
def test_first_fp16_updates_agree_with_fp32(data, tmp_path, variant):
    """The same initial weights (one seed), the same batches: fp16 (fairseq's default initial loss
    scale, no overflow on these batches) against fp32, for three updates."""
    fp32, batches = trainer_for(fairseq_train_flags(data, variant, tmp_path))
    fp16, _ = trainer_for(fairseq_train_flags(data, variant, tmp_path, "--fp16"))
    start = {k: v.detach().clone() for k, v in fp32.get_model().state_dict().items()}
    for k, v in fp16.get_model().state_dict().items():  # the fp32 weights rounded to fp16; g and g0 as they are
        assert torch.equal(
            start[k] if k.endswith(("qk_scale.g", "qk_scale.g0")) else start[k].half().float(), v.float()
        ), k

    losses32, _ = forward_losses(fp32, batches[:3])
    losses16, applied = forward_losses(fp16, batches[:3])
    assert all(applied), "an update overflowed at fairseq's default loss scale"
    # fp16 carries 11 significant bits (relative rounding 4.9e-4); a forward pass accumulates a few
    assert losses16 == pytest.approx(losses32, rel=1e-3)
    # After three Adam steps of lr 3e-4..1e-3 (warm-up): g within a quarter of the distance it moved.
    # (Measured: rmsnorm's g moved 1.18e-4 in fp32 and ended 1.8e-5 from it in fp16, 0.15 of that
    # distance, on a 2-core AMD EPYC: Adam divides g's tiny fp16 gradient by its own scale.)
    g32, g16 = g_values(fp32.get_model()), g_values(fp16.get_model())
    g0 = [start[k] for k in start if k.endswith("qk_scale.g")]
    for a, b, s in zip(g32, g16, g0):
        assert abs(float(a) - float(b)) <= 0.25 * abs(float(a) - float(s)) + 1e-6, (float(s), float(a), float(b))


def test_the_cpu_route_is_active_only_inside_a_cpu_fp16_trainer(data, tmp_path):
    from fairseq import trainer as trainer_module
    from fairseq.optim import fp16_optimizer

    def views_while_stepping(*precision):
        trainer, batches = trainer_for(fairseq_train_flags(data, "l2", tmp_path, *precision))
        seen = []
        task_step = trainer.task.train_step

        def spying(*args, **kwargs):
            seen.append((fp16_optimizer.torch is torch, trainer_module.torch is torch))
            return task_step(*args, **kwargs)

        trainer.task.train_step = spying
        trainer.train_step([batches[0]])
        return seen

    assert views_while_stepping("--fp16") == [(False, False)]
    assert views_while_stepping() == [(True, True)]  # fp32: fairseq as it is
    assert fp16_optimizer.torch is torch and trainer_module.torch is torch  # put back after each step
