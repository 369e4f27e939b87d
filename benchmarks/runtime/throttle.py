"""Reads of one process from one disk, held to a rate by the kernel's block throttle (cgroups).

A benchmark that needs a medium slower than the machine's own disk (one whose transfers take
the medium's time, not the CPU's: a network volume, a busy SSD, a GPU node's DMA next to its
compute) moves itself into a cgroup whose read rate on the disk holding its files is capped:
cgroup v1 ``blkio.throttle.read_bps_device``, or cgroup v2 ``io.max``. The bytes still travel
through the real disk, page-pinned and DMA'd as always; the kernel only delays them. Needs root
and one of the two controllers; otherwise ThrottleUnavailable says which is missing.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


class ThrottleUnavailable(RuntimeError):
    """The kernel's block throttle cannot be used here (the reason says why)."""


def whole_disk(path: Path) -> tuple[int, int]:
    """(major, minor) of the disk (not the partition) the filesystem holding `path` lives on."""
    device = os.stat(path).st_dev
    major, minor = os.major(device), os.minor(device)
    sysfs = Path(f"/sys/dev/block/{major}:{minor}")
    if major == 0 or not sysfs.exists():
        raise ThrottleUnavailable(
            f"{path} is on a filesystem without a block device ({major}:{minor}: tmpfs, "
            "overlay or network): there is no disk to throttle"
        )
    if (sysfs / "partition").exists():  # throttling applies to whole disks
        parent = (sysfs.resolve().parent / "dev").read_text().strip()
        major, minor = (int(part) for part in parent.split(":"))
    return major, minor


def _own_group(controller: str) -> Path:
    """This process's cgroup directory for a v1 controller, or its v2 group ("" controller)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, group = line.split(":", 2)
        if (controller and controller in names.split(",")) or (not controller and names == ""):
            base = CGROUP_ROOT / controller if controller else CGROUP_ROOT
            return base / group.lstrip("/")
    raise ThrottleUnavailable(f"this process is in no {controller or 'cgroup v2'} group")


def _v1_group(name: str, device: tuple[int, int], bytes_per_s: int) -> tuple[Path, Path]:
    root = CGROUP_ROOT / "blkio"
    if not (root / "blkio.throttle.read_bps_device").exists():
        raise ThrottleUnavailable("no cgroup v1 blkio controller with throttling at /sys/fs/cgroup/blkio")
    group = root / name
    group.mkdir(exist_ok=True)
    (group / "blkio.throttle.read_bps_device").write_text(f"{device[0]}:{device[1]} {bytes_per_s}")
    return group, _own_group("blkio")


def _v2_group(name: str, device: tuple[int, int], bytes_per_s: int) -> tuple[Path, Path]:
    if "io" not in (CGROUP_ROOT / "cgroup.controllers").read_text().split():
        raise ThrottleUnavailable("the cgroup v2 hierarchy at /sys/fs/cgroup has no io controller")
    (CGROUP_ROOT / "cgroup.subtree_control").write_text("+io")
    group = CGROUP_ROOT / name
    group.mkdir(exist_ok=True)
    (group / "io.max").write_text(f"{device[0]}:{device[1]} rbps={bytes_per_s}")
    return group, _own_group("")


@contextlib.contextmanager
def throttled_reads(path: Path, bytes_per_s: int) -> Iterator[str]:
    """Inside, every read this process (all its threads) makes from the disk holding `path`
    is held to `bytes_per_s`; yields a description of the throttle. Writes are not throttled."""
    if bytes_per_s <= 0:
        raise ValueError(f"bytes_per_s: must be positive, got {bytes_per_s}")
    if os.geteuid() != 0:
        raise ThrottleUnavailable("throttling a disk needs root (cgroups are written under /sys/fs/cgroup)")
    device = whole_disk(path)
    name = f"strata-bench-throttle-{os.getpid()}"
    try:
        if (CGROUP_ROOT / "blkio").is_dir():
            group, home = _v1_group(name, device, bytes_per_s)
            kind = "cgroup v1 blkio.throttle.read_bps_device"
        elif (CGROUP_ROOT / "cgroup.controllers").exists():
            group, home = _v2_group(name, device, bytes_per_s)
            kind = "cgroup v2 io.max"
        else:
            raise ThrottleUnavailable("neither a cgroup v1 blkio nor a cgroup v2 io controller is mounted")
    except OSError as exc:
        raise ThrottleUnavailable(f"the block throttle cannot be set up: {exc}") from exc
    (group / "cgroup.procs").write_text(str(os.getpid()))
    try:
        yield f"reads from disk {device[0]}:{device[1]} held to {bytes_per_s / 1e6:.0f} MB/s ({kind})"
    finally:
        (home / "cgroup.procs").write_text(str(os.getpid()))
        with contextlib.suppress(OSError):
            group.rmdir()
