"""Lightning's own Fabric examples, as shipped, under ``ringrun -np 2`` with nothing added but
``import ringplug``: the acceptance runs of Fabric's one-job set-up under ringrun (a Fabric
whose strategy would be one device becomes ``strategy="ring"``, a script without
``fabric.launch()`` runs, BatchNorm buffers stay rank 0's), to rerun by hand (not part of the
suite: it needs a checkout of Lightning and torchvision).

    python tests/acceptance/fabric_examples.py --python VENV/bin/python \\
        --lightning CHECKOUT_OF_pytorch-lightning [--control]

VENV needs ringplug[mpich,lightning], torchvision (torch 2.14.1 with torchvision 0.29.1),
torchmetrics and scikit-learn. Nothing is downloaded and nothing is written into the
checkout or this repository: everything lives in a new temporary folder, printed at the end.

- The examples are not copied: each is linked into a Lightning-shaped tree in the temporary
  folder, so that its ``Datasets`` folder (found relative to the file) is there too.
- MNIST is replaced by synthetic digits in MNIST's own idx files (`write_mnist`), 2,048
  training images so that an epoch on a CPU is short.
- CelebA is replaced by `StandInCelebA` (tests/acceptance/fabric_site/sitecustomize.py, on
  the ranks' PYTHONPATH): 48 synthetic faces with torchvision's interface, which also write
  down which rank read which image. The same file records a digest of each set-up module's
  parameters and buffers at the start of every forward.
- Each example runs twice: as one process (``python EXAMPLE``, no ringplug, its users'
  baseline) and on two ranks as
  ``ringrun -np 2 python -c "import ringplug, runpy, sys; sys.argv = [...]; runpy.run_path(...)"``.

Each run is checked as its users would check it: exit 0, the ranks log different losses on
about half the batches of the one-process run each, evaluation lines agree between ranks,
the checkpoint or images it saves are sound; and the ranks hold the same parameters and
buffers at every forward (gradients averaged, BatchNorm buffers rank 0's). ``--control`` adds
the image classifier on two ranks without ``import ringplug`` (two copies of one training),
which the checks must flag. A table of the runs and their wall times closes the output; the
exit code is the number of runs that failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from real_projects import write_mnist  # noqa: E402

SITE = Path(__file__).parent / "fabric_site"
MNIST_TRAIN, MNIST_TEST = 2048, 512
TIMEOUT = 900  # seconds a run may take
CELEBA_IMAGES = 48  # at most the DCGAN's batch of 128: one batch an epoch, one worker
PREFIX = re.compile(r"^\[(\d+)\] ?(.*)$")
TRAIN_LINE = re.compile(r"Train Epoch: \d+ \[\d+/\d+ \(\d+%\)\]\s+Loss: ([-\d.]+)")
DCGAN_LINE = re.compile(r"^\[\d+/\d+\]\[\d+/\d+\]\s+Loss_D: ([-\d.]+)\s+Loss_G: ([-\d.]+)")
EVALUATION_LINE = re.compile(r"(Test set: .*|For fold: .*)")

CHECKPOINT_CHECK = """\
import sys, torch
state = torch.load(sys.argv[1], weights_only=True)
bad = [name for name, value in state.items() if not value.float().isfinite().all()]
print(len(state), "tensors", "non-finite: " + ", ".join(bad) if bad else "all finite")
sys.exit(1 if bad or not state else 0)
"""

IMAGE_CHECK = """\
import sys
import numpy as np
from PIL import Image
for path in sys.argv[1:]:
    pixels = np.asarray(Image.open(path).convert("RGB"), dtype=float)
    if pixels.std() < 1:
        sys.exit(f"{path}: a flat image (std {pixels.std():.2f})")
print(len(sys.argv) - 1, "images")
"""


class Run:
    """One run of one example: its command, where it ran, and what its checks found."""

    def __init__(self, name: str, example: str, ranks: int, command: list[str], folder: Path):
        self.name, self.example, self.ranks, self.command = name, example, ranks, command
        self.folder = folder
        self.records = folder / "records"
        self.problems: list[str] = []
        self.facts: list[str] = []
        self.seconds = 0.0
        self.lines: dict[str, list[str]] = {}
        self.expect_problems = False  # a control: the checks must find something

    def go(self) -> None:
        self.folder.mkdir(parents=True)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(SITE), os.environ.get("PYTHONPATH")])),
            "FABRIC_EXAMPLES_RECORDS": str(self.records),
            "FABRIC_EXAMPLES_CELEBA_IMAGES": str(CELEBA_IMAGES),
        }
        started = time.monotonic()
        try:
            result = subprocess.run(
                self.command,
                cwd=self.folder,
                env=env,
                stdin=subprocess.DEVNULL,  # mpiexec reads standard input
                capture_output=True,
                text=True,
                timeout=TIMEOUT,
                check=False,
            )
            returncode, stdout, stderr = result.returncode, result.stdout, result.stderr
        except subprocess.TimeoutExpired as expired:
            returncode = f"none: stopped after {TIMEOUT} s"
            stdout, stderr = (
                text.decode(errors="replace") if isinstance(text, bytes) else text or ""
                for text in (expired.stdout, expired.stderr)
            )
        self.seconds = time.monotonic() - started
        output = re.sub(r"\x1b\[[0-9;]*m", "", stdout + stderr)
        (self.folder / "output.log").write_text(output)
        if returncode != 0:
            tail = " | ".join(output.strip().splitlines()[-3:])
            self.problems.append(f"exit code {returncode}: {tail}")
        self.lines = rank_lines(output, self.ranks)

    def rank_of(self, rank: str) -> list[str]:
        return self.lines.get(rank, [])


def rank_lines(output: str, ranks: int) -> dict[str, list[str]]:
    """Output lines by rank ("0", "1"; "solo" for one process), ringrun's '[r] ' removed."""
    lines: dict[str, list[str]] = defaultdict(list)
    for line in output.splitlines():
        match = PREFIX.match(line) if ranks > 1 else None
        if match:
            lines[match.group(1)].append(match.group(2))
        else:
            lines["solo" if ranks == 1 else "?"].append(line)
    return lines


def records(run: Run, kind: str) -> dict[str, list[list[dict]]]:
    """The stand-ins' records by rank: one list per process, in the order the processes
    started writing."""
    by_rank: dict[str, list[list[dict]]] = defaultdict(list)
    files = []
    for path in run.records.glob(f"{kind}-*.jsonl"):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        files.append((rows[0].get("time", 0.0), path.name.split("-")[1], rows))
    for _, rank, rows in sorted(files, key=lambda item: item[0]):
        by_rank[rank].append(rows)
    return by_rank


def ranks_of(run: Run) -> list[str]:
    return ["0", "1"] if run.ranks > 1 else ["solo"]


def check_forwards(run: Run) -> None:
    """Every rank saw the same parameters and buffers at the start of every forward."""
    forwards = {rank: sum(files, []) for rank, files in records(run, "forward").items()}
    if not forwards:
        run.problems.append("no forward recorded (the probe in fabric_site did not load)")
        return
    if any(not row["finite"] for rows in forwards.values() for row in rows):
        run.problems.append("non-finite parameters or buffers at a forward")
    if run.ranks == 1:
        run.facts.append(f"{len(forwards.get('solo', []))} forwards")
        return
    first, second = (forwards.get(rank, []) for rank in ("0", "1"))
    if len(first) != len(second):
        run.problems.append(f"forwards: rank 0 made {len(first)}, rank 1 {len(second)}")
    differing = [
        index
        for index, (a, b) in enumerate(zip(first, second, strict=False))
        if a["digest"] != b["digest"]
    ]
    if differing:
        row = first[differing[0]]
        run.problems.append(
            f"ranks held different parameters/buffers at {len(differing)} of {len(first)} "
            f"forwards, first at forward {differing[0]} (module {row['module']}, "
            f"{'training' if row['training'] else 'eval'})"
        )
    else:
        run.facts.append(f"parameters and buffers equal on both ranks at all {len(first)} forwards")


def check_mnist(run: Run, solo: Run | None) -> None:
    """The two MNIST examples: losses per rank, batches per rank, evaluation lines."""
    losses = {rank: [] for rank in ranks_of(run)}
    for rank in losses:
        losses[rank] = [float(m.group(1)) for m in map(TRAIN_LINE.search, run.rank_of(rank)) if m]
        if not losses[rank]:
            run.problems.append(f"rank {rank} logged no training loss")
    run.facts.append(
        "; ".join(
            f"rank {rank}: {len(values)} batches, first loss {values[0] if values else '-'}"
            for rank, values in losses.items()
        )
    )
    evaluations = {
        rank: [m.group(1) for m in map(EVALUATION_LINE.search, run.rank_of(rank)) if m]
        for rank in losses
    }
    if any(not lines for lines in evaluations.values()):
        run.problems.append("an evaluation line is missing")
    if run.ranks == 1:
        return
    if losses["0"] and losses["0"] == losses["1"]:
        run.problems.append("ranks 0 and 1 logged the same losses (each trained a copy)")
    elif losses["0"] and losses["1"] and losses["0"][0] == losses["1"][0]:
        run.problems.append("ranks 0 and 1 logged the same first loss")
    if solo is not None and solo.lines:
        whole = sum(1 for line in solo.rank_of("solo") if TRAIN_LINE.search(line))
        folds = max(1, sum(1 for line in solo.rank_of("solo") if "Working on fold" in line))
        for rank, values in losses.items():
            if abs(len(values) - whole / 2) > folds:  # one padded batch a loader
                run.problems.append(
                    f"rank {rank} ran {len(values)} batches, the one-process run {whole} "
                    f"(expected about {whole / 2:.0f} on each of 2 ranks)"
                )
    if evaluations["0"] != evaluations["1"]:
        run.problems.append(
            f"evaluation differs between ranks: {evaluations['0'][:1]} / {evaluations['1'][:1]}"
        )
    else:
        run.facts.append(f"evaluation equal on both ranks: {evaluations['0'][:1]}")


def check_checkpoint(run: Run, python: str) -> None:
    """The classifier's ``--save-model`` file (written once, through ``fabric.save``)."""
    path = run.folder / "mnist_cnn.pt"
    if not path.exists():
        run.problems.append("no mnist_cnn.pt")
        return
    result = subprocess.run(
        [python, "-c", CHECKPOINT_CHECK, str(path)], capture_output=True, text=True, check=False
    )
    (run.problems if result.returncode else run.facts).append(
        f"mnist_cnn.pt: {(result.stdout + result.stderr).strip().splitlines()[-1]}"
    )


def check_dcgan(run: Run, solo: Run | None, python: str) -> None:
    """The DCGAN: rank 0's stats lines, which images each rank read, its images, buffers."""
    stats = [m for m in map(DCGAN_LINE.search, run.rank_of("0" if run.ranks > 1 else "solo")) if m]
    if not stats:
        run.problems.append("no 'Loss_D ... Loss_G' line")
    else:
        run.facts.append(
            f"{len(stats)} stats lines, first Loss_D {stats[0].group(1)} Loss_G {stats[0].group(2)}"
        )
    if run.ranks > 1 and any(DCGAN_LINE.search(line) for line in run.rank_of("1")):
        run.problems.append("rank 1 printed fabric.print's lines")
    served = records(run, "served")
    # Per rank: the first process is the example's look at one batch before
    # setup_dataloaders; each later one is an epoch (one batch, read by one worker).
    epochs = {
        rank: [{row["index"] for row in rows} for rows in served.get(rank, [])[1:]]
        for rank in ranks_of(run)
    }
    run.facts.append(
        "images read per epoch: "
        + "; ".join(f"rank {rank}: {[len(e) for e in sets]}" for rank, sets in epochs.items())
    )
    if run.ranks > 1:
        first, second = epochs["0"], epochs["1"]
        if not first or len(first) != len(second):
            run.problems.append(f"epochs read: rank 0 {len(first)}, rank 1 {len(second)}")
        for number, (a, b) in enumerate(zip(first, second, strict=False)):
            if a & b or len(a | b) != CELEBA_IMAGES:
                run.problems.append(
                    f"epoch {number}: ranks read {len(a)} and {len(b)} images, {len(a & b)} "
                    f"in common, {len(a | b)} of {CELEBA_IMAGES} in all (expected halves)"
                )
                break
        if solo is not None:
            alone = [
                {row["index"] for row in rows}
                for rows in records(solo, "served").get("solo", [])[1:]
            ]
            if len(alone) != len(first):
                run.problems.append(f"{len(first)} epochs, the one-process run {len(alone)}")
    forwards = sum(records(run, "forward").get("0" if run.ranks > 1 else "solo", []), [])
    tracked = {row["module"]: row["batches_tracked"] for row in forwards}
    run.facts.append(f"num_batches_tracked at the last forward, by module: {tracked}")
    folders = [p for p in (run.folder / "outputs-fabric").glob("*") if any(p.glob("fake-*.png"))]
    if len(folders) != 1:
        run.problems.append(f"{len(folders)} output folders with generated images (expected 1)")
        return
    images = sorted(folders[0].glob("*.png"))
    if len([p for p in images if p.name.startswith("fake-")]) < 2:
        run.problems.append(f"generated images: {[p.name for p in images]} (expected 2 or more)")
    result = subprocess.run(
        [python, "-c", IMAGE_CHECK, *map(str, images)], capture_output=True, text=True, check=False
    )
    (run.problems if result.returncode else run.facts).append(
        f"{[p.name for p in images]}: {(result.stdout + result.stderr).strip().splitlines()[-1]}"
    )


def rank_command(
    python: str, ringrun: str, example: Path, arguments: list[str], ring: bool
) -> list[str]:
    """The example on two ranks, run as its own __main__ after ``import ringplug``."""
    imports = "import ringplug, runpy, sys" if ring else "import runpy, sys"
    argv, path = json.dumps([str(example), *arguments]), json.dumps(str(example))
    code = f'{imports}; sys.argv = {argv}; runpy.run_path({path}, run_name="__main__")'
    return [ringrun, "-np", "2", python, "-c", code]


def link_examples(checkout: Path, tree: Path) -> dict[str, Path]:
    """Each example linked (not copied) into TREE/examples/fabric/<name>/: its relative
    paths (``../../../Datasets``) then land in TREE."""
    linked = {}
    for name in ("image_classifier", "kfold_cv", "dcgan"):
        source = checkout / "examples" / "fabric" / name / "train_fabric.py"
        if not source.exists():
            raise SystemExit(
                f"{source} not found: --lightning must be a checkout of pytorch-lightning"
            )
        target = tree / "examples" / "fabric" / name / "train_fabric.py"
        target.parent.mkdir(parents=True)
        target.symlink_to(source)
        linked[name] = target
    return linked


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", required=True, help="the venv's interpreter")
    parser.add_argument(
        "--lightning", required=True, type=Path, help="a checkout of pytorch-lightning"
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="also run the image classifier on 2 ranks without import ringplug; it must be flagged",
    )
    args = parser.parse_args()
    python = args.python
    ringrun = str(Path(python).with_name("ringrun"))
    work = Path(tempfile.mkdtemp(prefix="fabric-examples-"))
    examples = link_examples(args.lightning.resolve(), work / "lightning")
    write_mnist(work / "lightning" / "Datasets", train=MNIST_TRAIN, test=MNIST_TEST)

    plan = [
        ("image_classifier", ["--epochs", "1", "--log-interval", "1", "--save-model"]),
        ("kfold_cv", ["--epochs", "1", "--folds", "2", "--log-interval", "1"]),
        ("dcgan", []),
    ]
    runs: list[Run] = []
    for name, arguments in plan:
        example = examples[name]
        solo = Run(
            f"{name}-python", name, 1, [python, str(example), *arguments], work / f"{name}-python"
        )
        ring = Run(
            f"{name}-ringrun-2",
            name,
            2,
            rank_command(python, ringrun, example, arguments, ring=True),
            work / f"{name}-ringrun-2",
        )
        pair = [solo, ring]
        if name == "image_classifier" and args.control:
            control = Run(
                f"{name}-ringrun-2-no-import",
                name,
                2,
                rank_command(python, ringrun, example, arguments, ring=False),
                work / f"{name}-ringrun-2-no-import",
            )
            control.expect_problems = True
            pair.append(control)
        for run in pair:
            run.go()
            if run.lines:
                check_forwards(run)
                if name == "dcgan":
                    check_dcgan(run, solo if run is not solo else None, python)
                else:
                    check_mnist(run, solo if run is not solo else None)
                if name == "image_classifier":
                    check_checkpoint(run, python)
            report(run)
            runs.append(run)

    print(f"\n{'run':36} {'ranks':>5} {'wall':>8}  result")
    for run in runs:
        print(f"{run.name:36} {run.ranks:5} {run.seconds:6.1f} s  {verdict(run)}")
    print(f"\ncommands, logs and outputs: {work}")
    return sum(failed(run) for run in runs)


def failed(run: Run) -> bool:
    if run.expect_problems:  # a control must run to its end and be caught by the checks
        return not run.problems or any(p.startswith("exit code") for p in run.problems)
    return bool(run.problems)


def verdict(run: Run) -> str:
    if run.expect_problems:
        return "FAILED: not a clean control" if failed(run) else "flagged, as it must be"
    return "FAILED" if run.problems else "ok"


def report(run: Run) -> None:
    print(f"== {run.name}  ({run.seconds:.1f} s)", flush=True)
    print("   " + shlex.join(run.command))
    for fact in run.facts:
        print(f"   {fact}")
    for problem in run.problems:
        print(f"   {'flagged' if run.expect_problems else 'PROBLEM'}: {problem}")
    (run.folder / "command.txt").write_text(shlex.join(run.command) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
