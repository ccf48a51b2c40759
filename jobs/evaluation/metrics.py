"""An answer's score against its reference, shared by the held-out text task (its YAML names it: before_after.py
writes its source into heldout_utils.py) and the held-out media task scored in the job (media_scores.py)."""

from __future__ import annotations


def rouge_l(references: list[str], predictions: list[str]) -> float:
    """ROUGE-L F1 of one answer against its reference (rouge_score, stemmed): lm-eval calls it per document."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    return scorer.score(references[0], predictions[0])["rougeL"].fmeasure
