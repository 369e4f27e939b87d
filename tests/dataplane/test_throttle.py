"""The benchmarks' disk-read throttle: the process moves into a capped cgroup and back, or is told why not."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks.runtime.throttle import CGROUP_ROOT, ThrottleUnavailable, throttled_reads, whole_disk


def _groups() -> str:
    return Path("/proc/self/cgroup").read_text()


def _can_throttle() -> bool:
    v1 = (CGROUP_ROOT / "blkio" / "blkio.throttle.read_bps_device").exists()
    v2 = (CGROUP_ROOT / "cgroup.controllers").exists() and "io" in (CGROUP_ROOT / "cgroup.controllers").read_text()
    return os.geteuid() == 0 and (v1 or v2)


ON_DISK = Path(__file__).resolve().parent
"""The checkout's own filesystem: a disk (a temporary directory may be a tmpfs)."""


def test_reads_are_capped_inside_and_everything_is_put_back() -> None:
    before = _groups()
    major, minor = whole_disk(ON_DISK)
    if not _can_throttle():
        with pytest.raises(ThrottleUnavailable, match="root|controller|cgroup"):
            with throttled_reads(ON_DISK, 100_000_000):
                pass
        return
    with throttled_reads(ON_DISK, 123_000_000) as how:
        assert f"{major}:{minor}" in how and "123 MB/s" in how
        inside = _groups()
        name = f"strata-bench-throttle-{os.getpid()}"
        assert name in inside
        if (CGROUP_ROOT / "blkio").is_dir():
            rule = (CGROUP_ROOT / "blkio" / name / "blkio.throttle.read_bps_device").read_text()
        else:
            rule = (CGROUP_ROOT / name / "io.max").read_text()
        assert f"{major}:{minor}" in rule and "123000000" in rule
    assert _groups() == before
    assert not (CGROUP_ROOT / "blkio" / name).exists() and not (CGROUP_ROOT / name).exists()


def test_a_filesystem_without_a_disk_is_refused_by_name() -> None:
    with pytest.raises(ThrottleUnavailable, match="without a block device"):
        whole_disk(Path("/dev/shm"))


def test_a_rate_must_be_positive() -> None:
    with pytest.raises(ValueError, match="bytes_per_s: must be positive"):
        with throttled_reads(ON_DISK, 0):
            pass
