"""Run ``ringplug-bench algorithms`` on the multi-host bed (network namespaces with their own
hostnames and sshd, `ringplug.bench.netbed`; needs root), so that the hierarchical
allreduce is measured against the flat ring and MPI's own Allreduce:

    sudo python tools/bed_algorithms.py --hosts 2 --per-host 2 --rate-gbit 1 \
        --json bed-2x2.json -- --sizes 4K,1M,64M --budget 2 --deadline 30

The words after ``--`` go to ``ringplug-bench algorithms``. The ranks' MPI traffic goes
over TCP between hosts (``UCX_TLS=tcp,self``), through shared memory within a host. The
links can be rate-shaped (``tbf``); a delay needs ``netem``, which not every kernel has.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from ringplug.bench.netbed import NetBed, Shape, uniform_hosts


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--per-host", type=int, default=2)
    parser.add_argument("--rate-gbit", type=float, default=0.0, help="0: unshaped")
    parser.add_argument("--delay-us", type=float, default=0.0, help="needs netem")
    parser.add_argument("--json", help="the bench's --json, written on host a")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("bench", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    if args.json:
        bench += ["--json", args.json]
    bed = NetBed(uniform_hosts(args.hosts), Shape(args.delay_us, args.rate_gbit))
    bed.start()
    try:
        print(f"# bed: {args.hosts} hosts x {args.per_host} ranks; links: {bed.shaping}")
        spec = ",".join(f"{bed.address(h.key)}:{args.per_host}" for h in bed.hosts)
        command = bed.command(
            bed.hosts[0].key,
            [sys.executable, "-m", "ringplug.run.cli", "--ssh-config-file", str(bed.ssh_config),
             "-H", spec, "-np", str(args.hosts * args.per_host),
             "-x", "UCX_TLS=tcp,self", "-x", "OMP_NUM_THREADS=1",
             sys.executable, "-m", "ringplug.bench.cli", "algorithms", *bench],
        )  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "RINGPLUG_MPIEXEC"}
        return subprocess.run(command, env=env, timeout=args.timeout, check=False).returncode
    finally:
        bed.stop()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
