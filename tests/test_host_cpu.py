"""dtrain.engine.host_cpu: a step's CPU time by thread group, from the scheduler's per-thread counters; and whether
the CPU computes bf16 natively, from its flags."""

import mmap
import os
import platform
import threading
import time

import pytest
import torch

from dtrain.common.host_memory import heap_mib
from dtrain.engine import host_cpu
from dtrain.engine.host_cpu import CPU_FIELDS, FIELDS, HostCpu, bf16_native, cpu_flags, read_threads


def fake_task(tasks, tid, name, ns):
    d = tasks / str(tid)
    d.mkdir(parents=True, exist_ok=True)
    (d / "comm").write_text(name + "\n")
    (d / "schedstat").write_text(f"{ns} 0 1\n")


def burn(seconds):
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_groups_and_threads_that_start_or_end_within_the_step(tmp_path):
    main = os.getpid()
    fake_task(tmp_path, main, "python", 1_000_000)
    fake_task(tmp_path, 11, "gloo_tcp_loop", 5_000_000)
    fake_task(tmp_path, 12, "pt_gloo_runloop", 0)
    fake_task(tmp_path, 13, "python", 7_000_000)  # a Python thread of the strategy's: no name of its own
    fake_task(tmp_path, 14, "tqdm_monitor", 100)
    assert read_threads(tmp_path)[11] == ("cpu_backend_ms", 5_000_000)
    faults = iter([100, 160])
    h = HostCpu(tasks=tmp_path, faults=lambda: next(faults))
    h.begin()
    fake_task(tmp_path, main, "python", 41_000_000)  # +40 ms
    fake_task(tmp_path, 11, "gloo_tcp_loop", 8_500_000)  # +3.5 ms
    fake_task(tmp_path, 12, "pt_gloo_runloop", 250_000)  # +0.25 ms
    (tmp_path / "13" / "schedstat").unlink()  # ended during the step: its part is not known, and not guessed
    fake_task(tmp_path, 15, "pt_nccl_watchdg", 2_000_000)  # started during the step: all of its time
    fake_task(tmp_path, 16, "python", 1_500_000)
    rec = h.sample_into({"step": 3})
    assert {k: rec[k] for k in ("step", *CPU_FIELDS, "minor_faults")} == {
        "step": 3, "cpu_main_ms": 40.0, "cpu_backend_ms": 5.75, "cpu_other_ms": 1.5, "minor_faults": 60}
    assert set(rec) == {"step", *FIELDS}  # and the process's memory (this one's: glibc here)
    assert h.sample_into({}) == {}  # nothing begun: nothing added


def test_off_without_the_counters(tmp_path):
    for h in (HostCpu(tasks=tmp_path / "missing"), HostCpu(tasks=tmp_path), HostCpu(on=False)):
        h.begin()
        assert not h.on and h.sample_into({"step": 1}) == {"step": 1}


def test_this_process_the_main_thread_and_another_one():
    h = HostCpu()
    assert h.on  # Linux: /proc/self/task/<tid>/schedstat
    h.begin()
    burn(0.05)
    burned, sampled = threading.Event(), threading.Event()
    worker = threading.Thread(target=lambda: (burn(0.03), burned.set(), sampled.wait()))
    worker.start()
    burned.wait()
    rec = h.sample_into({})  # while the worker lives: its counters are there to read
    sampled.set()
    worker.join()
    assert set(rec) == set(FIELDS)
    assert rec["cpu_main_ms"] >= 45 and rec["cpu_other_ms"] >= 25, rec


def test_minor_faults_count_fresh_pages_touched_within_the_step():
    pages = (64 << 20) // mmap.PAGESIZE
    fresh = mmap.mmap(-1, pages * mmap.PAGESIZE)  # anonymous: pages the kernel maps on first write, not the heap's
    h = HostCpu()
    h.begin()
    for i in range(pages):
        fresh[i * mmap.PAGESIZE] = 1
    rec = h.sample_into({})
    h.begin()
    for i in range(pages):  # the same pages again: mapped already
        fresh[i * mmap.PAGESIZE] = 2
    again = h.sample_into({})
    fresh.close()
    assert rec["minor_faults"] >= pages * 0.9 and again["minor_faults"] < pages * 0.1, (rec, again)


def test_the_heap_counts_what_is_allocated_and_what_it_holds():
    before = heap_mib()
    block = bytearray(64 << 20)  # 64 MiB through malloc
    during = heap_mib()
    del block
    assert during["heap_used_mib"] - before["heap_used_mib"] >= 63, (before, during)
    assert during["heap_mib"] >= during["heap_used_mib"]
    assert heap_mib()["heap_used_mib"] < during["heap_used_mib"] - 60  # freed: no longer in use


# -- bf16: which devices compute it natively (`train.amp: auto` follows) -------------------------------------------

@pytest.fixture(autouse=True)
def no_cap_on_torch_s_instructions(monkeypatch):
    """The cases below give the CPU's flags; a cap set in the environment that runs the tests (the variables oneDNN
    and ATen read, to run as an older CPU would) is a case of its own."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)


def cpuinfo(tmp_path, flags):
    f = tmp_path / "cpuinfo"
    f.write_text(f"processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    return f


@pytest.mark.parametrize("flags,capability,native,reason", [
    ("fpu sse avx2 fma", "AVX2", False,
     "CPU capability AVX2 without bf16 instructions (avx512_bf16, amx_bf16): bf16 emulated"),
    ("fpu avx2 avx512f avx512bw", "AVX512", False,
     "CPU capability AVX512 without bf16 instructions (avx512_bf16, amx_bf16): bf16 emulated"),
    ("fpu avx2 avx512f avx512_bf16", "AVX512", True, "CPU capability AVX512 with avx512_bf16: bf16 native"),
    ("avx512f avx512_bf16 amx_tile amx_bf16", "AVX512", True,
     "CPU capability AVX512 with avx512_bf16, amx_bf16: bf16 native"),
])
def test_a_cpu_computes_bf16_natively_with_the_flags_for_it(tmp_path, monkeypatch, flags, capability, native, reason):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    assert cpu_flags(cpuinfo(tmp_path, flags)) == set(flags.split())  # the first CPU's
    assert bf16_native(torch.device("cpu"), cpuinfo(tmp_path, flags)) == (native, reason)
    monkeypatch.setattr(host_cpu, "CPUINFO", cpuinfo(tmp_path, flags))  # the default file, as the trainer reads it
    assert bf16_native(torch.device("cpu")) == (native, reason)


@pytest.mark.parametrize("var,value,capped", [
    ("ONEDNN_MAX_CPU_ISA", "AVX2", True), ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE", True),
    ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16", False), ("ONEDNN_MAX_CPU_ISA", "ALL", False),
    ("ATEN_CPU_CAPABILITY", "avx2", True), ("ATEN_CPU_CAPABILITY", "avx512", False),
])
def test_a_cap_on_torch_s_cpu_instructions_counts_as_no_bf16(tmp_path, monkeypatch, var, value, capped):
    """Run as an older CPU would (the variables oneDNN and ATen read), a CPU with bf16 instructions is not native."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.setenv(var, value)
    native, reason = bf16_native(torch.device("cpu"), cpuinfo(tmp_path, "avx2 avx512f avx512_bf16"))
    assert native is not capped
    assert (f"{var}={value.upper() if var.startswith('ONEDNN') else value}: bf16 emulated" in reason) is capped


def test_an_arm_cpu_names_its_bf16_in_features_and_no_cpuinfo_is_not_native(tmp_path):
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\nCPU implementer\t: 0x41\n")
    assert bf16_native(torch.device("cpu"), arm)[0]
    native, reason = bf16_native(torch.device("cpu"), tmp_path / "missing")
    assert not native and "bf16 instructions not known (no /proc/cpuinfo)" in reason


def test_this_machine_agrees_with_torch_about_avx512_bf16():
    """The flags read here against torch's own (private) probe of the same instructions, where it has one."""
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    if probe is None or platform.machine() != "x86_64":
        pytest.skip("torch's probe of avx512_bf16 is x86's, and private")
    assert ("avx512_bf16" in cpu_flags()) == probe()


@pytest.mark.parametrize("supported,reason", [
    (True, "GPU NVIDIA H100: bf16 native"),
    (False, "GPU NVIDIA H100 (compute capability 7.0) without native bf16"),
])
def test_a_gpu_is_native_where_cuda_says_so_without_emulation(monkeypatch, supported, reason):
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: asked.append(including_emulation) or supported)
    assert bf16_native(torch.device("cuda", 0)) == (supported, reason)
    assert asked == [False]  # emulated bf16 (a V100's) is not native
