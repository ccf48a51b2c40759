"""What the stack declares in Google Cloud and Kubernetes: one component a thing, each a thin
pulumi.ComponentResource over pure functions that build its inputs and manifests.

- apis: the Google APIs; cluster: the GKE cluster and the TPU node pools; storage: the checkpoint bucket and
  the pods' IAM member; dataset: a local datasetFile uploaded under its content hash; registry: the Artifact
  Registry repository and the image; kube: the Kubernetes provider; raycluster: the namespace, ServiceAccount,
  Secret, CRD wait and the RayCluster; stop_hook: the TPU pods' preStop hook

Declared in order by __main__.py from one StackConfig (infra/config/stack.py). The dynamic resources (the jobs,
infra/training.py; the CRD wait, infra/crd_wait.py) stay at infra/'s top: deployed stacks hold their paths.
"""
