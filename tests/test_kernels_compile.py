"""Every CUDA source compiles (NVRTC through CuPy's bindings, no GPU needed), exactly as the loader builds it."""

from __future__ import annotations

import re
import os
import shutil
import subprocess
from pathlib import PureWindowsPath
from types import SimpleNamespace

import pytest

from flatopt.core import backend, kernels

pytestmark = pytest.mark.slow  # compiles every CUDA source (NVRTC, nvcc, ptxas): minutes


def _nvrtc_available() -> bool:
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
        return True
    except Exception:  # noqa: BLE001
        return False


def test_every_cu_file_is_registered():
    on_disk = sorted([p.name for p in kernels.KERNEL_DIR.glob("*.cu")]
                     + [f"generated/{p.name}" for p in kernels.KERNEL_DIR.glob("generated/*.cu")])
    assert on_disk == sorted(kernels.KERNELS), "register every .cu file (and only those) in core.kernels.KERNELS"


class _WindowsPath(PureWindowsPath):
    """A Windows path (``C:\\Users\\unit\\...``) whose files are read from the real kernel directory."""

    def read_text(self, *args, **kwargs):
        rel = self.relative_to(WINDOWS_DIR).as_posix()  # a generated source lies in kernels/generated
        return (REAL_DIR / rel).read_text(*args, **kwargs)


REAL_DIR = kernels.KERNEL_DIR
WINDOWS_DIR = r"C:\Users\unit\flatopt\kernels"


@pytest.fixture
def windows_path(monkeypatch):
    """The sources as the loader builds them on Windows (gpu-review H2: ``#line 1 "C:\\Users\\..."``, whose ``\\U``
    starts a universal-character name)."""
    monkeypatch.setattr(kernels, "KERNEL_DIR", _WindowsPath(WINDOWS_DIR))
    kernels.source.cache_clear()
    yield
    kernels.source.cache_clear()


def _need_nvrtc():
    if not _nvrtc_available():
        if shutil.which("nvcc") is None:
            pytest.skip("neither NVRTC (cupy + nvidia-cuda-nvrtc) nor nvcc is available")
        pytest.skip("NVRTC unavailable; see test_compiles_with_nvcc")


@pytest.mark.parametrize("filename", sorted(kernels.KERNELS))
@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
def test_compiles_with_nvrtc(filename, arch, windows_path):
    """Every source compiles with flatopt's own options, from a Windows path too, and keeps float32 subnormals: no
    flushing (``.ftz.f32``) arithmetic in the PTX (gpu-review M2; CuPy's RawModule would add -ftz=true)."""
    _need_nvrtc()
    ptx, lowered = backend.nvrtc_build(kernels.source(filename), filename, kernels.name_expressions(filename), arch)
    assert set(lowered) == set(kernels.name_expressions(filename))
    assert not flushing(ptx), flushing(ptx)[:5]


def flushing(ptx: bytes) -> list[str]:
    """The instructions of ``ptx`` that flush float32 subnormals (``.ftz`` with a float32 operand: ``mul.ftz.f32``,
    and the widening ``cvt.ftz.f64.f32`` too), but for the ``.approx`` ones that CUDA's math library uses inside
    ``powf`` and the like whatever -ftz says (it scales their operands itself)."""
    return [i for i in re.findall(r"\b[a-z0-9]+(?:\.[a-z0-9]+)*\.ftz(?:\.[a-z0-9]+)*\.f32\b", ptx.decode())
            if ".approx." not in i]


def cupy_options(options, arch="compute_90"):
    """The option list ``cupy.RawModule(code=..., options=options)`` compiles with (CuPy 14:
    ``_core.core.assemble_cupy_compiler_options``, then ``cuda/compiler.py`` appends -ftz=true, the architecture and
    --device-as-default-execution-space)."""
    from cupy._core import core

    return [*core.assemble_cupy_compiler_options(tuple(options)), "-ftz=true", f"-arch={arch}",
            "--device-as-default-execution-space"]


def compile_raw(source, names, options):
    """NVRTC on ``source`` with exactly ``options``: (PTX, log); raises with the log on failure."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source, "kern.cu", [], [])
    try:
        for expr in names:
            nvrtc.addNameExpression(prog, expr)
        try:
            nvrtc.compileProgram(prog, list(options))
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(nvrtc.getProgramLog(prog)) from exc
        return bytes(nvrtc.getPTX(prog)), nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


def compile_as_cupy(filename: str) -> bytes:
    """The PTX of ``filename`` compiled as ``cupy.RawModule(code=source, options=NVRTC_OPTIONS)`` would compile it
    (skips where NVRTC is missing, or where CuPy finds no CUDA headers: gpu-review H4)."""
    _need_nvrtc()
    try:
        options = cupy_options(backend.NVRTC_OPTIONS)
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"CuPy cannot assemble its options here: {exc}")
    return compile_raw(kernels.source(filename), kernels.name_expressions(filename), options)[0]


@pytest.mark.parametrize("filename", sorted(kernels.KERNELS))
def test_windows_path_compiles_with_cupys_option_list(filename, windows_path):
    """The ``#line`` file names of a Windows path are accepted with the option list CuPy builds (its include paths,
    -ftz=true; what a RawModule of these sources would compile with), and that list does flush subnormals."""
    ptx = compile_as_cupy(filename)
    assert flushing(ptx)  # what flatopt's own compile (above) avoids


@pytest.fixture
def recording_cupy(monkeypatch, tmp_path):
    """A recording model of CuPy for ``raw_module``: its RawModule compiles with CuPy's real option list, its Module
    records the image loaded (the list returned); the disk cache is ``tmp_path/cache`` (``CUPY_CACHE_DIR``)."""
    _need_nvrtc()
    loaded = []

    class RawModule:  # cupy.RawModule(code=...)
        def __init__(self, code, options=(), name_expressions=(), **_):
            loaded.append(compile_raw(code, name_expressions, cupy_options(options))[0])

        def get_function(self, expr):
            return expr

    class Module:  # cupy.cuda.function.Module
        def load(self, image):
            loaded.append(bytes(image))

        def get_function(self, name):
            return name

    class Device:
        id, compute_capability = 0, "90"

    fake = SimpleNamespace(RawModule=RawModule,
                           cuda=SimpleNamespace(Device=Device, function=SimpleNamespace(Module=Module)))
    monkeypatch.setattr(backend, "_cupy", fake)
    monkeypatch.setattr(backend, "_modules", {})
    monkeypatch.setattr(backend, "device_arch", lambda cp: "compute_90", raising=False)  # PTX, to read
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "cache"))
    return loaded


def _load_adamw(monkeypatch):
    monkeypatch.setattr(backend, "_modules", {})
    return backend.raw_module(("flatopt", "generated/adamw.cu"), kernels.source("generated/adamw.cu"),
                              kernels.name_expressions("generated/adamw.cu"))


def test_raw_module_loads_an_image_compiled_without_ftz(monkeypatch, recording_cupy):
    """What ``raw_module`` hands to the driver on real CuPy: compiled by flatopt without -ftz=true, not by
    ``cupy.RawModule`` (which appends -ftz=true after the caller's options; NVRTC takes the last).  The image is
    cached on disk (``CUPY_CACHE_DIR``) and reloaded without compiling."""
    loaded = recording_cupy
    mod = _load_adamw(monkeypatch)
    assert len(loaded) == 1 and not flushing(loaded[0]) and b"adamw_f0_step" in loaded[0]
    assert mod.get_function("adamw_f0_step<float>").startswith("_Z")  # the lowered (mangled) name
    monkeypatch.setattr(backend, "nvrtc_build", lambda *a: pytest.fail("compiled again: the disk cache missed"))
    _load_adamw(monkeypatch)
    assert loaded[1] == loaded[0]


def _entries(tmp_path):
    return sorted((tmp_path / "cache" / "flatopt").glob("*.bin"))


@pytest.mark.parametrize("damage", ["image byte", "truncated", "header", "another user's"])
def test_a_damaged_or_foreign_cached_module_is_compiled_again(monkeypatch, recording_cupy, tmp_path, damage):
    """The module cache is hostile input: an entry whose image no longer has its recorded sha256, a truncated one,
    one with a garbled header, or one that belongs to another user is never loaded; the source is compiled again."""
    loaded = recording_cupy
    _load_adamw(monkeypatch)
    (entry,) = _entries(tmp_path)
    blob = entry.read_bytes()
    if damage == "image byte":
        entry.write_bytes(blob[:-10] + bytes([blob[-10] ^ 1]) + blob[-9:])
    elif damage == "truncated":
        entry.write_bytes(blob[: len(blob) // 2])
    elif damage == "header":
        entry.write_bytes(b"{not json" + blob[blob.index(b"\n"):])
    else:
        if os.getuid() != 0:
            pytest.skip("chown to another user needs root")
        os.chown(entry, 12345, 12345)
    compiled = []
    real = backend.nvrtc_build
    monkeypatch.setattr(backend, "nvrtc_build", lambda *a: compiled.append(1) or real(*a))
    _load_adamw(monkeypatch)
    assert compiled == [1] and loaded[-1] == loaded[0]


def test_a_module_cache_others_can_write_is_not_used(monkeypatch, recording_cupy, tmp_path):
    """A cache directory writable by others (anyone could plant a module there) is neither read nor written."""
    loaded = recording_cupy
    d = tmp_path / "cache" / "flatopt"
    d.mkdir(parents=True)
    d.chmod(0o777)
    _load_adamw(monkeypatch)
    assert _entries(tmp_path) == [] and len(loaded) == 1


@pytest.mark.parametrize("filename", sorted(kernels.KERNELS))
def test_compiles_with_nvcc(filename, tmp_path):
    """Fallback where NVRTC is missing: nvcc with explicit instantiations of every template kernel."""
    nvcc = shutil.which("nvcc")
    if _nvrtc_available():
        pytest.skip("NVRTC compiled every source (test_compiles_with_nvrtc)")
    if nvcc is None:
        pytest.skip("nvcc not on PATH")
    inst = "\n".join(
        f"template __global__ void {expr.split('<')[0]}<{ctype}>({_params(filename, expr.split('<')[0], ctype)});"
        for expr in kernels.name_expressions(filename)
        for ctype in [expr.split("<")[1].rstrip(">")]
    )
    src = tmp_path / filename
    src.write_text(kernels.source(filename) + "\n" + inst + "\n")
    out = subprocess.run([nvcc, "-std=c++17", "--fmad=false", "-ptx", "-arch=compute_80", str(src), "-o",
                          str(tmp_path / "out.ptx")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr


def _params(filename: str, kernel: str, ctype: str) -> str:
    """The parameter list of ``kernel`` in ``filename`` with T replaced by ``ctype`` (for explicit instantiation)."""
    text = (kernels.KERNEL_DIR / filename).read_text()
    start = text.index(f" {kernel}(") + len(kernel) + 2
    depth, i = 1, start
    while depth:
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        i += 1
    return re.sub(r"\bT\b", ctype, text[start : i - 1])


@pytest.mark.parametrize("filename", sorted(f for f in kernels.KERNELS if '#include "a8_codec.cuh"' in
                                            (kernels.KERNEL_DIR / f).read_text()))
def test_8bit_clamp_is_normal_under_flush_to_zero(filename):
    """The 8-bit codec's clamp before log2 (the original's 1e-38f, a float32 subnormal) is never a float32 operand,
    even compiled as CuPy compiles (-ftz=true), so an all-zero block gets log2 = -126.2, not -inf and a NaN scale
    (gpu-review M2): no float32 instruction reads the constant 0f006CE3EE."""
    ptx = compile_as_cupy(filename)
    uses = [ln.strip() for ln in ptx.decode().splitlines() if "0F006CE3EE" in ln.upper()]
    assert not uses, uses[:3]


@pytest.mark.parametrize("filename", sorted(kernels.KERNELS))
def test_ptxas_resources_fit_the_launch(filename):
    """Every kernel compiled for sm_90 (the cubin ``raw_module`` loads on an H100/H200), read from ptxas' report:
    no spills, and registers x threads per block within the 64K registers of an SM, for the block size it is
    launched with: its ``__launch_bounds__`` (256 where it has none), so a compiler change cannot make a launch fail
    with "too many resources requested" (gpu-review L3).  A kernel without them may be launched with at most 256
    threads (the emulator refuses more: ``emu.UNBOUNDED_THREADS``)."""
    _need_nvrtc()
    from cupy_backends.cuda.libs import nvrtc

    from .cuda_emu.emu import launch_bounds

    bounds = launch_bounds(filename)
    names = kernels.name_expressions(filename)
    prog = nvrtc.createProgram(kernels.source(filename), filename, [], [])
    try:
        for expr in names:
            nvrtc.addNameExpression(prog, expr)
        nvrtc.compileProgram(prog, ["--gpu-architecture=sm_90", *backend.NVRTC_OPTIONS, "--ptxas-options=-v"])
        log = nvrtc.getProgramLog(prog)
        lowered = {nvrtc.getLoweredName(prog, e): e for e in names}
    finally:
        nvrtc.destroyProgram(prog)
    report = {}
    for part in log.split("Function properties for ")[1:]:  # one per function (entries and device functions)
        part = part.split("Compiling entry function")[0]
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", part)
        regs = re.search(r"Used (\d+) registers", part)
        report[part.split()[0]] = (int(spills.group(1)), int(spills.group(2)), int(regs.group(1)) if regs else 0)
    assert set(lowered) <= set(report), log[-2000:]
    for mangled, expr in lowered.items():
        stores, loads, regs = report[mangled]
        block = bounds.get(expr.split("<")[0], 256)
        assert stores == loads == 0, (expr, stores, loads)
        assert regs * block <= 65536, (expr, regs, block)


def test_8bit_decode_calls_cupys_exp2():
    """The fused 8-bit decode computes 2^x with the function CuPy's ``exp2`` ufunc (the twin's) calls,
    ``pow(in0_type(2), in0)``, not ``exp2f``, another algorithm (gpu-review S2: the "exact" 8-bit kernel-vs-twin
    cases would differ in the last bit on a GPU; the emulator's C library cannot show it).  CuPy's flags (-ftz=true,
    fmad on) still change powf's instructions, so the GPU check (benchmarks/gpu_check.py) compares every AL8 code's
    decode on a device."""
    import inspect

    from cupy._math import explog

    assert "out0 = pow(in0_type(2), in0)" in inspect.getsource(explog), "CuPy's exp2 changed: revisit a8_codec.cuh"
    codec = (kernels.KERNEL_DIR / "a8_codec.cuh").read_text()
    code = re.sub(r"//.*", "", codec)
    assert "exp2f(" not in code and "exp2(" not in code
    assert "powf(2.0f, " in code


def _loop_divisions(filename: str, kernel: str) -> dict:
    """{name expression: 64-bit div/rem instructions inside a loop (a label up to a branch back to it) of the
    kernel's PTX} for ``kernel<float>`` and ``kernel<double>`` of ``filename``."""
    ptx, lowered = backend.nvrtc_build(kernels.source(filename), filename, kernels.name_expressions(filename),
                                       "compute_90")
    text, out = ptx.decode(), {}
    for expr, low in lowered.items():
        if expr.split("<")[0] != kernel:
            continue
        start = text.index(f".entry {low}")
        end = text.find(".entry ", start + 1)
        lines = text[start : end if end > 0 else len(text)].splitlines()
        labels = {ln.strip()[:-1]: k for k, ln in enumerate(lines) if re.match(r"\s*\$L__\w+:", ln)}
        n = 0
        for k, ln in enumerate(lines):
            b = re.search(r"\bbra(?:\.uni)?\s+(\$L__\w+);", ln)
            if b and labels.get(b.group(1), k + 1) <= k:  # a branch back: the loop's body is lines[label:k]
                n += sum(1 for x in lines[labels[b.group(1)] : k] if re.search(r"\b(div|rem)\.[su]64\b", x))
        out[expr] = n
    return out


@pytest.mark.parametrize("filename, kernel", [("apollo8bit.cu", "ap_apply"), ("kron.cu", "kron_ds")])
def test_no_64bit_division_per_element(filename, kernel):
    """The elementwise loops carry their (row, column) from one element to the next instead of a 64-bit ``/`` and
    ``%`` per element (a ~20-instruction fast path plus a slow-path call each; gpu-review L2)."""
    _need_nvrtc()
    assert set(_loop_divisions(filename, kernel).values()) == {0}


@pytest.mark.parametrize("filename", sorted(f for f in kernels.KERNELS if f.startswith("generated/")))
def test_generated_kernels_load_and_store_16_byte_vectors(filename):
    """Every generated elementwise kernel (a step, a multi-tensor kernel, a map after a sum) has its vector path in the
    PTX: each array it reads loaded as a float4 (``v4.f32``) or two double2 (``v2.f64``), each array it writes stored
    so.  A sum's partials (blocked, strided by the grid) and its fold read no array elementwise."""
    _need_nvrtc()
    ptx, lowered = backend.nvrtc_build(kernels.source(filename), filename, kernels.name_expressions(filename),
                                       "compute_90")
    text = ptx.decode()
    checked = 0
    for expr, low in lowered.items():
        if re.search(r"_(partials\d*|partials\d*_multi|fold\d*|fold\d*_multi)<", expr):  # every level's
            continue
        checked += 1
        start = text.index(f".entry {low}")
        end = text.find(".entry ", start + 1)
        body = text[start: end if end > 0 else len(text)]
        vec = r"v4\.f32" if expr.endswith("<float>") else r"v2\.f64"
        loads = len(re.findall(rf"\bld\.global(?:\.nc)?\.{vec}", body))
        stores = len(re.findall(rf"\bst\.global\.{vec}", body))
        assert loads >= 1 and stores >= 1, (expr, loads, stores)
    assert checked, filename
