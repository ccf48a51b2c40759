"""The job's settings and the facts they are checked against; imports runtime/ only.

- settings: FinetuneSettings, every setting declared once (type, default, bounds, help, flag, stack key), and
  the checks (problems) that the job runs before Ray starts and the stack runs at preview
- declared: the field declarations the table is written in
- command_line: argparse, --help, from_args and to_argv, all derived from the table
- data_formats, splits: the record formats, file types and default splits; the `datasets` split grammar
- eval_tasks: --eval-tasks parsed and checked against the installed lm-eval's task index

Torch-free: the stack (infra/config/stack.py, infra/config/job.py, infra/config/pulumi_yaml.py) imports it at preview.
"""
