"""Word dropout as in the paper's code (Transformers without Tears): while training, each input
token is replaced by <unk> with probability p. Padding, </s> and <s> are left alone."""

import torch


def word_dropout(tokens: torch.Tensor, p: float, dictionary, training: bool) -> torch.Tensor:
    if not training or p <= 0:
        return tokens
    drop = torch.rand(tokens.shape, device=tokens.device) < p
    for special in (dictionary.pad(), dictionary.eos(), dictionary.bos()):
        drop &= tokens != special
    return tokens.masked_fill(drop, dictionary.unk())
