"""experiments/plot_dev.py: the dev curves of fairseq-train logs (the figure of ted/RESULTS.md)."""

import struct

import pytest

from experiments.plot_dev import main, read_valid

LINE = (
    "2026-11-29 14:35:14 | INFO | valid | epoch {e:03d} | valid on 'valid' subset | loss {loss} | "
    "nll_loss 6.5 | ppl 90.25 | bleu {bleu} | wps 283.6 | wpb 1543 | bsz 53 | num_updates {n}\n"
)


def plot_dev(*argv):
    return main(list(map(str, argv)))


def test_reads_the_valid_lines_and_draws_both_panels(tmp_path):
    log = tmp_path / "train.log"
    log.write_text(
        "| INFO | train | epoch 001 | loss 9.7 | num_updates 136\n"
        + LINE.format(e=2, loss=7.8, bleu=3.6, n=272)
        + LINE.format(e=4, loss=7.5, bleu=4.1, n=544)
    )
    assert read_valid(log) == [(272, 7.8, 3.6), (544, 7.5, 4.1)]
    out = tmp_path / "dev.png"
    plot_dev(out, f"baseline={log}", f"baseline, earlier (dashed)={log}", "--title", "t")
    header = out.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", header[16:24])
    assert width > height > 100


def test_a_log_without_dev_bleu_is_one_clear_error(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("| INFO | train | epoch 001 | loss 9.7 | num_updates 136\n")
    with pytest.raises(SystemExit, match="no 'valid on' lines with a bleu"):
        plot_dev(tmp_path / "x.png", f"a={log}")
