"""Components of the stack: one module per thing it builds, over pure functions."""

PROJECT = "gemma-tpu"
