"""The one-command GPU check runs without a device (``--dry-run``) and keeps its report when a section fails."""

from __future__ import annotations

import pytest

from .optional import bench


@pytest.fixture
def gpu_check():
    return bench("gpu_check")


TITLES = ["GPU tests", "Parity on large shapes", "Subnormals (FTZ) and the 8-bit decode", "Multi-GPU placement",
          "NCCL, one process per device", "Every optimizer's step", "Timings against the references"]


def test_dry_run_writes_every_section(gpu_check, tmp_path):
    out = tmp_path / "gpu.md"
    assert gpu_check.main(["--dry-run", "--out", str(out)]) == 0
    text = out.read_text()
    for title in TITLES:
        assert f"## {title}" in text
    assert text.count("not run: --dry-run") == len(TITLES)


def test_a_failing_section_is_reported_and_the_report_written(gpu_check, tmp_path):
    out, lines = tmp_path / "gpu.md", ["# report", ""]

    def boom():
        raise RuntimeError("the device fell over")

    gpu_check._section(lines, out, "first", boom)  # noqa: SLF001
    assert "the device fell over" in out.read_text() and "section failed" in out.read_text()
    gpu_check._section(lines, out, "second", lambda: ["fine"])  # noqa: SLF001
    text = out.read_text()
    assert "## second" in text and "fine" in text and "the device fell over" in text


def test_nccl_section_says_why_without_nccl(gpu_check, monkeypatch):
    from flatopt.core import backend

    def no_nccl():
        raise ImportError('Failure finding "libnccl.so.2"')

    monkeypatch.setattr(backend, "nccl", no_nccl)
    monkeypatch.setattr(backend, "cupy", lambda: None)
    assert gpu_check._nccl_check(1)[0].startswith("not run: Failure finding")  # noqa: SLF001


def test_decode_probe_kernel_compiles(gpu_check):
    """The fused-decode probe of the subnormals section (a8_codec.cuh's a8_al_value) compiles with NVRTC."""
    from flatopt.core import backend, kernels

    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    header = (kernels.KERNEL_DIR / "a8_codec.cuh").read_text()
    _, lowered = backend.nvrtc_build('#line 1 "a8_codec.cuh"\n' + header + gpu_check._A8DEC, "a8dec",  # noqa: SLF001
                                     ["a8dec<float>"], "compute_90")
    assert set(lowered) == {"a8dec<float>"}
