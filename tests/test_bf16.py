"""bfloat16 on the CPU: fairseq-train --cpu --bf16 through the plugin's route, and a trained model
cast to bfloat16 (as fairseq's trainer casts it) against itself in float32."""
import copy

import torch

import fairseq_qknorm  # noqa: F401
from conftest import train
from fairseq import checkpoint_utils
from fairseq.sequence_generator import SequenceGenerator
from fairseq_qknorm.qknorm_attention import QKScale


def qk_scales(model):
    return [m for m in model.modules() if isinstance(m, QKScale)]


def test_fairseq_train_cpu_bf16_runs_on_the_cpu_with_finite_losses(toy_bin, tmp_path):
    proc = train(toy_bin / "bin", tmp_path, arch="transformer_qknorm_paper", extra=["--bf16"], max_update=8)
    log = proc.stdout + proc.stderr
    assert "bfloat16 on the CPU" in log and "done training" in log
    losses = [float(line.split("loss=")[1].split(",")[0]) for line in log.splitlines() if "train_inner" in line]
    assert losses and all(torch.isfinite(torch.tensor(losses)))
    # fairseq saves checkpoints in float32 whatever the training dtype; the g are there, one per module
    state = torch.load(tmp_path / "checkpoint_last.pt", weights_only=True)["model"]
    g = [v for k, v in state.items() if k.endswith("qk_scale.g")]
    assert len(g) == 3 * 2 and all(torch.isfinite(v) for v in g)  # enc self, dec self, cross; 2 layers


def test_bf16_model_stays_close_to_float32_with_padding_and_in_beam_search(trained):
    data, save = trained
    (model,), _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(save / "checkpoint_best.pt")], arg_overrides={"data": str(data)})
    model.eval()
    half = copy.deepcopy(model).to(dtype=torch.bfloat16)
    assert all(s.g.dtype == torch.float32 for s in qk_scales(half)) and qk_scales(half)
    task.load_dataset("test")
    dataset = task.dataset("test")
    batch = dataset.collater([dataset[i] for i in range(16)])  # source lengths differ: padding
    net = batch["net_input"]
    assert (net["src_tokens"] == task.source_dictionary.pad()).any()
    with torch.no_grad():
        want = model(**net)[0].float().log_softmax(-1)
        got = half(**net)[0].float().log_softmax(-1)
    assert torch.isfinite(got).all()
    target = batch["target"]
    real = target != task.target_dictionary.pad()
    # the probabilities of the reference tokens, as bf16 (8 bits of mantissa) allows
    gold_want = want.gather(-1, target[..., None])[..., 0][real]
    gold_got = got.gather(-1, target[..., None])[..., 0][real]
    assert (gold_got - gold_want).abs().mean() < 0.05
    assert (got.argmax(-1)[real] == want.argmax(-1)[real]).float().mean() > 0.95

    def beam(m):
        gen = SequenceGenerator([m], task.target_dictionary, beam_size=4, max_len_b=40)
        with torch.no_grad():
            return [h[0] for h in gen.generate([m], batch)]

    hyps32, hyps16 = beam(model), beam(half)
    assert all(torch.isfinite(h["score"]) for h in hyps16)
    # The tiny model has near-ties between hypotheses, which bf16 rounding may flip: compare the
    # scores (mean log-probability per token) of the best hypotheses, not their tokens.
    gap = torch.stack([(a["score"] - b["score"]).abs() for a, b in zip(hyps32, hyps16)])
    assert gap.mean() < 0.05, gap
