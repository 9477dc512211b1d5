"""`--qk-norm none` with no other QK flag is fairseq's own attention: the same parameters, values
and training; a learned temperature on raw dot products only where `--qk-scale` asks for one,
starting at fairseq's 1/sqrt(head_dim). A checkpoint whose QK-norm parameters differ from what
the flags build is refused in one line, both ways."""

import re

import pytest
import torch
from conftest import build_model, train, train_each

import fairseq_qknorm  # noqa: F401

HEAD_DIM = 32 // 4  # conftest's small models: 32 wide, 4 heads


def seeded(arch, **flags):
    torch.manual_seed(0)
    model, d = build_model(arch=arch, dropout=0.0, qk_scale_init=None, **flags)
    return model.eval(), d


def outputs(model, vocab):
    torch.manual_seed(1)
    src = torch.randint(4, vocab, (3, 7))
    src[:, -1] = 2
    prev = torch.randint(4, vocab, (3, 5))
    return model(src, torch.full((3,), 7), prev)[0]


def test_no_norm_alone_is_fairseqs_transformer():
    ours, d = seeded("transformer_qknorm", qk_norm="none")
    stock, _ = seeded("transformer")
    mine, theirs = ours.state_dict(), stock.state_dict()
    assert mine.keys() == theirs.keys()  # no g
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    torch.testing.assert_close(outputs(ours, len(d)), outputs(stock, len(d)))


@pytest.mark.parametrize("scale", ["learned", "fixed"])
def test_a_temperature_on_raw_dot_products_starts_at_fairseqs_factor(scale):
    ours, d = seeded("transformer_qknorm", qk_norm="none", qk_scale=scale)
    stock, _ = seeded("transformer")
    gs = [v for k, v in ours.state_dict().items() if k.endswith("qk_scale.g")]
    assert len(gs) == 2 + 2 * 2 and all(g.item() == pytest.approx(HEAD_DIM**-0.5) for g in gs)
    torch.testing.assert_close(outputs(ours, len(d)), outputs(stock, len(d)))


def logged(log, key):
    return [float(x) for x in re.findall(rf"train_inner .*?\b{key}=([\d.]+)", log)]


@pytest.fixture(scope="module")
def trainings(toy_bin, tmp_path_factory):
    """{name: (save dir, fairseq-train output)} of the trainings the tests below read, in one process:
    fairseq's transformer and --qk-norm none for five updates without dropout, in that order
    (fairseq's own first, before any QK-norm model has run in the process), then a QK-norm (l2)
    model saved after one update."""
    root = tmp_path_factory.mktemp("no_norm")
    same = ["--dropout", "0", "--log-interval", "1", "--disable-validation", "--no-save"]
    runs = {
        "stock": dict(arch="transformer", max_update=5, extra=same),
        "none": dict(max_update=5, extra=[*same, "--qk-norm", "none"]),
        "l2": dict(max_update=1, extra=["--qk-scale-init", "10", "--disable-validation"]),
    }
    logs = train_each({name: dict(data_bin=toy_bin / "bin", save_dir=root / name, **kw) for name, kw in runs.items()})
    return {name: (root / name, log) for name, log in logs.items()}


def test_fairseq_train_with_no_norm_trains_as_fairseqs_transformer(trainings):
    """Five updates of fairseq-train: the same losses and gradient norms as fairseq's transformer
    (without dropout, whose random draws the two attentions take in a different order)."""
    (_, stock), (_, ours) = trainings["stock"], trainings["none"]
    for key in ("loss", "gnorm"):
        expected = logged(stock, key)
        assert len(expected) == 5, stock[-3000:]
        assert logged(ours, key) == pytest.approx(expected, rel=2e-3), key


def test_fairseq_train_logs_where_a_raw_temperature_starts(toy_bin, tmp_path):
    flags = ["--qk-norm", "none", "--qk-scale", "learned", "--disable-validation", "--no-save"]
    proc = train(toy_bin / "bin", tmp_path, max_update=1, extra=flags)
    assert f"qk-norm: no norm, g0=1/sqrt(head_dim)=1/sqrt({HEAD_DIM})={HEAD_DIM**-0.5:.4f}" in proc.stdout + proc.stderr


def test_an_l2_checkpoint_fine_tuned_without_a_norm_is_one_clear_line(toy_bin, tmp_path, trainings):
    l2, log = trainings["l2"]
    assert (l2 / "checkpoint_last.pt").exists(), log[-3000:]
    proc = train(
        toy_bin / "bin",
        tmp_path / "ft",
        max_update=2,
        check=False,
        extra=["--qk-norm", "none", "--finetune-from-model", l2 / "checkpoint_last.pt"],
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: the checkpoint has QK-norm parameters that these flags do not build "
        "(e.g. encoder.layers.0.self_attn.qk_scale.g): it was trained with other --qk-norm/--qk-scale "
        "flags; load it with the flags it was trained with"
    )


@pytest.mark.parametrize(
    "arch, trained, loaded",
    [
        ("transformer_qknorm", dict(qk_norm="layernorm"), dict(qk_norm="rmsnorm")),  # q_norm.bias
        ("transformer_lm_qknorm_gpt2_tiny", dict(qk_norm="l2"), dict(qk_norm="none")),
    ],
)
def test_more_qk_parameters_in_the_checkpoint_than_the_flags_build_is_refused(arch, trained, loaded):
    from fairseq_qknorm.errors import QKNormConfigError

    source, _ = build_model(arch=arch, **trained)
    target, _ = build_model(arch=arch, **loaded)
    with pytest.raises(QKNormConfigError, match="the checkpoint has QK-norm parameters that these flags do not build"):
        target.load_state_dict(source.state_dict())
    with pytest.raises(QKNormConfigError, match="the checkpoint has no QK-norm parameters"):
        source.load_state_dict(target.state_dict())
