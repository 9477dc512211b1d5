"""g0 = log2(L^2 - L) with L a percentile of the training lengths, read from binarized data."""

import math
import shutil

import numpy as np
import pytest
import torch
from conftest import train
from fairseq.data import indexed_dataset

import fairseq_qknorm  # noqa: F401
from fairseq_qknorm.length_prior import g0_for_length, g0_from_data, length_from_g0, length_percentile


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


@pytest.mark.parametrize("percentile", [97.5, 99, 50])
def test_auto_L_is_the_exact_percentile_of_the_longer_side(tmp_path, percentile):
    rng = np.random.default_rng(0)
    src = rng.integers(1, 60, size=537).tolist()
    tgt = rng.integers(5, 90, size=537).tolist()
    write_split(tmp_path / "train.de-en.de", src)
    write_split(tmp_path / "train.de-en.en", tgt)
    want = max(lower_percentile(src, percentile), lower_percentile(tgt, percentile))
    length, g0 = g0_from_data(str(tmp_path), "train", "de", "en", percentile)
    assert length == want
    assert g0 == pytest.approx(math.log2(want * want - want))
    # sharded --data (colon-separated): the lengths of every shard count
    other = tmp_path / "shard2"
    other.mkdir()
    write_split(other / "train.de-en.de", [200] * 537)
    write_split(other / "train.de-en.en", [1] * 537)
    length, _ = g0_from_data(f"{tmp_path}:{other}", "train", "de", "en", percentile)
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
    assert err[-1].startswith("error: --qk-scale-init auto: no training split 'train.src-tgt.src.idx'"), err[-3:]


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
def test_bad_flag_values_are_refused_by_the_parser(toy_bin, tmp_path, flag, value):
    proc = train(toy_bin / "bin", tmp_path / "ckpt", max_update=1, extra=[flag, value], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"argument {flag}" in proc.stderr.strip().splitlines()[-1]
