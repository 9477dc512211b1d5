"""Flag values QK-norm cannot mean: refused with one line naming the flag, by fairseq's parser or
when the model is built."""

import pytest

LM = ["--task", "language_modeling", "--arch", "transformer_lm_qknorm"]


def parse_training_flags(capsys, *flags, model=("--arch", "transformer_qknorm")):
    """fairseq-train's own parser, with the plugin's flags, in-process: the error line it ends with."""
    from conftest import USER_DIR
    from fairseq import options

    parser = options.get_training_parser()
    with pytest.raises(SystemExit) as e:
        options.parse_args_and_arch(parser, ["DATA", "--user-dir", USER_DIR, *model, *flags])
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


QK_REFUSED = [
    ("--qk-scale-init", "-3", "expected 'auto' or a positive finite number, got '-3'"),
    ("--qk-scale-init", "0", "expected 'auto' or a positive finite number, got '0'"),
    ("--qk-scale-init", "nan", "expected 'auto' or a positive finite number, got 'nan'"),
    ("--qk-scale-init", "inf", "expected 'auto' or a positive finite number, got 'inf'"),
    ("--qk-scale-init", "twelve", "expected 'auto' or a positive finite number, got 'twelve'"),
    ("--qk-length-percentile", "nan", "expected a percentile in (0, 100], got 'nan'"),
]


@pytest.mark.parametrize(
    "flag, value, expected",
    QK_REFUSED
    + [
        ("--word-dropout", "1", "expected a probability in [0, 1), got '1'"),
        ("--word-dropout", "-0.1", "expected a probability in [0, 1), got '-0.1'"),
    ],
)
def test_the_parser_refuses_values_the_technique_cannot_mean(capsys, flag, value, expected):
    assert parse_training_flags(capsys, flag, value).endswith(f"error: argument {flag}: {expected}")


@pytest.mark.parametrize("flag, value, expected", QK_REFUSED)
def test_the_language_models_parser_refuses_the_same_values(capsys, flag, value, expected):
    assert parse_training_flags(capsys, flag, value, model=LM).endswith(f"error: argument {flag}: {expected}")


def test_both_models_default_to_the_papers_qk_norm():
    """An architecture's QK-norm defaults, for a translation and a language model given no flag."""
    import argparse

    from fairseq.models import ARCH_CONFIG_REGISTRY

    import fairseq_qknorm  # noqa: F401

    flags = ("qk_norm", "qk_scale", "qk_scale_init", "qk_length_percentile", "qk_scale_per_head")
    defaults = []
    for arch in (
        "transformer_qknorm",
        "transformer_qknorm_paper",
        "transformer_lm_qknorm",
        "transformer_lm_qknorm_gpt",
    ):
        args = argparse.Namespace()
        ARCH_CONFIG_REGISTRY[arch](args)
        defaults.append({flag: getattr(args, flag) for flag in flags})
    assert defaults == [dict(zip(flags, ("l2", "learned", "auto", 97.5, False)))] * 4


def test_the_parser_keeps_values_the_technique_can_mean(capsys):
    from conftest import USER_DIR
    from fairseq import options

    flags = ["--qk-scale-init", "0.5", "--qk-length-percentile", "100", "--word-dropout", "0"]
    args = options.parse_args_and_arch(
        options.get_training_parser(), ["DATA", "--user-dir", USER_DIR, "--arch", "transformer_qknorm", *flags]
    )
    assert (args.qk_scale_init, args.qk_length_percentile, args.word_dropout) == (0.5, 100.0, 0.0)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        # values that never went through the parser: a hydra config, a saved Namespace
        (dict(qk_scale_init=-3.0), "--qk-scale-init: expected 'auto' or a positive finite number, got -3.0"),
        (dict(qk_scale_init=float("inf")), "--qk-scale-init: expected 'auto' or a positive finite number, got inf"),
        (dict(qk_scale="fixed", qk_scale_init=0.0), "--qk-scale-init: expected 'auto' or a positive finite number"),
        (dict(word_dropout=1.0), "--word-dropout: expected a probability in [0, 1), got 1.0"),
        (dict(qk_length_percentile=0.0), "--qk-length-percentile: expected a percentile in (0, 100], got 0.0"),
        (dict(qk_length_percentile=100.5), "--qk-length-percentile: expected a percentile in (0, 100], got 100.5"),
        # two flags that together mean nothing
        (
            dict(qk_scale_per_head=True, encoder_attention_heads=1, decoder_attention_heads=1),
            "--qk-scale-per-head: every attention has one head",
        ),
        (dict(qk_scale_per_head=True, qk_scale="none"), "--qk-scale-per-head: there is no g with --qk-scale none"),
    ],
)
def test_building_the_model_refuses_what_the_parser_never_saw(overrides, expected):
    from conftest import build_model

    from fairseq_qknorm.errors import QKNormConfigError

    with pytest.raises(QKNormConfigError) as e:
        build_model(**overrides)
    assert str(e.value).startswith(expected) and "\n" not in str(e.value)


def test_per_head_g_with_one_head_on_one_side_only_is_kept():
    from conftest import build_model

    model, _ = build_model(qk_scale_per_head=True, encoder_attention_heads=1)
    assert model.decoder.layers[0].self_attn.qk_scale.g.shape == (4, 1, 1)


@pytest.mark.parametrize(
    "flags, expected",
    [
        (
            ["--qk-scale-init", "-3"],
            "fairseq-train: error: argument --qk-scale-init: expected 'auto' or a positive finite number, got '-3'",
        ),
        (
            ["--qk-scale-per-head", "--encoder-attention-heads", "1", "--decoder-attention-heads", "1"],
            "error: --qk-scale-per-head: every attention has one head, so one g per head is one g per module; "
            "drop --qk-scale-per-head",
        ),
    ],
)
def test_fairseq_train_ends_with_one_line(toy_bin, tmp_path, flags, expected):
    from conftest import train

    proc = train(toy_bin / "bin", tmp_path / "ckpt", max_update=1, extra=flags, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == expected, proc.stderr[-2000:]


@pytest.mark.parametrize(
    "arch, module",
    [
        ("transformer_qknorm", "decoder.layers.1.encoder_attn"),
        ("transformer_qknorm", "encoder.layers.0.self_attn"),
        ("transformer_lm_qknorm_gpt2_tiny", "decoder.layers.1.self_attn"),
    ],
)
def test_a_learned_g_at_or_below_zero_is_logged_once(caplog, arch, module):
    import torch
    from conftest import build_model

    model, _ = build_model(arch, decoder_attention_heads=4)
    with torch.no_grad():
        model.get_submodule(module).qk_scale.g.fill_(-0.25)
    with caplog.at_level("WARNING"):
        model.set_num_updates(7)  # what fairseq's trainer calls before every update
        model.set_num_updates(8)
    warnings = [r.getMessage() for r in caplog.records if "learned g" in r.getMessage()]
    assert warnings == [
        f"qk-norm: the learned g {module}.qk_scale.g is -0.25 at update 7: "
        "g <= 0 turns attention towards the least similar keys (lower the learning rate, or "
        "the weight decay on g)"
    ]


@pytest.mark.parametrize(
    "value, effect",
    [(5.0, None), (1.0, None), (19.99, None), (1e9, "one-hot (training may diverge)"), (0.5, "nearly uniform")],
)
def test_a_scale_init_no_sentence_length_gives_is_one_warning_line(caplog, value, effect):
    from conftest import build_model

    with caplog.at_level("WARNING"):
        build_model(qk_scale_init=value)  # fairseq's default positions: 1024, g0 up to log2(1024^2 - 1024) = 19.9986
    warnings = [r.getMessage() for r in caplog.records if "--qk-scale-init" in r.getMessage()]
    assert warnings == (
        []
        if effect is None
        else [
            f"qk-norm: --qk-scale-init {value:g} is outside [1, 20], the values log2(L^2-L) of the sentence "
            f"lengths L from 2 to 1024 this model takes: attention starts {effect}"
        ]
    )


def test_fairseq_train_warns_and_inspect_reads_a_checkpoint_with_an_absurd_scale_init(toy_bin, tmp_path):
    from conftest import run, tool, train

    flags = ["--qk-scale-init", "1e9", "--max-source-positions", "64", "--max-target-positions", "64"]
    proc = train(toy_bin / "bin", tmp_path, max_update=1, extra=[*flags, "--disable-validation"])
    assert (
        "qk-norm: --qk-scale-init 1e+09 is outside [1, 11.98], the values log2(L^2-L) of the sentence lengths L "
        "from 2 to 64 this model takes: attention starts one-hot (training may diverge)"
    ) in proc.stdout + proc.stderr
    shown = run([tool("fairseq-qknorm-inspect"), "g", tmp_path / "checkpoint_last.pt"], check=False)
    assert shown.returncode == 0 and "Traceback" not in shown.stderr, shown.stderr[-3000:]
    assert shown.stdout.splitlines()[1] == "g0 = 1e+09 (log2(L^2 - L) of no sentence length L)"
