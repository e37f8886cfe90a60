"""``ringrun --check --bench``: the allreduce bandwidth the job's own ranks reach, measured.

Runs on every rank of a short job that ringrun starts with the job's own settings (hosts,
interfaces, rank count): an allreduce sweep from 64 KiB to 32 MiB on numpy buffers, timed
like nccl-tests (time, algbw, busbw), next to the ceiling it can be held against: on one
host the memory copy bandwidth (the ring's work is copies and adds in memory), across
hosts also the nominal speed of the fastest network interface the kernel reports. Rank 0
prints the table and remembers the peak bus bandwidth in the user's cache
(`ringplug.diagnose.ceiling_path`), where the training verdict (`ringplug.diagnose`)
finds it for jobs of the same ranks and hosts.

GPU buffers (NCCL) are not swept here yet; ``ringplug-bench allreduce --device cuda`` is.
"""

from __future__ import annotations

import socket
import statistics
import sys
import time

import numpy as np

from ringplug import core, diagnose
from ringplug.run.hosts.netinfo import candidate_interfaces, local_interfaces

# (bytes, timed iterations): few iterations for large sizes keep the sweep to seconds.
SWEEP = ((64 << 10, 40), (1 << 20, 20), (8 << 20, 8), (32 << 20, 5))
WARMUP = 2


def sweep() -> list[tuple[int, float]]:
    """(size in bytes, median seconds per allreduce) for each size of `SWEEP`.

    Every rank runs the same iterations; each is timed from a barrier so that a rank that
    arrives late does not shorten the others' time.
    """
    rows = []
    for nbytes, iterations in SWEEP:
        buffer = np.ones(nbytes // 4, np.float32)
        name = f"ringplug.ceiling.{nbytes}"
        for _ in range(WARMUP):
            core.allreduce(buffer, "sum", out=buffer, name=name)
        times = []
        for _ in range(iterations):
            core.barrier()
            start = time.perf_counter()
            core.allreduce(buffer, "sum", out=buffer, name=name)
            times.append(time.perf_counter() - start)
        # The slowest rank's median: the collective is done when every rank is.
        slowest = core.allreduce(np.array([statistics.median(times)]), "max", name=f"{name}.time")
        rows.append((nbytes, float(slowest[0])))
    return rows


def memory_copy_bandwidth(nbytes: int = 32 << 20, repeats: int = 5) -> float:
    """Bytes per second one ``np.copyto`` of `nbytes` moves here (median of `repeats`)."""
    source = np.ones(nbytes, np.uint8)
    target = np.empty_like(source)
    np.copyto(target, source)  # fault the pages in first
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(target, source)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times)


def _busbw(nbytes: int, seconds: float, ranks: int) -> float:
    return 2 * (ranks - 1) / ranks * nbytes / seconds


def main() -> int:
    core.init()
    ranks, hosts = core.size(), core.allgather_object(socket.gethostname())
    if ranks < 2:
        print(
            "ringrun --check --bench: one rank has nothing to reduce with; give -np 2 or "
            "more (and -H for several hosts).",
            file=sys.stderr,
        )
        return 2
    rows = sweep()
    copy = memory_copy_bandwidth()
    if core.rank() != 0:
        return 0
    unique = sorted(set(hosts))
    header = f"{'size':>10}  {'time(us)':>10}  {'algbw(GB/s)':>11}  {'busbw(GB/s)':>11}"
    lines = [
        f"ringplug allreduce sweep: {ranks} ranks on {', '.join(unique)}, float32, sum",
        header,
    ]
    for nbytes, seconds in rows:
        algbw, busbw = nbytes / seconds, _busbw(nbytes, seconds, ranks)
        lines.append(
            f"{nbytes / 2**20:>6.2f} MiB  {seconds * 1e6:>10.1f}  "
            f"{algbw / 1e9:>11.2f}  {busbw / 1e9:>11.2f}"
        )
    peak_size, peak_time = max(rows, key=lambda row: _busbw(row[0], row[1], ranks))
    peak = _busbw(peak_size, peak_time, ranks)
    lines.append(
        f"peak bus bandwidth {peak / 1e9:.2f} GB/s at {peak_size / 2**20:.0f} MiB; "
        f"memory copy on {socket.gethostname()} {copy / 1e9:.2f} GB/s "
        f"(the ring reaches {peak / copy:.0%} of it)"
    )
    if len(unique) > 1:
        links = [i for i in candidate_interfaces(local_interfaces()) if i.speed_mbps > 0]
        if links:
            nominal = links[0].speed_mbps * 1e6 / 8
            lines.append(
                f"fastest interface here: {links[0].name} at {links[0].speed_mbps} "
                f"Mb/s nominal ({nominal / 1e9:.2f} GB/s): the sweep reaches "
                f"{peak / nominal:.0%} of it"
            )
        else:
            lines.append("the network interfaces' nominal speed is unknown here (sysfs)")
    path = diagnose.write_ceiling(
        ranks, unique, peak, memory_copy=copy, sweep=[[n, t] for n, t in rows]
    )
    lines.append(
        f"saved to {path}: training verdicts of {ranks}-rank jobs on these hosts compare against it"
    )
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
