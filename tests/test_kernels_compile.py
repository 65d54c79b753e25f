"""Every CUDA source compiles (NVRTC through CuPy's bindings, no GPU needed), exactly as the loader builds it."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from flatopt.core import backend, kernels


def _nvrtc_available() -> bool:
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
        return True
    except Exception:  # noqa: BLE001
        return False


def test_every_cu_file_is_registered():
    on_disk = sorted(p.name for p in kernels.KERNEL_DIR.glob("*.cu"))
    assert on_disk == sorted(kernels.KERNELS), "register every .cu file (and only those) in core.kernels.KERNELS"


@pytest.mark.parametrize("filename", sorted(kernels.KERNELS))
@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
def test_compiles_with_nvrtc(filename, arch):
    if not _nvrtc_available():
        if shutil.which("nvcc") is None:
            pytest.skip("neither NVRTC (cupy + nvidia-cuda-nvrtc) nor nvcc is available")
        pytest.skip("NVRTC unavailable; see test_compiles_with_nvcc")
    lowered = backend.nvrtc_compile(kernels.source(filename), filename, kernels.name_expressions(filename), arch)
    assert set(lowered) == set(kernels.name_expressions(filename))


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
