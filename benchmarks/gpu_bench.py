"""The GPU call's workloads (benchmarks/gpu_call.py): one arm of one part, built in the call's one
process, that runs one unit of work when asked. Training runs through fairseq's own Trainer, as
fairseq-train builds it with --fp16 or --bf16 (the model cast, float32 master weights, fairseq's loss
scaler in fp16); beam search is benchmarks.models_bench's GenerateBench. Around them: a unit's time
with its device-memory high-water mark, and which of SDPA's kernels an arm's attention ran."""

import collections
import contextlib
import functools

import torch
import torch.nn.functional as F
from fairseq import options, utils
from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.distributed import utils as distributed_utils
from fairseq.tasks.language_modeling import LanguageModelingTask
from fairseq.trainer import Trainer
from torch.utils._python_dispatch import TorchDispatchMode

from .arms import SIZES, Size, build_model, dictionary
from .data import random_pairs, training_batches
from .models_bench import GenerateBench, _to
from .timing import DTYPES, synchronize, timed
from .variants import QK_VARIANTS

# The language model: fairseq's transformer_lm defaults (512 wide, 6 layers, 8 heads, FFN 2048)
# over blocks of LM_CONTEXT tokens; the smoke size for the dry run.
LM_SIZES = {"lm": Size(dim=512, layers=6, heads=8, ffn=2048, vocab=32000), "tiny": SIZES["tiny"]}
LM_CONTEXT = {"lm": 512, "tiny": 16}
SDPA_OP = "aten::_scaled_dot_product_"  # the fused kernels behind F.scaled_dot_product_attention


def cuda(device):
    return device.startswith("cuda")


def allocated(device):
    """Bytes of live tensors on the device (None off CUDA)."""
    return torch.cuda.memory_allocated() if cuda(device) else None


def measured(fn, device):
    """(seconds, high-water mark of the device memory during fn above what was allocated when it
    began; None off CUDA)."""
    if not cuda(device):
        return timed(fn, device), None
    synchronize(device)
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    seconds = timed(fn, device)
    return seconds, torch.cuda.max_memory_allocated() - start


def first_use(device):
    """cuBLAS allocates its workspace at the first matrix product in each precision, from the same
    allocator as tensors: done here, so that no arm's memory counts it."""
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        a = torch.ones(64, 64, device=device, dtype=dtype)
        (a @ a).sum().item()


class _FusedKernels(TorchDispatchMode):
    """Counts the fused SDPA kernels that ran (seen below autograd, where they are what runs)."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name.startswith(SDPA_OP) and not name.endswith("_backward"):
            self.calls[name[len(SDPA_OP) :]] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _sdpa_calls():
    """Counts the calls of F.scaled_dot_product_attention while the block runs: the plugin's
    attention calls it, fairseq's through F.multi_head_attention_forward, both by its name in
    torch.nn.functional, which is wrapped for the time of the block."""
    real, calls = F.scaled_dot_product_attention, [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    F.scaled_dot_product_attention = counted
    try:
        yield calls
    finally:
        F.scaled_dot_product_attention = real


def attention_kernels(fn):
    """{SDPA kernel: forward calls} in one call of fn: the fused kernels by their operator's name
    (flash_attention, efficient_attention, cudnn_attention, flash_attention_for_cpu, ...), "math"
    for the calls that none of them took; {} where the attention never calls SDPA."""
    with _sdpa_calls() as sdpa, _FusedKernels() as fused:
        fn()
    math = sdpa[0] - sum(fused.calls.values())
    return dict(fused.calls, **({"math": math} if math > 0 else {}))


def profile_table(fns, device, rows=25):
    """Where the time of the calls of fns goes, operator by operator, as torch's profiler tables it
    (sorted by the device's own time on CUDA, by the CPU's elsewhere)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda(device) else [])
    with profile(activities=activities) as prof:
        for fn in fns:
            fn()
        synchronize(device)
    averages = prof.key_averages()
    if cuda(device):
        sort = "self_device_time_total" if hasattr(averages[0], "self_device_time_total") else "self_cuda_time_total"
    else:
        sort = "self_cpu_time_total"
    return averages.table(sort_by=sort, row_limit=rows, max_name_column_width=60)


def parsed(flags):
    """fairseq-train's arguments from its flags."""
    return options.parse_args_and_arch(options.get_training_parser(), flags)


@functools.cache  # hydra takes seconds to build one; the parts of one task and precision share it
def trainer_config(task_flags, dtype, device, save_dir):
    """The Trainer's configuration, from fairseq-train's flags (a tuple): Adam and inverse_sqrt at
    fairseq's translation recipe's values, the precision, one process. Every arm of a part trains
    with it (the Trainer reads its optimizer, precision and device from it; the model is given)."""
    flags = [
        "unused",  # the data folder: the batches are made here, no task loads data
        *task_flags,
        "--optimizer",
        "adam",
        "--adam-betas",
        "(0.9, 0.98)",
        "--lr",
        "5e-4",
        "--lr-scheduler",
        "inverse_sqrt",
        "--warmup-updates",
        "4000",
        f"--{dtype}",
        "--distributed-world-size",
        "1",
        "--save-dir",
        save_dir,  # where fairseq writes crash.pt if a step raises
        *(["--cpu"] if not cuda(device) else []),
    ]
    return convert_namespace_to_omegaconf(parsed(flags))


class TrainArm:
    """One arm under fairseq's Trainer. fairseq-train's way in: distributed_utils.call_main (where
    the plugin clears fairseq 0.12's TPU reading of --bf16), then Trainer(cfg, task, model,
    criterion), which casts the model and moves it to the device. A unit is one train_step on one
    of the shared batches; an fp16 step that overflows is skipped by fairseq and counted here."""

    def __init__(self, cfg, task, model, criterion, batches):
        built = []
        distributed_utils.call_main(cfg, lambda cfg: built.append(Trainer(cfg, task, model, criterion)))
        (self.trainer,) = built
        self.batches = batches
        self.skipped = 0
        self.info = {"parameters": sum(p.numel() for p in model.parameters())}

    def run(self, setting, unit):
        if self.trainer.train_step([self.batches[setting][unit]], raise_oom=True) is None:
            self.skipped += 1


class GenerateArm:
    """One arm's beam search, one GenerateBench per batch size (benchmarks.models_bench: every
    hypothesis forced to the batch's median reference length, so every arm decodes the same steps)."""

    def __init__(self, jobs):
        self.benches = [GenerateBench(job) for job in jobs]
        self.info = {k: self.benches[0].info[k] for k in ("parameters", "beam", "beamable")}
        self.info["lengths"] = [b.info["length"] for b in self.benches]
        # what a search keeps between units: one model's weights (the arm holds one per batch size)
        model = self.benches[0].model
        self.kept_bytes = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))

    def run(self, setting, unit):
        self.benches[setting].generate()

    def output_tokens(self, setting):
        return sum(len(h[0]["tokens"]) for h in self.benches[setting].hypos)


class Part:
    """One size, precision and benchmark: its settings (a label and the work count of each unit:
    target tokens, tokens or sentences) and how to build each arm."""

    def __init__(self, settings, build, unit_name):
        self.settings = settings  # [(label, [count of each unit])]
        self.build = build  # arm -> an object with run(setting, unit) and info
        self.unit_name = unit_name


def training_part(batches, build, unit_name):
    """A training Part: one setting per batch size, its units the batches."""
    settings = [(f"{tokens} tokens", [int(b["ntokens"]) for b in bs]) for tokens, bs in batches.items()]
    return Part(settings, build, unit_name)


def translation_training(size, dtype, device, conf, lengths, seed, save_dir):
    """Training at a translation size: sentence pairs of TED's lengths, in batches of each
    --max-tokens of conf["train_tokens"] (fairseq's batching), shared by the arms. The model is
    built as the CPU benchmark builds it (benchmarks.arms)."""
    vocab = dictionary(SIZES[size].vocab)
    data = random_pairs(lengths, conf["train_sentences"], vocab, seed, conf["max_len"])
    batches = {t: [_to(b, device) for b in training_batches(data, t, seed)] for t in conf["train_tokens"]}
    task_flags = ("--task", "translation", "--arch", "transformer", "--criterion", "label_smoothed_cross_entropy")
    cfg = trainer_config(task_flags, dtype, device, save_dir)

    def build(arm):
        model, task = build_model(arm, SIZES[size], seed)
        criterion = LabelSmoothedCrossEntropyCriterion(task, sentence_avg=False, label_smoothing=0.1)
        return TrainArm(cfg, task, model, criterion, list(batches.values()))

    return training_part(batches, build, "target tokens/s")


def lm_flags(arm, size):
    """transformer_lm (pre-norm, as every named fairseq LM architecture and transformer_lm_qknorm)
    or transformer_lm_qknorm with the arm's QK-norm; g0 from the block length (--qk-scale-init auto)."""
    s = LM_SIZES[size]
    if arm in ("stock", "stock_control"):
        own = ["--arch", "transformer_lm"]
    elif arm in QK_VARIANTS:
        v = QK_VARIANTS[arm]
        own = ["--arch", "transformer_lm_qknorm", "--qk-norm", v["qk_norm"], "--qk-scale", v["qk_scale"]]
        own += ["--qk-scale-init", "auto"] if v["qk_scale"] != "none" else []
        own += ["--qk-scale-per-head"] if v["qk_scale_per_head"] else []
    else:
        raise ValueError(f"arm {arm}: the language model has stock, stock_control and the qknorm* arms")
    dims = {
        "--decoder-embed-dim": s.dim,
        "--decoder-input-dim": s.dim,
        "--decoder-output-dim": s.dim,
        "--decoder-ffn-embed-dim": s.ffn,
        "--decoder-layers": s.layers,
        "--decoder-attention-heads": s.heads,
        "--dropout": 0.1,
        "--attention-dropout": 0.0,
    }
    flags = [str(x) for kv in dims.items() for x in kv]
    return [*own, "--decoder-normalize-before", "--share-decoder-input-output-embed", *flags]


def lm_training(size, dtype, device, conf, seed, save_dir):
    """Training of the language model on blocks of LM_CONTEXT random tokens (their content does not
    change the speed), conf["lm_tokens"] tokens per batch size of conf["train_tokens"]."""
    context, vocab = LM_CONTEXT[size], dictionary(LM_SIZES[size].vocab)
    gen = torch.Generator().manual_seed(seed)

    def batch(rows):
        tokens = torch.randint(vocab.nspecial, len(vocab), (rows, context + 1), generator=gen)
        return {
            "id": torch.arange(rows),
            "nsentences": rows,
            "ntokens": rows * context,
            "net_input": {"src_tokens": tokens[:, :-1].contiguous(), "src_lengths": torch.full((rows,), context)},
            "target": tokens[:, 1:].contiguous(),
        }

    batches = {
        t: [_to(batch(t // context), device) for _ in range(max(1, conf["lm_tokens"] // t))]
        for t in conf["train_tokens"]
    }
    task_flags = ["--task", "language_modeling", "--tokens-per-sample", str(context), "--sample-break-mode", "none"]
    # with stock's model flags, which the Trainer never reads: one configuration for all arms
    cfg = trainer_config(
        (*task_flags, *lm_flags("stock", size), "--criterion", "cross_entropy"), dtype, device, save_dir
    )

    def build(arm):
        args = parsed(["unused", *task_flags, *lm_flags(arm, size)])  # the model's, as fairseq-train's
        task = LanguageModelingTask(args, vocab)
        utils.set_torch_seed(seed)  # the same weights in every arm, as benchmarks.arms builds them
        model = task.build_model(args)
        return TrainArm(cfg, task, model, task.build_criterion(cfg.criterion), list(batches.values()))

    return training_part(batches, build, "tokens/s")


def beam_search(size, dtype, device, conf, lengths_from, seed):
    """Beam search (beam conf["beam"]) over batches of conf["gen_sentences"] source sentences. The
    model is cast as fairseq-generate casts it for --fp16 (model.half()); fairseq-generate 0.12 has
    no bf16 cast (it decodes a --bf16 run in float32): here the model is cast to bfloat16 alike."""
    jobs = [
        dict(
            device=device,
            dtype=dtype,
            size=size,
            seed=seed,
            beam=conf["beam"],
            max_len=conf["max_len"],
            gen_sentences=n,
            lengths_from=lengths_from,
        )
        for n in conf["gen_sentences"]
    ]

    def build(arm):
        return GenerateArm([dict(job, arm=arm) for job in jobs])

    return Part([(f"{n} sentences", [n]) for n in conf["gen_sentences"]], build, "sentences/s")


def build_part(benchmark, model, dtype, device, conf, lengths, lengths_from, save_dir, seed=1):
    """The Part of one model ("lm" or a translation model), precision and benchmark, at the size
    conf["sizes"] gives the model (the dry run's are tiny)."""
    assert dtype in DTYPES
    size = conf["sizes"][model]
    if benchmark == "generate":
        return beam_search(size, dtype, device, conf, lengths_from, seed)
    if model == "lm":
        return lm_training(size, dtype, device, conf, seed, save_dir)
    return translation_training(size, dtype, device, conf, lengths, seed, save_dir)
