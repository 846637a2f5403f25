"""Host memory is memory: the host's real limit (cgroup v1/v2, RLIMIT_DATA/RLIMIT_AS,
memory.host_memory_gib, the available memory) is the budget, and a failed host allocation is an
out-of-memory error the run recovers from (memtrain/memory/host_limit.py, memtrain/oom.py)."""

from __future__ import annotations

import errno
import json
import os
import resource
import subprocess
import sys

import pytest
import torch

from memtrain.config import FaultsConfig
from memtrain.memory.host_limit import AVAILABLE, HostLimit, cgroup_limit, host_limit, process_limits
from memtrain.oom import AgreedOOM, agrees_inside_compute, is_host_oom, is_oom, memory_that_ran_out

MiB, GiB = 2**20, 2**30


def _write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_a_real_cpu_allocation_failure_is_a_host_out_of_memory_error():
    """torch's CPU allocator refusing a request (errno ENOMEM: here one larger than the address
    space; under RLIMIT_DATA any request past the limit) is an out-of-memory error of the host;
    so are MemoryError and an ENOMEM OSError. Other errors are not."""
    with pytest.raises(RuntimeError) as raised:
        torch.empty(2**62, dtype=torch.uint8)
    assert is_oom(raised.value) and is_host_oom(raised.value)
    assert memory_that_ran_out(raised.value, "cuda") == "host"
    assert is_oom(MemoryError()) and is_oom(OSError(errno.ENOMEM, "Cannot allocate memory"))
    assert is_host_oom(ImportError("/x/_pydantic_core.so: failed to map segment from shared object"))
    assert not is_oom(ImportError("No module named 'x'"))
    assert not is_oom(RuntimeError("shape mismatch")) and not is_oom(OSError(errno.ENOENT, "missing"))
    device = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert is_oom(device) and not is_host_oom(device) and memory_that_ran_out(device, "cuda") == "device"
    assert memory_that_ran_out(AgreedOOM([1]), "cuda") == "device"
    assert memory_that_ran_out(device, "cpu") == "host"  # a CPU run's device is the host


def test_cgroup_v2_limit_is_the_tightest_of_the_process_folder_and_its_parents(tmp_path):
    """The limit that leaves the least room binds, wherever it is set in the hierarchy; page cache
    the kernel can reclaim (inactive_file) is not counted as used; "max" is no limit."""
    root = tmp_path / "cgroup"
    _write(root / "cgroup.controllers", "cpu memory\n")
    _write(root / "memory.max", "max\n")
    _write(root / "job" / "memory.max", str(3 * GiB))
    _write(root / "job" / "memory.current", str(1 * GiB))
    _write(root / "job" / "step" / "memory.max", str(2 * GiB))
    _write(root / "job" / "step" / "memory.current", str(int(1.5 * GiB)))
    _write(root / "job" / "step" / "memory.stat", f"anon 1\ninactive_file {256 * MiB}\nactive_file 5\n")
    proc = tmp_path / "cgroup_of_self"
    proc.write_text("0::/job/step\n")
    limit, used, source = cgroup_limit(str(proc), str(root))
    assert (limit, used) == (2 * GiB, int(1.5 * GiB) - 256 * MiB)  # room 768 MiB < the parent's 2 GiB
    assert source == f"cgroup v2 memory.max of {root / 'job' / 'step'}"
    _write(root / "job" / "memory.current", str(int(2.5 * GiB)))  # now the parent leaves less
    assert cgroup_limit(str(proc), str(root))[:2] == (3 * GiB, int(2.5 * GiB))


def test_cgroup_v1_limit_and_its_no_limit_value(tmp_path):
    """v1's memory controller (``memory.limit_in_bytes``, ``total_inactive_file``); the kernel's
    "no limit" (9223372036854771712) is none, and a container whose own cgroup is mounted at the
    root (the path in /proc/self/cgroup does not exist there) is read at the mount."""
    root = tmp_path / "cgroup"
    _write(root / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")
    proc = tmp_path / "cgroup_of_self"
    proc.write_text("12:pids:/x\n4:memory:/docker/abc\n0::/\n")
    assert cgroup_limit(str(proc), str(root)) is None
    _write(root / "memory" / "memory.limit_in_bytes", str(4 * GiB))
    _write(root / "memory" / "memory.usage_in_bytes", str(3 * GiB))
    _write(root / "memory" / "memory.stat", f"cache 9\ntotal_inactive_file {GiB}\n")
    assert cgroup_limit(str(proc), str(root)) == (4 * GiB, 2 * GiB,
                                                   f"cgroup v1 memory.limit_in_bytes of {root / 'memory'}")


def test_resource_limits_leave_the_room_the_kernel_counts(tmp_path):
    """RLIMIT_DATA is compared with VmData, RLIMIT_AS with VmSize (not the resident set)."""
    status = tmp_path / "status"
    status.write_text("VmSize:\t 3000000 kB\nVmRSS:\t  100000 kB\nVmData:\t  500000 kB\n")
    limits = {resource.RLIMIT_DATA: (2_000_000 * 1024, resource.RLIM_INFINITY),
              resource.RLIMIT_AS: (resource.RLIM_INFINITY, resource.RLIM_INFINITY)}
    assert process_limits(str(status), limits.__getitem__) == [(1_500_000 * 1024, "RLIMIT_DATA")]
    limits[resource.RLIMIT_AS] = (3_100_000 * 1024, resource.RLIM_INFINITY)
    assert process_limits(str(status), limits.__getitem__)[1] == (100_000 * 1024, "RLIMIT_AS")


def test_the_host_limit_is_the_smallest_and_names_its_source():
    """Available memory, a cgroup (shared by the ranks), a resource limit (each rank its own) and
    memory.host_memory_gib: the smallest binds; the ranks' resident bytes count as theirs."""
    rss = 300 * MiB
    base = dict(resident_bytes=rss, available_bytes=20 * GiB, cgroup=(), rlimits=[])
    assert host_limit(0, 2, **base) == HostLimit(20 * GiB + 2 * rss, AVAILABLE, 2)
    assert not host_limit(0, 2, **base).fails_allocations
    cg = host_limit(0, 2, **{**base, "cgroup": (6 * GiB, 2 * GiB, "cgroup v2 memory.max of /x")})
    assert (cg.bytes, cg.source, cg.fails_allocations) == (4 * GiB + 2 * rss, "cgroup v2 memory.max of /x", False)
    data = host_limit(0, 2, **{**base, "rlimits": [(GiB, "RLIMIT_DATA")]})
    assert (data.bytes, data.share_bytes, data.source) == (2 * (GiB + rss), GiB + rss, "RLIMIT_DATA")
    assert data.fails_allocations and "RLIMIT_DATA" in data.describe()
    configured = host_limit(1.0, 2, **{**base, "rlimits": [(GiB, "RLIMIT_DATA")]})
    assert (configured.bytes, configured.source) == (GiB, "memory.host_memory_gib")


def test_a_resource_limit_set_by_the_launcher_is_read_in_the_process():
    """A real RLIMIT_DATA (as ``prlimit --data`` or a batch scheduler sets it) is what a process
    started under it plans for: the smallest limit, its room the limit less VmData now."""
    limit = 4 * GiB
    code = ("import json, re; from memtrain.memory.host_limit import host_limit; h = host_limit(0, 1); "
            "s = open('/proc/self/status').read(); "
            "vm = lambda k: int(re.search(k + r':\\s+(\\d+)', s).group(1)) * 1024; "
            "print(json.dumps([h.source, h.bytes, vm('VmData'), vm('VmRSS')]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_DATA, (limit, limit)))
    source, planned, vm_data, vm_rss = json.loads(out.stdout.strip().splitlines()[-1])
    assert source == "RLIMIT_DATA"
    assert abs(planned - (limit - vm_data + vm_rss)) < 64 * MiB  # read a moment apart


def test_host_allocations_that_can_fail_arm_the_agreement_points_inside_compute():
    """A CPU run under a resource limit can fail an allocation inside compute, where a rank that
    ran out must not strand the others in an engine collective: the points inside compute are
    made there, and not on an unlimited CPU run (the kernel's OOM killer acts first)."""
    assert agrees_inside_compute("cpu", FaultsConfig(), host_limited=True)
    assert not agrees_inside_compute("cpu", FaultsConfig(), host_limited=False)


def test_plan_under_a_limit_names_it_and_refuses_absurd_sizes(tmp_path, cache_dir):
    """``memtrain plan`` in a process under RLIMIT_DATA plans a CPU run's budget from that limit
    and says so; a GPU of 1e30 GiB is refused with exit 2 naming the option."""
    from conftest import REPO, tiny_args

    plan = [sys.executable, str(REPO / "memtrain" / "train.py"), "plan", *tiny_args(tmp_path / "out", cache_dir)]
    limit = 3 * GiB
    out = subprocess.run(plan, capture_output=True, text=True, timeout=300, cwd=REPO,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_DATA, (limit, limit)))
    assert out.returncode == 0, out.stderr
    head = out.stdout.splitlines()[0]
    assert "(RLIMIT_DATA)" in head
    budget_mib = float(head.split("budget ")[1].split(" MiB")[0])
    assert 0 < budget_mib < limit / MiB
    refused = subprocess.run(plan + ["--gpu_memory_gib", "1e30"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert refused.returncode == 2 and "--gpu_memory_gib" in refused.stderr and "Traceback" not in refused.stderr
