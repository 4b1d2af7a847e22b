"""GPU discovery: simulated GPU specs, NVML enumeration and the fallback between them.

This machine has no GPU and no NVML library, so the NVML path runs for real only up to
"library not found"; enumeration and CUDA_VISIBLE_DEVICES are checked against a stand-in
`pynvml` module that answers like the real one.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from placement.config import Settings
from placement.errors import ConfigError
from placement.policy.state import Gpu
from worker.devices import (
    SIM_ENV,
    Device,
    discover,
    nvml_devices,
    parse_sim_gpus,
    simulated_devices,
)

GiB = 2**30
GB = 10**9


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (SIM_ENV, "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):
        monkeypatch.delenv(name, raising=False)


# --- simulated GPU specs -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "sizes"),
    [
        ("2x24GiB", [24 * GiB, 24 * GiB]),
        ("40GB,80GB", [40 * GB, 80 * GB]),
        ("2x8GiB,1x80GiB", [8 * GiB, 8 * GiB, 80 * GiB]),
        ("  2 x 8 GiB ,  80G ", [8 * GiB, 8 * GiB, 80 * GiB]),
        ("3X1GiB", [GiB, GiB, GiB]),
        ("1.5GiB", [GiB * 3 // 2]),
        ("17179869184", [16 * GiB]),
        ("64x1GiB", [GiB] * 64),
    ],
)
def test_a_sim_spec_lists_one_size_per_simulated_gpu(spec: str, sizes: list[int]) -> None:
    assert parse_sim_gpus(spec) == sizes


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("8GiB,", "stray comma"),
        ("0x8GiB", "asks for 0 GPUs"),
        ("2x", "not a memory size"),
        ("two x 8GiB", "not a memory size"),
        ("2x8 parsecs", "not a memory size"),
        ("-8GiB", "not a memory size"),
        ("0GiB", "no memory"),
        ("65x1GiB", "more than 64"),
        ("60x1GiB,5x1GiB", "more than 64"),
    ],
)
def test_a_bad_sim_spec_is_a_config_error_quoting_it_and_the_accepted_forms(
    spec: str, why: str
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_sim_gpus(spec)
    message = str(info.value)
    assert repr(spec) in message
    assert why in message
    assert "'2x24GiB', '40GB,80GB', '2x8GiB,1x80GiB'" in message


def test_simulated_devices_are_numbered_from_zero_and_named_by_size() -> None:
    devices = simulated_devices("2x8GiB,40GB")
    assert [(d.index, d.name, d.total, d.simulated) for d in devices] == [
        (0, "Simulated 8 GiB", 8 * GiB, True),
        (1, "Simulated 8 GiB", 8 * GiB, True),
        (2, "Simulated 37.25 GiB", 40 * GB, True),
    ]
    assert all(d.uuid == "" and d.cuda_index is None for d in devices)


# --- ids ------------------------------------------------------------------------------------


def test_simulated_gpu_ids_are_unique_across_hosts_and_stable_across_discoveries() -> None:
    first = [d.gpu_id("h1") for d in discover("3x8GiB", simulate=True)]
    again = [d.gpu_id("h1") for d in discover("3x8GiB", simulate=True)]
    other = [d.gpu_id("h2") for d in discover("3x8GiB", simulate=True)]
    assert first == again == ["h1:sim0", "h1:sim1", "h1:sim2"]
    assert len(set(first) | set(other)) == 6


def test_a_real_gpu_is_known_by_its_nvml_uuid_whatever_the_host() -> None:
    device = Device(index=1, uuid="GPU-1234", name="NVIDIA H100", total=80 * GiB, cuda_index=0)
    assert device.gpu_id("h1") == device.gpu_id("h2") == "GPU-1234"


def test_a_device_becomes_the_ledger_entry_register_worker_takes() -> None:
    device = simulated_devices("2x8GiB")[1]
    assert device.to_gpu("h1") == Gpu(
        id="h1:sim1", host="h1", index=1, name="Simulated 8 GiB", total=8 * GiB
    )


# --- NVML ------------------------------------------------------------------------------------


def test_nvml_finds_no_gpu_on_this_machine_without_raising() -> None:
    if nvml_devices():
        pytest.skip("this machine has NVIDIA GPUs")
    assert nvml_devices() == []


class FakeNvml(types.ModuleType):
    """A stand-in for `pynvml` with the calls discovery makes, and a record of them."""

    class NVMLError(Exception):
        pass

    def __init__(self, gpus: list[tuple[str | bytes, str | bytes, int]], fail: bool = False):
        super().__init__("pynvml")
        self.gpus = gpus
        self.fail = fail
        self.calls: list[str] = []
        self.driver_reserved: int | None = None  # what memory info v2 says; None: no v2

    @property
    def nvmlMemory_v2(self) -> int:  # absent from bindings older than 11.5
        if self.driver_reserved is None:
            raise AttributeError("nvmlMemory_v2")
        return 0x02000028

    def nvmlInit(self) -> None:
        self.calls.append("init")
        if self.fail:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, handle: int) -> str | bytes:
        return self.gpus[handle][0]

    def nvmlDeviceGetUUID(self, handle: int) -> str | bytes:
        return self.gpus[handle][1]

    def nvmlDeviceGetMemoryInfo(self, handle: int, version: int | None = None) -> Any:
        total = self.gpus[handle][2]
        if version is None:
            return types.SimpleNamespace(total=total, free=0, used=0)
        assert version == self.nvmlMemory_v2
        return types.SimpleNamespace(total=total, reserved=self.driver_reserved, free=0, used=0)


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeNvml]:
    fake = FakeNvml(
        [
            (b"NVIDIA A100-SXM4-40GB", b"GPU-aaaa-0000", 40 * GiB),
            ("NVIDIA A100-SXM4-40GB", "GPU-bbbb-1111", 40 * GiB),
            ("NVIDIA A100-SXM4-40GB", "GPU-bbbc-2222", 40 * GiB),
        ]
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    yield fake


def test_nvml_devices_are_read_decoded_and_nvml_is_shut_down(nvml: FakeNvml) -> None:
    devices = nvml_devices()
    assert [(d.index, d.cuda_index, d.uuid, d.name) for d in devices] == [
        (0, 0, "GPU-aaaa-0000", "NVIDIA A100-SXM4-40GB"),
        (1, 1, "GPU-bbbb-1111", "NVIDIA A100-SXM4-40GB"),
        (2, 2, "GPU-bbbc-2222", "NVIDIA A100-SXM4-40GB"),
    ]
    assert all(d.total == 40 * GiB and not d.simulated for d in devices)
    assert nvml.calls == ["init", "shutdown"]


def test_a_real_gpu_registers_its_total_less_its_driver_s_memory_and_a_cuda_context(
    nvml: FakeNvml,
) -> None:
    nvml.driver_reserved = 512 * 2**20
    devices = nvml_devices(reserve=GiB)
    assert [d.total for d in devices] == [40 * GiB] * 3  # as NVML reports it
    assert devices[0].to_gpu("h1").total == 40 * GiB - 512 * 2**20 - GiB
    assert nvml_devices(reserve=0)[0].to_gpu("h1").total == 40 * GiB - 512 * 2**20


def test_without_nvml_memory_info_v2_only_the_context_is_kept_back(nvml: FakeNvml) -> None:
    assert [d.to_gpu("h1").total for d in discover(reserve=GiB)] == [39 * GiB] * 3


def test_a_simulated_gpu_registers_its_whole_size_whatever_the_reserve() -> None:
    [device] = discover("8GiB", simulate=True, reserve=GiB)
    assert device.to_gpu("h1").total == 8 * GiB


def test_a_reserve_that_leaves_a_gpu_nothing_is_a_config_error_naming_the_setting(
    nvml: FakeNvml,
) -> None:
    nvml.driver_reserved = GiB
    [device, *_] = nvml_devices(reserve=39 * GiB)  # found: only a worker that owns it fails
    with pytest.raises(ConfigError, match=r"GPU 0 .* lower GPUFLEET_GPU_RESERVE"):
        device.to_gpu("h1")


def test_a_driver_that_does_not_start_means_no_nvml_gpus(nvml: FakeNvml) -> None:
    nvml.fail = True
    assert nvml_devices() == []


@pytest.mark.parametrize(
    ("visible", "shown"),
    [
        ("2,0", [(2, 0), (0, 1)]),
        ("1", [(1, 0)]),
        ("", []),
        ("-1", []),
        ("0,7,1", [(0, 0)]),  # CUDA stops at the first entry that names no GPU
        ("1,1", [(1, 0)]),
        ("GPU-bbbc,0", [(2, 0), (0, 1)]),  # a unique uuid prefix
        ("GPU-bbb", []),  # an ambiguous prefix
        ("MIG-aaaa-0000/1/0", []),
    ],
)
def test_cuda_visible_devices_picks_and_renumbers_the_gpus_this_process_sees(
    nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch, visible: str, shown: list[tuple[int, int]]
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert [(d.index, d.cuda_index) for d in nvml_devices()] == shown


# --- discover ---------------------------------------------------------------------------------


def test_discover_prefers_real_gpus_over_a_sim_spec(nvml: FakeNvml) -> None:
    assert [d.uuid for d in discover("2x8GiB")] == [
        "GPU-aaaa-0000",
        "GPU-bbbb-1111",
        "GPU-bbbc-2222",
    ]
    assert all(d.simulated for d in discover("2x8GiB", simulate=True))


def test_discover_falls_back_to_the_simulated_gpus_of_the_spec(nvml: FakeNvml) -> None:
    nvml.gpus = []  # a machine without NVIDIA GPUs
    devices = discover("2x24GiB")
    assert [(d.index, d.total, d.simulated) for d in devices] == [
        (0, 24 * GiB, True),
        (1, 24 * GiB, True),
    ]


def test_the_sim_spec_comes_from_the_settings(tmp_path: Path) -> None:
    settings = Settings.from_env({"GPUFLEET_SIM_GPUS": "80GB", "GPUFLEET_HOME": str(tmp_path)})
    assert [d.total for d in discover(settings.sim_gpus, simulate=True)] == [80 * GB]


def test_no_gpu_and_no_spec_is_a_config_error_saying_what_to_set() -> None:
    if nvml_devices():
        pytest.skip("this machine has NVIDIA GPUs")
    with pytest.raises(
        ConfigError, match=r"GPUFLEET_SIM_GPUS is not set.*GPUFLEET_SIM_GPUS=2x8GiB"
    ):
        discover()


def test_simulating_without_a_spec_is_a_config_error_too(nvml: FakeNvml) -> None:
    with pytest.raises(ConfigError, match="simulation was asked for"):
        discover(simulate=True)
