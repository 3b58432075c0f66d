"""Multi-step parity against a single-process reference, with a bound derived where the test runs (issue 31):
ours must lie within 10 times the distance between two equally valid float32 references (another order of the
same float32 sums), floored at two float32 ulps. Both distances come from the order of float32 sums, amplified
over the steps; that order depends on the CPU's matmul blocking, so a fixed bound tuned on one CPU fails on
another (2.45e-6 against 1e-6 on an AMD EPYC). A wrong step is 1e-3 or more. tests/cpp/parity_bound.h is the
same rule for the C++ suites."""

NOISE_FACTOR, TWO_ULPS = 10, 2.4e-7


def max_rel_err(ours, ref):
    """Over tensors: the largest absolute difference relative to each reference tensor's largest magnitude."""
    return max(((a.double() - b.double()).abs().max() / b.double().abs().max()).item() for a, b in zip(ours, ref))


def within_noise(ours, ref, other, what):
    """Asserts the rule; returns (ours' distance, the references' distance)."""
    worst, noise = max_rel_err(ours, ref), max_rel_err(other, ref)
    assert worst <= NOISE_FACTOR * max(noise, TWO_ULPS), (
        f"{what}: max relative error {worst} > {NOISE_FACTOR} x the references' {noise}")
    return worst, noise
