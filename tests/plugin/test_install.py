"""What the install gives fairseq's own examples beside the plugin: sacremoses, which fairseq's
IWSLT'14 example needs to validate (--eval-bleu-detok moses), and no second torch through it."""

from argparse import Namespace
from importlib import metadata


def test_fairseqs_moses_detokenizer_builds():
    from fairseq.data import encoders

    detok = encoders.build_tokenizer(
        Namespace(
            tokenizer="moses", source_lang="en", target_lang="en", moses_no_dash_splits=False, moses_no_escape=False
        )
    )  # what the translation task builds for --eval-bleu-detok moses
    assert detok.decode("Hello , world ! It &apos;s fine .") == "Hello, world! It's fine."


def requirement_tree(name, seen=None):
    """NAME and every distribution it requires here, recursively (as pip resolves them: no extras,
    environment markers evaluated)."""
    from packaging.requirements import Requirement

    seen = set() if seen is None else seen
    seen.add(name)
    for text in metadata.requires(name) or []:
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        needed = requirement.name.lower().replace("_", "-")
        if needed not in seen:
            requirement_tree(needed, seen)
    return seen


def test_sacremoses_pulls_in_no_torch():
    tree = requirement_tree("sacremoses")
    assert "click" in tree and not {"torch", "torchaudio"} & tree, tree
