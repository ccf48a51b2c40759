"""The stack's config, parsed and checked once before any resource exists: stack (StackConfig, the frozen
dataclass __main__.py builds everything from, and `load`/`parse`), reader (the key reader and its errors: the
closest key named for a misspelt one), checks (the slice, capacity, model and data keys), serving_checks (the serve
keys against the host that would run them), cpu_node (the CPU node's room for the heads), job (the fine-tune's
settings as the stack sends them, and the datasetFile's bucket object) and pulumi_yaml (Pulumi.yaml's fine-tune
keys, written from the job's declarations: `python -m infra.config.pulumi_yaml`).

Called by __main__.py, infra/local_run.py and the components; imports infra/cloud/, infra/serving/app.py and the
job modules below it, nothing above.
"""
