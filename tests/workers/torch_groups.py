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
- ``sets``: groups over some of the ranks on the core's process sets: every collective kind
  against numpy, overlapping groups in flight at once, ``new_subgroups``, a 2 x 2
  ``DeviceMesh`` with DTensor (4 ranks), bad groups refused; no gloo group anywhere.
- ``frozen``: rank 2 of the group [1, 2] stops calling (3 ranks, small stall settings): rank
  1's monitored barrier and all_reduce fail naming world rank 2 and the set; the job goes on.
- ``missing``: rank 2 never calls ``new_group([0, 1, 2], use_local_synchronization=True)``
  (3 ranks, after ``frozen``): ranks 0 and 1 fail after RINGPLUG_TIMEOUT naming it.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import ringplug
from ringplug.core import runtime
from ringplug.core.process_sets import all_process_sets
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


def _on(group: object, rank: int, members: list[int]) -> dict[str, bool]:
    """What a group over `members` must be on every rank: a ringplug group over a process
    set of exactly those ranks on its members, torch's NON_GROUP_MEMBER elsewhere."""
    if rank not in members:
        return {"non-member": group is dist.GroupMember.NON_GROUP_MEMBER}
    return {
        "on-ringplug": isinstance(group, backend.RingProcessGroup)
        and dist.get_backend(group) == "ringplug"
        and group.process_set is not None
        and list(group.process_set.ranks) == members,
        "rank-and-size": (dist.get_rank(group), dist.get_world_size(group))
        == (members.index(rank), len(members)),
    }


def every_kind(group: object, rank: int, members: list[int]) -> dict[str, bool]:
    """Every collective kind on `group` (members only), each against numpy's result from
    every member's input; the roots are the group's last member, which is not its rank 0."""
    k, me, root = len(members), members.index(rank), members[-1]

    def values(r: int, n: int = 4) -> np.ndarray:
        return np.arange(n, dtype=np.float64) * (r + 1) + 10 * r

    def tensor(r: int, n: int = 4) -> torch.Tensor:
        return torch.from_numpy(values(r, n).copy())

    def same(t: torch.Tensor, want: np.ndarray) -> bool:
        return t.shape == want.shape and np.allclose(t.numpy(), want, rtol=0, atol=1e-12)

    inputs = np.stack([values(r) for r in members])
    found: dict[str, bool] = {}
    for op, reduce in [("sum", np.sum), ("avg", np.mean), ("max", np.max)]:
        t = tensor(rank)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op.upper()), group=group)
        found[f"all_reduce-{op}"] = same(t, reduce(inputs, axis=0))
    t = tensor(rank)
    dist.broadcast(t, src=root, group=group)
    found["broadcast-root-not-group-rank-0"] = same(t, values(root))
    slots = [torch.zeros(4, dtype=torch.float64) for _ in members]
    dist.all_gather(slots, tensor(rank), group=group)
    found["all_gather"] = all(same(s, values(r)) for s, r in zip(slots, members, strict=True))
    out = torch.zeros(4 * k, dtype=torch.float64)
    dist.all_gather_into_tensor(out, tensor(rank), group=group)
    found["all_gather_into_tensor"] = same(out, inputs.reshape(-1))
    wide = np.stack([values(r, 2 * k) for r in members])  # each member's input of 2k
    out = torch.zeros(2, dtype=torch.float64)
    dist.reduce_scatter_tensor(out, tensor(rank, 2 * k), group=group)
    found["reduce_scatter_tensor"] = same(out, wide.sum(axis=0)[2 * me : 2 * me + 2])
    out = torch.zeros(2, dtype=torch.float64)
    dist.reduce_scatter(out, list(tensor(rank, 2 * k).split(2)), group=group)
    found["reduce_scatter"] = same(out, wide.sum(axis=0)[2 * me : 2 * me + 2])
    t = tensor(rank)
    dist.reduce(t, dst=root, group=group)
    if rank == root:
        found["reduce-at-the-root"] = same(t, inputs.sum(axis=0))
    slots = [torch.zeros(4, dtype=torch.float64) for _ in members] if rank == root else None
    dist.gather(tensor(rank), slots, dst=root, group=group)
    if slots is not None:
        found["gather-at-the-root"] = all(
            same(s, values(r)) for s, r in zip(slots, members, strict=True)
        )
    out = torch.zeros(2, dtype=torch.float64)
    pieces = list(tensor(rank, 2 * k).split(2)) if rank == root else None
    dist.scatter(out, pieces, src=root, group=group)
    found["scatter"] = same(out, values(root, 2 * k)[2 * me : 2 * me + 2])
    out = torch.zeros(2 * k, dtype=torch.float64)
    dist.all_to_all_single(out, tensor(rank, 2 * k), group=group)
    found["all_to_all_single"] = same(
        out, np.concatenate([values(r, 2 * k)[2 * me : 2 * me + 2] for r in members])
    )
    # Uneven splits: member j sends j + 1 elements to each member.
    sizes = [me + 1] * k
    received = [members.index(r) + 1 for r in members]
    out = torch.zeros(sum(received), dtype=torch.float64)
    dist.all_to_all_single(out, tensor(rank, sum(sizes)), received, sizes, group=group)
    found["all_to_all_single-uneven"] = same(
        out,
        np.concatenate(
            [
                values(r, (j + 1) * k)[(j + 1) * me : (j + 1) * (me + 1)]
                for j, r in enumerate(members)
            ]
        ),
    )
    store = dist.distributed_c10d._get_default_store()
    key = f"barrier/{dist.get_process_group_ranks(group)}"
    store.add(key, 1)
    dist.barrier(group=group)
    found["barrier-lets-none-through-early"] = store.add(key, 0) >= k
    return found


def sets(rank: int, size: int, checks: dict[str, bool], details: dict[str, str]) -> None:
    """Groups over some of the ranks on core process sets: every kind, overlapping groups in
    flight at once, new_subgroups, a 2 x 2 DeviceMesh (4 ranks), and what is refused."""
    last = size - 1
    upper, pair = list(range(1, size)), [0, last]  # overlapping at the last rank
    groups = {"upper": (upper, dist.new_group(ranks=upper)), "pair": (pair, dist.new_group(pair))}
    for key, (members, group) in groups.items():
        for name, ok in _on(group, rank, members).items():
            checks[f"{key}/{name}"] = ok
        if rank in members:
            for name, ok in every_kind(group, rank, members).items():
                checks[f"{key}/{name}"] = ok
        else:  # torch's own answer outside a group: nothing happens, nothing hangs
            t = full(rank)
            checks[f"{key}/outside-untouched"] = dist.all_reduce(
                t, group=group
            ) is None and torch.equal(t, full(rank))

    # Collectives in flight on both groups and the world at once; the last rank, in both,
    # starts them in the other order.
    works, expected = [], []
    order = ["pair", "upper"] if rank == last else ["upper", "pair"]
    for key in order:
        members, group = groups[key]
        if rank in members:
            t = full(rank + 1)
            works.append((key, t, dist.all_reduce(t, group=group, async_op=True)))
            expected.append(sum(m + 1 for m in members))
    world = full(rank)
    works.append(("world", world, dist.all_reduce(world, async_op=True)))
    expected.append(sum(range(size)))
    for (key, t, work), want in zip(works, expected, strict=True):
        work.wait()
        checks[f"in-flight-at-once/{key}"] = torch.equal(t, full(want))

    # Point-to-point: the same refusal as on the world.
    if rank in pair:
        try:
            dist.send(full(1), dst=pair[1 - pair.index(rank)], group=groups["pair"][1])
            checks["pair/send-refused"] = False
        except NotImplementedError as exc:
            checks["pair/send-refused"] = "point-to-point messages are not supported" in str(exc)

    # Removing a group while a member has a collective in flight on it: refused on both.
    pair_group = groups["pair"][1]
    if rank in pair:
        late = full(1)
        work = dist.all_reduce(late, group=pair_group, async_op=True) if rank == 0 else None
        try:
            dist.destroy_process_group(pair_group)
            checks["pair/destroy-refused-while-pending"] = False
        except ringplug.RingplugError as exc:
            text = str(exc)
            checks["pair/destroy-refused-while-pending"] = (
                "Cannot remove process set" in text
                and f"world ranks 0, {last}" in text
                and "rank 0: 1 ('torch." in text
            )
            details["pair/destroy"] = text
        if rank == last:
            dist.all_reduce(late, group=pair_group)
        if work is not None:
            work.wait()
        checks["pair/late-all_reduce"] = torch.equal(late, full(2))
        dist.destroy_process_group(pair_group)
        checks["pair/destroyed-set-removed"] = pair_group.process_set not in (all_process_sets())

    # new_subgroups: pairs on 4 ranks, sets of one rank on 3.
    width = 2 if size % 2 == 0 else 1
    mine, subgroups = dist.new_subgroups(group_size=width)
    own = [r for r in range(size) if r // width == rank // width]
    checks["new_subgroups/count"] = len(subgroups) == size // width
    checks.update({f"new_subgroups/{n}": ok for n, ok in _on(mine, rank, own).items()})
    t = full(rank + 1)
    dist.all_reduce(t, group=mine)
    checks["new_subgroups/all_reduce"] = torch.equal(t, full(sum(r + 1 for r in own)))

    if size == 4:
        mesh_checks(rank, checks, details)

    # Bad groups: the same clear error on every rank concerned, nobody left waiting.
    def refused(key: str, call: object, error: type, *words: str) -> None:
        try:
            call()  # type: ignore[operator]
            checks[key] = False
        except error as exc:
            checks[key] = all(word in str(exc) for word in words)
            details[key] = str(exc)

    refused(
        "bad/ranks-disagree",
        lambda: dist.new_group([0, 1] if rank == 0 else [0, last]),
        ringplug.MismatchError,
        "rank 0 passed [0, 1]",
        f"passed [0, {last}]",
    )
    refused(
        "bad/sort_ranks-false",
        lambda: dist.new_group([last, 0], sort_ranks=False),
        ValueError,
        "sort_ranks=False",
        "increasing order",
    )
    local_sync(rank, size, checks, details, refused)
    try:  # torch refuses it on CPU before any backend sees it (no bound device)
        dist.split_group(split_ranks=[pair])
        checks["bad/split_group"] = False
    except (RuntimeError, NotImplementedError) as exc:
        checks["bad/split_group"] = True
        details["bad/split_group"] = str(exc)

    t = full(1)
    dist.all_reduce(t)
    checks["world-still-works"] = torch.equal(t, full(size))
    c10d = dist.distributed_c10d
    kinds = {type(pg).__name__ for pg in c10d._world.pg_map}
    checks["no-gloo-group"] = kinds == {"RingProcessGroup"}
    details["group-kinds"] = str(sorted(kinds))


def local_sync(rank: int, size: int, checks: dict[str, bool], details: dict[str, str], refused):
    """``new_group(use_local_synchronization=True)``, which only the members call: two
    disjoint groups made at once by different ranks (P = 0 and the last rank, Q = the ranks
    between), every kind on them against numpy, a group of every rank, removal among the
    members, and the bad inputs."""
    last = size - 1
    local = {"P": [0, last], "Q": list(range(1, last))}
    mine = "P" if rank in local["P"] else "Q"
    other = "Q" if mine == "P" else "P"
    members = local[mine]
    group = dist.new_group(members, use_local_synchronization=True)
    for name, ok in _on(group, rank, members).items():
        checks[f"local-{mine}/{name}"] = ok
    checks[f"local-{mine}/named-by-its-members"] = group.process_set.process_set_id == (
        "[" + ",".join(map(str, members)) + "]#0"
    )
    for name, ok in every_kind(group, rank, members).items():
        checks[f"local-{mine}/{name}"] = ok
    # The other group's ranks are not this rank's business: torch answers None at once.
    checks["local/other-group-is-none-here"] = (
        dist.new_group(local[other], use_local_synchronization=True) is None
    )
    everyone = dist.new_group(use_local_synchronization=True)
    t = full(rank + 1)
    dist.all_reduce(t, group=everyone)
    checks["local/every-rank"] = torch.equal(t, full(sum(range(1, size + 1)))) and (
        everyone.process_set is not None and everyone.process_set.members_only
    )
    process_set = group.process_set
    dist.destroy_process_group(group)
    checks[f"local-{mine}/destroyed-among-members"] = process_set not in all_process_sets()
    dist.destroy_process_group(everyone)
    if rank in local["P"]:
        refused(
            "local-bad/duplicate-ranks",  # torch's own check, before the backend
            lambda: dist.new_group([0, last, last], use_local_synchronization=True),
            ValueError,
            "duplicate",
        )
        refused(
            "local-bad/sort_ranks-false",
            lambda: dist.new_group([last, 0], sort_ranks=False, use_local_synchronization=True),
            ValueError,
            "sort_ranks=False",
        )


def mesh_checks(rank: int, checks: dict[str, bool], details: dict[str, str]) -> None:
    """A 2 x 2 DeviceMesh ("dp", "tp") on 4 ranks: its dimensions' groups, and DTensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    # The mesh is [[0, 1], [2, 3]]: "dp" runs down a column, "tp" along a row.
    dp = [rank % 2, rank % 2 + 2]
    tp = [rank - rank % 2, rank - rank % 2 + 1]
    for name, members in (("dp", dp), ("tp", tp)):
        group = mesh[name].get_group()
        checks.update({f"mesh/{name}/{n}": ok for n, ok in _on(group, rank, members).items()})
        t = full(rank + 1)
        dist.all_reduce(t, group=group)
        checks[f"mesh/{name}/all_reduce"] = torch.equal(t, full(sum(r + 1 for r in members)))
        slots = [torch.zeros(3) for _ in members]
        dist.all_gather(slots, full(rank), group=group)
        checks[f"mesh/{name}/all_gather"] = [s[0].item() for s in slots] == members
    whole = torch.arange(16.0).reshape(4, 4)
    sharded = distribute_tensor(whole, mesh, [Shard(0), Shard(1)])
    row, column = rank // 2, rank % 2
    checks["dtensor/shard"] = torch.equal(
        sharded.to_local(), whole[2 * row : 2 * row + 2, 2 * column : 2 * column + 2]
    )
    checks["dtensor/redistribute-replicate"] = torch.equal(
        sharded.redistribute(mesh, [Replicate(), Replicate()]).to_local(), whole
    )
    checks["dtensor/redistribute-shard-1"] = torch.equal(
        sharded.redistribute(mesh, [Shard(1), Replicate()]).to_local(),
        whole[:, 2 * row : 2 * row + 2],
    )


def frozen(rank: int, size: int, checks: dict[str, bool], details: dict[str, str]) -> None:
    """The group [1, 2] of 3 ranks: rank 2 stops calling its collectives; rank 1's
    monitored barrier names it, then the stall inspector reports and fails rank 1's
    all_reduce naming world rank 2 and the set (which it shuts down on both members, as a
    stall shuts down the world's engine); the job goes on."""
    store = dist.distributed_c10d._get_default_store()
    members = [1, 2]
    group = dist.new_group(ranks=members)
    if rank == 1:
        try:
            dist.monitored_barrier(group, timeout=datetime.timedelta(seconds=2))
            checks["frozen/monitored_barrier-raised"] = False
        except ringplug.BarrierTimeoutError as exc:
            text = str(exc)
            checks["frozen/monitored_barrier-names-rank-and-set"] = (
                exc.caused_by == (2,)
                and "for rank(s) 2, which never called it" in text
                and "process set 1 (world ranks 1, 2)" in text
            )
            details["monitored_barrier"] = text
        try:
            dist.all_reduce(full(1), group=group)  # rank 2 never joins it
            checks["frozen/all_reduce-raised"] = False
        except ringplug.StallError as exc:
            text = str(exc)
            checks["frozen/stall-error-names-rank-and-set"] = (
                "is ready on rank(s) 1 but not on rank(s) 2" in text
                and "process set 1 (world ranks 1, 2)" in text
            )
            details["stall"] = text
        store.set("rank1-gave-up", "1")
    else:  # rank 2 is frozen; rank 0 stays out of the world's collectives meanwhile
        store.wait(["rank1-gave-up"], datetime.timedelta(seconds=120))
    tensor = full(rank)
    dist.all_reduce(tensor)  # the world is unharmed
    checks["frozen/job-goes-on"] = torch.equal(tensor, full(sum(range(size))))
    if rank == 2:  # the stall shut the group down on both members alike
        try:
            dist.all_reduce(full(1), group=group)
            checks["frozen/group-shut-down-here-too"] = False
        except ringplug.StallError as exc:
            checks["frozen/group-shut-down-here-too"] = "process set 1" in str(exc)


def missing(rank: int, size: int, checks: dict[str, bool], details: dict[str, str]) -> None:
    """Fault injection: ranks 0 and 1 make ``new_group([0, 1, 2],
    use_local_synchronization=True)``, and rank 2 never calls it (it is blocked in work of
    its own until a file says they gave up): ranks 0 and 1 fail after RINGPLUG_TIMEOUT with
    `MembersMissingError` naming rank 2 and the set; rank 2 then calls, late, and fails at
    once naming ranks 0 and 1; the job goes on."""
    from ringplug.core.errors import MembersMissingError

    gave_up = OUTDIR / f"members-gave-up-{rank}"
    timeout = runtime.settings().timeout
    if rank in (0, 1):
        started = time.monotonic()
        try:
            dist.new_group([0, 1, 2], use_local_synchronization=True)
            checks["missing/raised"] = False
        except MembersMissingError as exc:
            waited = time.monotonic() - started
            text = str(exc)
            checks["missing/names-rank-and-set"] = (
                exc.caused_by == (2,)
                and "for rank(s) 2 to make process set [0,1,2]#0 (world ranks 0, 1, 2)" in text
                and "never called" in text
            )
            checks["missing/after-its-timeout"] = waited >= 0.9 * timeout
            checks["missing/is-a-timeout"] = isinstance(exc, TimeoutError)
            details["missing"] = f"{waited:.1f} s of {timeout:g}: {text}"
        gave_up.write_text("gave up")
    else:  # blocked elsewhere, never calling new_group, until both members gave up
        deadline = time.monotonic() + 180
        while not all((OUTDIR / f"members-gave-up-{r}").exists() for r in (0, 1)):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        # Then it calls, late: it finds their proposals, then their withdrawals, and fails
        # naming them ("gave up on it" is the withdrawals' error, never a wait's), not alone
        # in MPI_Comm_create_group until a watchdog ends the job.
        try:
            dist.new_group([0, 1, 2], use_local_synchronization=True)
            checks["missing/late-member-refused"] = False
        except MembersMissingError as exc:
            text = str(exc)
            named = (
                "rank 2 cannot make process set [0,1,2]#0 (world ranks 0, 1, 2): rank(s) 0, 1 "
                "gave up on it (rank 0 waited"
            )
            checks["missing/late-member-refused"] = (
                exc.caused_by == (0, 1)
                and named in text
                and f"rank 0 waited {timeout:g} s (RINGPLUG_TIMEOUT) for rank(s) 2" in text
                and "call it again on every member" in text
            )
            details["missing-late"] = text
    # Every member calls again, as the late member's error says: each member's count of
    # such sets moved on alike, so this one is made.
    group = dist.new_group([0, 1, 2], use_local_synchronization=True)
    tensor = full(rank)
    dist.all_reduce(tensor, group=group)
    checks["missing/every-member-tries-again-and-makes-it"] = torch.equal(tensor, full(3))
    tensor = full(rank)
    dist.all_reduce(tensor)
    checks["missing/job-goes-on"] = torch.equal(tensor, full(sum(range(size))))


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


SCENARIOS = {
    "calls": calls,
    "monitored-missing": monitored_missing,
    "sets": sets,
    "frozen": frozen,
    "missing": missing,
}
OUTDIR = Path(".")


def main(scenario: str, start: str, outdir: Path) -> None:
    global OUTDIR
    OUTDIR = outdir
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
