"""How close a run must come to TRL's, step by step.

Each step's gradient norm against TRL's, relative, by step index. Adam's first updates move nearly every weight by
about the LR whatever its gradient's size, so the float32 rounding in which two implementations differ (ours divides
each token's loss by the global count and sums, TRL takes the batch's mean; the CPU's kernels: AVX2 or AVX-512)
grows about 30 times a step. Measured: on an AVX2-only AMD EPYC (2026-12-07) the media run's norms differed 1.6e-7,
4.8e-6, 1.6e-4 at steps 1 to 3; on an AVX-512 one (Zen 4, 2026-12-08) the towers' run 1.4e-4 and GRPO's DAPO case
1.2e-4 at step 3, the losses within 1e-6 throughout (1e-4 held at every step on earlier sessions' machines). A
gradient off by a constant factor moves step 1's norm by that factor, which 1e-5 catches.
"""

GRAD_NORM_REL = (1e-5, 1e-4, 1e-3)


def grad_norm_rel(step: int) -> float:
    """The relative tolerance of step `step`'s (0-based) gradient norm."""
    return GRAD_NORM_REL[min(step, len(GRAD_NORM_REL) - 1)]
