"""The cloud's facts the stack is built on, each with its source and date: the TPU generations and slice shapes
(tpu: hosts, chips and labels derived from the jobs' table), the capacity kinds and GKE's grace periods
(capacity), the Gemma 4 sizes and their memory plans on a slice and on a serving host (models).

Pure tables and functions, no Pulumi: the config's checks (infra/config/), the components (infra/resources/),
the prices (infra/prices.py) and the tests read them. Imports only infra/job_modules.py below it.
"""
