"""g0 = log2(L^2 - L) with L a percentile of the training lengths, read from binarized data."""

import json
import math
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import train, train_args
from fairseq.data import indexed_dataset

import fairseq_qknorm  # noqa: F401
from fairseq_qknorm.length_prior import g0_for_length, g0_from_pairs, length_from_g0, length_percentile, training_pairs


def test_paper_value():
    assert g0_for_length(72) == pytest.approx(math.log2(5112))
    assert g0_for_length(72) == pytest.approx(12.31967, abs=1e-5)
    assert length_from_g0(g0_for_length(79)) == pytest.approx(79)


def lower_percentile(values, p):
    """Independent definition: the sorted value at index floor(p/100 * (n-1))."""
    s = sorted(values)
    return s[int(math.floor(p / 100 * (len(s) - 1)))]


def write_split(prefix, lengths):
    builder = indexed_dataset.make_builder(f"{prefix}.bin", impl="mmap", vocab_size=100)
    for n in lengths:
        builder.add_item(torch.IntTensor([5] * n + [2]))  # n tokens + </s>, as fairseq-preprocess writes
    builder.finalize(f"{prefix}.idx")


def translation_task(data, src="de", tgt="en", **cfg):
    """fairseq's translation task on DATA (folders separated by ':'), as fairseq-train sets it up."""
    from fairseq.tasks.translation import TranslationConfig, TranslationTask

    first = data.split(":")[0]
    for lang in (src, tgt):
        (Path(first) / f"dict.{lang}.txt").write_text("w 1\n")
    cfg = TranslationConfig(
        data=data, source_lang=src, target_lang=tgt, dataset_impl="mmap", train_subset="train", **cfg
    )
    return TranslationTask.setup_task(cfg)


@pytest.mark.parametrize("percentile", [97.5, 99, 50])
def test_auto_L_is_the_exact_percentile_of_the_longer_side(tmp_path, percentile):
    rng = np.random.default_rng(0)
    src = rng.integers(1, 60, size=537).tolist()
    tgt = rng.integers(5, 90, size=537).tolist()
    write_split(tmp_path / "train.de-en.de", src)
    write_split(tmp_path / "train.de-en.en", tgt)
    want = max(lower_percentile(src, percentile), lower_percentile(tgt, percentile))
    length, g0 = g0_from_pairs(training_pairs(translation_task(str(tmp_path)), "train"), percentile)
    assert length == want
    assert g0 == pytest.approx(math.log2(want * want - want))
    # sharded --data (colon-separated): fairseq reads one shard per epoch; the lengths of every shard count
    other = tmp_path / "shard2"
    other.mkdir()
    write_split(other / "train.de-en.de", [200] * 537)
    write_split(other / "train.de-en.en", [1] * 537)
    pairs = training_pairs(translation_task(f"{tmp_path}:{other}"), "train")
    length, _ = g0_from_pairs(pairs, percentile)
    assert length == max(lower_percentile(src + [200] * 537, percentile), lower_percentile(tgt + [1] * 537, percentile))


def test_g0_refuses_L_below_2_and_percentile_100_is_the_longest():
    with pytest.raises(ValueError, match="L must be at least 2"):
        g0_for_length(1)
    assert length_percentile([3, 4, 5], 100) == 5


def test_auto_without_a_training_split_is_one_clear_line(toy_bin, tmp_path):
    data = tmp_path / "bin"
    shutil.copytree(toy_bin / "bin", data)
    for f in data.glob("train.*"):
        f.unlink()
    proc = train(data, tmp_path / "ckpt", max_update=1, check=False)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert err[-1].startswith(f"error: --qk-scale-init auto: no training split 'train' in {data} ("), err[-3:]


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--qk-length-percentile", "101"),
        ("--qk-length-percentile", "0"),
        ("--qk-scale-init", "twelve"),
        ("--qk-norm", "l1"),
        ("--norm-type", "rms"),
    ],
)
def test_bad_flag_values_are_refused_by_the_parser(toy_bin, tmp_path, capsys, monkeypatch, flag, value):
    """fairseq-train's command line, through the function the command calls, in this process: its
    parser refuses the value before anything else runs, and a process of its own would only add
    the seconds of importing fairseq. An exception other than argparse's exit fails the test."""
    from fairseq_cli.train import cli_main

    command = ["fairseq-train", *train_args(toy_bin / "bin", tmp_path / "ckpt", max_update=1, extra=[flag, value])]
    monkeypatch.setattr(sys, "argv", [str(c) for c in command])
    with pytest.raises(SystemExit) as exited:
        cli_main()
    stderr = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in stderr
    assert f"argument {flag}" in stderr.strip().splitlines()[-1]


def binarized_tokens(prefix):
    """Token counts (without </s>) of a fairseq-preprocess'ed file, read without fairseq's tasks."""
    dataset = indexed_dataset.MMapIndexedDataset(str(prefix))  # sizes is a view of its memory map: keep it open
    return (dataset.sizes - 1).tolist()


def test_auto_on_fairseqs_multilingual_task(toy_bin, tmp_path):
    """translation_multi_simple_epoch, as fairseq's multilingual examples train: L over the pairs
    of every direction, each sentence one token longer for its language token on either side."""
    data = toy_bin / "bin"
    flags = ["--task", "translation_multi_simple_epoch", "--lang-pairs", "src-tgt,tgt-src", "--encoder-langtok", "src"]
    flags += ["--decoder-langtok", "--share-all-embeddings", "--disable-validation", "--no-save"]
    proc = train(data, tmp_path, max_update=1, extra=flags)
    src, tgt = (binarized_tokens(data / f"train.src-tgt.{lang}") for lang in ("src", "tgt"))
    # each side of the two directions holds both languages' sentences, plus a language token
    want = lower_percentile([n + 1 for n in src + tgt], 97.5)
    log = proc.stdout + proc.stderr
    line = re.search(r"qk-norm: L=(\d+) \(97.5th percentile of the 'train' pairs' lengths: (.*?)\) g0", log)
    assert line, log[-3000:]
    assert int(line.group(1)) == want
    assert line.group(2) == f"src-tgt {len(src)}, tgt-src {len(src)}"


def test_auto_counts_only_the_pairs_fairseq_train_keeps(toy_bin, tmp_path):
    """fairseq-train skips training pairs longer than --max-source-positions /
    --max-target-positions (</s> included): L is measured over the others."""
    data = toy_bin / "bin"
    flags = ["--max-source-positions", "24", "--max-target-positions", "24", "--disable-validation", "--no-save"]
    proc = train(data, tmp_path, max_update=1, extra=flags)
    log = proc.stdout + proc.stderr
    src, tgt = (np.array(binarized_tokens(data / f"train.src-tgt.{lang}")) for lang in ("src", "tgt"))
    fits = (src + 1 <= 24) & (tgt + 1 <= 24)
    skipped = re.search(r"(\d+) samples have invalid sizes and will be skipped", log)
    assert skipped and int(skipped.group(1)) == (~fits).sum() > 0, log[-3000:]
    want = max(lower_percentile(src[fits].tolist(), 97.5), lower_percentile(tgt[fits].tolist(), 97.5))
    line = re.search(r"qk-norm: L=(\d+) \(97.5th percentile of the 'train' pairs' lengths: (.*?)\) g0", log)
    assert line, log[-3000:]
    assert int(line.group(1)) == want
    assert line.group(2) == (
        f"src-tgt {fits.sum()} of {len(src)}; {(~fits).sum()} longer than the maximum positions (24, 24) "
        "are skipped, as fairseq-train skips them"
    )


def inspected_g0(capsys, checkpoint):
    """fairseq-qknorm-inspect g's report on CHECKPOINT, and its line that names g0 and L."""
    from fairseq_qknorm_cli import inspect_checkpoints

    inspect_checkpoints.main(["g", str(checkpoint), "--json"])
    (report,) = json.loads(capsys.readouterr().out)
    inspect_checkpoints.main(["g", str(checkpoint)])
    return report, capsys.readouterr().out.splitlines()[1]


def test_a_restored_g_keeps_the_g0_it_started_from(toy_bin, tmp_path, capsys):
    """fairseq-train --restore-file keeps the checkpoint's g, whatever --qk-scale-init says: the
    checkpoints it saves, and those of a resume with yet another --qk-scale-init, name the g0 that
    g started from, and fairseq-qknorm-inspect g reports that g0 and its L."""
    data, first, restored = toy_bin / "bin", tmp_path / "first", tmp_path / "restored"
    quick = ["--disable-validation"]
    train(data, first, max_update=2, extra=quick)  # auto: g0 from the training data's L
    origin, origin_line = inspected_g0(capsys, first / "checkpoint_last.pt")
    assert origin_line.startswith("g0 = ") and "L = " in origin_line  # e.g. g0 = 11.0782 = log2(L^2 - L), L = 47

    flags = [*quick, "--restore-file", first / "checkpoint_last.pt", "--qk-scale-init", "5"]
    proc = train(data, restored, max_update=4, extra=flags)
    assert (
        f"qk-norm: the loaded g started from g0={origin['g0']:.4f}, not from this model's --qk-scale-init 5; "
        f"the saved config records g0={origin['g0']:.4f}"
    ) in proc.stdout + proc.stderr
    train(data, restored, max_update=6, extra=[*quick, "--qk-scale-init", "7"])  # a resume from checkpoint_last.pt
    report, line = inspected_g0(capsys, restored / "checkpoint_last.pt")
    assert report["num_updates"] == 6
    assert line == origin_line
    assert report["g0"] == pytest.approx(origin["g0"], rel=1e-7) and report["L"] == pytest.approx(origin["L"])
    for row in report["g"]:
        assert row["g"] != pytest.approx(report["g0"])  # trained: g - g0 is what six updates did


@pytest.mark.parametrize("scale", ["learned", "fixed"])
def test_a_checkpoint_saved_without_g0_still_loads(scale):
    """A checkpoint from before g0 was saved beside g loads as fairseq loads it (strict), and its g
    is taken to have started from the model's --qk-scale-init; one with g0 brings its own."""
    from argparse import Namespace

    from conftest import build_model

    source, _ = build_model(qk_scale=scale, qk_scale_init=9.0)
    state = source.state_dict()
    older = {k: v for k, v in state.items() if not k.endswith(".qk_scale.g0")}
    assert len(state) - len(older) == 6  # one g0 per attention module
    for checkpoint, g0 in ((older, 5.0), (state, 9.0)):
        target, _ = build_model(qk_scale=scale, qk_scale_init=5.0)
        cfg = Namespace(qk_scale_init=5.0)
        target.load_state_dict(checkpoint, model_cfg=cfg)
        assert cfg.qk_scale_init == g0
        loaded = target.state_dict()
        assert all(torch.equal(loaded[k], v) for k, v in checkpoint.items())
        assert all(loaded[k].item() == g0 for k in loaded if k.endswith(".qk_scale.g0"))


@pytest.mark.parametrize("norm", ["l2", "layernorm", "rmsnorm"])
def test_auto_starts_every_norm_in_the_papers_logit_range(tmp_path, norm):
    """`auto` gives every --qk-norm the l2 norm's initial logits: a query against an equal key scores
    log2(L^2 - L), and no pair scores more. A LayerNorm or RMSNorm output has length sqrt(head_dim),
    so its g starts at g0 / head_dim; with g0 itself its logits would start head_dim times larger."""
    import argparse

    from fairseq_qknorm.qk_flags import resolve_qk_scale_init
    from fairseq_qknorm.qknorm_attention import QKNormAttention

    write_split(tmp_path / "train.de-en.de", [30] * 40)
    write_split(tmp_path / "train.de-en.en", [20] * 40)
    dims = dict(encoder_embed_dim=64, decoder_embed_dim=64, encoder_attention_heads=2, decoder_attention_heads=2)
    flags = dict(qk_norm=norm, qk_scale="learned", qk_scale_init="auto", qk_length_percentile=97.5)
    task = translation_task(str(tmp_path))
    g = resolve_qk_scale_init(argparse.Namespace(**dims, **flags), task)
    _, paper_g0 = g0_from_pairs(training_pairs(task, "train"), 97.5)
    assert g == pytest.approx(paper_g0 if norm == "l2" else paper_g0 / 32)

    torch.manual_seed(0)
    attention = QKNormAttention(64, 2, qk_norm=norm, qk_scale_init=g, self_attention=True)
    attention.k_proj.load_state_dict(attention.q_proj.state_dict())  # key i equals query i
    x = torch.randn(7, 3, 64)
    scores, _ = attention(x, x, x, before_softmax=True)
    own = scores.diagonal(dim1=-2, dim2=-1)
    assert torch.allclose(own, torch.full_like(own, paper_g0), rtol=1e-3)
    assert scores.abs().max() <= paper_g0 * (1 + 1e-3)


def test_auto_with_affine_norms_needs_one_head_size(tmp_path):
    import argparse

    from fairseq_qknorm.errors import QKNormConfigError
    from fairseq_qknorm.qk_flags import resolve_qk_scale_init

    write_split(tmp_path / "train.de-en.de", [30] * 40)
    write_split(tmp_path / "train.de-en.en", [20] * 40)
    args = argparse.Namespace(
        encoder_embed_dim=64, decoder_embed_dim=64, encoder_attention_heads=2, decoder_attention_heads=4
    )
    args.__dict__.update(qk_norm="rmsnorm", qk_scale="learned", qk_scale_init="auto", qk_length_percentile=97.5)
    with pytest.raises(
        QKNormConfigError, match=r"--qk-norm rmsnorm --qk-scale-init auto: .* differ in size \[16, 32\]"
    ):
        resolve_qk_scale_init(args, translation_task(str(tmp_path)))
