"""Adafactor8Bit's segmented CUDA steps (private): the fused passes of ``adafactor8bit.fused`` over every tensor of a
group at once (kernels ``a8f_*_seg`` of ``kernels/adafactor8bit.cu``), as Adafactor's are (``adafactor.gpu``).

Segmented paths: the factored Adafactor step without a first moment (the default: ``a8f_rows_seg``,
``a8f_cols_seg``, ``a8f_colfin_seg``, [``a8f_encode_seg``: the quantized factor vectors], ``a8f_factors_seg``,
``a8f_scalars_seg``, ``a8f_apply_seg``: 6–7 launches per group) and the elementwise step with a float32 second moment
and no first moment (1-D tensors below ``min_8bit_size`` by default, or ``factored=False``: ``a8f_flat_u_seg``,
``a8f_scalars_seg``, ``a8f_flat_apply_seg``: 3 launches per group), with ``maximize``, weight decay, the clip,
parameter scaling, Fira and ``lag_norm``.  Every other item runs as before (``fused.kernel_step`` per tensor, or the
twin): a first moment, CAME and a quantized elementwise second moment (their per-tensor steps keep a full-size float32
scratch, the exact m or V, that a plan would have to hold per tensor), SGD mode, APOLLO and empty parameters.

A group: the items of one device, dtype, configuration object, path, step count and ``lr_scale``, so that every
per-step scalar (b, ρ) is one kernel argument.  On the 76-tensor transformer set under the defaults: two groups,
10 launches per step (the per-tensor path: 356).

**The plan** (built once per batch composition, kept on the optimizer, re-used while the batch has the same names,
param, grad and state objects, configurations, step-count offsets and ``lr_scale``s): per group one int64 device
table (a row of ``FIELDS`` per tensor, then each pass's block list) and two workspaces (the dtype's and float32)
holding each tensor's scratch: 1/R, the factors, the column partials (≈ n/32 elements of a factored tensor), W, the
partials of Σθ² and ΣU², the step's scalars and the exact values of the quantized factor vectors (no full-size
scratch: the elementwise apply recomputes U from the gradient and the new V, bit for bit).  A steady-state step
uploads and allocates nothing and never synchronises with the host.

Bits: each block of a segmented pass runs, through the same device function, the part of a tensor (a row, a column
block, a codec block, a matrix, a chunk) that a block of the per-tensor kernel runs, and every reduction is cut and
ordered by the tensor's own sizes: the result is ``fused.kernel_step``'s, bit for bit, whatever else is in the group
(``tests/test_adafactor8bit_fused.py`` compares segmented, per-tensor and twin).
"""

from __future__ import annotations

import math
from operator import itemgetter

import numpy as np

from . import fused, quant
from . import state as S
from .common import eps1_of, rho_of
from ..core import backend, blocks, kernels, step_plan

ENABLED = True  # False: every item per tensor (tests compare the two)
MAX_PLANS = 8  # plans kept per optimizer for batches of two or more names
ALIGN = 32  # elements: each scratch array starts at a multiple of this in its workspace
WORK = 4096  # elements: small rows, column blocks and matrices go several to a block, up to about this much work
MAX_PER = 64  # and at most this many to a block

FIELDS = ("p", "g", "n", "B", "r", "c", "rq", "rbits", "rsc", "rml", "rx", "rquant", "cq", "cbits", "csc", "cml", "cx",
          "cquant", "block", "inv", "pp", "npp", "rf", "cf", "cparts", "wparts", "wsum", "ub", "nu", "parts", "scal",
          "prev", "fprev", "lagf", "sqrtn", "sqrtnd", "uparts", "v", "rpb", "cpb", "fpb")  # the .cu's A8S_*, in order
FACTORED, FLAT = "factored", "flat"
_ITEM, _SLOT, _LR = itemgetter(0), itemgetter(1), itemgetter(2)


def path_of(cfg, st) -> str | None:
    """The segmented path of a parameter's step (``FACTORED``, ``FLAT``), or None (per tensor)."""
    if not fused.supported(cfg, st) or S.is_sgd(cfg) or cfg.beta1 is not None:
        return None
    shape = st.sizes["shape"]
    if len(shape) >= 2 and cfg.factored:
        return FACTORED
    return FLAT if st.variance is not None else None


def _ptr(a) -> int:
    return 0 if a is None else int(a.data.ptr)


def _f32_bits(x: float) -> int:
    return int(np.float32(x).view(np.int32))


def _per(work: int) -> int:
    """Units (rows, column blocks, matrices) of ``work`` elements each to one block of a segmented pass."""
    return max(1, min(MAX_PER, WORK // max(work, 1)))


def _pairs(ti: int, units: int, step: int = 1) -> np.ndarray:
    u = np.arange(0, units, step, dtype=np.int64)
    return np.stack([np.full(u.size, ti, np.int64), u], axis=1)


class _Layout:
    """Offsets (elements) of scratch arrays in one workspace."""

    def __init__(self):
        self.size = 0

    def take(self, n: int) -> int:
        off = self.size
        self.size += -(-max(n, 1) // ALIGN) * ALIGN
        return off


class _Group:
    """The tensors of one group: the device table and workspaces, built once."""

    def __init__(self, path: str, cfg, members: list):
        """``members``: ``[(param, grad, state)]`` of one device and dtype, none empty."""
        cp = backend.cupy()
        self.path, self.cfg = path, cfg
        p0 = members[0][0]
        self.dtype, self.device = p0.dtype, p0.device
        tl, fl = _Layout(), _Layout()  # the dtype's workspace, the float32 one
        rows, ents, specs = [], {k: [] for k in ("rows", "cols", "fin", "enc", "fac", "apply", "flat")}, []
        for ti, (p, g, st) in enumerate(members):
            n = p.size
            f = dict.fromkeys(FIELDS, 0)
            f.update(p=p, g=g, n=n, block=cfg.block_size, sqrtn=_f32_bits(math.sqrt(n)),
                     sqrtnd=_f32_bits(math.sqrt(n) * cfg.d), scal=("f", fl.take(4)))
            f["prev"] = st.prev_update_norm if cfg.lag_norm else f["scal"]
            f["fprev"] = st.fira_prev if cfg.enable_fira_for_adafactor else f["scal"]
            f["lagf"] = st.lag_fira_scale if cfg.enable_fira_for_adafactor and cfg.lag_norm else f["scal"]
            if path == FACTORED:
                bdim, r, c = blocks.factor_dims(st.sizes["shape"])
                nr, nc, parts = bdim * r, bdim * c, -(-r // fused.ROWS)
                f.update(B=bdim, r=r, c=c, parts=parts, nu=bdim, npp=nr)
                for k, size in (("inv", nr), ("pp", nr), ("rf", nr), ("cf", nc), ("cparts", parts * nc),
                                ("wparts", parts * nc), ("wsum", nc), ("ub", bdim)):
                    f[k] = ("t", tl.take(size))
                for pre, slot, size, which in (("r", "row_var", nr, 0), ("c", "col_var", nc, 1)):
                    arr = getattr(st, slot)
                    if arr is not None:  # float32: the state is its own exact values
                        f.update({pre + "q": arr, pre + "bits": 8, pre + "sc": arr, pre + "ml": arr, pre + "x": arr,
                                  pre + "quant": 0})
                    else:
                        q = getattr(st, slot + "_q")
                        f.update({pre + "q": q, pre + "bits": q.dtype.itemsize * 8, pre + "sc": getattr(st, slot + "_scale"),
                                  pre + "ml": getattr(st, slot + "_min_log"), pre + "x": ("f", fl.take(size)),
                                  pre + "quant": 1})
                        nb = quant.nblocks(size, cfg.block_size)
                        ents["enc"].append(np.stack([np.full(nb, ti, np.int64), np.full(nb, which, np.int64),
                                                     np.arange(nb, dtype=np.int64)], axis=1))
                f.update(rpb=_per(c), cpb=_per(min(r, fused.ROWS) * min(c, 128)), fpb=_per(r + c))
                ents["rows"].append(_pairs(ti, nr, f["rpb"]))
                ents["cols"].append(_pairs(ti, -(-c // 128) * parts * bdim, f["cpb"]))
                ents["fin"].append(_pairs(ti, -(-nc // fused.THREADS)))
                ents["fac"].append(_pairs(ti, bdim, f["fpb"]))
            else:
                nparts = -(-n // fused.CHUNK)
                f.update(v=st.variance, uparts=("f", fl.take(nparts)), pp=("t", tl.take(nparts)), nu=nparts,
                         npp=nparts)
                ents["flat"].append(_pairs(ti, nparts))
            ents["apply"].append(_pairs(ti, n, fused.CHUNK))
            rows.append(f)
        self.ntensors = len(rows)
        with self.device:
            self.work_t = cp.empty(tl.size, self.dtype)  # every entry is written before it is read, each step
            self.work_f = cp.empty(fl.size, np.float32)
            bases = {"t": (_ptr(self.work_t), self.work_t.itemsize), "f": (_ptr(self.work_f), 4)}

            def val(x):
                if isinstance(x, tuple):
                    base, size = bases[x[0]]
                    return base + x[1] * size
                return x if isinstance(x, int) else _ptr(x)

            lists = {k: (np.concatenate(v) if v else np.empty((0, 2), np.int64)) for k, v in ents.items()}
            self.nblocks = {k: len(v) for k, v in lists.items()}
            self.table = step_plan.DeviceTable(cp, {"tab": [[val(f[k]) for k in FIELDS] for f in rows], **lists})
            self.views = self.table.views
        # the state arrays the table addresses (params and grads: weak references, in Plan)
        self.keep = [x for f in rows for k, x in f.items() if k not in ("p", "g") and hasattr(x, "data")]

    def launch(self, t: int, lr) -> None:
        """The group's passes (nothing allocated, no host synchronisation)."""
        cp = backend.cupy()
        cfg, v, nb = self.cfg, self.views, self.nblocks
        i32, f32 = np.int32, np.float32
        b = 1.0 - cfg.beta2 if cfg.beta2 is not None else math.pow(t, cfg.beta2_decay)
        eps1 = eps1_of(cfg)
        rho = rho_of(cfg, t, lr)
        fira = cfg.enable_fira_for_adafactor

        def k(name, grid, args, threads=fused.THREADS):
            if grid:
                kernels.get("adafactor8bit.cu", name, self.dtype)((grid,), (threads,), args)

        with self.device:
            self.table.order(cp)
            if self.path == FACTORED:
                need_u = cfg.d > 0 or fira
                lo = fused.weight_lo(b)
                k("a8f_rows_seg", nb["rows"], (v["tab"], v["rows"], f32(b), lo, f32(eps1), i32(cfg.scale_parameter)))
                k("a8f_cols_seg", nb["cols"], (v["tab"], v["cols"]), 128)
                k("a8f_colfin_seg", nb["fin"], (v["tab"], v["fin"], f32(b), lo, f32(eps1)))
                k("a8f_encode_seg", nb["enc"], (v["tab"], v["enc"], f32(quant.al_floor(eps1))))
                k("a8f_factors_seg", nb["fac"], (v["tab"], v["fac"], i32(need_u), f32(eps1)))
                use_u, negate = (1 if need_u else 0), cfg.maximize
            else:
                adam = (not cfg.factored) and cfg.beta2 is not None and cfg.beta3 is None
                eps_g2 = 0.0 if adam else eps1
                need_u = cfg.d > 0 or fira
                u_args = (i32(adam), f32(eps1 if adam else 0.0), f32(max(eps1 * eps1, quant.FLT_MIN)))
                k("a8f_flat_u_seg", nb["flat"], (v["tab"], v["flat"], f32(b), f32(1.0 - b), f32(b * eps_g2), *u_args,
                                                 i32(need_u), i32(cfg.scale_parameter), i32(cfg.maximize)))
                use_u, negate = (2 if need_u else 0), False
            k("a8f_scalars_seg", self.ntensors,
              (v["tab"], i32(use_u), f32(rho), i32(cfg.scale_parameter), f32(cfg.eps[1]), i32(0), f32(1.0), f32(cfg.d),
               i32(cfg.d > 0), i32(cfg.weight_decay != 0), f32(cfg.weight_decay), i32(cfg.scale_weight_decay),
               i32(cfg.lag_norm), i32(fira), f32(1.0 + cfg.fira_margin), i32(negate)))
            decay = (i32(cfg.weight_decay != 0), i32(fira))
            if self.path == FACTORED:
                k("a8f_apply_seg", nb["apply"], (v["tab"], v["apply"], *decay))
            else:  # U recomputed from g and the new V (the same bits; no full-size U kept)
                k("a8f_flat_apply_seg", nb["apply"], (v["tab"], v["apply"], *u_args, i32(cfg.maximize), *decay))


class Plan:
    """The groups of one batch composition (see the module documentation) and the items left per tensor."""

    def __init__(self, items: list):
        its, slots = list(map(_ITEM, items)), list(map(_SLOT, items))
        self.refs = step_plan.watch(self, (a for it in its for a in (it.param, it.grad)))
        self.ids = self._ids(items)
        self.states = [s.state for s in slots]  # held: their ids stay theirs
        self.cfgs = [s.state.cfg for s in slots]
        t0 = slots[0].t
        self.dt = [s.t - t0 for s in slots]
        self.scales = [lr[1] for lr in map(_LR, items)]
        classes: dict = {}
        rest = []
        for i, (it, slot) in enumerate(zip(its, slots)):
            st = slot.state
            path = path_of(st.cfg, st) if it.param.size else None
            if path is None:
                rest.append(i)
                continue
            key = (it.param.device.id, it.param.dtype, id(st.cfg), path, self.dt[i], self.scales[i])
            classes.setdefault(key, []).append(i)
        self.rest = rest
        self.groups = [(idx[0], _Group(key[3], self.cfgs[idx[0]], [(its[i].param, its[i].grad, slots[i].state)
                                                                     for i in idx]))
                       for key, idx in classes.items()]

    @staticmethod
    def _ids(items) -> list:
        return [id(x) for it, s, _ in items for x in (it.param, it.grad, s.state, s.state.cfg)]

    def matches(self, items: list) -> bool:
        if self.dead or self._ids(items) != self.ids:
            return False
        slots = list(map(_SLOT, items))
        t0 = slots[0].t
        return [s.t - t0 for s in slots] == self.dt and [lr[1] for lr in map(_LR, items)] == self.scales

    def launch(self, items: list) -> None:
        for first, group in self.groups:
            _, slot, lr = items[first]
            group.launch(slot.t, lr)


def run(opt, items: list) -> list:
    """Step the segmentable items of ``[(item, slot, lr)]`` (CuPy; ``slot.t`` advanced) through the cached plan of this
    batch composition; returns the items left to step per tensor."""
    if not ENABLED:
        return items
    plans = opt.plan_cache.family_plans("adafactor8bit.segmented")
    key = tuple(it.name for it, _, _ in items)
    plan = plans.get(key)
    if plan is None or not plan.matches(items):
        plans.pop(key, None)
        if len(key) > 1 and sum(len(k) > 1 for k in plans) >= MAX_PLANS:
            plans.pop(next(k for k in plans if len(k) > 1))
        plan = plans[key] = Plan(items)
    plan.launch(items)
    return [items[i] for i in plan.rest]

