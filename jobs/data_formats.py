"""What data the fine-tune reads: file types, record formats, overlong records, the default eval share.

No imports: the stack's config (infra/config.py) and cost estimate (infra/prices.py) check and
count against these same facts before anything runs.
"""

LOCAL_DATA = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}  # suffix -> datasets builder
FORMATS = {  # name -> the columns that identify it
    "messages": ("messages",),
    "prompt/completion": ("prompt", "completion"),
    "instruction/context/response": ("instruction", "response"),
}
COLUMNS = ("messages", "prompt", "completion", "instruction", "context", "response")  # what --columns may name
OVERLONG = ("truncate", "drop")  # records longer than --seq-len; the first is the default
DEFAULT_DATASET = "databricks/databricks-dolly-15k"  # the walkthrough's records (Pulumi.yaml's dataset)
EVAL_SHARE = 16  # the default eval split: the 1/16 as many records right after the training slice
