"""Replaying Adafactor8Bit's optimizer-wide APOLLO seed counter across the ranks of a sharded optimizer."""

from __future__ import annotations

from .plan import Plan


class ApolloSeeds:
    """Adafactor8Bit hands APOLLO projection seeds out from an optimizer-wide counter, in the order parameters
    are first stepped (``Adafactor8Bit``'s ``hooks.init``).  Sharded, each rank first-steps only its own names, so
    this replays the single-process counter over the whole batch on every rank and makes the owner's state
    creation use the global seed (the wrapped optimizer's ``hooks.init`` is wrapped on this instance only)."""

    def __init__(self, opt):
        self.opt = opt
        self.counter = int(opt._apollo_seed_counter)  # noqa: SLF001 - Adafactor8Bit's counter, replayed
        self.pending: dict[str, int] = {}
        base = opt.hooks.init

        def init_named(name, xp, shape, dtype):
            seed = self.pending.pop(name, None)
            if seed is not None:
                opt._apollo_seed_counter = seed  # noqa: SLF001 - Adafactor8Bit's counter, replayed
            return base(name, xp, shape, dtype)

        opt.hooks = opt.hooks.replace(init=init_named)

    def reserve(self, batch, plan_before: Plan) -> tuple[dict, int]:
        """The seeds the names first stepped in ``batch`` get in the single-process run, and the next counter."""
        seeds, counter = {}, self.counter
        for name, shape in batch:
            if name in plan_before.entries or name in seeds:
                continue
            cfg = self.opt.config_for(name, shape)
            if cfg.apollo_rank > 0 and len(shape) >= 2:  # the condition of Adafactor8Bit's hooks.init
                seeds[name] = counter
                counter += 1
        return seeds, counter

    def begin(self, reserved: tuple[dict, int]) -> None:
        self.pending, self.counter = dict(reserved[0]), reserved[1]

    def settle(self) -> None:
        self.pending = {}
        self.opt._apollo_seed_counter = self.counter  # noqa: SLF001 - Adafactor8Bit's counter, replayed

    def reset(self) -> None:
        self.counter = int(self.opt._apollo_seed_counter)  # noqa: SLF001 - Adafactor8Bit's counter, replayed
        self.pending = {}
