"""Tolerances derived from what a test compares, for the tests that compare alike things; each test says beside
its bound what a real bug would give there. Measured on one CPU with 5 simulated others (torch's vector kernels at
ATEN_CPU_CAPABILITY=default / avx2 / avx512, oneDNN's capped at SSE41 / AVX2 / AVX512_CORE, MKL_CBWR=COMPATIBLE,
1 and 2 threads), every bound here holds with >= 3x to spare."""

F32 = 2.0 ** -24  # float32's unit roundoff: one rounding moves a value by at most this fraction of it (6e-8)
F64 = 2.0 ** -53  # float64's (1.1e-16)
BF16 = 2.0 ** -8  # bfloat16's (3.9e-3)


def f32_sum(n_terms: int) -> float:
    """How far float32 rounding can move a sum of `n_terms` terms, relative to the sum of their sizes: n * u
    (Higham's gamma_n, the worst case; ~sqrt(n) * u is typical). Through a network, n counts the terms summed
    along a value's whole path (tokens, hidden and intermediate widths, attention keys, logits), and the sizes'
    sum is about the largest entry of the tensor compared: a bound for `atol = f32_sum(n) * tensor.abs().max()`,
    so entries that nearly cancel keep the absolute error of the large ones."""
    return n_terms * F32


def adamw_rounding(steps: int, lr: float) -> float:
    """The largest element-wise difference float rounding explains between the weights of two runs that take
    `steps` AdamW steps at `lr` on the same gradients computed in another order (other micro-batches, prompts
    forwarded once or per row, another reduction over ranks, another CPU's kernels): `steps * lr / 100`.

    AdamW moves an element by lr * m / (sqrt(v) + eps) per step: at most ~lr, whatever its gradient's size, as
    the update depends on the gradient relative to its own history. A relative change rho of one gradient element
    changes its update by ~lr * rho, and by lr * delta / eps where |g| ~ eps (1e-8). Rounding changes a float32
    sum of n terms of size t by delta <= n * u * t (u = 2**-24), 6e-5 of the terms for n ~ 1000: an update moves
    by lr / 100 only where its gradient cancels to under 1/150 of its terms' size (or delta reaches 1e-10 at
    |g| ~ eps). The worst seen: lr * 4e-4 per step (8.1e-6 after 2 steps at lr 1e-2, test_distributed.py on a
    Xeon with AVX512-FP16; 7.9e-6 under the simulated CPUs), 25x under the bound.

    A real bug (a row of the R rows of a step dropped, weighted wrongly, or one rank's gradient scaled) changes
    the gradient by ~1/R: the updates of typical elements by ~lr / R, and of the elements that row dominates by
    ~lr. For R <= 16 that is >= 6x the bound on typical elements and ~100x on the worst one."""
    return steps * lr / 100


def max_abs_diff(a: dict, b: dict) -> float:
    """The largest element-wise difference between two {name: tensor} dicts with the same keys."""
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)
