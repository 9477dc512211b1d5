"""QKNormAttention against an explicit reference, against fairseq's MultiheadAttention, and in both
of its code paths (fused SDPA, plain)."""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from fairseq.modules import MultiheadAttention

import fairseq_qknorm  # noqa: F401  (registers the plugin)
from fairseq_qknorm.qknorm_attention import QKNormAttention

E, H, T, S, B = 32, 4, 6, 7, 3
D = E // H
VARIANTS = [
    dict(qk_norm=n, qk_scale=s, qk_scale_init=2.5, qk_scale_per_head=p)
    for n, s, p in itertools.product(
        ["l2", "layernorm", "rmsnorm", "none"], ["learned", "fixed", "none"], [False, True]
    )
    if not (s == "none" and p)
]


def ids(v):
    return f"{v['qk_norm']}-{v['qk_scale']}{'-perhead' if v['qk_scale_per_head'] else ''}"


def make(variant, cross=False, seed=0):
    torch.manual_seed(seed)
    kw = dict(kdim=E, vdim=E, encoder_decoder_attention=True) if cross else dict(self_attention=True)
    m = QKNormAttention(E, H, **variant, **kw).eval()
    with torch.no_grad():  # move norm affine params and g away from their init, so they matter
        for name, p in m.named_parameters():
            if "norm" in name or name.endswith(".g"):
                p.add_(torch.rand_like(p) * 0.5)
    return m


def heads(x):  # (T, B, E) -> (B, H, T, D)
    return x.view(x.size(0), x.size(1), H, D).permute(1, 2, 0, 3)


def reference(m, query, key, key_padding_mask=None, attn_mask=None):
    """The technique written out: normalize q, k per head; g * q.k (or 1/sqrt(d)); masks; softmax; V."""
    q, k, v = heads(m.q_proj(query)), heads(m.k_proj(key)), heads(m.v_proj(key))
    if m.qk_norm == "l2":
        q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    elif m.qk_norm == "layernorm":
        q = F.layer_norm(q, (D,), m.q_norm.weight, m.q_norm.bias, m.q_norm.eps)
        k = F.layer_norm(k, (D,), m.k_norm.weight, m.k_norm.bias, m.k_norm.eps)
    elif m.qk_norm == "rmsnorm":
        eps = torch.finfo(q.dtype).eps if m.q_norm.eps is None else m.q_norm.eps
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + eps) * m.q_norm.weight
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps) * m.k_norm.weight
    scale = m.qk_scale.g if m.qk_scale is not None else 1 / math.sqrt(D)
    scores = scale * (q @ k.transpose(-1, -2))
    if attn_mask is not None:
        scores = scores + attn_mask
    if key_padding_mask is not None:
        scores = scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
    w = scores.softmax(-1)
    out = (w @ v).permute(2, 0, 1, 3).reshape(query.size(0), query.size(1), E)
    return m.out_proj(out), w


def inputs(cross):
    torch.manual_seed(1)
    query = torch.randn(T, B, E)
    key = torch.randn(S, B, E) if cross else query
    kpm = torch.zeros(B, key.size(0), dtype=torch.bool)
    if cross:
        kpm[0, :2] = True  # left padding, as fairseq pads sources
    else:
        kpm[0, -2:] = True  # right padding: with a causal mask, left padding would hide every key
    kpm[2, -1:] = True
    causal = None if cross else torch.triu(torch.full((T, T), float("-inf")), 1)
    return query, key, kpm, causal


@pytest.mark.parametrize("variant", VARIANTS, ids=ids)
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_matches_reference_in_both_paths(variant, cross):
    m = make(variant, cross)
    query, key, kpm, causal = inputs(cross)
    query.requires_grad_(), key.requires_grad_()
    grad = torch.randn(T, B, E)
    wrt = [query] + ([key] if cross else []) + list(m.parameters())

    def grads(out):
        return torch.autograd.grad(out, wrt, grad)

    want, want_w = reference(m, query, key, kpm, causal)
    fused, none_w = m(query, key, key, key_padding_mask=kpm, attn_mask=causal, need_weights=False)
    plain, avg_w = m(query, key, key, key_padding_mask=kpm, attn_mask=causal, need_weights=True)
    _, head_w = m(query, key, key, key_padding_mask=kpm, attn_mask=causal, need_head_weights=True)
    assert none_w is None
    torch.testing.assert_close(fused, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(plain, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(head_w, want_w.transpose(0, 1), atol=1e-5, rtol=1e-5)  # (H, B, T, S)
    torch.testing.assert_close(avg_w, want_w.mean(1), atol=1e-5, rtol=1e-5)
    want_grads = grads(want)
    for ours in (fused, plain):  # gradients of the input(s) and of every parameter, g included
        for a, b in zip(grads(ours), want_grads):  # sums over all tokens: float32 rounding adds up
            torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-4)


def test_before_softmax_returns_the_scaled_logits():
    m = make(dict(qk_norm="l2", qk_scale="learned", qk_scale_init=4.0))
    query, key, kpm, causal = inputs(False)
    scores, v = m(query, query, query, key_padding_mask=kpm, before_softmax=True)
    q, k = heads(m.q_proj(query)), heads(m.k_proj(query))
    want = m.qk_scale.g * F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-1, -2)
    want = want.masked_fill(kpm[:, None, None, :], float("-inf")).flatten(0, 1)
    torch.testing.assert_close(scores, want, atol=1e-5, rtol=1e-5)
    assert v.shape == (B * H, T, D)
    finite = scores[scores.isfinite()]
    assert finite.abs().max() <= m.qk_scale.g.item() + 1e-5  # cosine similarities times g


@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_none_equals_fairseq_multihead_attention(cross):
    kw = dict(kdim=E, vdim=E, encoder_decoder_attention=True) if cross else dict(self_attention=True)
    torch.manual_seed(0)
    stock = MultiheadAttention(E, H, **kw).eval()
    ours = QKNormAttention(E, H, qk_norm="none", qk_scale="none", **kw).eval()
    assert set(ours.state_dict()) == set(stock.state_dict())  # no parameter of its own
    ours.load_state_dict(stock.state_dict())
    query, key, kpm, causal = inputs(cross)
    for need_weights in (False, True):
        a, wa = stock(query, key, key, key_padding_mask=kpm, attn_mask=causal, need_weights=need_weights)
        b, wb = ours(query, key, key, key_padding_mask=kpm, attn_mask=causal, need_weights=need_weights)
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        if need_weights:
            torch.testing.assert_close(wb, wa, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm", ["l2", "layernorm", "rmsnorm"])
def test_zero_g_and_zero_norm_weights_give_finite_gradients(norm):
    """y = 0 * ... holds no trace of the normalized q; nor does a zero weight (backward divides by a
    clamped one). The gradients stay finite, and g = 0 leaves the queries' projection without any."""
    m = make(dict(qk_norm=norm, qk_scale="learned", qk_scale_init=8.0)).train()
    if norm != "l2":
        with torch.no_grad():
            m.q_norm.weight[:2] = 0.0
            m.k_norm.weight[-3:] = 0.0
    query, _, kpm, causal = inputs(False)
    for g in (8.0, 0.0):
        m.zero_grad()
        with torch.no_grad():
            m.qk_scale.g.fill_(g)
        out, _ = m(query, query, query, key_padding_mask=kpm, attn_mask=causal, need_weights=False)
        out.pow(2).sum().backward()
        assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)
        assert (m.q_proj.weight.grad.abs().sum() == 0) == (g == 0.0)


def saved_bytes(module, *args, **kwargs):
    """Bytes of the distinct tensors autograd keeps for backward, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    kept = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*args, **kwargs)
    return sum(kept.values())


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v["qk_norm"] != "none"], ids=ids)
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_qknorm_keeps_no_more_for_backward_than_stock_attention(variant, cross):
    kw = dict(kdim=E, vdim=E, encoder_decoder_attention=True) if cross else dict(self_attention=True)
    stock = MultiheadAttention(E, H, **kw).train()
    ours = QKNormAttention(E, H, **variant, **kw).train()
    query, key, kpm, _ = inputs(cross)
    query = query.requires_grad_()
    call = dict(key_padding_mask=kpm, need_weights=False)
    stock_bytes, our_bytes = saved_bytes(stock, query, key, key, **call), saved_bytes(ours, query, key, key, **call)
    # per row of q and k, one float (1/||x|| or rstd): nothing the size of q or k itself
    assert our_bytes <= stock_bytes + 4 * B * H * (T + key.size(0)) + 64, (our_bytes, stock_bytes)


@pytest.mark.parametrize("per_head", [False, True])
def test_gradients_reach_g_and_are_finite(per_head):
    m = make(dict(qk_norm="l2", qk_scale="learned", qk_scale_init=12.3, qk_scale_per_head=per_head))
    m.train()
    query, key, kpm, causal = inputs(False)
    out, _ = m(query, query, query, key_padding_mask=kpm, attn_mask=causal, need_weights=False)
    out.pow(2).sum().backward()
    g = m.qk_scale.g
    assert g.grad is not None and g.grad.shape == g.shape
    assert torch.isfinite(g.grad).all() and g.grad.abs().sum() > 0
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)


@pytest.mark.parametrize("variant", VARIANTS, ids=ids)
def test_checkpoint_names_and_shapes_are_fairseqs_plus_qknorms(variant):
    """What a checkpoint holds: fairseq's MultiheadAttention state under its own names, plus g, the
    g0 it started from, and the per-head norms' weights under the names saved models have."""
    stock = MultiheadAttention(E, H, self_attention=True).state_dict()
    ours = QKNormAttention(E, H, **variant, self_attention=True).state_dict()
    norm = {"l2": [], "none": [], "rmsnorm": ["weight"], "layernorm": ["weight", "bias"]}[variant["qk_norm"]]
    extra = {f"{side}_norm.{p}": (D,) for side in "qk" for p in norm}
    if variant["qk_scale"] != "none":
        extra["qk_scale.g"] = (H, 1, 1) if variant["qk_scale_per_head"] else ()
        extra["qk_scale.g0"] = ()
    assert {k: tuple(v.shape) for k, v in ours.items()} == {**{k: tuple(v.shape) for k, v in stock.items()}, **extra}


def test_fixed_scale_is_a_buffer_not_a_parameter():
    m = make(dict(qk_norm="l2", qk_scale="fixed", qk_scale_init=1.0))
    assert not any(n.endswith(".g") for n, _ in m.named_parameters())
    assert "qk_scale.g" in m.state_dict()


# On CUDA, the fused path runs one of FUSED_BACKENDS' kernels (the GPU call runs these with -k cuda).
@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
)
def test_zero_queries_keys_and_all_padding_rows_give_no_nan(device):
    m = make(dict(qk_norm="l2", qk_scale="learned", qk_scale_init=8.0)).to(device)
    with torch.no_grad():
        m.q_proj.weight.zero_(), m.q_proj.bias.zero_(), m.k_proj.weight.zero_(), m.k_proj.bias.zero_()
    query, _, kpm, causal = (x.to(device) for x in inputs(False))
    kpm[1] = True  # a sentence that is all padding
    for need_weights in (False, True):
        out, _ = m(query, query, query, key_padding_mask=kpm, attn_mask=causal, need_weights=need_weights)
        assert torch.isfinite(out).all()
    m.train()
    out, _ = m(query, query, query, key_padding_mask=kpm, attn_mask=causal, need_weights=False)
    out.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)


def test_the_fused_path_keeps_cudnn_attention_out(monkeypatch):
    # cuDNN's SDPA builds a plan per new shape (qknorm_attention.FUSED_BACKENDS says why it is left out).
    seen = []
    sdpa = F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    m = make(dict(qk_norm="l2", qk_scale="learned", qk_scale_init=8.0))
    query, _, kpm, causal = inputs(False)
    m(query, query, query, key_padding_mask=kpm, attn_mask=causal, need_weights=False)
    assert seen == [False]
    assert torch.backends.cuda.cudnn_sdp_enabled()  # and the process's own setting is back


@pytest.mark.parametrize("norm", ["l2", "layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_g_stays_float32_when_the_model_is_cast(dtype, norm):
    m = make(dict(qk_norm=norm, qk_scale="learned", qk_scale_init=12.3196))
    g_before = m.qk_scale.g.detach().clone()
    m.to(dtype)
    assert m.q_proj.weight.dtype == dtype
    assert m.qk_scale.g.dtype == torch.float32 and torch.equal(m.qk_scale.g.detach(), g_before)
    assert isinstance(m.qk_scale.g, torch.nn.Parameter)
    if dtype == torch.bfloat16:  # fp16 matmuls are not implemented on every CPU build
        query, _, kpm, causal = inputs(False)
        out, w = m(query.to(dtype), None, None, key_padding_mask=kpm, attn_mask=causal, need_weights=True)
        assert out.dtype == dtype and torch.isfinite(out).all() and torch.isfinite(w).all()


def test_bad_settings_are_refused_with_the_flag_name():
    with pytest.raises(ValueError, match="--qk-norm"):
        QKNormAttention(E, H, qk_norm="l1", self_attention=True)
    with pytest.raises(ValueError, match="--qk-scale"):
        QKNormAttention(E, H, qk_scale="sometimes", self_attention=True)
    with pytest.raises(ValueError, match="--qk-scale-init"):
        QKNormAttention(E, H, qk_scale="learned", qk_scale_init=None, self_attention=True)
