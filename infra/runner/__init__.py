"""The job runner: the client code that submits the jobs to a Ray head and follows them, reaches the GKE
API server, scales the TPU slice, retries and refreshes tokens, and starts a local Ray head.

Nothing here imports Pulumi (tests/test_layout.py fails if anything does): the dynamic resources
(infra/training.py, infra/crd_wait.py), `make local` and the tests call it directly.
"""
