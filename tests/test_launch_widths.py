"""Every kernel argument is packed at the width of its parameter (gpu-review H3), whatever the hyper-parameters' types.

CuPy packs a scalar at its own width (a Python float as 8 bytes, a NumPy float32 as 4) and the device reads
``sizeof(parameter)``: a NumPy float32 given to a ``double`` parameter reads as about 5e-315.  The emulator refuses
such a launch (``tests/cuda_emu/emu.py``: "got float32 packed as f4"); here every optimizer of the registry steps with
NumPy-float32 hyper-parameters, on float32 and float64 parameters, so that no launch site can regress.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from flatopt.core import backend, kernels

from .cuda_emu import emu, fakecupy
from .helpers import make_for, make_params, run_steps
from .registry import REGISTRY


@pytest.fixture(scope="module")
def device():
    yield from fakecupy.device_or_emulated()


def _configs(opt):
    if hasattr(opt, "config"):
        return [opt.config]
    return [v.config for v in vars(opt).values() if hasattr(v, "config")]  # MuonAdamW: its two halves


def _float_fields(cfg):
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if type(v) is float:
            out[f.name] = np.float32(v)
        elif isinstance(v, tuple) and v and all(type(x) is float for x in v):
            out[f.name] = tuple(np.float32(x) for x in v)
    return out


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_configs_normalise_numpy_scalars(name):
    """Validation makes every float hyper-parameter a Python float (``momentum=np.float32(0.9)`` included)."""
    for cfg in _configs(REGISTRY[name].make()):
        fields = _float_fields(cfg)
        again = dataclasses.replace(cfg, **fields)
        for k in fields:
            v = getattr(again, k)
            kinds = {type(x) for x in v} if isinstance(v, tuple) else {type(v)}
            assert kinds == {float}, f"{type(cfg).__name__}.{k} kept {v!r}"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", sorted(REGISTRY))
@pytest.mark.parametrize("validated", [True, False], ids=["validated", "raw"])
def test_numpy_float32_hyperparameters_pack_at_the_parameters_width(name, dtype, validated, device):
    """Steps with NumPy-float32 hyper-parameters: through validation, and written into the config behind its back
    (so that every launch site's packing, not only the configs' normalisation, is what is tested)."""
    spec = REGISTRY[name]
    params = {n: (s, backend.cupy().asarray(p)) for n, (s, p) in make_params(spec.shapes, dtype).items()}
    opt = make_for(spec, params)
    for cfg in _configs(opt):
        fields = _float_fields(cfg)
        if validated:
            new = dataclasses.replace(cfg, **fields)
            for f in dataclasses.fields(cfg):
                object.__setattr__(cfg, f.name, getattr(new, f.name))
        else:
            for k, v in fields.items():
                object.__setattr__(cfg, k, v)
    run_steps(opt, params, 2)  # an argument packed at another width is an EmulatorError
    for _, p in params.values():
        assert np.isfinite(backend.to_numpy(p)).all()


@pytest.mark.parametrize("filename", sorted(kernels.KERNELS))
def test_param_types_are_the_compiled_signatures(filename):
    """``kernels.param_types`` (read from the source) agrees with the signature g++ compiled, for every kernel."""
    why = emu.available()
    if why:
        pytest.skip(why)
    for expr in kernels.name_expressions(filename):
        name, ctype = expr[:-1].split("<")
        codes = emu.get(filename, expr).params
        types = kernels.param_types(filename, name, ctype)
        assert len(types) == len(codes), expr
        for i, (t, code) in enumerate(zip(types, codes)):
            if t is None:
                assert code.startswith("p"), (expr, i, code)
            else:
                assert emu._scalar_code(np.dtype(t)) == code, (expr, i, t, code)  # noqa: SLF001


def test_packed_kernel_converts_and_refuses():
    """A scalar is converted to its parameter's type; a float for an integer parameter is refused."""
    got = []
    k = backend.Packed(lambda grid, block, args: got.append(args), "k", (None, np.float64, np.int32, np.float32))
    arr = object()
    k((1,), (1,), (arr, np.float32(0.5), 3, 0.25))
    (a, b, c, d), = got
    assert a is arr and type(b) is np.float64 and b == 0.5 and type(c) is np.int32 and type(d) is np.float32
    with pytest.raises(TypeError, match="argument 2 is a float"):
        k((1,), (1,), (arr, 1.0, 2.0, 1.0))
    with pytest.raises(TypeError, match="3 arguments for 4"):
        k((1,), (1,), (arr, 1.0, 2))
