"""flatopt: training optimizers that update flat parameter buffers in place, on NumPy (CPU) or CuPy (GPU).

    import numpy as np, flatopt
    opt = flatopt.AdamW(lr=1e-3)
    opt.step("w", (4, 3), w_flat, g_flat)      # w_flat updated in place; g_flat never written

Every optimizer keeps one contract (``flatopt.Optimizer``): parameters are flat, contiguous float32/float64
buffers addressed by name and updated in place; gradients are never written; bad input raises a
``ValueError``/``TypeError`` naming the parameter before anything changes; ``step_batch(items)`` equals ``step`` on
each item in order, bit for bit; ``state_dict``/``load_state_dict`` (and ``flatopt.save``/``flatopt.load``) resume
bit for bit.  ``help(flatopt.Optimizer)`` and each class's docstring say the rest.
"""

from . import gradients, schedules
from .buffers import flat_view, pack, pack_like
from .core.driver import PerParamOptimizer
from .core.parallel import TaskError
from .core.types import Optimizer, OptimizerState, OptItem
from .core.precision import Precision
from .adafactor import Adafactor
from .adafactor8bit import Adafactor8Bit
from .adam import Adam
from .ademamix import AdEMAMix
from .adamw import AdamW
from .adopt import Adopt
from .checkpoint import CheckpointError, load, save
from .errors import IncompatibleStateError
from .muon import Muon
from .muon.muon_adamw import MuonAdamW
from .kron import KronPsgd
from .lamb import Lamb
from .lion import Lion
from .mars import Mars
from .nadamw import NAdamW
from .qhadamw import QHAdamW
from .radam import RAdam
from .schedulefree import ScheduleFreeAdamW
from .sgd import SGD
from .soap import Soap
from .sophia import Sophia
from .stiefel import Stiefel

__version__ = "0.1.0"

__all__ = [
    "Adafactor",
    "Adafactor8Bit",
    "Adam",
    "AdEMAMix",
    "AdamW",
    "Adopt",
    "CheckpointError",
    "IncompatibleStateError",
    "Muon",
    "MuonAdamW",
    "KronPsgd",
    "Lamb",
    "Lion",
    "Mars",
    "NAdamW",
    "QHAdamW",
    "RAdam",
    "ScheduleFreeAdamW",
    "Optimizer",
    "OptimizerState",
    "OptItem",
    "Precision",
    "PerParamOptimizer",
    "SGD",
    "Soap",
    "Sophia",
    "Stiefel",
    "TaskError",
    "flat_view",
    "gradients",
    "load",
    "pack",
    "pack_like",
    "save",
    "schedules",
]
