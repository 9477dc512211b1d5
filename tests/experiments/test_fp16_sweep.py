"""The fp16 learning-rate sweep (experiments.fp16_sweep, the fp32 sweep's runs with --fp16 and their
own training loop on the sweep engine) end to end on two tiny runs: what each record holds per
attempted update, the command with no folder of the machine, and a rerun that trains nothing; a run
at a rate that overflows at once, with where it overflowed; the module that first overflows, found
in-process on a tiny fp16 model; and two processes sweeping into one results.json."""

import json
import math
import sys

import pytest
from conftest import build_model, run

from experiments.fp16_sweep import FP16_MAX, OUTPUT_LOGITS, first_non_finite, largest_values, site_value

SWEEP = [sys.executable, "-m", "experiments.fp16_sweep"]
TINY = ["--arms", "stock", "qknorm", "--lrs", "0.1", "--updates", "3", "--warmup-updates", "2", "--stats-interval", "2"]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The sweeps' WORK: the toy corpus, binarized by the first sweep, reused by the next."""
    return tmp_path_factory.mktemp("fp16_sweep_work")


def test_tiny_fp16_sweep_records_every_attempted_update(work, tmp_path):
    out = tmp_path / "out"
    proc = run([*SWEEP, "--work-dir", work, "--out-dir", out, *TINY, "--threads", "1"])
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["precision"] == "--fp16" and results["command"].startswith(
        "python -m experiments.fp16_sweep --work-dir $WORK "
    )
    assert [r["arm"] for r in results["runs"]] == ["stock", "qknorm"]
    for r in results["runs"]:
        assert r["outcome"] == "finished" and r["applied"].count(True) == 3
        assert len(r["loss"]) == len(r["applied"]) == len(r["loss_scale"])
        assert all(loss is None or math.isfinite(loss) for loss in r["loss"])
        assert r["command"].startswith("fairseq-train DATA_BIN --user-dir USER_DIR ") and r["command"].endswith(
            " --fp16"
        )
        assert str(work) not in r["command"] and str(tmp_path) not in r["command"]
        assert [s["update"] for s in r["stats"]] == [0, 2, 3] and all("fp16_loss" in s for s in r["stats"])
        assert r["forward_overflow"] == [None] * len(r["applied"]) and r["overflow_site"] is None
        for s in r["stats"]:  # the largest values of every logged update, on the float32 copy
            groups = s["max_abs"]
            assert list(groups["attention logits"]) == list(s["max_logit"])
            assert list(groups["output logits"]) == [OUTPUT_LOGITS]
            assert sorted(groups["ffn hidden"]) == [
                f"{side}.layers.{i}.fc1" for side in ("decoder", "encoder") for i in (0, 1)
            ]
            assert sorted(groups["layer output"]) == [
                f"{side}.layers.{i}" for side in ("decoder", "encoder") for i in (0, 1)
            ]
            assert all(0 < v < FP16_MAX for group in groups.values() for v in group.values())
        assert r["max_output_logit"] == max(s["max_abs"]["output logits"][OUTPUT_LOGITS] for s in r["stats"])
    for name in ("loss_scale.png", "max_logit_vs_lr.png", "layer_output.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    assert "| stock | 0.1 | 1 | finished | 3 |" in proc.stdout

    again = run([*SWEEP, "--work-dir", work, "--out-dir", out, *TINY, "--threads", "1"])
    assert "keeping 2 finished runs" in again.stdout and "update 2 | attempts" not in again.stdout
    assert json.loads((out / "results.json").read_text())["runs"] == results["runs"]

    # The same sweep run in two parts (one process per arm, as the GPU call does), merged
    parts = []
    for i, r in enumerate(results["runs"]):
        parts.append(tmp_path / f"part{i}.json")
        parts[-1].write_text(json.dumps({**results, "runs": [r]}))
    merged = run([*SWEEP, "merge", *reversed(parts), "--out-dir", tmp_path / "merged", "--command", "two parts"])
    assert json.loads((tmp_path / "merged" / "results.json").read_text())["runs"] == results["runs"]
    assert "| stock | 0.1 | 1 | finished | 3 |" in merged.stdout
    assert (tmp_path / "merged" / "loss_scale.png").is_file()


def test_on_cuda_the_runs_are_the_same_but_for_cpu(tmp_path):
    from experiments.fp16_sweep import fairseq_flags, parse_args

    on_cpu = fairseq_flags("BIN", "qknorm", 0.3, 1, 300, 75, "SAVE")
    on_cuda = fairseq_flags("BIN", "qknorm", 0.3, 1, 300, 75, "SAVE", device="cuda")
    assert "--cpu" in on_cpu and [f for f in on_cpu if f != "--cpu"] == on_cuda and on_cuda[-1] == "--fp16"
    assert parse_args(["--work-dir", str(tmp_path), "--out-dir", str(tmp_path)]).device == "cpu"


def test_a_run_that_overflows_records_where(work, tmp_path):
    """At peak rate 30 the weights leave fp16's range within a few updates: the run ends at the
    loss-scale floor, and its record says which module's fp16 output first was not finite in the
    failing forward pass, how large that output is in float32 on the failing batch, and the same
    module at each snapshot."""
    out = tmp_path / "out"
    flags = ["--arms", "qknorm", "--lrs", "30", "--updates", "5", "--warmup-updates", "2", "--stats-interval", "2"]
    proc = run([*SWEEP, "--work-dir", work, "--out-dir", out, *flags])
    (r,) = json.loads((out / "results.json").read_text())["runs"]
    assert r["outcome"] == "minimum loss scale" and r["applied"][-21:] == [False] * 21
    # every attempt of the final burst overflowed in its forward pass
    assert r["overflow_site"] == r["forward_overflow"][-1] and None not in r["forward_overflow"][-21:]
    assert site_value(r["failing_batch"], r["overflow_site"]) > FP16_MAX
    assert len(r["overflow_site_values"]) == len(r["stats"]) and None not in r["overflow_site_values"]
    assert r["max_output_logit"] >= r["failing_batch"]["outputs"][OUTPUT_LOGITS]
    assert (out / "overflow_sites.png").read_bytes()[:4] == b"\x89PNG"
    row = f"| qknorm | 30 | 1 | minimum loss scale at update {r['stopped_at_update']} | 21 (21) | 21: {r['overflow_site']} (21) |"
    assert row in proc.stdout


@pytest.fixture(scope="module")
def tiny_fp16():
    """A tiny stock Transformer in fp16 on the CPU, a batch for it and fairseq's criterion."""
    import argparse

    import torch
    from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion

    torch.manual_seed(1)
    model, d = build_model("transformer")
    tokens = torch.randint(d.nspecial, len(d), (2, 6))
    sample = {
        "net_input": {"src_tokens": tokens, "src_lengths": torch.tensor([6, 6]), "prev_output_tokens": tokens},
        "target": tokens,
        "ntokens": 12,
    }
    criterion = LabelSmoothedCrossEntropyCriterion(argparse.Namespace(target_dictionary=d), False, 0.1)
    return model.half().eval(), sample, criterion


@pytest.mark.parametrize(
    "overflow, site",
    [
        (None, None),
        ("decoder.layers.1.fc1", "decoder.layers.1.fc1"),  # its weights scaled past fp16's range of outputs
        ("decoder.embed_scale", "input of decoder.dropout_module"),  # made between modules
    ],
)
def test_first_non_finite_names_the_module_whose_fp16_output_overflowed(tiny_fp16, overflow, site):
    import copy

    import torch

    model, sample, criterion = tiny_fp16
    model = copy.deepcopy(model)
    if overflow == "decoder.layers.1.fc1":
        with torch.no_grad():
            model.decoder.layers[1].fc1.weight.mul_(1e5)
    elif overflow == "decoder.embed_scale":
        model.decoder.embed_scale = 1e6
    with torch.no_grad(), first_non_finite(model) as found:
        criterion(model, sample)
    assert found.get("site") == site
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())  # all removed
    # In float32 the same forward pass measures the values fp16 could not hold.
    values = largest_values(copy.deepcopy(model).float(), criterion, sample)
    assert len(values["attention logits"]) == 6 and OUTPUT_LOGITS in values["outputs"]
    if overflow is None:
        assert max([*values["outputs"].values(), *values["inputs"].values()]) < FP16_MAX
    else:  # past fp16's range at the site, within it in what it was made from
        made_from = site_value(values, "input of decoder.layers.1.fc1" if "fc1" in site else "encoder.embed_tokens")
        assert site_value(values, site) > FP16_MAX > made_from  # (the embedding is shared with the encoder)


# Two sweeps into one OUT, as two processes run them: while this one trains its first run (a
# stand-in that trains nothing), the other adds its run of the second arm.
TWO_PROCESSES = """
import json, sys
from pathlib import Path
from experiments import fp16_sweep, sweep

work, out = Path(sys.argv[1]), Path(sys.argv[2])
args = fp16_sweep.parse_args(["--work-dir", str(work), "--out-dir", str(out), "--arms", "stock", "qknorm", "--lrs", "0.1"])
settings = {"updates": args.updates, "warmup_updates": args.warmup_updates, "stats_interval": args.stats_interval}
trained = []

def train(config, bin_dir, work_dir, arm, lr, seed, *rest):
    trained.append(arm)
    other = {"arm": "qknorm", "lr": lr, "seed": seed, "by": "the other process"}
    sweep.write_json(out / "results.json", {"command": "the other", "settings": settings, "runs": [other]})
    return {"arm": arm, "lr": lr, "seed": seed, "by": "this process"}

runs = sweep.run_sweep(fp16_sweep.SWEEP, args, [], {}, lambda: work, train=train)
print(json.dumps({"trained": trained, "runs": runs}))
"""


def test_two_processes_sweeping_into_one_results_json_keep_each_others_runs(tmp_path):
    proc = run([sys.executable, "-c", TWO_PROCESSES, tmp_path / "work", tmp_path / "out"])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # qknorm was skipped here: the other process had added it
    assert result["trained"] == ["stock"]
    runs = json.loads((tmp_path / "out" / "results.json").read_text())["runs"]
    assert [(r["arm"], r["by"]) for r in runs] == [("qknorm", "the other process"), ("stock", "this process")]
    assert result["runs"] == runs
