"""Multi-rank worker: where Horovod's torch semantics differ from ringplug.torch's, the
Horovod API follows Horovod. Only ``hvd.*`` names, references computed here with numpy.

Integer Average and scale factors, alltoall's return forms and gradient, the averaged
allgather gradient, grouped collectives with autograd, join refusing allgather/broadcast,
unnamed calls lining up after a join and after a re-init, broadcast_optimizer_state on a
fresh optimizer with a frozen parameter, DistributedOptimizer's names, sparse gradients,
a name taken until its handle is synchronized.
``python hvd_semantics.py OUTDIR`` writes OUTDIR/semantics-<rank>.json: {check: true/false}.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from checklist import checker, raises

import ringplug.horovod.torch as hvd


def main(outdir: Path) -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    checks: dict[str, bool] = {}

    check = checker(checks)

    # Integers: each rank's values scaled in float64 and truncated toward zero before the
    # sum, the sum likewise after it (Average: by 1/size).
    ints = [np.array([-7, -3, 0, 5, 9, 100], np.int64) * (r + 1) for r in range(size)]
    mine = torch.from_numpy(ints[rank].copy())
    total = np.sum(ints, axis=0)
    for dtype in (torch.int32, torch.int64):
        x = mine.to(dtype)
        check(
            f"int-average/{dtype}",
            lambda x=x: (
                hvd.allreduce(x, op=hvd.Average).tolist()
                == np.trunc(total / size).astype(np.int64).tolist()
            ),
        )
        pre = np.sum([np.trunc(v * 0.3) for v in ints], axis=0).astype(np.int64)
        check(
            f"int-prescale/{dtype}",
            lambda x=x, pre=pre: (
                hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.3).tolist() == pre.tolist()
            ),
        )
        check(
            f"int-postscale/{dtype}",
            lambda x=x: (
                hvd.allreduce(x, op=hvd.Sum, postscale_factor=0.3).tolist()
                == np.trunc(total * 0.3).astype(np.int64).tolist()
            ),
        )
        check(
            f"int-average-dtype/{dtype}",
            lambda x=x, dtype=dtype: hvd.allreduce(x, average=True).dtype == dtype,
        )
    inplace = mine.to(torch.int32).clone()
    hvd.allreduce_(inplace, average=True)
    check(
        "int-average-in-place",
        lambda: inplace.tolist() == np.trunc(total / size).astype(np.int64).tolist(),
    )
    grouped = hvd.grouped_allreduce([mine, mine * 2], op=hvd.Average)
    check(
        "int-average-grouped",
        lambda: (
            [g.tolist() for g in grouped]
            == [
                np.trunc(total / size).astype(np.int64).tolist(),
                np.trunc(2 * total / size).astype(np.int64).tolist(),
            ]
        ),
    )
    rows = torch.arange(size * 3, dtype=torch.int64).reshape(size * 3, 1) * (rank + 1)
    block = hvd.reducescatter(rows, op=hvd.Average)
    whole = np.arange(size * 3).reshape(size * 3, 1) * sum(r + 1 for r in range(size))
    check(
        "int-average-reducescatter",
        lambda: (
            block.tolist()
            == np.trunc(whole[3 * rank : 3 * rank + 3] / size).astype(np.int64).tolist()
        ),
    )

    # alltoall: only the tensor without splits; (tensor, int32 splits) with them.
    even = torch.arange(size * 2, dtype=torch.float32) + 10 * rank
    got = hvd.alltoall(even)
    check(
        "alltoall-no-splits-tensor",
        lambda: (
            isinstance(got, torch.Tensor)
            and got.tolist() == [10 * s + 2 * rank + k for s in range(size) for k in range(2)]
        ),
    )
    uneven = torch.ones(size * (rank + 1), 2) * rank
    received, splits = hvd.alltoall(uneven, splits=[rank + 1] * size)
    check(
        "alltoall-splits-int32",
        lambda: (
            splits.dtype == torch.int32
            and splits.tolist() == [s + 1 for s in range(size)]
            and received.shape == (sum(s + 1 for s in range(size)), 2)
        ),
    )
    handle = hvd.alltoall_async(even)
    check(
        "alltoall-async-tuple",
        lambda: [t.dtype for t in hvd.synchronize(handle)] == [torch.float32, torch.int32],
    )
    leaf = (torch.arange(size * (rank + 1), dtype=torch.float64) + 1).requires_grad_()
    out, _ = hvd.alltoall(leaf, splits=torch.tensor([rank + 1] * size, dtype=torch.int32))
    (out * out).sum().backward()
    # d(sum out^2)/d leaf = 2 * leaf: each row's gradient comes back from where it went.
    check("alltoall-grad", lambda: torch.equal(leaf.grad, 2 * leaf.detach()))
    check(
        "alltoall-float-splits-refused",
        lambda: raises(lambda: hvd.alltoall(even, torch.ones(size)), ValueError, "int"),
    )

    # allgather's gradient: this rank's rows of the average of the ranks' gradients.
    g = torch.full((rank + 1, 2), 1.0, requires_grad=True)
    gathered = hvd.allgather(g)
    weights = torch.arange(gathered.shape[0], dtype=torch.float32).reshape(-1, 1) * (rank + 1)
    (gathered * weights).sum().backward()
    start = sum(r + 1 for r in range(rank))
    mean_factor = sum(r + 1 for r in range(size)) / size
    expected = [[(start + i) * mean_factor] * 2 for i in range(rank + 1)]
    check("allgather-grad-average", lambda: np.allclose(g.grad.numpy(), expected))
    a = torch.full((rank + 1,), 1.0, requires_grad=True)
    b = torch.full((2, 3), float(rank), requires_grad=True)
    ga, gb = hvd.grouped_allgather([a, b])
    (ga.sum() * 2 + gb.sum() * 3).backward()
    check(
        "grouped-allgather",
        lambda: ga.shape == (sum(r + 1 for r in range(size)),) and gb.shape == (2 * size, 3),
    )
    check(
        "grouped-allgather-grad",
        lambda: a.grad.tolist() == [2.0] * (rank + 1) and b.grad.tolist() == [[3.0] * 3] * 2,
    )

    # grouped allreduce and reducescatter with autograd (Sum: the gradient summed too).
    p = torch.ones(3, requires_grad=True)
    q = torch.ones(2, 2, requires_grad=True)
    rp, rq = hvd.grouped_allreduce([p, q], op=hvd.Sum)
    (rp.sum() * (rank + 1) + rq.sum()).backward()
    check(
        "grouped-allreduce-grad",
        lambda: (
            p.grad.tolist() == [float(sum(r + 1 for r in range(size)))] * 3
            and q.grad.tolist() == [[float(size)] * 2] * 2
        ),
    )
    s = torch.ones(size * 2, 3, requires_grad=True)
    part = hvd.reducescatter(s, op=hvd.Sum)
    (part * (rank + 1)).sum().backward()
    # Rows of rank r's block reach every rank's input, weighted by r + 1.
    grad_rows = [[float((r + 1) * size)] * 3 for r in range(size) for _ in range(2)]
    check(
        "reducescatter-grad",
        lambda: part.tolist() == [[float(size)] * 3] * 2 and s.grad.tolist() == grad_rows,
    )
    blocks = hvd.grouped_reducescatter(
        [torch.ones(size, 2), torch.ones(size * 2)], op=hvd.Sum, postscale_factor=0.5
    )
    check(
        "grouped-reducescatter",
        lambda: [b.tolist() for b in blocks] == [[[size * 0.5] * 2], [size * 0.5] * 2],
    )

    # sparse_allreduce_async: the same values as a dense allreduce.
    dense = torch.zeros(5, 3)
    dense[rank % 5] = float(rank + 1)
    dense[4] = 1.0
    wait = hvd.sparse_allreduce_async(dense.to_sparse(), name="sparse", op=hvd.Average)
    check(
        "sparse-allreduce",
        lambda: torch.allclose(wait().to_dense(), hvd.allreduce(dense, op=hvd.Average)),
    )

    # A failed call leaves the ranks in step for the unnamed calls that follow.
    check(
        "mismatch-raises",
        lambda: raises(lambda: hvd.allreduce(torch.ones(2 + rank)), RuntimeError, "rank"),
    )
    check("in-step-after-mismatch", lambda: hvd.allgather_object(rank) == list(range(size)))

    # join: allgather and broadcast fail on every rank while a rank has joined; allreduce
    # runs (the joined rank adds zeros); unnamed calls after join() line up again.
    named = hvd.allreduce(torch.ones(2), name="cached", op=hvd.Sum)  # a cache slot before
    if rank == 0:
        last = hvd.join()
    else:
        check(
            "join-allgather-refused",
            lambda: raises(lambda: hvd.allgather(torch.ones(1)), RuntimeError, "joined"),
        )
        check(
            "join-broadcast-refused",
            lambda: raises(lambda: hvd.broadcast(torch.ones(1), 1), RuntimeError, "joined"),
        )
        summed = hvd.allreduce(torch.ones(2), name="cached", op=hvd.Sum)
        unnamed = hvd.allreduce(torch.ones(1), op=hvd.Sum)
        check(
            "join-allreduce-zeros",
            lambda: summed.tolist() == [size - 1.0] * 2 and unnamed.item() == size - 1,
        )
        last = hvd.join()
    check("join-last", lambda: last != 0 and named.tolist() == [float(size)] * 2)
    check("in-step-after-join", lambda: hvd.allgather_object(last) == [last] * size)

    # After a shutdown that left an unmatched unnamed call, init() lines the ranks up again.
    if rank == 0:
        orphan = hvd.allreduce_async(torch.ones(1))
    # Rank 0's orphan is in before anyone shuts down (a named call: an unnamed one would
    # meet the orphan's number on the other ranks).
    hvd.allgather_object(rank, name="before-shutdown")
    hvd.shutdown()
    if rank == 0:
        # Which shutdown rank 0's engine hears first is a race: its own (the orphan was
        # "shut down" by this rank) or a peer's (that rank "left the job" while this one
        # waited in the orphan). Either is an error that names why; a hang or a result is not.
        try:
            hvd.synchronize(orphan)
            said = "returned"
        except RuntimeError as exc:
            said = str(exc)
        print(f"rank 0's orphan at shutdown: {said}", file=sys.stderr)
        check(
            "orphan-fails-at-shutdown",
            lambda: "(by this rank)" in said or said.startswith("rank ") and "left the job" in said,
        )
    hvd.init()
    check(
        "in-step-after-reinit",
        lambda: (
            hvd.allreduce(torch.ones(1) * (rank + 1), op=hvd.Sum).item()
            == sum(r + 1 for r in range(size))
        ),
    )

    # broadcast_optimizer_state on a fresh optimizer: one zero step makes its state; a
    # frozen parameter gets no gradient.
    class Frozen(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.index = torch.nn.Parameter(torch.tensor([1, 3]), requires_grad=False)
            self.weight = torch.nn.Parameter(torch.full((4,), float(rank)))

    model = Frozen()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4 * (rank + 1)),
        named_parameters=model.named_parameters(),
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    check(
        "optimizer-state-created",
        lambda: (
            model.index.grad is None
            and model.weight.grad is not None
            and "momentum_buffer" in opt.state[model.weight]
        ),
    )
    check(
        "optimizer-hyperparameters-from-root", lambda: opt.param_groups[0]["weight_decay"] == 1e-4
    )

    # Names: generated without named_parameters (unique, the same on every rank);
    # duplicates refused; a step after a manual synchronize() warns.
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    groups = [{"params": net[0].parameters()}, {"params": net[1].parameters()}]
    unnamed_opt = hvd.DistributedOptimizer(torch.optim.SGD(groups, lr=0.1))
    names = sorted(unnamed_opt._parameter_names.values())
    check(
        "generated-names",
        lambda: len(set(names)) == 4 and hvd.allgather_object(names) == [names] * size,
    )
    twins = [torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)]
    check(
        "duplicate-names-refused",
        lambda: raises(
            lambda: hvd.DistributedOptimizer(
                torch.optim.SGD([p for m in twins for p in m.parameters()], lr=0.1),
                named_parameters=[kv for m in twins for kv in m.named_parameters()],
            ),
            ValueError,
            "duplicate",
        ),
    )
    net(torch.ones(2, 3)).sum().backward()
    unnamed_opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        unnamed_opt.step()
    check(
        "step-after-synchronize-warns",
        lambda: any("skip_synchronize" in str(w.message) for w in caught),
    )

    # Sparse gradients (SparseAdam needs them sparse): reduced and handed back sparse.
    embedding = torch.nn.Embedding(10, 3, sparse=True)
    hvd.broadcast_parameters(embedding.state_dict(), root_rank=0)
    sparse_opt = hvd.DistributedOptimizer(
        torch.optim.SparseAdam(list(embedding.parameters())),
        named_parameters=embedding.named_parameters(),
    )
    embedding(torch.tensor([[rank, 5]])).sum().backward()
    sparse_opt.synchronize()
    grad = embedding.weight.grad
    with sparse_opt.skip_synchronize():
        sparse_opt.step()
    expected_rows = {r: 1.0 / size for r in range(size)}
    expected_rows[5] = expected_rows.get(5, 0.0) + 1.0
    dense_grad = grad.to_dense()
    check("sparse-grad-stays-sparse", lambda: grad.is_sparse)
    check(
        "sparse-grad-averaged",
        lambda: all(np.allclose(dense_grad[r].numpy(), v) for r, v in expected_rows.items()),
    )
    weights = hvd.allgather(embedding.weight.detach().reshape(1, -1))
    check("sparse-ranks-identical", lambda: all(torch.equal(weights[0], w) for w in weights))

    # A name stays taken until the program synchronizes its handle, whatever the timing
    # (Horovod's duplicate-name tests): the last rank submits after the others, so its first
    # operation can run at once; once the engine has run it on every rank, a second
    # submission of the name is still refused, and another kind may take the name.
    late = size - 1
    if rank != late:
        first = hvd.allreduce_async(torch.ones(1), name="twice", op=hvd.Sum)
    hvd.barrier()
    if rank == late:
        first = hvd.allreduce_async(torch.ones(1), name="twice", op=hvd.Sum)
    ran = threading.Event()
    first._parts._handle.add_done_callback(lambda _: ran.set())  # the engine ran it
    ended = ran.wait(60)
    hvd.barrier()  # the engine ran it on every rank
    check(
        "name-taken-until-synchronized",
        lambda: (
            ended
            and raises(
                lambda: hvd.allreduce_async(torch.ones(1), name="twice"), ValueError, "twice"
            )
        ),
    )
    other_kind = hvd.allgather_async(torch.full((1,), float(rank)), name="twice")
    check(
        "name-free-for-another-kind", lambda: hvd.synchronize(other_kind).tolist() == [*range(size)]
    )
    check("name-synchronized-result", lambda: hvd.synchronize(first).item() == size)
    again = hvd.allreduce_async(torch.ones(1), name="twice", op=hvd.Sum)
    check("name-free-once-synchronized", lambda: hvd.synchronize(again).item() == size)
    polled = hvd.allreduce_async(torch.ones(1), name="polled", op=hvd.Sum)
    deadline = time.monotonic() + 60  # the Horovod idiom: poll until done, then reuse the name
    while not hvd.poll(polled) and time.monotonic() < deadline:
        pass
    check(
        "name-free-once-polled-done",
        lambda: hvd.synchronize(hvd.allreduce_async(torch.ones(1), name="polled")).item() == 1,
    )

    # Names Horovod has that ringplug answers or refuses.
    check("ccl-ddl-built", lambda: hvd.ccl_built() is False and hvd.ddl_built() is False)
    check("is-homogeneous", lambda: hvd.is_homogeneous() is True)
    check("elastic-there", lambda: callable(hvd.elastic.run) and callable(hvd.elastic.TorchState))
    check(
        "internal-error-is-runtime-error",
        lambda: issubclass(hvd.HorovodInternalError, RuntimeError),
    )

    process_sets(check, rank, size)

    (outdir / f"semantics-{rank}.json").write_text(json.dumps(checks))


def process_sets(check, rank: int, size: int) -> None:
    """Horovod's process sets: even and odd ranks, each set's collectives against numpy,
    root ranks counted in the world, non-members refused, the optimizer on one set."""
    loose = hvd.ProcessSet([0])
    check("ps-unregistered", lambda: loose.process_set_id is None and loose.size() is None)
    evens = hvd.add_process_set(range(0, size, 2))
    odds = hvd.add_process_set(hvd.ProcessSet(range(1, size, 2)))
    mine, other = (evens, odds) if rank % 2 == 0 else (odds, evens)
    members = list(mine.ranks)
    check("ps-ids", lambda: (evens.process_set_id, odds.process_set_id) == (1, 2))
    check(
        "ps-rank-size-included",
        lambda: (
            mine.rank() == members.index(rank)
            and mine.size() == len(members)
            and mine.included() is True
            and other.included() is False
        ),
    )
    check("ps-rank-outside-refused", lambda: raises(other.rank, ValueError, "not part"))
    check(
        "ps-duplicate-refused",
        lambda: raises(lambda: hvd.add_process_set(range(size)), ValueError, "duplicate"),
    )
    # Ranks that pass different sets: the same error on every rank, none left waiting.
    check(
        "ps-ranks-disagree-refused",
        lambda: raises(lambda: hvd.add_process_set([rank]), hvd.HorovodInternalError, "disagree"),
    )
    mine_t = torch.tensor([float(rank + 1)])
    check(
        "ps-allreduce-sum",
        lambda: (
            hvd.allreduce(mine_t, op=hvd.Sum, process_set=mine).item()
            == sum(r + 1 for r in members)
        ),
    )
    # Horovod's arguments by position, the set last: it reaches the set's engine too.
    check(
        "ps-allreduce-set-by-position",
        lambda: (
            hvd.allreduce(mine_t, None, None, hvd.Compression.none, hvd.Sum, 1.0, 1.0, mine).item()
            == sum(r + 1 for r in members)
        ),
    )
    check(
        "ps-allreduce-average",
        lambda: hvd.allreduce(mine_t, process_set=mine).item() == np.mean([r + 1 for r in members]),
    )
    check(
        "ps-nonmember-refused",
        lambda: raises(lambda: hvd.allreduce(mine_t, process_set=other), ValueError, "member"),
    )
    check(
        "ps-grouped-allreduce-async",
        lambda: (
            [
                t.tolist()
                for t in hvd.synchronize(
                    hvd.grouped_allreduce_async(
                        [mine_t, 2 * mine_t], op=hvd.Sum, process_set=mine, name="ps.grouped"
                    )
                )
            ]
            == [[sum(r + 1 for r in members)], [2 * sum(r + 1 for r in members)]]
        ),
    )
    # The same name in flight on the set and on the world at once.
    on_set = hvd.allreduce_async(torch.ones(1), op=hvd.Sum, name="ps.same", process_set=mine)
    on_world = hvd.allreduce_async(torch.ones(1), op=hvd.Sum, name="ps.same")
    check(
        "ps-same-name-on-set-and-world",
        lambda: (
            (hvd.synchronize(on_set).item(), hvd.synchronize(on_world).item())
            == (len(members), size)
        ),
    )
    # Horovod's root_rank is a world rank: the set's last member (world rank 2 of {0, 2}).
    root = members[-1]
    check(
        "ps-broadcast-world-root",
        lambda: hvd.broadcast(torch.tensor([float(rank)]), root, process_set=mine).item() == root,
    )
    check(
        "ps-broadcast-inplace-world-root",
        lambda: hvd.broadcast_(torch.tensor([float(rank)]), root, process_set=mine).item() == root,
    )
    check(
        "ps-broadcast-inplace-set-by-position",
        lambda: hvd.broadcast_(torch.tensor([float(rank)]), root, None, mine).item() == root,
    )
    check(
        "ps-broadcast-root-outside-refused",
        lambda: raises(
            lambda: hvd.broadcast(mine_t, other.ranks[0], process_set=mine),
            ValueError,
            "invalid root rank",
        ),
    )
    check(
        "ps-allgather",
        lambda: hvd.allgather(torch.tensor([rank]), process_set=mine).tolist() == members,
    )
    # Allgather's gradient: each rank's rows get the average over the set's members.
    gathered_from = torch.ones(1, requires_grad=True)
    weight = float((rank + 1) ** 2)
    (hvd.allgather(gathered_from, process_set=mine) * weight).sum().backward()
    check(
        "ps-allgather-gradient-averaged-over-the-set",
        lambda: gathered_from.grad.item() == np.mean([(r + 1) ** 2 for r in members]),
    )
    check(
        "ps-reducescatter",
        lambda: (
            hvd.reducescatter(
                torch.full((2 * len(members),), rank + 1.0), op=hvd.Sum, process_set=mine
            ).tolist()
            == [float(sum(r + 1 for r in members))] * 2
        ),
    )
    check(
        "ps-alltoall",
        lambda: (
            hvd.alltoall(torch.tensor([rank] * len(members)), process_set=mine).tolist() == members
        ),
    )
    check(
        "ps-broadcast-object",
        lambda: hvd.broadcast_object({"r": rank}, root_rank=root, process_set=mine) == {"r": root},
    )
    check("ps-allgather-object", lambda: hvd.allgather_object(rank, process_set=mine) == members)
    params = {"w": torch.tensor([float(rank)])}
    hvd.broadcast_parameters(params, root_rank=root, process_set=mine)
    check("ps-broadcast-parameters", lambda: params["w"].item() == root)
    check("ps-barrier", lambda: hvd.barrier(process_set=mine) is None)

    # DistributedOptimizer on the even ranks: they step on their average; the odd ranks on
    # their own gradient (as Horovod: a rank outside the set does not reduce).
    w = torch.nn.Parameter(torch.ones(2))
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD([w], lr=1.0), named_parameters=[("w", w)], process_set=evens
    )
    optimizer.zero_grad()
    (w * (rank + 1)).sum().backward()
    optimizer.step()
    evens_mean = np.mean([r + 1 for r in evens.ranks])
    expected = 1 - (evens_mean if evens.included() else rank + 1)
    check("ps-optimizer", lambda: w.tolist() == [expected] * 2)

    check("ps-remove", lambda: hvd.remove_process_set(odds) and odds.process_set_id is None)
    check(
        "ps-removed-refused",
        lambda: raises(lambda: hvd.allreduce(mine_t, process_set=odds), ValueError, "registered"),
    )
    check(
        "ps-remove-global-is-false", lambda: hvd.remove_process_set(hvd.global_process_set) is False
    )
    hvd.remove_process_set(evens)
    given, rest = hvd.ProcessSet([0]), hvd.ProcessSet(range(1, size))
    hvd.init(process_sets=[given, rest])
    check(
        "ps-init-process-sets",
        lambda: (
            given.process_set_id is not None
            and hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=given).item() == 1
            if rank == 0
            else given.included() is False
        ),
    )
    check("ps-init-dynamic", lambda: hvd.init(process_sets="dynamic") is None)
    check("ps-remove-both", lambda: hvd.remove_process_set(given) and hvd.remove_process_set(rest))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
