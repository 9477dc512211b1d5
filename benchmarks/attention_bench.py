"""The attention layer alone: forward + backward of self and cross attention over padded batches,
and one incremental decoding step (beam search) against a cache, for fairseq's MultiheadAttention,
QKNormAttention and the plain QK-norm. All arms run in one process, interleaved case by case."""

import math

import torch
from fairseq.modules import MultiheadAttention

from fairseq_qknorm.qknorm_attention import QKNormAttention

from .arms import QK_SCALE_INIT, SIZES, scale_init
from .plain_attention import PlainQKNormAttention
from .timing import DTYPES, timed
from .variants import QK_VARIANTS

ATTENTION_ARMS = ("stock", "qknorm", "qknorm_plain", *(a for a in QK_VARIANTS if a != "qknorm"))


def build_attention(arm, dim, heads, cross, seed):
    kind = {"encoder_decoder_attention": True} if cross else {"self_attention": True}
    torch.manual_seed(seed)  # the same projections in every arm
    if arm == "stock":
        return MultiheadAttention(dim, heads, **kind)
    if arm == "qknorm_plain":
        return PlainQKNormAttention(dim, heads, qk_scale_init=QK_SCALE_INIT, **QK_VARIANTS["qknorm"], **kind)
    variant = QK_VARIANTS[arm]
    init = scale_init(variant["qk_norm"], dim // heads)
    return QKNormAttention(dim, heads, qk_scale_init=init, **variant, **kind)


def padding_mask(lengths, time, device):
    """(batch, time) True on padding; right-padded."""
    return torch.arange(time, device=device)[None, :] >= lengths[:, None].to(device)


class AttentionBench:
    """cases: name -> {arm: a call to time}; every arm gets the same inputs."""

    def __init__(self, job):
        self.device, self.dtype = job["device"], DTYPES[job["dtype"]]
        size = SIZES[job["size"]]
        self.dim, self.heads, self.seed = size.dim, size.heads, job["seed"]
        self.gen = torch.Generator().manual_seed(job["seed"])
        self.cases = {}
        for length in job["attention_lengths"]:
            batch = max(1, job["attention_tokens"] // length)
            for cross in (False, True):
                name = f"{'cross' if cross else 'self'} T={length} fwd+bwd"
                self.cases[name] = self._fwd_bwd_case(cross, length, batch)
        hyps, cache = job["gen_sentences"] * job["beam"], job["attention_cache"]
        for cross in (False, True):
            name = f"{'cross' if cross else 'self'} step, cache {cache}"
            self.cases[name] = self._step_case(cross, cache, job["gen_sentences"], job["beam"])
        # Warm up every arm, then pick per case a number of calls that takes attention_seconds.
        self.calls = {}
        for name, fns in self.cases.items():
            for fn in fns.values():
                fn()
            once = timed(fns["stock"], self.device)
            self.calls[name] = max(1, min(1000, math.ceil(job["attention_seconds"] / max(once, 1e-6))))
        self.info = {"units": 1, "cases": list(self.cases), "calls": self.calls, "hypotheses": hyps}

    def _randn(self, *shape):
        return torch.randn(*shape, generator=self.gen).to(self.device, self.dtype)

    def _lengths(self, batch, length):
        """Real-looking padding: a length-sorted batch pads each sentence by up to a fifth."""
        low = max(1, math.ceil(0.8 * length))
        return torch.randint(low, length + 1, (batch,), generator=self.gen)

    def _module(self, arm, cross):
        return build_attention(arm, self.dim, self.heads, cross, self.seed).to(self.device, self.dtype)

    def _fwd_bwd_case(self, cross, length, batch):
        x = self._randn(length, batch, self.dim).requires_grad_()
        enc = self._randn(length, batch, self.dim).requires_grad_() if cross else x
        mask = padding_mask(self._lengths(batch, length), length, self.device)
        grad = self._randn(length, batch, self.dim)

        def make(module):
            def call():
                module.zero_grad(set_to_none=True)
                x.grad = enc.grad = None
                out, _ = module(x, enc, enc, key_padding_mask=mask, need_weights=False)
                out.backward(grad)

            return call

        return {arm: make(self._module(arm, cross).train()) for arm in ATTENTION_ARMS}

    def _step_case(self, cross, cache, sentences, beam):
        """One decoding step for sentences * beam hypotheses: self attention against `cache`
        earlier steps, or cross attention against `cache` encoder states (cached, with padding)."""
        hyps = sentences * beam
        x = self._randn(1, hyps, self.dim)
        enc = self._randn(cache, sentences, self.dim).repeat_interleave(beam, dim=1)
        enc_mask = padding_mask(self._lengths(sentences, cache), cache, self.device).repeat_interleave(beam, dim=0)

        def attend_to_source(module, state):
            if type(module) is QKNormAttention:  # the plugin's decoder gives it one copy per sentence
                kw = dict(key_padding_mask=enc_mask[::beam], incremental_state=state, static_kv=True)
                return module(x, enc[:, ::beam], enc[:, ::beam], need_weights=False, **kw)
            kw = dict(key_padding_mask=enc_mask, incremental_state=state, static_kv=True, need_weights=False)
            return module(x, enc, enc, **kw)

        def make(module):
            module.eval()
            module.set_beam_size(beam)  # fairseq's MultiheadAttention: one copy per sentence
            state = {}
            with torch.no_grad():  # fill the cache once, as the first steps would
                if cross:
                    attend_to_source(module, state)
                else:
                    module(self._randn(cache, hyps, self.dim), None, None, incremental_state=state, need_weights=False)
            filled = dict(module._get_input_buffer(state))

            @torch.no_grad()
            def call():
                module._set_input_buffer(state, dict(filled))  # the same cache length at every call
                if cross:
                    attend_to_source(module, state)
                else:
                    module(x, x, x, incremental_state=state, need_weights=False)

            return call

        return {arm: make(self._module(arm, cross)) for arm in ATTENTION_ARMS}

    def measure(self, unit):
        """ms per call, per case and arm (all arms, interleaved case by case)."""
        out = {}
        for name, fns in self.cases.items():
            n = self.calls[name]
            out[name] = {
                arm: 1e3 * timed(lambda: [fn() for _ in range(n)], self.device) / n  # noqa: B023 (called here)
                for arm, fn in fns.items()
            }
        return out
