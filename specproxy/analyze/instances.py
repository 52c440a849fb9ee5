"""How the server instances the arms ran in enter an A/B: the variance components and the warnings.

Why: two restarts of the same config can give non-overlapping intervals (docs/statistics.md), so an A/B
that ignores which server instance served a request claims more than the data carry. One rule here,
used by every ratio row (``stats.bootstrap_ratio`` for per-request stats, ``aggregate`` for aggregate
throughput), so that all rows treat instances alike:

* An arm in one instance cannot show restart-to-restart variance. If the other arm ran in
  several, the lone instance borrows their between-instance variance (assumes the same spread in
  both arms). If each arm ran in its own single
  instance, the instance effect is unmeasured: the verdict is "not distinguishable" whatever
  the request-level interval says, and the warnings say why. Both arms in the same single
  instance: a valid comparison for that instance only, with a warning.
* Arms sharing instances (interleaved A/B) are resampled independently: conservative.
"""

from __future__ import annotations

from typing import Any, Iterable

__all__ = ["CONFOUNDED_WARNING", "SEPARATE_INSTANCES_WARNING", "instance_parts", "instance_warning",
           "unknown_instances_warning"]

CONFOUNDED_WARNING = "an A/B inside one server instance is confounded with that instance"
SEPARATE_INSTANCES_WARNING = (
    "each arm ran in a different single instance: the instance effect is unmeasured, so the verdict "
    "cannot be faster/slower; the interval covers request-to-request noise only. Run each arm in "
    "several instances (restarts)")


def unknown_instances_warning(arm: str) -> str:
    """The warning for an arm whose turns carry no server instance (its server's /metrics was not
    scraped): not "confounded with that instance", since which instance it ran in is not known."""
    return (f"arm {arm}'s server instances are unknown (its server's /metrics was not scraped): whether "
            "the arms ran in one server instance or in several cannot be told, and restart-to-restart "
            "variance is not in the interval")


def instance_parts(comps: dict, ka: int | None, kb: int | None, ua: list, ub: list,
                    warnings: list[str]) -> tuple[list, bool]:
    """The variance components of a comparison given where each arm ran, and whether the
    verdict is forced to "not distinguishable" (each arm in its own single instance).

    Shared by every ratio row (per-request stats and aggregate throughput), so all rows treat
    server instances by the same rule (module docstring)."""
    single_a, single_b = ka == 1, kb == 1
    confound = instance_warning(None if ka is None else ua, None if kb is None else ub)
    if confound and confound not in warnings:
        warnings.append(confound)
    forced = confound == SEPARATE_INSTANCES_WARNING
    parts = [comps["a"][:2], comps["b"][:2]]
    if (single_a and (kb or 0) >= 2) or (single_b and (ka or 0) >= 2):
        one, many = ("a", "b") if single_a else ("b", "a")
        k_many = ka if many == "a" else kb
        v_many, df_many, _ = comps[many]
        # the lone instance carries a whole instance effect: ~k * (variance of the pooled stat)
        parts = [(comps[one][0], comps[one][1]), ((k_many + 1) * v_many, df_many)]
        warnings.append(f"arm {one} ran in one instance: its instance-to-instance variance is "
                        f"borrowed from arm {many}'s {k_many} instances (assumes equal spread)")
    return parts, forced


def instance_warning(instances_a: Iterable[Any] | None, instances_b: Iterable[Any] | None) -> str | None:
    """The one warning on how the arms' server instances confound an A/B; None when they do not.

    ``instances_*``: the distinct instances an arm ran in, None when it has no instance labels.
    Both arms in the same single instance: a valid comparison for that instance only. Each in a
    different single instance: the instance effect is unmeasured (the precise warning; saying
    "inside one instance" beside it would contradict it). One arm in one instance and the other in
    several: None here, as ``bootstrap_ratio`` borrows the other arm's between-instance variance
    and says so. One arm's instances known and the other's unknown: that they are unknown (not
    "confounded with that instance": the unknown arm may have run anywhere). Both unknown: None
    (the arms' own lines say "instances unknown").
    """
    a = None if instances_a is None else set(instances_a)
    b = None if instances_b is None else set(instances_b)
    single_a, single_b = a is not None and len(a) == 1, b is not None and len(b) == 1
    if single_a and single_b:
        return CONFOUNDED_WARNING if a == b else SEPARATE_INSTANCES_WARNING
    if (a is None) != (b is None):
        return unknown_instances_warning("a" if a is None else "b")
    return None
