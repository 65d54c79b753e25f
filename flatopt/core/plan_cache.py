"""What one optimizer derives from its batches and keeps between steps, in one object the driver owns.

``PerParamOptimizer`` creates one ``PlanCache`` (``opt.plan_cache``) and nothing else stores caches on the optimizer:

* ``step_plans``: ``core.step_plan.StepPlan`` per batch composition (tuple of names), at most ``step_plan.MAX_PLANS``;
* ``bucket_plans`` and ``bucket_epoch``: ``core.cpu_plan``'s packed storage of small items per list of slots, and a
  counter that grows whenever one is built (a kept ``cpu_plan.StaticPlan`` is stale once it changed);
* ``alias``: the last batch that passed ``core.validate.check_batch_aliasing`` (weak references);
* ``serial``: ``step_batch`` calls so far (``core.step_plan``: did another step run since a plan's last one?);
* ``family``: an algorithm family's own caches by a key of its choice (Adafactor's GPU plans, Adafactor8Bit's
  segmented kernels' plans), so that a family needs no attribute of its own on the optimizer.

``forget()`` (after ``reset``/``load_state_dict``: the slots the plans hold are replaced) drops every plan.
"""

from __future__ import annotations

from typing import Any


class PlanCache:
    """The caches of one optimizer (see the module doc)."""

    __slots__ = ("step_plans", "bucket_plans", "bucket_epoch", "alias", "serial", "family")

    def __init__(self) -> None:
        self.step_plans: dict[tuple[str, ...], Any] = {}
        self.bucket_plans: dict[tuple[int, ...], Any] = {}
        self.bucket_epoch = 0
        self.alias: list[Any] = []
        self.serial = 0
        self.family: dict[str, dict[Any, Any]] = {}

    def family_plans(self, key: str) -> dict[Any, Any]:
        """The family cache named ``key`` (created empty on first use)."""
        plans = self.family.get(key)
        if plans is None:
            plans = self.family[key] = {}
        return plans

    def forget(self) -> None:
        """Drop every plan (fresh containers: nothing built before is found again)."""
        self.step_plans = {}
        self.bucket_plans = {}
        self.family = {}
