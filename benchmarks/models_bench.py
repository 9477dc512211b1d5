"""Whole-model workloads, one arm per process: training steps and beam-search generation."""

import argparse

import torch
from fairseq import utils
from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion
from fairseq.sequence_generator import SequenceGenerator

from .arms import SIZES, build_model
from .data import one_batch, random_pairs, training_batches
from .lengths import read_pair_lengths
from .timing import DTYPES, timed_cpu


def _to(sample, device):
    return utils.apply_to_sample(lambda t: t.to(device), sample)


def activations_mb(model, forward) -> float:
    """MiB of tensors that autograd keeps for backward during forward(), parameters left out:
    the activation memory, exactly, next to a peak RSS that the allocator blurs."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameters:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(kept.values()) / 2**20


class TrainBench:
    """Forward, label-smoothed cross entropy, backward and an Adam step over fixed batches, as
    fairseq-train does them. One unit of measure is one batch: the runner interleaves the arms
    batch by batch. Speed in target tokens per second (fairseq's wps)."""

    def __init__(self, job):
        self.device = job["device"]
        model, task = build_model(job["arm"], SIZES[job["size"]], job["seed"])
        self.model = model.to(device=self.device, dtype=DTYPES[job["dtype"]]).train()
        self.criterion = LabelSmoothedCrossEntropyCriterion(task, sentence_avg=False, label_smoothing=0.1)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=5e-4, betas=(0.9, 0.98))
        lengths = read_pair_lengths(*job["lengths_from"])
        data = random_pairs(lengths, job["train_sentences"], task.source_dictionary, job["seed"], job["max_len"])
        self.batches = [_to(b, self.device) for b in training_batches(data, job["max_tokens"], job["seed"])]
        self.ntokens = sum(b["ntokens"] for b in self.batches)
        self.info = {
            "units": len(self.batches),
            "batches": len(self.batches),
            "target_tokens": self.ntokens,
            "sentences": sum(b["nsentences"] for b in self.batches),
            "parameters": sum(p.numel() for p in self.model.parameters()),
        }
        # Warm-up: the largest batch (the allocator's high-water mark) and one more.
        largest = max(self.batches, key=lambda b: b["net_input"]["src_tokens"].numel() + b["target"].numel())
        for b in (largest, self.batches[0]):
            self.step(b)
        self.info["activations_mb"] = activations_mb(self.model, lambda: self.criterion(self.model, largest))

    def step(self, sample):
        loss, _, _ = self.criterion(self.model, sample)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()

    def measure(self, unit):
        batch = self.batches[unit]
        seconds, cpu = timed_cpu(lambda: self.step(batch), self.device)
        return {"seconds": seconds, "cpu_seconds": cpu, "target_tokens": batch["ntokens"]}


class GenerateBench:
    """fairseq's SequenceGenerator, beam search with incremental decoding, on one batch of source
    sentences, after fairseq-generate's prepare_for_inference_. Every hypothesis is forced to the
    same length L (min_len = max_len = L), so every arm runs the same number of decoding steps
    whatever its weights."""

    def __init__(self, job):
        self.device = job["device"]
        model, task = build_model(job["arm"], SIZES[job["size"]], job["seed"])
        beam = job["beam"]
        model.prepare_for_inference_(
            argparse.Namespace(generation=argparse.Namespace(beam=beam, print_alignment=False))
        )
        self.model = model.to(device=self.device, dtype=DTYPES[job["dtype"]])
        lengths = read_pair_lengths(*job["lengths_from"])
        data = random_pairs(lengths, job["gen_sentences"], task.source_dictionary, job["seed"] + 1, job["max_len"])
        self.sample = _to(one_batch(data), self.device)
        # L: the median reference length of the batch, capped like the training lengths.
        self.length = int(torch.median(torch.as_tensor(data.tgt_sizes - 1)).item())
        dictionary = task.target_dictionary
        self.generator = SequenceGenerator(
            [self.model], dictionary, beam_size=beam, max_len_a=0, max_len_b=self.length, min_len=self.length
        )
        if job["arm"] == "stock_beamable":
            self.model.decoder.set_beam_size(beam)
        # Warm-up: every code path of a generation, for two steps only. It also tells whether cross
        # attention kept one copy of the encoder's keys per sentence: fairseq's by a beam size set
        # on the module, the plugin's by being given one copy per sentence.
        shared = []
        hooks = [
            m.register_forward_pre_hook(
                lambda module, args, kwargs: shared.append(kwargs["key"].size(1) < kwargs["query"].size(1)),
                with_kwargs=True,
            )
            for m in self.model.modules()
            if getattr(m, "encoder_decoder_attention", False)
        ]
        warm = SequenceGenerator([self.model], dictionary, beam_size=beam, max_len_a=0, max_len_b=2, min_len=2)
        warm.generate([self.model], self.sample)
        for hook in hooks:
            hook.remove()
        beamable = any(shared) or any(getattr(m, "beam_size", 1) > 1 for m in self.model.modules())
        self.info = {
            "units": 1,
            "sentences": len(data),
            "beam": beam,
            "length": self.length,
            "beamable": beamable,
            "parameters": sum(p.numel() for p in self.model.parameters()),
        }

    def generate(self):
        self.hypos = self.generator.generate([self.model], self.sample)

    def measure(self, unit):
        seconds, cpu = timed_cpu(self.generate, self.device)
        return {
            "seconds": seconds,
            "cpu_seconds": cpu,
            "sentences": len(self.hypos),
            "output_tokens": sum(len(h[0]["tokens"]) for h in self.hypos),
        }
