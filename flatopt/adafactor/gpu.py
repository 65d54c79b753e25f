"""Adafactor's fused CUDA path: segmented kernels over every CuPy tensor of a step (``kernels/adafactor.cu``); the
array-agnostic twin is ``adafactor.numerics``.

``run(opt, cfg, items)`` steps ``[(item, slot, lr)]`` (``slot.t`` advanced).  The items are split into groups of one
device, dtype and step count (the per-step scalars ρ-factor and β̂₂ are kernel arguments); each group is stepped by
at most six launches on the current stream, whatever its number of tensors (``af_stats_multi``, ``af_cols_multi``,
``af_colfold_multi``, ``af_factors_multi``, ``af_scalars_multi``, ``af_apply_multi``; the column passes only when the
group has a factored tensor).  Every data-dependent scalar (Σθ², α, ΣU², the clip factor) stays on the device: no
host synchronisation.

**The plan** (:class:`Plan`, built once per batch composition and kept on the optimizer): per group, one int64 device
table (each tensor's row of addresses and shape, then each pass's block list, then the ``lr_scale`` of each tensor)
and one workspace of the group's dtype (row and column factors, the column sums' tile partials, the chunks' partials,
the step scalars), uploaded and allocated when the plan is built.  A repeated step with the same arrays allocates and
uploads nothing.  A plan is re-used while the batch has the same names, the same param, grad and state objects, the
same step-count offsets between its items and the same ``lr_scale``s (checked against this step's learning rates),
and the optimizer the same config; otherwise a new one is built (a batch of fresh gradient arrays each step rebuilds
it each step: one upload, still far fewer launches than a launch per pass per tensor).  The plan holds weak
references to the params and grads (a freed array kills it: an ``id`` cannot be re-used while it lives) and strong
ones to the states and the state arrays it addresses.

Workspace per factored (B, r, c) tensor: B·r + 2·B·c + 2·B·c·⌈r/32⌉ + B + 2 elements (≈ n/16 for a large matrix:
the column sums' tile partials), plus 2·⌈n/4096⌉ with parameter scaling; per unfactored tensor 2·⌈n/4096⌉ + 2.

Each tensor's reductions are cut and ordered by its shape alone (``kernels/adafactor.cu``), so a tensor's bits do not
depend on the rest of its batch: ``step_batch`` ≡ serial ``step`` calls, bit for bit.  Shapes the kernels serve less
well (correct, only slower): a few very long rows (one warp sums a row, e.g. a (2, 10⁷) tensor) and narrow matrices
(c < 256 leaves threads of the column-sum tiles idle).
"""

from __future__ import annotations

from operator import itemgetter

import numpy as np

from ..core import backend, blocks, kernels, step_plan
from .numerics import step_sizes

# Constants of kernels/adafactor.cu (AF_*)
THREADS = 256
WARPS = THREADS // 32
CHUNK = 4096
TILE_ROWS = 32
NCOL = 19
KIND_ROWS, KIND_CHUNK = 0, 1
# Plans kept per optimizer for batches of two or more names (a single name keeps its own plan).
MAX_PLANS = 8

_ITEM, _SLOT, _LR = itemgetter(0), itemgetter(1), itemgetter(2)


def _ptr(a) -> int:
    return int(a.data.ptr)


def _grid(*axes) -> np.ndarray:
    """Every combination of the given integer sequences (first axis slowest), as rows."""
    mesh = np.meshgrid(*[np.asarray(a, np.int64) for a in axes], indexing="ij")
    return np.stack([m.reshape(-1) for m in mesh], axis=1)


class _Tensor:
    """One tensor's shape, workspace layout (offsets into the group's workspace, in elements) and block entries."""

    def __init__(self, ti: int, p, g, slot, need_rms: bool, off: int):
        st = slot.state
        self.n = n = p.size
        self.factored = st.exp_avg_sq is None
        self.B, self.r, self.c = blocks.factor_dims(tuple(slot.shape)) if self.factored else (0, 1, 1)
        self.chunked = need_rms or not self.factored
        self.nch = -(-n // CHUNK) if self.chunked else 0
        self.nrt = -(-self.r // TILE_ROWS) if self.factored else 0
        B, r, c = self.B, self.r, self.c
        sizes = dict(rows=B * r, cfac=B * c, cw=B * c, cpart=2 * B * c * self.nrt, part=2 * self.nch, usum=B, scal=2)
        self.off = {}
        for k, size in sizes.items():
            self.off[k] = off
            off += size
        self.end = off
        self.arrays = (p, g, st.exp_avg, st.exp_avg_sq_row if self.factored else st.exp_avg_sq, st.exp_avg_sq_col)
        ch = np.arange(0, n, CHUNK, dtype=np.int64)
        ent = []
        if self.factored:
            ent.append(_grid([ti], [KIND_ROWS], np.arange(0, B * r, WARPS)))
            self.cols = _grid([ti], range(B), range(self.nrt), range(-(-c // THREADS)))
            self.fold = _grid([ti], np.arange(0, B * c, WARPS))
            self.mats = _grid([ti], range(B))
        if self.chunked:
            ent.append(_grid([ti], [KIND_CHUNK], ch))
        self.stats = np.concatenate(ent) if ent else np.empty((0, 3), np.int64)
        self.apply = _grid([ti], ch)

    def row(self, base: int, itemsize: int) -> list[int]:
        """The tensor's table row (``AF_*`` fields; addresses of absent buffers are 0)."""
        p, g, m, sa, sb = (0 if a is None else _ptr(a) for a in self.arrays)
        w = {k: base + v * itemsize for k, v in self.off.items()}
        return [p, g, m, sa, sb, self.n, self.B, self.r, self.c, int(self.factored), w["rows"], w["cfac"], w["cw"],
                w["cpart"], self.nrt, w["part"], self.nch, w["usum"], w["scal"]]


class _Group:
    """The tensors of one (device, dtype, step count) class of a plan: the device table and workspace, built once."""

    def __init__(self, members: list, scales: list, need_rms: bool):
        """``members``: ``[(param, grad, slot)]`` of one device and dtype, none empty; ``scales``: the doubles the
        kernels multiply the base learning rate by (``lr_scale``, or the whole lr with a base of 1)."""
        cp = backend.cupy()
        p0 = members[0][0]
        self.dtype, self.device = p0.dtype, p0.device
        tensors, off = [], 0
        for ti, (p, g, slot) in enumerate(members):
            tensors.append(_Tensor(ti, p, g, slot, need_rms, off))
            off = tensors[-1].end
        fact = [t for t in tensors if t.factored]
        lists = {"stats": np.concatenate([t.stats for t in tensors]),
                 "cols": np.concatenate([t.cols for t in fact]) if fact else np.empty((0, 4), np.int64),
                 "fold": np.concatenate([t.fold for t in fact]) if fact else np.empty((0, 2), np.int64),
                 "mats": np.concatenate([t.mats for t in fact]) if fact else np.empty((0, 2), np.int64),
                 "apply": np.concatenate([t.apply for t in tensors])}
        self.nblocks = {k: len(v) for k, v in lists.items()}
        self.ntensors = len(tensors)
        with self.device:
            self.work = cp.empty(max(off, 1), self.dtype)  # every entry is written before it is read, each step
            base, itemsize = _ptr(self.work), self.work.itemsize
            rows = np.asarray([t.row(base, itemsize) for t in tensors], np.int64).reshape(-1)
            self.table = step_plan.DeviceTable(cp, {"tensors": rows, "scales": np.asarray(scales, np.float64).view(
                np.int64), **lists})  # (core/multi_tensor.py: the upload)
            views = dict(self.table.views)
            views["scales"] = views["scales"].view(cp.float64)
            self.views = views
        # the state arrays the table addresses (params and grads: weak references, in Plan)
        self.keep = [a for t in tensors for a in t.arrays[2:] if a is not None]

    def launch(self, cfg, t: int, base_lr: float, need_rms: bool, has_m: bool) -> None:
        """The group's passes (nothing allocated, no host synchronisation)."""
        cp = backend.cupy()
        factor, beta = step_sizes(cfg, t, 1.0)
        dt, i32 = self.dtype.type, np.int32
        v, nb = self.views, self.nblocks
        ema = (dt(cfg.eps1), dt(beta), dt(1.0 - beta))
        b1 = cfg.beta1 if has_m else 0.0

        def k(name, grid, args):
            if grid:
                kernels.get("adafactor.cu", name, self.dtype)((grid,), (THREADS,), args)

        with self.device:
            self.table.order(cp)
            k("af_stats_multi", nb["stats"], (v["tensors"], v["stats"], *ema, i32(need_rms)))
            k("af_cols_multi", nb["cols"], (v["tensors"], v["cols"]))
            k("af_colfold_multi", nb["fold"], (v["tensors"], v["fold"], *ema))
            k("af_factors_multi", nb["mats"], (v["tensors"], v["mats"]))
            k("af_scalars_multi", self.ntensors, (v["tensors"], v["scales"], float(base_lr), float(factor),
                                                  dt(cfg.eps2), dt(cfg.clip_threshold), float(cfg.weight_decay),
                                                  i32(need_rms)))
            k("af_apply_multi", nb["apply"], (v["tensors"], v["apply"], dt(b1), dt(1.0 - b1), i32(has_m),
                                              i32(cfg.weight_decay != 0)))


class Plan:
    """The groups of one batch composition (see the module documentation)."""

    def __init__(self, opt, items: list, base: float):
        self.config = opt.config
        its, slots = list(map(_ITEM, items)), list(map(_SLOT, items))
        self.refs = step_plan.watch(self, (a for it in its for a in (it.param, it.grad)))
        self.ids = self._ids(its, slots)
        self.states = [s.state for s in slots]  # held: their ids stay theirs (the driver never swaps a pinned
        # state's arrays; an unpinned one, after load_state_dict, moves before its plan is built: plans are dropped)
        self.t0 = slots[0].t
        self.dt = [s.t - self.t0 for s in slots]
        lrs = list(map(_LR, items))
        # the kernels compute each lr as base · lr_scale in double, as the driver: keep the lr_scales when they give
        # this step's lrs exactly, else the lrs themselves (with a base of 1: the plan then holds for these lrs only)
        scales = [float(opt.lr_scale(it.name)) for it in its]
        self.by_scale = list(map(base.__mul__, scales)) == lrs
        self.scales = scales if self.by_scale else lrs
        need_rms = bool(opt.config.scale_parameter)
        classes: dict = {}
        for i, (it, slot) in enumerate(zip(its, slots)):
            if it.param.size:
                classes.setdefault((it.param.device.id, it.param.dtype, self.dt[i]), []).append(i)
        self.groups = [(idx[0], _Group([(its[i].param, its[i].grad, slots[i]) for i in idx],
                                       [self.scales[i] for i in idx], need_rms))
                       for idx in classes.values()]

    @staticmethod
    def _ids(its, slots) -> list:
        return [id(x) for it, s in zip(its, slots) for x in (it.param, it.grad, s.state)]

    def matches(self, opt, items: list, base: float) -> bool:
        if self.dead or opt.config is not self.config:
            return False
        slots = list(map(_SLOT, items))
        if self._ids(list(map(_ITEM, items)), slots) != self.ids:
            return False
        t0 = slots[0].t
        if [s.t - t0 for s in slots] != self.dt:
            return False
        lrs = list(map(_LR, items))
        return (list(map(base.__mul__, self.scales)) if self.by_scale else self.scales) == lrs

    def launch(self, cfg, slots: list, base: float) -> None:
        need_rms, has_m = bool(cfg.scale_parameter), cfg.beta1 is not None
        for first, group in self.groups:
            group.launch(cfg, slots[first].t, base if self.by_scale else 1.0, need_rms, has_m)


def run(opt, cfg, items: list) -> None:
    """Step ``[(item, slot, lr)]`` of CuPy items (``slot.t`` advanced; ``cfg``: this step's config, with the current
    manual lr or None) with the segmented kernels, through the cached plan of this batch composition."""
    base = float(opt.lr) if opt.lr is not None else 1.0  # the base of Adafactor's hooks.effective_lr
    plans = opt.plan_cache.family_plans("adafactor.gpu")
    key = tuple(it.name for it, _, _ in items)
    plan = plans.get(key)
    if plan is None or not plan.matches(opt, items, base):
        plans.pop(key, None)
        if len(key) > 1 and sum(len(k) > 1 for k in plans) >= MAX_PLANS:
            plans.pop(next(k for k in plans if len(k) > 1))
        plan = plans[key] = Plan(opt, items, base)
    plan.launch(cfg, list(map(_SLOT, items)), base)

