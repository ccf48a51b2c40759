"""What a label says: IGNORE marks a position whose token is not trained on (PyTorch's cross-entropy
ignore_index), and the count of the positions a batch predicts. The data lays labels out, the loss reads them."""

from __future__ import annotations

IGNORE = -100  # the label of a position whose token is not trained on


def predicted_tokens(labels):
    """How many tokens a batch predicts: the labels after the first position that are not IGNORE
    (position t's logits predict label t + 1)."""
    return (labels[..., 1:] != IGNORE).sum()
