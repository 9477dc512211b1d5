"""Every search decodes with its own beam size, whatever searches ran on the model before: the hub
(translate, sample, generate, in any order and batch size), fairseq-generate and an ensemble with
fairseq's own transformer. Each output is compared with what a model that ran no search before
gives; beamable cross attention (one copy of the encoder's keys per sentence) stays on."""

import pytest
import torch
from conftest import USER_DIR

import fairseq_qknorm  # noqa: F401

# How the checkpoint of the `trained` fixture (fairseq-train with --eval-bleu) is loaded: as
# trained (its --eval-bleu-args ask for beam 1), with fairseq's default --eval-bleu-args (beam 5:
# fairseq's TranslationTask builds a beam-5 generator on the model while loading it), and as if
# trained without --eval-bleu.
LOADS = {
    "eval-bleu-beam-1": {},
    "eval-bleu-default-beam-5": {"eval_bleu_args": '{"max_len_b": 40}'},
    "no-eval-bleu": {"eval_bleu": False},
}


def load_hub(trained, toy_bin, **overrides):
    from fairseq.models.transformer import TransformerModel

    data, save = trained
    hub = TransformerModel.from_pretrained(
        str(save),
        checkpoint_file="checkpoint_best.pt",
        data_name_or_path=str(data),
        user_dir=USER_DIR,
        bpe="sentencepiece",
        sentencepiece_model=str(toy_bin / "spm.model"),
        source_lang="src",
        target_lang="tgt",
        **overrides,
    )
    return hub.eval()


# (method, number of test sentences, keyword arguments): beam 1 after a loading that may set beam
# 5, beam 1 after beam 5 with 2, 5 and 10 sentences, sampling after beam search, and back.
CALLS = [
    ("translate", 3, dict(beam=1)),
    ("translate", 2, dict(beam=5)),
    ("translate", 10, dict(beam=1)),
    ("translate", 5, dict(beam=5)),
    ("translate", 5, dict(beam=1)),
    ("sample", 4, dict(beam=3, sampling=True, sampling_topk=5)),
    ("sample", 7, dict()),
    ("generate", 6, dict(beam=4)),
    ("translate", 2, dict(beam=2)),
    ("translate", 9, dict()),
]


def call(hub, method, sentences, kwargs):
    torch.manual_seed(7)  # sampling draws the same numbers in both models
    kwargs = dict(kwargs, max_len_b=20)  # the tiny model may never end a sentence: keep searches short
    if method == "generate":
        hypos = hub.generate([hub.encode(s) for s in sentences], **kwargs)
        return [[(h["tokens"].tolist(), round(float(h["score"]), 4)) for h in beams] for beams in hypos]
    return getattr(hub, method)(sentences, **kwargs)


@pytest.mark.parametrize("load", list(LOADS))
def test_hub_calls_in_sequence_equal_a_fresh_model(trained, toy_bin, toy_raw, load):
    sources = (toy_raw / "test.src").read_text().splitlines()
    hub = load_hub(trained, toy_bin, **LOADS[load])
    for i, (method, n, kwargs) in enumerate(CALLS):
        got = call(hub, method, sources[:n], kwargs)
        # the reference: a model loaded for this call alone, on which nothing has set a beam size
        fresh = call(load_hub(trained, toy_bin, eval_bleu=False), method, sources[:n], kwargs)
        assert got == fresh, f"call {i}: {method}({n} sentences, {kwargs}) after {CALLS[:i]}"


# In process, on models built from the architecture registry: fairseq's SequenceGenerator, which
# fairseq-generate, fairseq-interactive, the hub and --eval-bleu validation all run.


def small_models(vocab=40):
    """A QK-norm model moved off its init, and a copy that runs no search before its reference one."""
    import copy

    from conftest import build_model

    model, d = build_model(vocab=vocab)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".g"):
                p.add_(torch.rand_like(p) * 0.3)
    model.eval()
    return model, copy.deepcopy(model), d


def source_batch(vocab, sentences=5, length=7):
    torch.manual_seed(0)
    src = torch.randint(4, vocab, (sentences, length))
    src[:, -1] = 2  # </s>
    src[1, :3] = 1  # left padding, as fairseq batches
    return {"net_input": {"src_tokens": src, "src_lengths": (src != 1).sum(1)}, "id": torch.arange(sentences)}


def search(models, d, sample, beam, sampling_topk=None):
    """fairseq's SequenceGenerator: beam search, or with SAMPLING_TOPK sampling (-1: from all)."""
    from fairseq.search import Sampling
    from fairseq.sequence_generator import SequenceGenerator

    strategy = None if sampling_topk is None else Sampling(d, sampling_topk=sampling_topk)
    torch.manual_seed(3)
    generator = SequenceGenerator(models, d, beam_size=beam, max_len_b=10, search_strategy=strategy)
    hypos = generator.generate(models, sample)
    return [[(h["tokens"].tolist(), round(float(h["score"]), 5)) for h in beams] for beams in hypos]


# (beam, generator arguments): beam 5 over 5 sentences, then beam 1 (every fifth sentence's
# encoder output with a beam size left over), sampling, and other beams.
SEARCHES = [(5, {}), (1, {}), (3, dict(sampling_topk=5)), (4, {}), (1, dict(sampling_topk=-1)), (2, {})]


def test_each_search_uses_its_own_beam_size():
    model, fresh, d = small_models()
    sample = source_batch(len(d))
    for beam, kwargs in SEARCHES:
        reference = search([copy_of(fresh)], d, sample, beam, **kwargs)
        assert search([model], d, sample, beam, **kwargs) == reference, f"beam {beam} {kwargs}"


def copy_of(model):
    import copy

    return copy.deepcopy(model)


def test_an_ensemble_with_fairseqs_transformer_uses_each_searchs_beam_size():
    from conftest import build_model

    model, fresh, d = small_models()
    torch.manual_seed(5)
    stock, _ = build_model(arch="transformer", vocab=40)
    stock.eval()
    sample = source_batch(len(d))
    for beam, kwargs in SEARCHES:
        reference = search([copy_of(fresh), stock], d, sample, beam, **kwargs)
        assert search([model, stock], d, sample, beam, **kwargs) == reference, f"beam {beam} {kwargs}"


def test_beam_search_keeps_one_copy_of_the_keys_per_sentence_and_finds_the_same_hypotheses():
    """Beamable cross attention: each sentence's keys and values are projected and cached once,
    shared by its hypotheses (fairseq's transformer keeps one copy per hypothesis). The search
    finds what it finds with one copy per hypothesis, scores included."""
    from fairseq.models.transformer import TransformerEncoderBase

    model, copied, d = small_models()
    model.double(), copied.double()
    sample = source_batch(len(d))
    beam, sentences = 4, 5
    seen = []  # (queries, keys) of every cross-attention call
    for layer in model.decoder.layers:
        layer.encoder_attn.register_forward_pre_hook(
            lambda module, args, kwargs: seen.append((kwargs["query"].size(1), kwargs["key"].size(1))),
            with_kwargs=True,
        )
    shared = search([model], d, sample, beam)
    assert seen[0] == (sentences * beam, sentences)
    # fairseq's own reordering of the encoder output: one copy per hypothesis all along
    copied.encoder.reorder_encoder_out = TransformerEncoderBase.reorder_encoder_out.__get__(copied.encoder)
    for a, b in zip(shared, search([copied], d, sample, beam)):
        assert [tokens for tokens, _ in a] == [tokens for tokens, _ in b]
        torch.testing.assert_close([score for _, score in a], [score for _, score in b])


def test_training_after_a_beam_search_does_not_share_keys():
    """A training batch is not made of beams: after a search (--eval-bleu's validation) a forward
    without an incremental state gives what it gave before."""
    model, _, d = small_models()
    model.double()
    sample = source_batch(len(d))
    prev = torch.randint(4, len(d), (5, 6))
    before, _ = model(**sample["net_input"], prev_output_tokens=prev)
    search([model], d, sample, 5)
    after, _ = model(**sample["net_input"], prev_output_tokens=prev)
    torch.testing.assert_close(after, before, atol=0, rtol=0)
