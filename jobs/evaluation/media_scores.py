"""The held-out records with pictures and sound, scored before and after in the job (issue 46).

lm-eval's tasks here are text, and its `hf-multimodal` backend reads pictures only, through `AutoProcessor`
(lm_eval/models/hf_vlms.py), which for Gemma 4 needs torchvision (data/media_processor.py): so the held-out media
records are answered in the job, as the sample answers are (training/samples.py: greedy, up to their length, each
record with its pictures and clips), and scored as the text `heldout` task scores its answers: exact match, ROUGE-L
(metrics.rouge_l) and chrF (lm-eval's own aggregation). The task is `heldout_media` in evaluation.json.
"""

from __future__ import annotations

from dataclasses import replace

MEDIA_TASK = "heldout_media"


def media_scores(run, limit: int | None, batch_size: int) -> dict[str, dict]:
    """{heldout_media: {"metrics", "samples", "version"}} for the run's model as it is now, every rank in lockstep
    (training_run.TrainingRun `run`); {} without held-out media records."""
    from lm_eval.api.metrics import chrf

    from evaluation.metrics import rouge_l
    from training.samples import answer, held_out_prompts, root_first

    rows = run.data.eval
    if rows is None or getattr(rows, "media", None) is None:
        return {}
    settings = replace(run.settings, eval_samples=limit or len(rows), prompt_loss=False)
    prompts = [p for p in held_out_prompts(rows, run.trainee.tokenizer, settings) if "media" in p]
    root_first(run.trainee)
    answers = [a for at in range(0, len(prompts), batch_size)
               for a in answer(run.trainee, prompts[at : at + batch_size], run.device, run.world)]  # fmt: skip
    if not answers:
        return {}
    pairs = [(a["reference"].strip(), a["completion"].strip()) for a in answers]
    metrics = {"exact_match": sum(ref == said for ref, said in pairs) / len(pairs),
               "rouge_l": sum(rouge_l([ref], [said]) for ref, said in pairs) / len(pairs),
               "chrf": chrf(pairs)}  # fmt: skip
    return {MEDIA_TASK: {"metrics": metrics, "samples": len(pairs), "version": None}}
