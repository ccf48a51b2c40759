"""Before and after: the held-out records and named lm-eval tasks scored on the base and on the fine-tune.

- heldout_task: the held-out tasks written for lm-eval (their records, YAMLs and metrics) into the run
- before_after: those and the named tasks scored in the job through HFLM over the FSDP model, evaluation.json
- endpoint, media_scores, metrics: scoring through a served endpoint, the held-out media records, an answer's score

The top of jobs/: imports training/, data/, config/ and runtime/. Called by the fine-tune's driver and
train_loop_per_worker, and by rescore.py.
"""
