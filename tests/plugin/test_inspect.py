"""fairseq-qknorm-inspect on tiny models trained here: the g it prints are the checkpoint's, its
attention statistics agree with ones computed independently, its PNGs are real images whose panel
titles name each system and do not overlap, and bad input gets one clear line."""

import json
import math
import sys
from argparse import Namespace

import pytest
import torch
import torch.nn.functional as F
from conftest import run, tool, train

from fairseq_qknorm_cli import inspect_checkpoints as inspect_cli
from fairseq_qknorm_cli import plots

BASELINE = "baseline: LayerNorm, scaled dot product"  # fairseq's stock transformer
QKNORM = "QKNorm: LayerNorm, l2 + learned g"  # transformer_qknorm_paper


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These tests run tiny models in this process: on a busy 2-core machine, torch's second thread
    only spins (each small matmul then takes milliseconds)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def baseline(toy_bin, tmp_path_factory):
    """fairseq's stock transformer (stock MultiheadAttention), a few updates on the same data."""
    save = tmp_path_factory.mktemp("ckpt_stock")
    train(
        toy_bin / "bin",
        save,
        arch="transformer",
        extra=["--no-epoch-checkpoints", "--disable-validation"],
        max_update=3,
    )
    return save / "checkpoint_last.pt"


def inspect_json(capsys, *args):
    inspect_cli.main([str(a) for a in args] + ["--json"])
    return json.loads(capsys.readouterr().out)


def usage_error(capsys, *args):
    """The last line argparse writes for a command line it refuses (after the usage)."""
    with pytest.raises(SystemExit) as exit_:
        inspect_cli.main([str(a) for a in args])
    assert exit_.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def checkpoint_g(path):
    import fairseq_qknorm  # noqa: F401  (allow-lists the checkpoint's classes)

    model = torch.load(path, map_location="cpu", weights_only=True)["model"]
    return {k: v for k, v in model.items() if k.endswith(".qk_scale.g")}


def test_L_of_a_layernorm_g0_counts_the_head_dim(capsys):
    """With --qk-norm layernorm, `auto` starts g at log2(L^2 - L) / head_dim (qk_flags.for_the_norm):
    the L reported is the sentence length, and the range g is compared with is over head_dim too."""
    from conftest import build_model

    from fairseq_qknorm.length_prior import g0_for_length

    g0 = g0_for_length(40) / 8  # 32 wide, 4 heads
    model, _ = build_model(qk_norm="layernorm", qk_scale="learned", qk_scale_init=g0)
    cfg = Namespace(arch="transformer_qknorm", qk_norm="layernorm", qk_scale="learned", qk_scale_init=g0)
    cfg.__dict__.update(
        encoder_embed_dim=32, decoder_embed_dim=32, encoder_attention_heads=4, decoder_attention_heads=4
    )
    t = inspect_cli.temperatures("checkpoint.pt", {"model": model.state_dict(), "args": cfg})
    assert t["L"] == pytest.approx(40)
    assert t["summary"]["within"] == 6  # every g at its g0, 12.6 / 8, within (10, 25) / 8
    inspect_cli.print_temperatures(t)
    out = capsys.readouterr().out
    assert f"g0 = {g0:.4f} = log2(L^2 - L)/8 (head_dim: the length^2 of a layernorm output), L = 40" in out
    assert "within 1.25-3.125, the range Bricken & Pehlevan read off trained QKNorm heads over head_dim 8" in out


def test_printed_g_are_the_checkpoint_parameters(trained, capsys):
    _, save = trained
    path = save / "checkpoint_last.pt"
    params = checkpoint_g(path)
    assert len(params) == 6  # TINY_MODEL: 2 encoder self, 2 decoder self, 2 decoder cross
    side = {
        "encoder self": "encoder.layers.{}.self_attn",
        "decoder self": "decoder.layers.{}.self_attn",
        "decoder cross": "decoder.layers.{}.encoder_attn",
    }

    (t,) = inspect_json(capsys, "g", path)
    assert t["name"] == QKNORM
    assert len(t["g"]) == len(params)
    for row in t["g"]:
        assert row["head"] is None
        assert row["g"] == params[side[row["module"]].format(row["layer"]) + ".qk_scale.g"].item()
    saved = torch.load(path, map_location="cpu", weights_only=True)
    assert t["g0"] == saved["cfg"]["model"].qk_scale_init
    assert t["L"] ** 2 - t["L"] == pytest.approx(2 ** t["g0"])
    assert t["num_updates"] == saved["optimizer_history"][-1]["num_updates"]

    inspect_cli.main(["g", str(path)])
    text = capsys.readouterr().out
    assert text.startswith(f"{QKNORM} ({path}): transformer_qknorm_paper, {t['num_updates']} updates")
    table = [line.split() for line in text.splitlines()]
    for row in t["g"]:  # e.g. "decoder cross  1  -  10.8929  -0.1853"
        cells = row["module"].split() + [str(row["layer"]), "-", f"{row['g']:.4f}", f"{row['g'] - t['g0']:+.4f}"]
        assert cells in table, (cells, text)
    assert text.rstrip().splitlines()[-1].startswith("summary: 6 g from")

    (named,) = inspect_json(capsys, "g", path, "--labels", "paper QKNorm")
    assert named == {**t, "name": "paper QKNorm"}


def test_a_fixed_g_is_reported_as_fixed_not_as_a_length(capsys):
    # --qk-scale fixed --qk-scale-init 1 (the paper's no-g ablation): 1 = log2(L^2 - L) for L = 2, but
    # no length was involved, and there is nothing learned to tabulate
    t = {
        "checkpoint": "ckpt.pt",
        "name": "QKNorm: LayerNorm, l2 + fixed g",
        "arch": "transformer_qknorm_paper",
        "num_updates": 300,
        "qk_norm": "l2",
        "qk_scale": "fixed",
        "per_head": False,
        "g0": 1.0,
        "L": None,
        "g": [{"module": "encoder self", "layer": 0, "head": None, "g": 1.0}],
    }
    inspect_cli.print_temperatures(t)
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "g = 1.0000 in every module, fixed (--qk-scale fixed --qk-scale-init 1): not learned"
    assert len(out) == 2 and "L =" not in "".join(out)


def test_checkpoint_without_qknorm_gets_one_line(baseline):
    proc = run([tool("fairseq-qknorm-inspect"), "g", baseline], check=False)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and str(baseline) in last and "no QKNorm temperature g" in last
    assert BASELINE in last and "fairseq-qknorm-inspect stats" in last


def test_a_checkpoint_without_g_among_several_gets_its_line(baseline, trained, capsys):
    _, save = trained
    qknorm = save / "checkpoint_last.pt"
    stock, with_g = inspect_json(capsys, "g", baseline, qknorm)
    assert [with_g] == inspect_json(capsys, "g", qknorm)
    assert stock == {
        "checkpoint": str(baseline),
        "name": BASELINE,
        "arch": "transformer",
        "num_updates": 3,
        "qk_norm": None,
        "qk_scale": None,
        "g": [],
    }
    inspect_cli.main(["g", str(baseline), str(qknorm)])
    text = capsys.readouterr().out.splitlines()
    assert text[:3] == [
        f"{BASELINE} ({baseline}): transformer, 3 updates",
        f"{baseline} has no QKNorm temperature g (no '*.qk_scale.g' parameter; arch transformer, {BASELINE}); "
        "`fairseq-qknorm-inspect stats` gives attention statistics for any checkpoint",
        "",
    ]
    assert text[3].startswith(f"{QKNORM} ({qknorm}): transformer_qknorm_paper, {with_g['num_updates']} updates")


def test_each_subcommand_refuses_what_it_cannot_use(tmp_path, capsys):
    ckpt = tmp_path / "checkpoint_best.pt"
    ckpt.write_bytes(b"")  # exists: argparse looks no further
    prog = "fairseq-qknorm-inspect"
    assert usage_error(capsys) == f"{prog}: error: the following arguments are required: COMMAND"
    assert usage_error(capsys, "g") == f"{prog} g: error: the following arguments are required: CKPT"
    missing = tmp_path / "nope.pt"
    assert usage_error(capsys, "g", missing) == f"{prog} g: error: argument CKPT: no such file: {missing}"
    assert usage_error(capsys, "stats", ckpt) == f"{prog} stats: error: the following arguments are required: --data"
    assert (
        usage_error(capsys, "stats", ckpt, "--data", tmp_path / "bin")
        == f"{prog} stats: error: argument --data: no such directory: {tmp_path / 'bin'}"
    )
    assert usage_error(capsys, "stats", ckpt, ckpt, ckpt, "--data", tmp_path).startswith(
        f"{prog}: error: unrecognized arguments: {ckpt}"
    )  # two checkpoints at most, side by side
    assert (
        usage_error(capsys, "heatmaps", ckpt, "--sentence", "a b", "--png-dir", tmp_path)
        == f"{prog} heatmaps: error: the following arguments are required: --spm"
    )
    assert (
        usage_error(capsys, "heatmaps", ckpt, "--spm", ckpt, "--png-dir", tmp_path)
        == f"{prog} heatmaps: error: the following arguments are required: --sentence"
    )
    assert (
        usage_error(capsys, "g-history", tmp_path)
        == f"{prog} g-history: error: the following arguments are required: --png-dir"
    )
    assert usage_error(capsys, "g", ckpt, "--labels", "a", "b") == f"{prog} g: error: --labels: 2 given for 1 CKPT"
    assert (
        usage_error(capsys, "stats", ckpt, ckpt, "--data", tmp_path, "--labels", "baseline")
        == f"{prog} stats: error: --labels: 1 given for 2 CKPT"
    )
    assert (
        usage_error(capsys, "g-history", tmp_path, "--png-dir", tmp_path, "--labels", "a", "b")
        == f"{prog} g-history: error: --labels: 2 given for 1 CKPT_DIR"
    )
    assert usage_error(capsys, "stats", ckpt, "--data", tmp_path, "--sentence", "a b").endswith(
        "unrecognized arguments: --sentence a b"
    )  # heatmaps' flag, not stats'


@pytest.mark.parametrize("command", ["heatmaps", "g-history"])
def test_figures_without_matplotlib_say_which_extra_to_install(tmp_path, monkeypatch, command):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    args = {
        "heatmaps": [tmp_path / "ckpt.pt", "--sentence", "a b", "--spm", tmp_path / "ckpt.pt"],
        "g-history": [tmp_path],
    }[command]
    (tmp_path / "ckpt.pt").write_bytes(b"")
    with pytest.raises(SystemExit) as exit_:
        inspect_cli.main([command, *map(str, args), "--png-dir", str(tmp_path / "png")])
    assert exit_.value.code == "error: --png-dir needs matplotlib: pip install 'fairseq-qknorm[plot]'"


def test_system_names_come_from_the_config():
    name = inspect_cli.system_name
    assert name(Namespace(arch="transformer")) == BASELINE  # no qk options at all
    assert (
        name(Namespace(norm_type="scalenorm", qk_norm="none", qk_scale="none"))
        == "baseline: ScaleNorm, scaled dot product"
    )
    assert name(Namespace(norm_type="layernorm", qk_norm="l2", qk_scale="learned")) == QKNORM
    assert (
        name(Namespace(norm_type="scalenorm", qk_norm="l2", qk_scale="learned", qk_scale_per_head=True))
        == "QKNorm: ScaleNorm, l2 + learned g per head"
    )
    assert name(Namespace(norm_type="layernorm", qk_norm="l2", qk_scale="fixed")) == "QKNorm: LayerNorm, l2 + fixed g"
    assert (
        name(Namespace(norm_type="layernorm", qk_norm="rmsnorm", qk_scale="none"))
        == "QKNorm: LayerNorm, rmsnorm, scaled dot product"
    )


def test_paths_are_told_apart_by_the_part_that_differs():
    parts = inspect_cli.distinct_parts
    assert parts(
        ["w/arms/baseline-seed1/checkpoints/checkpoint_best.pt", "w/arms/qknorm-seed1/checkpoints/checkpoint_best.pt"]
    ) == ["baseline-seed1", "qknorm-seed1"]
    assert parts(["run/checkpoint3.pt", "run/checkpoint_best.pt"]) == ["checkpoint3.pt", "checkpoint_best.pt"]
    assert parts(["a/b.pt", "a/x/b.pt"]) == ["b.pt", "x/b.pt"]  # one is not left empty
    assert parts(["/abs/a.pt", "rel/a.pt"]) == ["/abs", "rel"]
    assert parts(["only/checkpoint_best.pt"]) == ["only/checkpoint_best.pt"]
    assert parts(["c.pt", "./c.pt"]) == ["c.pt", "./c.pt"]  # the same file: nothing tells them apart


def _modules(model):
    from fairseq_qknorm_cli.attention_stats import attention_module

    return {attention_module(n): m for n, m in model.named_modules() if attention_module(n)}


def _head_weights(module, call):
    """(heads, tgt, src) weights of one attention call, not through the tool's recording."""
    from fairseq_qknorm.qknorm_attention import QKNormAttention

    if isinstance(module, QKNormAttention):
        _, w = module(**{**call, "need_weights": True, "need_head_weights": True})
        return w[:, 0]
    # fairseq's stock attention: recompute it with torch's own implementation, per head.
    _, w = F.multi_head_attention_forward(
        call["query"],
        call["key"],
        call["value"],
        module.embed_dim,
        module.num_heads,
        None,
        torch.cat([module.q_proj.bias, module.k_proj.bias, module.v_proj.bias]),
        None,
        None,
        False,
        0.0,
        module.out_proj.weight,
        module.out_proj.bias,
        training=False,
        key_padding_mask=call.get("key_padding_mask"),
        need_weights=True,
        attn_mask=call.get("attn_mask"),
        use_separate_proj_weight=True,
        q_proj_weight=module.q_proj.weight,
        k_proj_weight=module.k_proj.weight,
        v_proj_weight=module.v_proj.weight,
        average_attn_weights=False,
    )
    return w[0]


def independent_stats(path, data):
    """The statistics, one unpadded sentence pair at a time, from weights captured here."""
    from fairseq import checkpoint_utils

    import fairseq_qknorm  # noqa: F401

    (model,), _, task = checkpoint_utils.load_model_ensemble_and_task([str(path)], arg_overrides={"data": str(data)})
    model.eval()
    task.load_dataset("valid")
    dataset = task.dataset("valid")
    eos = task.target_dictionary.eos()
    modules = _modules(model)
    sums = {where: [0, 0.0, 0.0, 0] for where in modules}  # rows, entropy, max weight, saturated
    for i in range(len(dataset)):
        src, tgt = dataset[i]["source"], dataset[i]["target"]
        prev = torch.cat([torch.tensor([eos]), tgt[:-1]])
        calls = {}
        hooks = [
            m.register_forward_pre_hook(
                lambda m, a, kw, where=w, calls=calls: calls.__setitem__(where, kw), with_kwargs=True
            )
            for w, m in modules.items()
        ]
        with torch.no_grad():
            model(src[None], torch.tensor([len(src)]), prev[None])
            for h in hooks:
                h.remove()
            for where, module in modules.items():
                w = _head_weights(module, calls[where]).double()
                if where[0] == "decoder self":
                    w = w[:, 1:]  # the first target position has one key only: no choice
                s = sums[where]
                s[0] += w.shape[0] * w.shape[1]
                s[1] += float(-(w * w.clamp_min(1e-300).log()).sum())
                s[2] += float(w.max(dim=-1).values.sum())
                s[3] += int((w.max(dim=-1).values > 0.9).sum())
    return {
        where: {"rows": r, "entropy": e / r, "max_weight": m / r, "saturated": n / r}
        for where, (r, e, m, n) in sums.items()
    }, len(dataset)


def test_attention_statistics_match_independent_computation(trained, baseline, capsys):
    data, save = trained
    qknorm = save / "checkpoint_last.pt"
    report = inspect_json(capsys, "stats", baseline, qknorm, "--data", data, "--subset", "valid", "--cpu")
    assert [c["checkpoint"] for c in report["checkpoints"]] == [str(baseline), str(qknorm)]
    assert [c["name"] for c in report["checkpoints"]] == [BASELINE, QKNORM]
    g = {k: v.item() for k, v in checkpoint_g(qknorm).items()}
    for run_, path in zip(report["checkpoints"], (baseline, qknorm)):
        expected, sentences = independent_stats(path, data)
        assert run_["sentences"] == sentences
        got = {(m["module"], m["layer"]): m for m in run_["modules"]}
        assert set(got) == set(expected) and len(got) == 6
        for where, e in expected.items():
            m = got[where]
            assert m["rows"] == e["rows"]  # padding and the one-key rows left out, nothing else
            for key in ("entropy", "max_weight", "saturated"):
                assert m[key] == pytest.approx(e[key], abs=2e-5), (path.parent.name, where, key)
            assert math.isfinite(m["logit_min"]) and m["logit_min"] < m["logit_max"]
            if path == qknorm:  # unit q and k: every logit is g * cos, inside [-g, g]
                side, layer = ("encoder", where[1]) if where[0] == "encoder self" else ("decoder", where[1])
                name = "encoder_attn" if where[0] == "decoder cross" else "self_attn"
                bound = g[f"{side}.layers.{layer}.{name}.qk_scale.g"]
                assert -bound - 1e-4 <= m["logit_min"] and m["logit_max"] <= bound + 1e-4

    inspect_cli.print_attention(report)
    text = capsys.readouterr().out
    assert f"[1] {BASELINE} ({baseline}, transformer)" in text.splitlines()
    assert f"[2] {QKNORM} ({qknorm}, transformer_qknorm_paper)" in text.splitlines()
    table = [line.split() for line in text.splitlines()]
    for base, qk in zip(*(c["modules"] for c in report["checkpoints"])):  # side by side, one row each
        assert [
            *base["module"].split(),
            str(base["layer"]),
            f"{base['entropy']:.3f}",
            f"{base['max_weight']:.3f}",
            f"{100 * base['saturated']:.1f}%",
            f"{base['logit_min']:.2f}",
            "..",
            f"{base['logit_max']:.2f}",
            f"{qk['entropy']:.3f}",
            f"{qk['max_weight']:.3f}",
            f"{100 * qk['saturated']:.1f}%",
            f"{qk['logit_min']:.2f}",
            "..",
            f"{qk['logit_max']:.2f}",
        ] in table


def _png_size(path):
    from PIL import Image

    with Image.open(path) as image:
        assert image.format == "PNG"
        image.verify()
    with Image.open(path) as image:
        return image.size


def _overlap(a, b):
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def _titles(fig):
    """{panel title: its box} of every panel, after checking that no two titles overlap, nor the
    figure's title, and that each lies inside the figure."""
    boxes = {ax.get_title(): ax.title.get_window_extent() for ax in fig.axes if ax.get_title()}
    figure = fig.bbox
    for title, box in boxes.items():
        assert figure.x0 <= box.x0 and box.x1 <= figure.x1, title
        assert not _overlap(box, fig._suptitle.get_window_extent()), title
        assert not any(_overlap(box, other) for t, other in boxes.items() if t != title), title
    return boxes


def test_heatmaps_name_each_system_and_are_valid_pngs(
    trained, baseline, toy_bin, toy_raw, tmp_path, capsys, monkeypatch
):
    _, save = trained
    qknorm = save / "checkpoint_last.pt"
    figures = []
    save_png = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or save_png(fig, path))
    sentence = min((toy_raw / "test.src").read_text().splitlines(), key=len)  # few labels to draw
    heatmaps = ["heatmaps", baseline, qknorm, "--sentence", sentence, "--spm", toy_bin / "spm.model", "--cpu"]
    result = inspect_json(capsys, *heatmaps, "--png-dir", tmp_path / "png")
    assert result["names"] == [BASELINE, QKNORM]
    assert result["target_from"] == f"greedy translation by {BASELINE}" and result["target"]
    assert [f["module"] for f in result["files"]] == ["encoder self", "decoder self", "decoder cross"]
    tokens = result["tokens"][0]
    n_src, n_tgt, layers = len(tokens["source"]), len(tokens["target"]), 2
    queries = {"encoder self": n_src, "decoder self": n_tgt, "decoder cross": n_tgt}
    keys = {"encoder self": n_src, "decoder self": n_tgt, "decoder cross": n_src}
    for f in result["files"]:
        expected = (
            round(2 * plots.panel_inches(keys[f["module"]]) * plots.DPI),
            round(layers * plots.panel_inches(queries[f["module"]]) * plots.DPI),
        )
        assert _png_size(f["path"]) == expected == (f["width"], f["height"])
    assert not list((tmp_path / "png").glob("*.tmp"))
    # Each panel: the system's name, then the part of its path that differs, then the layer.
    for fig in figures:
        titles = [" ".join(t.split()) for t in _titles(fig)]
        assert titles == [
            f"{name} {path.parent.name} layer {layer}"
            for layer in range(layers)
            for name, path in ((BASELINE, baseline), (QKNORM, qknorm))
        ]

    figures.clear()
    result = inspect_json(
        capsys,
        *heatmaps,
        "--target",
        result["target"],
        "--png-dir",
        tmp_path / "named",
        "--labels",
        "stock",
        "paper system",
    )
    assert result["names"] == ["stock", "paper system"] and result["target_from"] == "given"
    assert [" ".join(t.split()) for t in _titles(figures[0])][:2] == [
        f"stock {baseline.parent.name} layer 0",
        f"paper system {qknorm.parent.name} layer 0",
    ]


def test_g_history_is_a_valid_png(trained, tmp_path, capsys):
    _, save = trained
    history = inspect_json(capsys, "g-history", save, "--png-dir", tmp_path / "png")
    assert history["name"] == QKNORM
    w, h = plots.G_HISTORY_INCHES
    assert _png_size(history["file"]["path"]) == (round(w * plots.DPI), round(h * plots.DPI))
    last = checkpoint_g(save / "checkpoint_last.pt")
    assert len(history["g"]) == len(last) == 6
    assert history["g"]["decoder cross 1"][-1] == last["decoder.layers.1.encoder_attn.qk_scale.g"].item()


@pytest.mark.parametrize("layers", [2, 12])
def test_the_g_history_legend_stands_beside_the_lines(tmp_path, monkeypatch, layers):
    figures = []
    save_png = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or save_png(fig, path))
    updates = [0, 100, 200]
    series = {
        f"{kind} {layer}": (kind, layer, [11.0, 11.5 + layer / 10, 12.0 + layer / 5])
        for kind in ("encoder self", "decoder self", "decoder cross")
        for layer in range(layers)
    }
    plots.g_history(str(tmp_path / "g.png"), "learned temperature g over training", updates, series, 11.0, (10.0, 25.0))
    (fig,) = figures
    (ax,) = fig.axes
    legends = fig.legends + [ax.get_legend()] * (ax.get_legend() is not None)
    assert len(legends) == 1 and len(legends[0].get_texts()) == len(series) + 2  # a module each, g0, the band
    box, figure = legends[0].get_window_extent(), fig.bbox
    assert not _overlap(box, ax.get_window_extent()) and not _overlap(box, fig._suptitle.get_window_extent())
    assert figure.x0 <= box.x0 and box.x1 <= figure.x1 and figure.y0 <= box.y0 and box.y1 <= figure.y1
