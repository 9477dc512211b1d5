"""The benchmark's own logic (benchmarks/): it runs end to end on tiny sizes, its plain QK-norm computes
what QKNormAttention computes, its arms differ only where they should, and its tables and targets
follow from the numbers. No timing is asserted."""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # `benchmarks` is a folder of the repository, not an installed package

from benchmarks import cpu, norm_bounds, report  # noqa: E402
from benchmarks.run import arm_batches, section, update_markdown  # noqa: E402
from benchmarks.variants import QK_VARIANTS  # noqa: E402

VARIANTS = list(QK_VARIANTS)
MODEL_ARMS = ["stock", "stock_control", *VARIANTS, "scalenorm_paper"]
GENERATE_ARMS = ["stock", "stock_control", "stock_beamable", *VARIANTS, "scalenorm_paper"]
ATTENTION_ARMS = ["stock", "qknorm", "qknorm_plain", *VARIANTS[1:]]


def bench(*args):
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.run", *map(str, args)], cwd=ROOT, capture_output=True, text=True
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("lengths")
    (d / "c.src").write_text("".join("w " * (1 + i % 9) + "\n" for i in range(40)))
    (d / "c.tgt").write_text("".join("w " * (2 + i % 7) + "\n" for i in range(40)))
    return f"{d / 'c.src'},{d / 'c.tgt'}"


@pytest.fixture(scope="module")
def quick(corpus, tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    md = d / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\nHand-written text that the script must keep.\n")
    proc = bench(
        "--quick", "--threads", "1", "--lengths-from", corpus, "--results-dir", d / "results", "--markdown", md
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (results,) = (d / "results").glob("cpu-quick-*.json")
    return json.loads(results.read_text()), results, md


def test_results_name_no_folder_of_the_machine(quick, tmp_path_factory):
    result, results, _ = quick
    meta = result["meta"]
    assert (
        "--lengths-from $DATA_DIR/c.src,$DATA_DIR/c.tgt --results-dir $RESULTS_DIR --markdown $MARKDOWN"
        in (meta["command"])
    )
    assert result["settings"]["lengths_from"] == "$DATA_DIR/c.src,$DATA_DIR/c.tgt"
    assert meta["results_file"] == f"$RESULTS_DIR/{results.name}"
    assert str(tmp_path_factory.getbasetemp()) not in results.read_text()


def test_quick_run_measures_every_arm(quick):
    result, _, _ = quick
    groups = {}
    for g in result["groups"]:
        groups.setdefault(g["benchmark"], []).append(g)
    assert set(groups) == {"train", "generate", "attention", "memory"}
    for name, expected_arms in (("train", MODEL_ARMS), ("memory", MODEL_ARMS), ("generate", GENERATE_ARMS)):
        # in batches, each with its own baselines: every arm once, the baselines in every batch
        baselines = expected_arms[:3] if name == "generate" else expected_arms[:2]
        assert all(list(g["arms"])[: len(baselines)] == baselines for g in groups[name])
        assert [a for g in groups[name] for a in g["arms"] if a not in baselines] == expected_arms[len(baselines) :]
        for arm in (a for g in groups[name] for a in g["arms"].values()):
            values = next(iter(arm["metrics"].values()))
            assert len(values) == result["settings"]["repeats"] == 1 and values[0] > 0
            assert arm["peak_rss_mb"] >= arm["start_rss_mb"] > 0
    train = [a for g in groups["train"] for a in g["arms"].values()]
    assert len({a["info"]["target_tokens"] for a in train}) == 1
    # The memory processes (only they) have the allocator return freed blocks: glibc here.
    assert not any(a["info"]["freed_memory_returned"] for a in train)
    assert all(a["info"]["freed_memory_returned"] for g in groups["memory"] for a in g["arms"].values())
    assert all(a["info"]["activations_mb"] > 0 for a in train)
    # Forced lengths: every arm generates every hypothesis to L tokens + </s>.
    gen = {n: a for g in groups["generate"] for n, a in g["arms"].items()}
    info = gen["stock"]["info"]
    expected = info["sentences"] * (info["length"] + 1)
    assert all(a["metrics"]["output_tokens"] == [expected] for a in gen.values())
    # SequenceGenerator switches beamable cross attention on for the plugin's model, not for
    # fairseq's transformer; stock_beamable switches it on by hand.
    assert {n for n, a in gen.items() if a["info"]["beamable"]} == set(GENERATE_ARMS) - {"stock", "stock_control"}
    (attention,) = groups["attention"]
    cases = attention["cases"]
    assert len(cases) == 2 * len(result["settings"]["attention_lengths"]) + 2
    assert all(list(times) == ATTENTION_ARMS for times in cases.values())
    meta = result["meta"]
    assert meta["threads"] == 1 and meta["torch"] == torch.__version__ and len(meta["load_end"]) == 3
    # the CPU beside every result: model, cores, torch's kernel set, vector flags
    assert meta["cpu"] and meta["cores"] == os.cpu_count() and meta["device_name"].startswith(meta["cpu"])
    assert meta["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert isinstance(meta["cpu_flags"], list) and set(meta["cpu_flags"]) <= set(cpu.VECTOR_FLAGS)


def test_quick_run_writes_the_tables_between_markers(quick, tmp_path):
    result, results, md = quick
    text = md.read_text()
    assert text.startswith("# Benchmarks\n\nHand-written text that the script must keep.\n")
    assert text.count(f"<!-- BEGIN cpu ({result['meta']['device_name']}) results") == 1
    assert "| tiny fp32 | qknorm |" in text and f"torch's CPU kernels: {result['meta']['cpu_capability']}" in text
    # the targets table: a row per QK-norm variant
    assert all(f"| tiny fp32 | {arm} | " in text.split("**Targets**")[1] for arm in VARIANTS)
    assert "train peak memory, freed memory returned <= 1.03" in text.split("**Targets**")[1]
    # Rendering the same file again replaces the section instead of adding one.
    proc = bench("--render", results, "--markdown", md)
    assert proc.returncode == 0, proc.stderr
    assert md.read_text() == text
    assert "| scalenorm_paper |" in proc.stdout


def test_bad_lengths_file_is_one_clear_error(tmp_path):
    proc = bench(
        "--quick", "--lengths-from", f"{tmp_path}/missing.src,{tmp_path}/missing.tgt", "--results-dir", tmp_path / "r"
    )
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        f"error: --lengths-from: cannot read {tmp_path}/missing.src: No such file or directory"
    ]
    assert not (tmp_path / "r").exists()


def test_no_lengths_file_is_one_clear_error(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "BENCH_LENGTHS_FROM"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--results-dir", str(tmp_path / "r")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode != 0
    assert "--lengths-from SRC,TGT (or $BENCH_LENGTHS_FROM) is needed" in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "r").exists()


def test_variants_are_every_qk_norm_the_flags_allow():
    from fairseq_qknorm.qknorm_attention import QK_NORMS, QK_SCALES

    flags = {(v["qk_norm"], v["qk_scale"], v["qk_scale_per_head"]) for v in QK_VARIANTS.values()}
    norms = [n for n in QK_NORMS if n != "none"]  # no norm: not a QK-norm
    assert flags == {(n, s, p) for n in norms for s in QK_SCALES for p in (False, True) if not (s == "none" and p)}
    assert QK_VARIANTS["qknorm"] == {"qk_norm": "l2", "qk_scale": "learned", "qk_scale_per_head": False}


def test_arm_batches_hold_the_baselines_and_every_arm_once():
    arms = GENERATE_ARMS
    train = arm_batches("train", arms, 7)
    assert all(b[:2] == ["stock", "stock_control"] and len(b) <= 7 for b in train)
    assert [a for b in train for a in b[2:]] == arms[3:]  # stock_beamable is generation only
    generate = arm_batches("generate", arms, 7)
    assert all(b[:3] == ["stock", "stock_control", "stock_beamable"] and len(b) <= 7 for b in generate)
    assert [a for b in generate for a in b[3:]] == arms[3:]
    assert arm_batches("generate", ["stock", "stock_control"], 7) == [["stock", "stock_control"]]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_cuda_without_a_device_is_one_clear_error(corpus, tmp_path):
    proc = bench("--device", "cuda", "--lengths-from", corpus, "--results-dir", tmp_path / "r")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == ["error: --device cuda: torch sees no CUDA device"]


def test_plain_attention_computes_what_qknorm_computes():
    from benchmarks.arms import QK_SCALE_INIT
    from benchmarks.plain_attention import PlainQKNormAttention
    from fairseq_qknorm.qknorm_attention import QKNormAttention

    dim, heads, beam = 16, 4, 3
    for kind in ({"self_attention": True}, {"encoder_decoder_attention": True}):
        modules = []
        for cls in (QKNormAttention, PlainQKNormAttention):
            torch.manual_seed(0)
            modules.append(
                cls(dim, heads, qk_norm="l2", qk_scale="learned", qk_scale_init=QK_SCALE_INIT, **kind).eval()
            )
        fused, plain = modules
        x, enc = torch.randn(5, 2 * beam, dim), torch.randn(7, 2, dim).repeat_interleave(beam, dim=1)
        pad = torch.zeros(2 * beam, 7, dtype=torch.bool)
        pad[:beam, 5:] = True
        causal = torch.triu(torch.full((5, 5), float("-inf")), 1)
        if "self_attention" in kind:
            self_pad = torch.zeros(2 * beam, 5, dtype=torch.bool)
            self_pad[:beam, 3:] = True
            calls = [
                dict(query=x, key=x, value=x, key_padding_mask=self_pad, need_weights=False),
                dict(query=x, key=x, value=x, attn_mask=causal, need_weights=False),
            ]
        else:
            calls = [dict(query=x, key=enc, value=enc, key_padding_mask=pad, need_weights=False)]
        for call in calls:
            torch.testing.assert_close(plain(**call)[0], fused(**call)[0])
        # Incremental decoding: three steps against the cache. Cross attention: QKNorm is given one
        # copy of the encoder output per sentence (beamable, as the plugin's decoder does), the
        # plain one a copy per hypothesis.
        states = [{}, {}]
        cross = "encoder_decoder_attention" in kind
        for _ in range(3):
            y = torch.randn(1, 2 * beam, dim)
            outs = [
                m(
                    y,
                    (enc[:, ::share] if cross else y),
                    (enc[:, ::share] if cross else y),
                    key_padding_mask=pad[::share] if cross else None,
                    incremental_state=s,
                    static_kv=cross,
                    need_weights=False,
                )[0]
                for m, s, share in zip((fused, plain), states, (beam, 1))
            ]
            torch.testing.assert_close(outs[1], outs[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_plain_attention_masks_in_half_precision(dtype):
    # The benchmark's CUDA run starts with fp16: a mask value that fp16 cannot hold (the paper
    # code's -1e9) stops it. Masked keys must get no weight, whatever they hold, and the output
    # is the fp32 one within the dtype's rounding.
    from benchmarks.arms import QK_SCALE_INIT
    from benchmarks.plain_attention import PlainQKNormAttention

    torch.manual_seed(0)
    plain = PlainQKNormAttention(16, 4, qk_norm="l2", qk_scale="learned", qk_scale_init=QK_SCALE_INIT).eval()
    x = torch.randn(5, 4, 16)
    other = x.clone()
    other[3:] = torch.randn(2, 4, 16)  # what the masked positions hold
    pad = torch.zeros(4, 5, dtype=torch.bool)
    pad[:, 3:] = True
    causal = torch.triu(torch.full((5, 5), float("-inf")), 1)
    tolerance = {torch.float16: 0.02, torch.bfloat16: 0.1}[dtype]
    for call in (dict(key_padding_mask=pad), dict(attn_mask=causal), dict(attn_mask=causal.isinf())):
        full = plain.float()(x, x, x, **call)[0]
        half = plain.to(dtype)(x.to(dtype), x.to(dtype), x.to(dtype), **call)[0]
        changed = plain(other.to(dtype), other.to(dtype), other.to(dtype), **call)[0]
        assert half.dtype == dtype
        torch.testing.assert_close(changed[:3], half[:3])
        torch.testing.assert_close(half.float(), full, rtol=tolerance, atol=tolerance)


def test_arms_differ_only_in_what_they_are_about():
    from fairseq.modules import MultiheadAttention

    from benchmarks.arms import SIZES, build_model
    from fairseq_qknorm.qknorm_attention import QKNormAttention

    stock = build_model("stock", SIZES["tiny"], seed=3)[0].state_dict()
    for arm, extra in (
        ("qknorm", {"qk_scale.g", "qk_scale.g0"}),  # g, and the g0 it started from
        ("qknorm_layernorm_none", {"q_norm.weight", "q_norm.bias", "k_norm.weight", "k_norm.bias"}),
    ):
        model = build_model(arm, SIZES["tiny"], seed=3)[0]
        attn = [m for m in model.modules() if isinstance(m, MultiheadAttention)]
        assert len(attn) == 3 and all(isinstance(m, QKNormAttention) for m in attn)
        state = model.state_dict()
        assert {k.split("attn.", 1)[1] for k in set(state) - set(stock)} == extra
        assert set(stock) <= set(state)
        for k, v in stock.items():  # the same seed gives the same weights: generation can compare
            assert torch.equal(state[k], v), k


def _fake(wps, peak, activations, plain_ms, fused_ms):
    arms = {
        name: {"metrics": {"wps": w, "wps_cpu": w}, "peak_rss_mb": p, "info": {"activations_mb": a}}
        for name, w, p, a in zip(("stock", "qknorm_rmsnorm_none"), wps, peak, activations)
    }
    return [
        {"benchmark": "train", "size": "glen", "dtype": "fp32", "arms": arms},
        {
            "benchmark": "attention",
            "size": "glen",
            "dtype": "fp32",
            "cases": {
                "self T=64 fwd+bwd": {"stock": fused_ms, "qknorm": fused_ms, "qknorm_plain": plain_ms},
                "self T=16 fwd+bwd": {"stock": fused_ms, "qknorm": plain_ms, "qknorm_plain": fused_ms},
            },
        },
    ]


def test_targets_use_the_median_of_the_per_pair_ratios():
    # Rounds drift (a loaded machine): the per-pair ratios are 0.98, 0.98, 0.5 -> median 0.98, while
    # the ratio of the medians would be 50/100 = 0.5.
    groups = _fake(
        wps=([100, 50, 100], [98, 49, 50]),
        peak=(1000, 1040),
        activations=(10.0, 10.2),
        plain_ms=[2, 2, 2],
        fused_ms=[1, 3, 1],
    )
    checks = {(arm, key[1]): (round(value, 3), ok) for _, arm, key, value, ok in report.targets(groups)}
    assert checks == {
        ("qknorm_rmsnorm_none", "wps"): (0.98, True),
        ("qknorm_rmsnorm_none", "activations"): (1.02, True),
        ("qknorm_rmsnorm_none", "memory"): (1.04, False),
        ("self T=64 fwd+bwd", "qknorm_plain / qknorm time"): (2.0, True),  # T=16: no target
    }
    assert report.pair_ratios([2, 3], [4, 6]) == [0.5, 0.5]
    table = report.targets_tables(report.targets(groups))
    assert "| glen fp32 | qknorm_rmsnorm_none | 0.980 | 1.020 | **1.040 MISS** |" in table
    assert table.endswith("3 of 4 targets met; 1 missed (in bold).")


def test_memory_targets_take_only_processes_that_returned_freed_memory():
    def arm(peak, returned):
        return {
            "metrics": {"wps": [1.0]},
            "peak_rss_mb": peak,
            "start_rss_mb": 300.0,
            "info": {"freed_memory_returned": returned},
        }

    groups = [
        {
            "benchmark": "memory",
            "size": "glen",
            "dtype": "fp32",
            "batch": 1,
            "arms": {"stock": arm(1000, True), "qknorm": arm(1020, True), "qknorm_l2_none": arm(1050, True)},
        },
        {
            "benchmark": "memory",
            "size": "glen",
            "dtype": "fp32",
            "batch": 2,
            "arms": {"stock": arm(1000, False), "qknorm_rmsnorm_none": arm(1100, False)},
        },
    ]
    checks = {(arm, key): (round(value, 3), ok) for _, arm, key, value, ok in report.targets(groups)}
    assert checks == {
        ("qknorm", ("memory", "peak")): (1.02, True),
        ("qknorm_l2_none", ("memory", "peak")): (1.05, False),
    }
    assert "| glen fp32 #2 | qknorm_rmsnorm_none | 1,100 | 1.100 | 300 |" in report.memory_table(groups)


def test_generation_targets_include_the_like_for_like_ratio():
    def speed(values):
        return {"metrics": {"sentences_per_s": values}, "peak_rss_mb": 100, "info": {}}

    arms = {
        "stock": speed([1.0, 1.0]),
        "stock_beamable": speed([2.0, 2.0]),
        "qknorm": speed([1.9, 1.9]),
        "scalenorm_paper": speed([0.5, 0.5]),
    }  # not a QK-norm: no target
    checks = {
        (arm, key[1]): (round(value, 3), ok)
        for _, arm, key, value, ok in report.targets(
            [{"benchmark": "generate", "size": "small", "dtype": "fp32", "arms": arms}]
        )
    }
    assert checks == {
        ("qknorm", "speed"): (1.9, True),
        ("qknorm", "like for like"): (0.95, False),
        ("qknorm", "memory"): (1.0, True),
    }


def test_update_markdown_replaces_only_its_own_machines_section(tmp_path):
    """One section per CPU model (and one for CUDA): one CPU's results stand beside another's."""
    md = tmp_path / "B.md"
    amd, intel = ({"device": "cpu", "device_name": f"{name}, 2 cores"} for name in ("AMD EPYC", "Intel Xeon"))
    update_markdown(md, section(amd), "amd table 1\n")
    update_markdown(md, section({"device": "cuda", "device_name": "NVIDIA H200"}), "gpu table\n")
    update_markdown(md, section(intel), "intel table\n")
    update_markdown(md, section(amd), "amd table 2\n")
    text = md.read_text()
    assert "amd table 1" not in text and all(t in text for t in ("amd table 2", "gpu table", "intel table"))
    assert text.index("amd table 2") < text.index("gpu table") < text.index("intel table")
    assert "<!-- BEGIN cpu (Intel Xeon, 2 cores) results" in text and "<!-- BEGIN cuda results" in text


def test_a_speed_miss_is_within_the_noise_floor_only_if_identical_code_missed_as_far():
    def batch(n, control, arm):
        return {
            "benchmark": "train",
            "size": "small",
            "dtype": "fp32",
            "batch": n,
            "arms": {
                name: {"metrics": {"wps": [w], "wps_cpu": [w]}, "peak_rss_mb": 100, "info": {"activations_mb": 1.0}}
                for name, w in (("stock", 100.0), ("stock_control", control), arm)
            },
        }

    # batch 1: the control measures 0.90 of stock, the arm 0.93: a miss within the noise floor;
    # batch 2: the control measures 1.02, the arm 0.93: a measured miss.
    groups = [batch(1, 90.0, ("qknorm", 93.0)), batch(2, 102.0, ("qknorm_l2_fixed", 93.0))]
    assert {k: round(v, 3) for k, v in report.noise_floor(groups).items()} == {
        ("train", "small fp32"): 0.9,
        ("train", "small fp32 #2"): 1.02,
    }
    checks = report.targets(groups)
    assert report.within_noise(groups, checks) == {("small fp32", "qknorm", ("train", "wps"))}
    table = report.targets_tables(checks, report.within_noise(groups, checks))
    assert "| small fp32 | qknorm | **0.930 MISS** † |" in table
    assert "| small fp32 | qknorm_l2_fixed | **0.930 MISS** |" in table
    assert "4 of 6 targets met; 2 missed (in bold), 1 of them within the noise floor" in table
    assert "largest 0.100" in report.noise_table(groups)


def test_one_process_times_every_arm_against_the_first(corpus):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.one_process", "--size", "tiny", "--rounds", "2", "--threads", "1"]
        + ["--arms", "stock", "qknorm_rmsnorm_none", "no_qknorm", "one_pass", "--lengths-from", corpus]
        + ["--flush-denormals"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    machine = cpu.describe(cpu.record())
    assert f"Machine: {machine}; torch {torch.__version__}, denormals flushed to zero" in proc.stdout
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert [r[0].strip() for r in rows[1:]] == ["stock", "qknorm_rmsnorm_none", "no_qknorm", "one_pass"]
    assert float(rows[1][2]) == 1.0 and float(rows[2][1]) > 0
    assert rows[1][3].strip() == "1.000–1.000"


@pytest.mark.parametrize("g", [None, 0.0, 7.5], ids=["no-g", "zero-g", "g"])
def test_the_compiled_stand_in_runs_the_l2_norms_code_while_it_stands_in(g, monkeypatch):
    """l2_compiled, its compile step left out (it needs a C++ compiler): the values and gradients of
    ScaledUnitNorm, in its place only while its arm runs."""
    from fairseq_qknorm import lean_norms
    from fairseq_qknorm.lean_norms import ScaledUnitNorm

    monkeypatch.setattr(norm_bounds, "_compile", lambda fn: fn)
    torch.manual_seed(0)
    x = torch.randn(5, 2, 3, 8, requires_grad=True)
    grad = torch.randn(2, 3, 5, 8).permute(2, 0, 1, 3)
    g_in = None if g is None else torch.tensor(g, requires_grad=True)
    inputs = [x] + ([] if g_in is None else [g_in])
    want = ScaledUnitNorm.apply(x, g_in)
    want_grads = torch.autograd.grad(want, inputs, grad)
    with norm_bounds.standing_in("l2_compiled"):
        assert lean_norms.ScaledUnitNorm is norm_bounds.CompiledUnitNorm
        got = lean_norms.unit_norm(x, g_in)
        got_grads = torch.autograd.grad(got, inputs, grad)
    assert lean_norms.ScaledUnitNorm is ScaledUnitNorm
    torch.testing.assert_close(got, want)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b)


def test_one_process_times_generation_too(corpus):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.one_process", "--benchmark", "generate", "--size", "tiny"]
        + ["--rounds", "2", "--threads", "1", "--arms", "stock_beamable", "qknorm", "--lengths-from", corpus],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"Machine: {cpu.describe(cpu.record())}; torch {torch.__version__}\n" in proc.stdout
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert rows[0][0].strip() == "generate tiny fp32, 1 threads"
    assert [r[0].strip() for r in rows[1:]] == ["stock_beamable", "qknorm"] and float(rows[2][1]) > 0


def test_median_interval_brackets_the_median_within_the_values():
    values = [0.9, 0.95, 1.0, 1.02, 1.05, 1.1, 1.3]
    lo, hi = report.median_interval(values)
    assert min(values) <= lo <= statistics.median(values) <= hi <= max(values) and lo < hi
    assert report.median_interval([1.0] * 5) == (1.0, 1.0)
    assert report.median_interval(values) == (lo, hi)  # seeded: the same interval every run


def test_norm_alone_times_every_norm_and_its_composition_against_l2(capsys, monkeypatch):
    """Its compile step left out (it needs a C++ compiler): the table, the machine, the profiles."""
    from benchmarks import norm_alone

    monkeypatch.setattr(norm_bounds, "_compile", lambda fn: fn)
    norm_alone.main(["--sizes", "small", "--rounds", "2", "--threads", "1", "--profile"])
    out = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| small")]
    names = [r[1].strip() for r in rows]
    assert names == [
        "l2",
        "l2 composed",
        "l2 compiled",
        "layernorm",
        "layernorm composed",
        "rmsnorm",
        "rmsnorm composed",
    ]
    assert float(rows[0][3]) == 1.0 and all(float(r[2]) > 0 for r in rows)
    assert out.startswith(f"Machine: {cpu.describe(cpu.record())}; torch {torch.__version__}, 1 threads\n")
    assert all(f"small, {name}, 10 forwards and backwards:" in out for name in names)
    assert "_weight_norm_interface_backward" in out.split("small, l2, 10")[1].split("small, l2 composed")[0]


def test_sdpa_new_shapes_times_first_and_repeated_calls_per_backend(capsys):
    from benchmarks import sdpa_new_shapes

    sdpa_new_shapes.main(["--device", "cpu", "--shapes", "2", "--tokens", "200"])
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [r[0].strip() for r in rows[1:]] == ["default", "plugin", "math"]  # after the header; the CPU's
    for _, first, again, ratio in rows[1:]:
        assert float(first) > 0 and float(again) > 0 and float(ratio) > 0
    with pytest.raises(SystemExit):
        sdpa_new_shapes.main(["--device", "cpu", "--shapes", "0"])
