"""Where one attention layer's activation memory goes: `python -m benchmarks.saved_tensors`.

For fairseq's MultiheadAttention and every QK-norm variant: one training forward of self attention
(512 wide, 4 heads, 64 sentences x 40 tokens, 4 of them padding), and the tensors autograd keeps for
backward, one line per distinct storage, named by the op that made it. An exact count: timing-free."""

import torch
from fairseq.modules import MultiheadAttention

from fairseq_qknorm.qknorm_attention import QKNormAttention

from .arms import QK_SCALE_INIT
from .variants import QK_VARIANTS

E, H, T, B = 512, 4, 40, 64


def kept(module, x, mask):
    """storage -> (MiB, shape, the op that made it), for what module's forward keeps for backward."""
    skip = {p.untyped_storage().data_ptr() for p in module.parameters()} | {x.untyped_storage().data_ptr()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip and ptr not in seen:
            op = t.grad_fn.name() if t.grad_fn is not None else "(no grad)"
            seen[ptr] = (t.untyped_storage().nbytes() / 2**20, tuple(t.shape), op, t)  # t: keep it alive
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x, x, x, key_padding_mask=mask, need_weights=False)
    return seen


def main():
    torch.manual_seed(0)
    x = torch.randn(T, B, E, requires_grad=True)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[:, -4:] = True
    arms = {"stock": MultiheadAttention(E, H, self_attention=True)}
    arms.update(
        {
            name: QKNormAttention(E, H, qk_scale_init=QK_SCALE_INIT, self_attention=True, **flags)
            for name, flags in QK_VARIANTS.items()
        }
    )
    for name, module in arms.items():
        seen = kept(module.train(), x, mask)
        big = "; ".join(f"{op} {shape} {mib:.1f}" for mib, shape, op, _ in seen.values() if mib >= 0.5)
        print(f"{name}: {sum(v[0] for v in seen.values()):.2f} MiB kept: {big}")


if __name__ == "__main__":
    main()
