"""The machine a job runs on, and how a job ends: the bottom of jobs/, importing no other package.

- outcome: JobInputError (exit 2), a failed check (exit 1), the JOB_RESULT_JSON line
- tpu_generations: the TPU generations table (the stack's infra/cloud/tpu.py reads the same rows)
- backend: tpu, cpu or cuda: the device, its process group and dtype; joining or starting Ray
- torch_tpu_api: every TorchTPU name the jobs call, with the torch-tpu wheel file it was read in
- storage: local or gs:// (pyarrow, gcsfs), the pods' credentials probe, a gs:// model copied once
- memory_plan, utilisation: GiB a device holds (the stack's preview reads it); model FLOPs and MFU
- log_lines, run_files: what a person reads in the log; what a run leaves in its directory

Called by every package above it, by the entry scripts and by the stack (infra/job_modules.py).
"""
