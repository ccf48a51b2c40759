"""Before and after: the held-out records and named lm-eval tasks scored on the base and on the fine-tune.

- before_after: the held-out tasks written for lm-eval, scored in the job through HFLM over the FSDP model,
  evaluation.json

The top of jobs/: imports training/, data/, config/ and runtime/. Called by the fine-tune's driver and
train_loop_per_worker, and by rescore.py.
"""
