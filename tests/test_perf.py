"""perf: the CPU's bf16 flag and what `xgblora env` says the defaults chose."""

from __future__ import annotations

import pytest

from xgblora import env, perf


@pytest.mark.parametrize(("flags", "native"), [
    ("fpu sse avx2 avx512f", False), ("avx2 avx512f avx512_bf16", True), ("avx2 amx_bf16 amx_tile", True),
    ("fp asimd sve bf16 i8mm", True), ("fp asimd sve sve2", False),
])
def test_cpu_has_bf16_reads_the_flags(tmp_path, monkeypatch, flags, native):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(cpuinfo if path == "/proc/cpuinfo" else path,
                                                                         *a, **k))
    assert perf.cpu_has_bf16() is native


@pytest.mark.parametrize("native", [False, True])
def test_environment_reports_the_cpu_defaults(monkeypatch, native):
    monkeypatch.setattr(env, "cpu_has_bf16", lambda: native)
    monkeypatch.setattr(env.torch.cuda, "is_available", lambda: False)
    report = env.environment()
    defaults = report["defaults"]
    assert report["bf16_supported"] is native
    assert defaults["device"] == "cpu" and defaults["attn_implementation"] == "sdpa"
    assert defaults["fused_adamw"] is True and defaults["tf32"] is False
    assert defaults["packing"].startswith("off")
    assert ("--bf16 to enable" in defaults["autocast"]) is native
