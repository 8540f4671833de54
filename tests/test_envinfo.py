"""Provenance of committed results: the host CPU model beside the device."""

from __future__ import annotations

import platform
from pathlib import Path

from rlexact.envinfo import host_cpu, result_header


def test_host_cpu_reads_the_first_model_name(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: X\nmodel name\t: Example CPU 9000\n\nmodel name\t: B\n")
    assert host_cpu(info) == "Example CPU 9000"


def test_host_cpu_falls_back_without_a_model_name(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t:\n")
    fallback = platform.processor() or "unknown"
    assert host_cpu(info) == fallback
    assert host_cpu(tmp_path / "missing") == fallback


def test_result_header_records_the_host_cpu() -> None:
    header = result_header("probe")
    assert header["host_cpu"] == host_cpu() and header["host_cpu"] != ""
    assert list(header)[:7] == ["benchmark", "command", "commit", "date", "device", "host_cpu", "cpu_count"]
