"""Multi-rank worker: torch.distributed groups, stores and monitored barriers on ringplug.

``python torch_groups.py OUTDIR SCENARIO:START...``: the scenarios one after the other in
the same ranks, each in a torch.distributed of its own (started, used, destroyed); each rank
writes OUTDIR/<scenario>-<start>-<rank>.json with a boolean per check and the details of the
failed ones.

START is how torch.distributed began, as users meet it:
- ``backend``: the user's own ``dist.init_process_group("ringplug")`` under ringrun;
- ``strategy``: as RingStrategy and RingFabricStrategy start it (`init_process_group` of
  ``ringplug.torch.backend``), the start under which Lightning calls ``new_group``.

Scenarios:
- ``calls``: every group, store and barrier call Lightning and libraries make, each against
  what it must give.
- ``monitored-missing``: rank 1 reaches a ``monitored_barrier`` only after the others'
  timeout passed: they fail naming rank 1, rank 1 fails naming them, and the job goes on.
- ``subgroup-missing``: rank 1 never joins an all_reduce of the group [0, 1]; rank 0's fails
  by the group's deadline (1 s, under RINGPLUG_TIMEOUT), and the job goes on.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import ringplug
from ringplug.torch import backend

LIGHTNING_TIMEOUT = datetime.timedelta(days=10000)  # what Lightning's _InfiniteBarrier asks


def full(value: float) -> torch.Tensor:
    return torch.full((3,), float(value))


def calls(rank: int, size: int, checks: dict[str, bool], details: dict[str, str]) -> None:
    last = size - 1
    # Lightning's prepare_data barrier: a gloo group over every rank, "infinite" timeout.
    lightning = dist.new_group(backend="gloo", timeout=LIGHTNING_TIMEOUT)
    checks["world-gloo/served-by-ringplug"] = type(lightning).__name__ == "RingProcessGroup"
    checks["world-gloo/backend-name"] = dist.get_backend(lightning) == "gloo"
    store = dist.distributed_c10d._get_default_store()
    store.add("before-lightning", 1)
    lightning.monitored_barrier()  # as _InfiniteBarrier calls it
    checks["world-gloo/monitored_barrier"] = store.add("before-lightning", 0) == size
    dist.monitored_barrier(lightning, timeout=datetime.timedelta(seconds=30))
    tensor = full(rank)
    dist.all_reduce(tensor, group=lightning)
    checks["world-gloo/all_reduce"] = torch.equal(tensor, full(sum(range(size))))
    checks["world-gloo/ranks"] = dist.get_process_group_ranks(lightning) == list(range(size))
    dist.destroy_process_group(lightning)
    tensor = full(1)
    dist.all_reduce(tensor)
    checks["world-gloo/destroyed-default-lives"] = torch.equal(tensor, full(size))

    plain = dist.new_group()
    tensor = full(rank + 1)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=plain)
    checks["world-default/all_reduce"] = torch.equal(tensor, full(size))
    dist.barrier(group=plain)

    store = dist.distributed_c10d._get_default_store()
    # A barrier lets no rank through before every rank has arrived.
    store.add("before-monitored", 1)
    dist.monitored_barrier(wait_all_ranks=True)
    checks["monitored/default-group"] = store.add("before-monitored", 0) == size

    members = [0, last]
    for name in ("default", "gloo"):
        sub = dist.new_group(ranks=members, backend=None if name == "default" else "gloo")
        key = f"subgroup-{name}"
        if rank not in members:
            checks[f"{key}/non-member"] = sub is dist.GroupMember.NON_GROUP_MEMBER
            continue
        checks[f"{key}/rank"] = dist.get_rank(sub) == members.index(rank)
        checks[f"{key}/size"] = dist.get_world_size(sub) == 2
        checks[f"{key}/ranks"] = dist.get_process_group_ranks(sub) == members
        tensor = full(rank + 1)
        dist.all_reduce(tensor, group=sub)
        checks[f"{key}/all_reduce"] = torch.equal(tensor, full(1 + last + 1))
        tensor = full(rank * 10)
        dist.broadcast(tensor, src=last, group=sub)
        checks[f"{key}/broadcast"] = torch.equal(tensor, full(last * 10))
        gathered: list[object] = [None, None]
        dist.all_gather_object(gathered, {"rank": rank}, group=sub)
        checks[f"{key}/all_gather_object"] = gathered == [{"rank": 0}, {"rank": last}]
        objects: list[object] = [f"from-{rank}", rank]
        dist.broadcast_object_list(objects, src=last, group=sub)
        checks[f"{key}/broadcast_object_list"] = objects == [f"from-{last}", last]
        store.add(f"{key}/before-monitored", 1)
        dist.monitored_barrier(group=sub, timeout=datetime.timedelta(seconds=30))
        checks[f"{key}/monitored_barrier"] = store.add(f"{key}/before-monitored", 0) == 2
        dist.barrier(group=sub)
        dist.destroy_process_group(sub)

    # new_subgroups_by_enumeration: every rank in exactly one of them.
    layout = [list(range(size - 1)), [last]]
    mine, _ = dist.new_subgroups_by_enumeration(layout)
    tensor = full(rank)
    dist.all_reduce(tensor, group=mine)
    own = next(group for group in layout if rank in group)
    checks["subgroups/all_reduce"] = torch.equal(tensor, full(sum(own)))

    if rank == last:
        store.set("greeting", f"hello from {last}")
    checks["store/get-from-another-rank"] = store.get("greeting") == f"hello from {last}".encode()
    store.add("arrived", 1)
    store.wait(["greeting"])
    dist.barrier()
    checks["store/add-from-every-rank"] = store.add("arrived", 0) == size
    if rank == 0:
        checks["store/compare_set"] = store.compare_set("token", "", "rank0") == b"rank0"
    dist.barrier()
    checks["store/compare_set-seen"] = store.get("token") == b"rank0"
    started = time.monotonic()
    try:
        store.wait(["never-set"], datetime.timedelta(seconds=1))
        checks["store/wait-has-a-deadline"] = False
    except dist.DistStoreError as exc:
        waited = time.monotonic() - started
        checks["store/wait-has-a-deadline"] = waited < 15 and "never-set" in str(exc)
        details["store/wait"] = f"{waited:.1f} s: {exc}"

    objects = [None] * size
    dist.all_gather_object(objects, rank * 2)
    checks["default/all_gather_object"] = objects == [r * 2 for r in range(size)]
    sent = [f"from-{rank}"]
    dist.broadcast_object_list(sent, src=last)
    checks["default/broadcast_object_list"] = sent == [f"from-{last}"]
    checks["default/ranks"] = dist.get_process_group_ranks(dist.group.WORLD) == list(range(size))


def monitored_missing(
    rank: int, size: int, checks: dict[str, bool], details: dict[str, str]
) -> None:
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        store.wait(["others-gave-up"], datetime.timedelta(seconds=60))  # arrive too late
    started = time.monotonic()
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=2))
        checks["monitored/raised"] = False
    except ringplug.BarrierTimeoutError as exc:
        waited = time.monotonic() - started
        checks["monitored/raised"] = True
        # Rank 1 came late; when it did, every other rank had given up already.
        blamed = [r for r in range(size) if r != 1] if rank == 1 else [1]
        named = ", ".join(map(str, blamed))
        checks["monitored/names-the-missing-rank"] = exc.caused_by == tuple(blamed) and (
            f"for rank(s) {named}, which never called it" in str(exc)
        )
        checks["monitored/within-its-timeout"] = 2 <= waited < 15
        checks["monitored/is-a-torch-error"] = isinstance(exc, RuntimeError)
        details["monitored"] = f"{waited:.1f} s: {exc}"
    if rank != 1:
        store.add("gave-up", 1)
        if store.add("gave-up", 0) == size - 1:
            store.set("others-gave-up", "1")
    tensor = full(rank)
    dist.all_reduce(tensor)
    checks["monitored/job-goes-on"] = torch.equal(tensor, full(sum(range(size))))


def subgroup_missing(
    rank: int, size: int, checks: dict[str, bool], details: dict[str, str]
) -> None:
    store = dist.distributed_c10d._get_default_store()
    # The group's own deadline, well inside RINGPLUG_TIMEOUT: rank 2 waits in the next
    # collective of every rank meanwhile, under RINGPLUG_TIMEOUT.
    pair = dist.new_group(ranks=[0, 1], timeout=datetime.timedelta(seconds=1))
    if rank == 0:
        started = time.monotonic()
        try:
            dist.all_reduce(full(1), group=pair)  # rank 1 never joins it
            checks["subgroup/raised"] = False
        except RuntimeError as exc:
            waited = time.monotonic() - started
            checks["subgroup/raised"] = True
            checks["subgroup/by-the-deadline"] = waited < 30  # the group's 1 s
            details["subgroup"] = f"{waited:.1f} s: {exc}"
        store.set("rank0-gave-up", "1")
    elif rank == 1:
        store.wait(["rank0-gave-up"], datetime.timedelta(seconds=60))
    tensor = full(rank)
    dist.all_reduce(tensor)  # the default group is unharmed
    checks["subgroup/job-goes-on"] = torch.equal(tensor, full(sum(range(size))))


SCENARIOS = {
    "calls": calls,
    "monitored-missing": monitored_missing,
    "subgroup-missing": subgroup_missing,
}


def main(scenario: str, start: str, outdir: Path) -> None:
    ringplug.init()
    if start == "strategy":
        backend.init_process_group()
    else:
        dist.init_process_group("ringplug")
    rank, size = ringplug.rank(), ringplug.size()
    checks: dict[str, bool] = {}
    details: dict[str, str] = {}
    SCENARIOS[scenario](rank, size, checks, details)
    dist.barrier()
    dist.destroy_process_group()
    (outdir / f"{scenario}-{start}-{rank}.json").write_text(
        json.dumps({"checks": checks, "details": details})
    )


if __name__ == "__main__":
    for run in sys.argv[2:]:
        main(*run.split(":"), Path(sys.argv[1]))
