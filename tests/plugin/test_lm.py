"""The language model `transformer_lm_qknorm` through fairseq's own commands: fairseq-train with
each --sample-break-mode (and the L that `auto` takes from its samples), fairseq-eval-lm,
fairseq-interactive and the hub (sampling and beam search), step-by-step decoding against the full
forward, --cpu --bf16, two processes over gloo, safe loading and fairseq-qknorm-inspect. The model
is fairseq's transformer_lm_gpt2_tiny with 4 heads, trained for seconds on the toy corpus."""

import json
import math
import os
import re

import numpy as np
import pytest
import torch
from conftest import COMMON_TRAIN_FLAGS, RECORD_G, USER_DIR, build_model, decode, read_records, run, tool, train

import fairseq_qknorm  # noqa: F401  (registers the model; allow-lists checkpoint classes)

ARCH = "transformer_lm_qknorm_gpt2_tiny"
TOKENS_PER_SAMPLE = 48
# fmt: off
LM_MODEL = [
    "--task", "language_modeling", "--decoder-attention-heads", "4", "--tokens-per-sample", str(TOKENS_PER_SAMPLE),
    "--dropout", "0", "--attention-dropout", "0",
]
# fmt: on
LM_FLAGS = ["--max-tokens", "1024", *COMMON_TRAIN_FLAGS]


def train_lm(data, save, *extra, arch=ARCH, updates=4, break_mode="eos", launcher=(), **kwargs):
    extra = ["--sample-break-mode", break_mode, *extra]
    return train(data, save, arch, extra, updates, LM_MODEL, flags=LM_FLAGS, launcher=launcher, **kwargs)


@pytest.fixture(scope="module")
def lm_bin(toy_raw, tmp_path_factory):
    """The toy corpus's target side as a monolingual corpus, binarized (one dictionary)."""
    d = tmp_path_factory.mktemp("lm_bin")
    run(
        [
            tool("fairseq-preprocess"),
            "--only-source",
            "--trainpref",
            toy_raw / "train.tgt",
            "--validpref",
            toy_raw / "dev.tgt",
            "--testpref",
            toy_raw / "test.tgt",
            "--destdir",
            d,
            "--workers",
            "1",
        ]
    )
    return d


@pytest.fixture(scope="module")
def lm(lm_bin, tmp_path_factory):
    """A tiny QKNorm LM trained 40 updates with --sample-break-mode eos: (save dir, training log)."""
    save = tmp_path_factory.mktemp("lm_ckpt")
    proc = train_lm(lm_bin, save, updates=40)
    return save, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def lm_bos(lm_bin, tmp_path_factory):
    """The same LM trained with --add-bos-token (<s> in front of every sample): (save dir, training log)."""
    save = tmp_path_factory.mktemp("lm_bos_ckpt")
    proc = train_lm(lm_bin, save, "--add-bos-token", "--disable-validation", updates=8)
    return save, proc.stdout + proc.stderr


def logged_length(log):
    found = re.search(r"qk-norm: L=(\d+) \((.*)\) g0=log2\(L\^2-L\)=([\d.]+)", log)
    assert found, log[-3000:]
    return int(found.group(1)), found.group(2), float(found.group(3))


def saved_args(path):
    state = torch.load(path, map_location="cpu", weights_only=True)
    return state["cfg"]["model"], state["model"]


def complete_blocks(sizes, block_size):
    """fairseq's 'complete' break mode, written out: whole sentences packed up to block_size."""
    blocks, current = [], 0
    for size in sizes:
        if current and current + size > block_size:
            blocks.append(current)
            current = 0
        current += size
    return blocks + [current] if current else blocks


@pytest.mark.parametrize("break_mode", ["none", "eos", "complete"])
def test_auto_length_comes_from_the_samples_of_each_break_mode(toy_raw, lm_bin, lm, tmp_path, break_mode):
    save, log = lm  # fairseq-train with --sample-break-mode eos: the module's LM
    if break_mode != "eos":
        save, proc = tmp_path, train_lm(lm_bin, tmp_path, "--disable-validation", updates=2, break_mode=break_mode)
        log = proc.stdout + proc.stderr
    assert "done training" in log, log[-2000:]
    # Independently of fairseq: a sentence of n words is n + 1 tokens (its </s>).
    sentence_sizes = [len(line.split()) + 1 for line in (toy_raw / "train.tgt").read_text().splitlines()]
    expected = {
        "none": TOKENS_PER_SAMPLE,
        "eos": int(np.percentile(sentence_sizes, 97.5, method="lower")),
        "complete": int(np.percentile(complete_blocks(sentence_sizes, TOKENS_PER_SAMPLE), 97.5, method="lower")),
    }[break_mode]
    length, source, g0 = logged_length(log)
    assert length == expected and f"--sample-break-mode {break_mode}" in source
    args, _ = saved_args(save / "checkpoint_last.pt")
    assert args.qk_scale_init == pytest.approx(math.log2(expected**2 - expected)) == pytest.approx(g0, abs=1e-4)


def test_auto_length_counts_the_s_of_add_bos_token(toy_raw, lm_bos):
    save, log = lm_bos
    sentence_sizes = [len(line.split()) + 1 for line in (toy_raw / "train.tgt").read_text().splitlines()]
    expected = int(np.percentile(sentence_sizes, 97.5, method="lower")) + 1  # <s> in front of each sample
    length, source, _ = logged_length(log)
    assert length == expected and source.endswith(", +1 for the <s> of --add-bos-token"), source
    args, _ = saved_args(save / "checkpoint_last.pt")
    assert args.add_bos_token and args.qk_scale_init == pytest.approx(math.log2(expected**2 - expected))


@pytest.mark.parametrize("norm", ["l2", "layernorm", "rmsnorm"])
def test_auto_over_head_dim_for_the_affine_norms(norm):
    """As the translation model's (plugin/test_g0.py): a LayerNorm or RMSNorm output has length
    sqrt(head_dim), so `auto` starts g at log2(L^2 - L) / head_dim, the l2 norm's initial logits."""
    from argparse import Namespace

    from fairseq_qknorm.transformer_lm_qknorm import resolve_lm_qk_scale_init

    task = Namespace(args=Namespace(sample_break_mode="none", tokens_per_sample=64, add_bos_token=False))
    args = Namespace(
        qk_norm=norm, qk_scale="learned", qk_scale_init="auto", decoder_embed_dim=96, decoder_attention_heads=3
    )
    g0 = math.log2(64 * 63)
    assert resolve_lm_qk_scale_init(args, task) == pytest.approx(g0 if norm == "l2" else g0 / 32)


def test_eos_blocks_build_under_numpy_2():
    """fairseq's TokenBlockDataset in eos mode reads np.compat.long, which numpy 2 removed."""
    from fairseq.data import TokenBlockDataset

    sentences = [torch.tensor([4, 5, 2]), torch.tensor([6, 2])]
    blocks = TokenBlockDataset(sentences, [3, 2], block_size=None, pad=1, eos=2, break_mode="eos")
    assert [b.tolist() for b in blocks] == [[4, 5, 2], [6, 2]]


def test_stock_transformer_lm_trains_with_eos_break_mode_beside_the_plugin(lm_bin, tmp_path):
    proc = train_lm(lm_bin, tmp_path, "--disable-validation", arch="transformer_lm_gpt2_tiny", updates=2)
    log = proc.stdout + proc.stderr
    assert "qk-norm" not in log and (tmp_path / "checkpoint_last.pt").is_file()


def test_training_learns_and_the_checkpoint_holds_one_g_per_layer(lm):
    save, log = lm
    losses = [float(m) for m in re.findall(r"valid on 'valid' subset \| loss ([\d.]+)", log)]
    assert len(losses) >= 2 and losses[-1] < losses[0] < math.log2(200)
    args, model = saved_args(save / "checkpoint_best.pt")
    assert args.arch == ARCH and args.qk_norm == "l2" and args.qk_scale == "learned"
    g = {k: v for k, v in model.items() if k.endswith("qk_scale.g")}
    assert sorted(g) == [f"decoder.layers.{i}.self_attn.qk_scale.g" for i in range(2)]
    assert all(v.item() != pytest.approx(args.qk_scale_init, abs=1e-6) for v in g.values())  # g was trained


def test_eval_lm_perplexity_equals_the_validation_perplexity(lm, lm_bin):
    save, log = lm
    best = min(float(m) for m in re.findall(r"valid on 'valid' subset \| loss [\d.]+ \| ppl ([\d.]+)", log))
    out = decode(
        "fairseq-eval-lm",
        lm_bin,
        save / "checkpoint_best.pt",
        "--cpu --sample-break-mode eos --gen-subset valid --max-tokens 1024",
    )
    ppl = float(re.search(r"Perplexity: ([\d.]+)", out.stdout + out.stderr).group(1))
    assert ppl == pytest.approx(best, abs=0.01)


@pytest.mark.parametrize("flags", [["--beam", "3"], ["--beam", "1", "--sampling", "--sampling-topk", "5"]])
def test_interactive_continues_prompts(lm, lm_bin, toy_raw, flags):
    save, _ = lm
    prompts = [" ".join(line.split()[:3]) for line in (toy_raw / "test.tgt").read_text().splitlines()[:3]]
    out = run(
        [
            tool("fairseq-interactive"),
            lm_bin,
            "--task",
            "language_modeling",
            "--user-dir",
            USER_DIR,
            "--path",
            save / "checkpoint_best.pt",
            "--cpu",
            "--seed",
            "2",
            *flags,
        ],
        input="\n".join(prompts) + "\n",
    )
    hyps = [line.split("\t")[2] for line in out.stdout.splitlines() if line.startswith("H-")]
    assert len(hyps) == len(prompts)
    for prompt, hyp in zip(prompts, hyps):
        assert hyp.startswith(prompt) and len(hyp.split()) > len(prompt.split())


@pytest.fixture(scope="module")
def hub(lm, lm_bin):
    from fairseq.models.transformer_lm import TransformerLanguageModel

    save, _ = lm
    return TransformerLanguageModel.from_pretrained(
        str(save), "checkpoint_best.pt", data_name_or_path=str(lm_bin), user_dir=USER_DIR
    ).eval()


def test_hub_greedy_search_is_the_argmax_of_the_full_forward(hub, toy_raw):
    """fairseq's generator decodes step by step from the cache of normalized keys; each step's
    choice must be the argmax of a fresh full forward over the text so far."""
    prompt = hub.encode(" ".join((toy_raw / "test.tgt").read_text().split()[:4]))[:-1]  # without </s>
    [best] = hub.generate([prompt], beam=1, max_len_b=20)[0][:1]
    eos, pad = hub.task.source_dictionary.eos(), hub.task.source_dictionary.pad()
    history = torch.cat([torch.tensor([eos]), prompt])  # the generator starts from <eos> + the prompt
    with torch.no_grad():
        while history[-1] != eos and len(history) <= 20:
            logits, _ = hub.models[0](history[None])
            logits[0, -1, pad] = -math.inf  # as the generator
            history = torch.cat([history, logits[0, -1].argmax().view(1)])
    assert best["tokens"].tolist() == history[1:].tolist() and len(history) > len(prompt) + 3


def test_hub_beam_search_and_sampling(hub, toy_raw):
    prompt = " ".join((toy_raw / "test.tgt").read_text().split()[:3])
    beams = hub.generate([hub.encode(prompt)], beam=4, max_len_b=10)[0]
    assert len(beams) == 4 and beams[0]["score"] >= beams[-1]["score"]
    torch.manual_seed(1)
    samples = {hub.sample(prompt, beam=1, sampling=True, sampling_topk=20, max_len_b=10) for _ in range(4)}
    assert all(s.startswith(prompt) for s in samples) and len(samples) > 1


VARIANTS = {
    "l2-learned": dict(qk_norm="l2", qk_scale="learned"),
    "l2-perhead": dict(qk_norm="l2", qk_scale="learned", qk_scale_per_head=True),
    "l2-fixed": dict(qk_norm="l2", qk_scale="fixed"),
    "layernorm": dict(qk_norm="layernorm", qk_scale="learned"),
    "rmsnorm": dict(qk_norm="rmsnorm", qk_scale="none"),
}


def perturbed_lm(**variant):
    model, d = build_model(arch=ARCH, decoder_attention_heads=4, **variant)
    torch.manual_seed(1)
    with torch.no_grad():  # every norm weight and g off its init, so that a wrong cache would show
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".g"):
                p.add_(torch.rand_like(p) * 0.3)
    return model.double().eval(), d


@pytest.mark.parametrize("name", list(VARIANTS))
def test_incremental_decoding_equals_the_full_forward(name):
    model, d = perturbed_lm(**VARIANTS[name])
    torch.manual_seed(0)
    tokens = torch.randint(4, len(d), (3, 7))
    full, _ = model(tokens)
    state = {}
    for t in range(tokens.size(1)):
        step, _ = model(tokens[:, : t + 1], incremental_state=state)
        torch.testing.assert_close(step[:, -1], full[:, t], atol=1e-5, rtol=1e-5)


def test_beam_reordering_keeps_the_cache_equal():
    model, d = perturbed_lm(**VARIANTS["layernorm"])
    torch.manual_seed(0)
    tokens = torch.randint(4, len(d), (4, 6))
    state, history = {}, tokens[:, :1]
    order = torch.tensor([1, 0, 3, 2])
    for t in range(tokens.size(1)):
        step, _ = model(history, incremental_state=state)
        full, _ = model(history)
        torch.testing.assert_close(step[:, -1], full[:, -1], atol=1e-5, rtol=1e-5)
        model.decoder.reorder_incremental_state_scripting(state, order)
        history = torch.cat([history[order], tokens[:, t + 1 : t + 2]], dim=1)


def test_bf16_training_on_the_cpu_keeps_g_in_float32(lm_bin, tmp_path):
    proc = train_lm(lm_bin, tmp_path, "--bf16", "--disable-validation", updates=6)
    log = proc.stdout + proc.stderr
    assert "bfloat16 on the CPU" in log
    losses = [float(x) for x in re.findall(r"train_inner .*?loss=([\d.na]+)", log)]
    assert losses and all(math.isfinite(x) for x in losses)
    _, model = saved_args(tmp_path / "checkpoint_last.pt")
    g = [v for k, v in model.items() if k.endswith("qk_scale.g")]
    assert len(g) == 2 and all(v.dtype == torch.float32 and torch.isfinite(v).all() for v in g)


def test_two_processes_over_gloo_keep_g_identical(lm_bin, tmp_path):
    hooks, records = tmp_path / "hooks", tmp_path / "records"
    hooks.mkdir(), records.mkdir()
    (hooks / "sitecustomize.py").write_text(RECORD_G)
    launcher = [
        tool("torchrun"),
        "--standalone",
        "--nproc-per-node",
        "2",
        "--no-python",
        "sh",
        "-c",
        'exec "$0" "$@" --distributed-rank "$RANK"',
    ]
    env = dict(
        PYTHONPATH=os.pathsep.join(filter(None, [str(hooks), os.environ.get("PYTHONPATH")])),
        QK_G_RECORD_DIR=str(records),
        OMP_NUM_THREADS="1",
    )
    proc = train_lm(
        lm_bin,
        tmp_path / "ckpt",
        "--distributed-world-size",
        "2",
        "--distributed-init-method",
        "env://",
        "--distributed-no-spawn",
        "--distributed-backend",
        "gloo",
        "--ddp-backend",
        "legacy_ddp",
        "--disable-validation",
        updates=3,
        launcher=launcher,
        env=env,
    )
    assert "training on 2 devices" in proc.stdout + proc.stderr
    rank0, rank1 = read_records(records, 0), read_records(records, 1)
    assert [r["update"] for r in rank0] == [0, 1, 2, 3] == [r["update"] for r in rank1]
    assert all(r0["g"] == r1["g"] and len(r0["g"]) == 2 for r0, r1 in zip(rank0, rank1))
    assert rank0[-1]["g"] != rank0[0]["g"]  # g trained
    assert all(r0["ids"] != r1["ids"] for r0, r1 in zip(rank0[1:], rank1[1:]))  # on different samples


def test_a_poisoned_lm_checkpoint_is_refused(lm, lm_bin, tmp_path):
    from test_safe_loading import RunsACommand, assert_refused

    save, _ = lm
    state = torch.load(save / "checkpoint_best.pt", weights_only=True)
    marker = tmp_path / "PWNED"
    state["extra_state"]["payload"] = RunsACommand(marker)
    torch.save(state, tmp_path / "poisoned.pt")
    proc = decode(
        "fairseq-eval-lm",
        lm_bin,
        tmp_path / "poisoned.pt",
        "--cpu --gen-subset valid --max-tokens 1024",
        check=False,
    )
    assert_refused(proc, marker)


def test_inspect_prints_g_per_layer(lm):
    save, _ = lm
    [report] = json.loads(run([tool("fairseq-qknorm-inspect"), "g", save / "checkpoint_best.pt", "--json"]).stdout)
    args, model = saved_args(save / "checkpoint_best.pt")
    assert report["arch"] == ARCH and report["g0"] == pytest.approx(args.qk_scale_init)
    assert [(r["module"], r["layer"]) for r in report["g"]] == [("decoder self", 0), ("decoder self", 1)]
    for r in report["g"]:
        assert r["g"] == pytest.approx(model[f"decoder.layers.{r['layer']}.self_attn.qk_scale.g"].item())


def test_auto_without_a_training_split_is_one_clear_line(lm_bin, tmp_path):
    data = tmp_path / "valid_only"
    data.mkdir()
    for f in lm_bin.iterdir():
        if not f.name.startswith("train."):
            (data / f.name).symlink_to(f)
    proc = train_lm(data, tmp_path / "ckpt", updates=1, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --qk-scale-init auto: no 'train' split in ")
