"""The plugin through fairseq's real command-line tools, in subprocesses, on a generated corpus:
fairseq-preprocess (fixture), fairseq-train, resume, fairseq-generate, fairseq-interactive, hub
loading, fairseq-hydra-train; every checkpoint read by torch's safe (weights_only) unpickler."""

import math
import re
import shutil
import textwrap

import numpy as np
import pytest
from conftest import TINY_MODEL, USER_DIR, decode, run, tool, train

import fairseq_qknorm  # noqa: F401  (allow-lists fairseq checkpoint classes for torch.load)


def hypotheses(stdout):
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^H-(\d+)\t\S+\t(.*)$", stdout, re.M)}


def test_train_logs_L_and_g0_and_saves_g0(trained):
    import torch

    _, save = trained
    log = (save / "train.log").read_text()
    pattern = (
        r"qk-norm: L=(\d+) \(97.5th percentile of the 'train' pairs' lengths: src-tgt 800\) g0=log2\(L\^2-L\)=([\d.]+)"
    )
    m = re.search(pattern, log)
    assert m, log[-3000:]
    length, g0 = int(m.group(1)), float(m.group(2))
    # L is the 97.5th percentile (an observed length) of the longer side's subword counts: counted
    # here from the sentencepiece-encoded text the data was binarized from.
    data = trained[0].parent  # toy_bin: bin/ and the encoded train.sp.{src,tgt}
    percentiles = [
        int(
            np.percentile(
                [len(line.split()) for line in (data / f"train.sp.{side}").read_text().splitlines()],
                97.5,
                method="lower",
            )
        )
        for side in ("src", "tgt")
    ]
    assert length == max(percentiles)
    ckpt = torch.load(save / "checkpoint_best.pt")  # weights_only=True, torch's default
    assert ckpt["cfg"]["model"].qk_scale_init == pytest.approx(g0, abs=1e-4)
    assert g0 == pytest.approx(math.log2(length * length - length), abs=1e-4)
    gs = {k: v for k, v in ckpt["model"].items() if k.endswith("qk_scale.g")}
    assert len(gs) == 2 + 2 * 2  # 2 encoder layers (self) + 2 decoder layers (self, cross)
    assert all(v.dtype == torch.float32 for v in gs.values())
    assert any(abs(v.item() - g0) > 1e-4 for v in gs.values()), "g did not learn"


def test_the_dev_loss_in_the_log_is_the_loss_of_the_saved_model(trained):
    """fairseq-train validates the model it is training (the paper's system: a FixNorm output
    projection, which caches its unit matrix for inference) after several epochs of updates;
    fairseq-validate, in a new process, loads the last checkpoint. They must see the same model."""
    data, save = trained
    logged = re.findall(r"valid on 'valid' subset \| loss ([\d.]+)", (save / "train.log").read_text())
    assert len(logged) >= 3, "needs validations after several epochs of updates"
    proc = run(
        [
            tool("fairseq-validate"),
            data,
            "--task",
            "translation",
            "--user-dir",
            USER_DIR,
            "--path",
            save / "checkpoint_last.pt",
            "--cpu",
            "--max-tokens",
            "1500",
            "--required-batch-size-multiple",  # the batches fairseq-train validated on
            "1",
            "--num-workers",
            "0",
        ]
    )
    (fresh,) = re.findall(r"valid on 'valid' subset \| loss ([\d.]+)", proc.stdout + proc.stderr)
    assert float(logged[-1]) == pytest.approx(float(fresh), abs=0.001)


def test_checkpoint_needs_the_plugin_to_load_safely(trained):
    """Without the plugin's allow-list torch refuses the checkpoint; with it, it loads. No
    environment variable or weights_only=False is involved. One process: torch alone tries first,
    then the plugin is imported and torch loads the same file."""
    _, save = trained
    code = textwrap.dedent("""
        import sys, torch
        try:
            torch.load(sys.argv[1])
            print("without the plugin: loaded")
        except Exception as e:
            print("without the plugin: refused:", " ".join(str(e).split()))
        import fairseq_qknorm
        torch.load(sys.argv[1])
        print("with the plugin: loaded")
    """)
    out = run([tool("python"), "-c", code, save / "checkpoint_best.pt"]).stdout
    bare = re.search(r"^without the plugin: (.*)$", out, re.M).group(1)
    assert bare.startswith("refused:") and "argparse.Namespace" in bare, bare
    assert "\nwith the plugin: loaded\n" in out, out


def test_resume_from_checkpoint_last(trained, tmp_path):
    data, save = trained
    resumed = tmp_path / "ckpt"
    shutil.copytree(save, resumed)
    proc = train(data, resumed, arch="transformer_qknorm_paper", max_update=61)  # one update past it
    out = proc.stdout + proc.stderr
    assert re.search(r"Loaded checkpoint .*checkpoint_last\.pt \(epoch \d+ @ 60 updates\)", out), out[-3000:]
    assert "num_updates 61" in out


def test_generate_beam4_translates_every_sentence(trained, toy_raw):
    data, save = trained
    proc = decode(
        "fairseq-generate",
        data,
        save / "checkpoint_best.pt",
        "--beam 4 --batch-size 16 --required-batch-size-multiple 1 --remove-bpe sentencepiece --cpu",
    )
    hyps = hypotheses(proc.stdout)
    n_test = len((toy_raw / "test.src").read_text().splitlines())
    assert sorted(hyps) == list(range(n_test))
    assert "BLEU4 = " in proc.stdout


def test_interactive_translates_stdin(trained, toy_bin):
    data, save = trained
    lines = (toy_bin / "test.sp.src").read_text().splitlines()[:3]
    proc = decode(
        "fairseq-interactive",
        data,
        save / "checkpoint_best.pt",
        "--beam 4 --source-lang src --target-lang tgt --cpu",
        input="\n".join(lines) + "\n",
    )
    assert sorted(hypotheses(proc.stdout)) == [0, 1, 2]


def test_hub_from_pretrained_translates(trained, toy_bin, toy_raw):
    data, save = trained
    sentence = (toy_raw / "test.src").read_text().splitlines()[0]
    code = textwrap.dedent(f"""
        from fairseq.models.transformer import TransformerModel
        hub = TransformerModel.from_pretrained({str(save)!r}, checkpoint_file="checkpoint_best.pt",
            data_name_or_path={str(data)!r}, user_dir={USER_DIR!r}, bpe="sentencepiece",
            sentencepiece_model={str(toy_bin / "spm.model")!r}, source_lang="src", target_lang="tgt")
        print("OUT:" + hub.translate({sentence!r}, beam=4))
        print("G:" + str(float(hub.models[0].encoder.layers[0].self_attn.qk_scale.g)))
    """)
    proc = run([tool("python"), "-c", code])
    out = re.search(r"^OUT:(.+)$", proc.stdout, re.M)
    assert out and out.group(1).strip(), proc.stdout
    assert "▁" not in out.group(1)  # sentencepiece was decoded


def test_hydra_train_with_the_shipped_config(toy_bin, tmp_path):
    save = tmp_path / "ckpt"
    overrides = [
        f"+model.{flag[2:].replace('-', '_')}={value}" for flag, value in zip(TINY_MODEL[::2], TINY_MODEL[1::2])
    ]
    proc = run(
        [
            tool("fairseq-hydra-train"),
            "--config-dir",
            f"{USER_DIR}/config",
            "--config-name",
            "ted_glen_qknorm",
            f"task.data={toy_bin / 'bin'}",
            f"common.user_dir={USER_DIR}",
            "task.eval_bleu=false",
            "checkpoint.best_checkpoint_metric=loss",
            "checkpoint.maximize_best_checkpoint_metric=false",
            "optimization.max_update=3",
            f"checkpoint.save_dir={save}",
            "common.cpu=true",
            "dataset.num_workers=0",
            "+model.qk_norm=rmsnorm",
            *overrides,
        ],
        cwd=tmp_path,
    )  # hydra writes outputs/ in cwd
    out = proc.stdout + proc.stderr
    assert "qk-norm: L=" in out and "num_updates 3" in out, out[-3000:]
    import torch

    ckpt = torch.load(save / "checkpoint_last.pt")
    assert ckpt["cfg"]["model"]["_name"] == "transformer_qknorm_paper_glen"
    assert isinstance(ckpt["cfg"]["model"]["qk_scale_init"], float)
    assert any(k.endswith("self_attn.q_norm.weight") for k in ckpt["model"])  # rmsnorm took effect
