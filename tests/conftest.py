"""Shared fixtures: a tiny generated corpus, its sentencepiece + fairseq-preprocess'ed form, and a
QKNorm model trained on it through the real fairseq-train CLI (once per test session)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
ROOT = str(Path(__file__).resolve().parents[1])
USER_DIR = str(Path(ROOT) / "fairseq_qknorm")

# A model small enough to train in seconds on 2 CPU cores.
TINY_MODEL = [
    "--encoder-layers",
    "2",
    "--decoder-layers",
    "2",
    "--encoder-embed-dim",
    "32",
    "--decoder-embed-dim",
    "32",
    "--encoder-ffn-embed-dim",
    "64",
    "--decoder-ffn-embed-dim",
    "64",
    "--encoder-attention-heads",
    "4",
    "--decoder-attention-heads",
    "4",
]
# fmt: off
# What every test training shares: Adam, one seed, the CPU, fairseq's simple log every 5 updates.
COMMON_TRAIN_FLAGS = [
    "--optimizer", "adam", "--lr", "0.003", "--required-batch-size-multiple", "1", "--cpu", "--seed", "1",
    "--log-format", "simple", "--log-interval", "5", "--no-epoch-checkpoints", "--num-workers", "0",
]
TRAIN_FLAGS = [
    "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "20",
    "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--max-tokens", "1500",
    *COMMON_TRAIN_FLAGS,
]
# fmt: on


def run(cmd, check=True, **kwargs):
    """Run a command; on failure show its output (the test's own assertion message)."""
    cmd = [str(c) for c in cmd]
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"),
        PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
    )  # experiments/
    # Checkpoints must load with torch's safe unpickler, as users get it: nothing may turn it off.
    for name in ("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_WEIGHTS_ONLY_LOAD"):
        env.pop(name, None)
    env.update(kwargs.pop("env", {}))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, **kwargs)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"command failed ({proc.returncode}): {' '.join(cmd)}\n--- stdout\n{proc.stdout[-4000:]}\n"
            f"--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def tool(name):
    return str(BIN / name)


@pytest.fixture(scope="session")
def toy_raw(tmp_path_factory):
    from fairseq_qknorm_cli.toy_corpus import write_corpus

    d = tmp_path_factory.mktemp("toy_raw")
    write_corpus(d, train=800, dev=60, test=40, seed=3)
    return d


@pytest.fixture(scope="session")
def toy_bin(toy_raw, tmp_path_factory):
    """Binarized toy data (joined dictionary) plus the sentencepiece model, in one folder."""
    d = tmp_path_factory.mktemp("toy_bin")
    run(
        [
            tool("fairseq-qknorm-spm-train"),
            "--input",
            f"{toy_raw}/train.src,{toy_raw}/train.tgt",
            "--model_prefix",
            d / "spm",
            "--vocab_size",
            "200",
        ]
    )
    for split in ("train", "dev", "test"):
        for side in ("src", "tgt"):
            out = run([tool("fairseq-qknorm-spm-encode"), "--model", d / "spm.model", toy_raw / f"{split}.{side}"])
            (d / f"{split}.sp.{side}").write_text(out.stdout)
    run(
        [
            tool("fairseq-preprocess"),
            "--source-lang",
            "src",
            "--target-lang",
            "tgt",
            "--trainpref",
            d / "train.sp",
            "--validpref",
            d / "dev.sp",
            "--testpref",
            d / "test.sp",
            "--joined-dictionary",
            "--destdir",
            d / "bin",
            "--workers",
            "1",
        ]
    )
    return d


def train_args(
    data_bin, save_dir, arch="transformer_qknorm", extra=(), max_update=40, model=TINY_MODEL, flags=TRAIN_FLAGS
):
    """fairseq-train's arguments with the plugin, ARCH and the MODEL and training FLAGS, for
    MAX_UPDATE updates into SAVE_DIR; EXTRA flags last."""
    run_length = ["--max-update", str(max_update), "--save-dir", save_dir]
    return [data_bin, "--user-dir", USER_DIR, "--arch", arch, *model, *flags, *run_length, *extra]


def train(
    data_bin,
    save_dir,
    arch="transformer_qknorm",
    extra=(),
    max_update=40,
    model=TINY_MODEL,
    cpu=True,
    flags=TRAIN_FLAGS,
    launcher=(),
    **kwargs,
):
    """fairseq-train (behind launcher, e.g. torchrun) with train_args(); the other keywords go to run()."""
    flags = flags if cpu else [f for f in flags if f != "--cpu"]
    command = train_args(data_bin, save_dir, arch, extra, max_update, model, flags)
    return run([*launcher, tool("fairseq-train"), *command], **kwargs)


def train_in_this_process(argv):
    """fairseq-train ARGV in this process: fairseq_cli.train's main, as the command calls it after
    parsing its flags. For a model a test only reads or a training it watches from inside; what a user
    sees from the command is tested through train()."""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.distributed import utils as distributed_utils
    from fairseq_cli.train import main

    args = options.parse_args_and_arch(options.get_training_parser(), [str(a) for a in argv])
    distributed_utils.call_main(convert_namespace_to_omegaconf(args), main)


# fairseq-train's entry point, for several trainings in turn; each one's output follows a line naming
# it, and an error in one is printed there and the next one still trains.
TRAIN_EACH = """
import json, os, sys, traceback
from fairseq_cli.train import cli_main
os.dup2(1, 2)  # fairseq logs to stdout, tracebacks go to stderr: one stream, in order
for name, argv in json.loads(sys.argv[1]).items():
    print("=== " + name, flush=True)
    sys.argv = ["fairseq-train", *argv]
    try:
        cli_main()
    except BaseException:
        traceback.print_exc()
"""


def train_each(runs):
    """{name: its fairseq-train output} for {name: train_args()'s keywords}, trained in that order in
    one process: one import of fairseq, not one per training. For tests of what a model trains to;
    what a user sees from the fairseq-train command is tested through train()."""
    argv = {name: [str(a) for a in train_args(**kw)] for name, kw in runs.items()}
    out = run([tool("python"), "-c", TRAIN_EACH, json.dumps(argv)]).stdout
    return dict(re.findall(r"^=== (\S+)\n(.*?)(?=^=== |\Z)", out, re.M | re.S))


def decode(command, data, checkpoint, flags, **kwargs):
    """fairseq-generate, fairseq-interactive or fairseq-eval-lm on DATA with the plugin and a
    checkpoint; FLAGS as on a command line."""
    return run([tool(command), data, "--user-dir", USER_DIR, "--path", checkpoint, *flags.split()], **kwargs)


@pytest.fixture(scope="session")
def trained(toy_bin, tmp_path_factory):
    """A QKNorm model (the paper's system, tiny) trained for a few dozen updates: (bin dir, ckpt dir)."""
    save = tmp_path_factory.mktemp("ckpt_qknorm")
    # --eval-bleu puts numpy objects in the checkpoint: loading it exercises the whole allow-list.
    proc = train(
        toy_bin / "bin",
        save,
        arch="transformer_qknorm_paper",
        max_update=60,
        extra=[
            "--eval-bleu",
            "--eval-bleu-args",
            '{"beam": 1, "max_len_b": 40}',
            "--eval-bleu-remove-bpe",
            "sentencepiece",
            "--best-checkpoint-metric",
            "bleu",
            "--maximize-best-checkpoint-metric",
        ],
    )
    (save / "train.log").write_text(proc.stdout + proc.stderr)
    return toy_bin / "bin", save


def build_model(arch="transformer_qknorm", vocab=40, **overrides):
    """A small model built in-process through the architecture registry, as fairseq-train builds it
    (without data: a numeric --qk-scale-init)."""
    import argparse

    from fairseq.data import Dictionary
    from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY

    import fairseq_qknorm  # noqa: F401

    d = Dictionary()
    for i in range(vocab):
        d.add_symbol(f"w{i}")
    task = argparse.Namespace(source_dictionary=d, target_dictionary=d)
    small = dict(
        encoder_layers=2,
        decoder_layers=2,
        encoder_embed_dim=32,
        decoder_embed_dim=32,
        encoder_ffn_embed_dim=64,
        decoder_ffn_embed_dim=64,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        dropout=0.0,
        qk_scale_init=6.0,
    )
    # an override of None leaves that setting to the architecture
    args = argparse.Namespace(arch=arch, **{k: v for k, v in {**small, **overrides}.items() if v is not None})
    ARCH_CONFIG_REGISTRY[arch](args)
    return ARCH_MODEL_REGISTRY[arch].build_model(args, task), d


# A sitecustomize for the multi-process trainings (plugin/test_lm.py, experiments/test_distributed.py),
# imported by every Python process of the run (PYTHONPATH); acts only in fairseq-train, once
# fairseq.trainer is imported: wraps Trainer.train_step to append, per update, the update count,
# the ids of the sentences this rank trained on and every qk_scale.g (float.hex: exact) to
# QK_G_RECORD_DIR/g.rank$RANK.jsonl.
RECORD_G = """
import importlib.abc
import importlib.util
import json
import os
import sys


def _record(trainer, samples, start=False):
    ids = sorted(int(i) for sample in samples for i in (sample or {}).get("id", []))
    g = {name: [float(x).hex() for x in p.detach().flatten().tolist()]
         for name, p in trainer.get_model().named_parameters() if name.endswith("qk_scale.g")}
    path = os.path.join(os.environ["QK_G_RECORD_DIR"], "g.rank%s.jsonl" % os.environ["RANK"])
    with open(path, "a") as f:
        f.write(json.dumps({"update": trainer.get_num_updates(), "start": start, "ids": ids, "g": g}) + "\\n")


def _instrument(trainer_class):
    train_step = trainer_class.train_step

    def recorded_train_step(self, samples, *args, **kwargs):
        if not getattr(self, "_g_recorded", False):
            self._g_recorded = True
            _record(self, [], start=True)  # before the first update: the initial (or resumed) g
        out = train_step(self, samples, *args, **kwargs)
        _record(self, samples)
        return out

    trainer_class.train_step = recorded_train_step


class _AfterTrainerImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "fairseq.trainer":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_instrument(module):
            exec_module(module)
            _instrument(module.Trainer)

        spec.loader.exec_module = exec_and_instrument
        return spec


if os.environ.get("QK_G_RECORD_DIR"):
    sys.meta_path.insert(0, _AfterTrainerImport())
"""


def read_records(records, rank):
    return [json.loads(line) for line in (records / f"g.rank{rank}.jsonl").read_text().splitlines()]
