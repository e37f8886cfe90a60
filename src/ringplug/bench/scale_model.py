"""The cost model of `ringplug-bench scale`: alpha per message, beta per byte, gamma per call
of Python, fitted by least squares to measured points, and what it predicts for large jobs.

A measured point is what one rank did in a timed operation (messages and bytes it sent,
Python calls it made) and the seconds it took; the model says
``seconds = alpha * messages + beta * bytes + gamma * calls``. The fit minimises the
squared *relative* error over the points (a 4 KiB call and a 64 MiB one count alike) with
every coefficient at least zero.

Two fits take this form: one of wall time (a network's alpha and beta, Python's gamma),
one of the CPU time a rank spends outside its waits (alpha and gamma are then the CPU of a
message and of a call; no bytes). The predictions put the fitted control plane (ringplug's
negotiation: ceil(log2 p) messages per cycle, and the cycle's CPU) next to a data plane
taken from published figures, for
Horovod's 512-GPU benchmark (:data:`HOROVOD_MODELS`, :data:`ROCE`) and for a CPU job whose
data plane is ringplug's ring on 10 Gbit/s links (:data:`CPU_JOB`). Every assumption is a
named constant below, with where it comes from.

Example:
    >>> points = [Point("a", 1, 0, 0, 2e-6), Point("b", 0, 1e6, 0, 1e-3), Point("c", 0, 0, 1, 5e-6)]
    >>> fit = fit_model(points)
    >>> round(fit.alpha * 1e6, 3), round(fit.beta * 1e9, 3), round(fit.gamma * 1e6, 3)
    (2.0, 1.0, 5.0)
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Point:
    """One measured operation of one rank: what it sent and called, and how long it took."""

    label: str
    messages: float
    bytes: float
    calls: float
    seconds: float


@dataclass(frozen=True)
class Fit:
    """The fitted coefficients (seconds per message, per byte, per Python call) and the
    relative error of the fit on each point it was fitted to."""

    alpha: float
    beta: float
    gamma: float
    errors: dict[str, float]

    def predict(self, messages: float, nbytes: float, calls: float) -> float:
        return self.alpha * messages + self.beta * nbytes + self.gamma * calls

    @property
    def rms_error(self) -> float:
        values = list(self.errors.values())
        return math.sqrt(sum(e * e for e in values) / len(values)) if values else 0.0


def fit_model(points: list[Point]) -> Fit:
    """Least squares of relative error with alpha, beta, gamma >= 0: the unconstrained
    solution on every subset of the three terms, keeping the best one that has no negative
    coefficient (exact for three unknowns)."""
    if not points:
        raise ValueError("the model needs at least one measured point")
    rows = np.array([[p.messages, p.bytes, p.calls] for p in points], dtype=np.float64)
    seconds = np.array([p.seconds for p in points], dtype=np.float64)
    # Each row divided by its own measurement: the residual is the relative error.
    weighted = rows / seconds[:, None]
    target = np.ones(len(points))
    best: tuple[float, np.ndarray] | None = None
    for used in itertools.chain.from_iterable(
        itertools.combinations(range(3), k) for k in (3, 2, 1)
    ):
        columns = list(used)
        if not weighted[:, columns].any():
            continue
        solution, *_ = np.linalg.lstsq(weighted[:, columns], target, rcond=None)
        if (solution < 0).any():
            continue
        coefficients = np.zeros(3)
        coefficients[columns] = solution
        residual = float(np.sum((weighted @ coefficients - target) ** 2))
        if best is None or residual < best[0] - 1e-15:
            best = (residual, coefficients)
    coefficients = best[1] if best is not None else np.zeros(3)
    predicted = rows @ coefficients
    errors = {p.label: float(predicted[i] / p.seconds - 1.0) for i, p in enumerate(points)}
    return Fit(float(coefficients[0]), float(coefficients[1]), float(coefficients[2]), errors)


def rounds(ranks: int) -> int:
    """Rounds of ringplug's negotiation on `ranks` ranks: ceil(log2 p)."""
    return math.ceil(math.log2(ranks)) if ranks > 1 else 0


@dataclass(frozen=True)
class Model:
    """A network the predictions assume (for its data plane)."""

    name: str
    parameters: int  # float32 gradients: 4 bytes each
    compute_s: float  # forward and backward of one step on one worker
    source: str

    @property
    def gradient_bytes(self) -> int:
        return 4 * self.parameters


# Horovod's benchmark (its README and docs/benchmarks.rst): 128 servers of 4 Pascal GPUs,
# RoCE at 25 Gbit/s, tf_cnn_benchmarks with --batch_size 64 per GPU; 90% scaling
# efficiency for Inception V3 and ResNet-101 at 512 GPUs (68% for VGG-16).
HOROVOD_EFFICIENCY = 0.90
HOROVOD_BATCH = 64
HOROVOD_MODELS = (
    Model(
        "ResNet-101",
        44_549_160,  # torchvision.models.resnet101's parameters
        HOROVOD_BATCH / 115.0,
        "torchvision parameter count; 115 images/s per P100 assumed: TensorFlow's published "
        "219 images/s for ResNet-50 (P100, batch 64, synthetic data) scaled by FLOPs "
        "(4.1 against 7.8 GFLOPs); Horovod's README measures 104 per GPU at 16 GPUs",
    ),
    Model(
        "Inception V3",
        27_161_264,  # torchvision.models.inception_v3's parameters (with the aux head)
        HOROVOD_BATCH / 142.0,
        "torchvision parameter count; 142 images/s per P100: TensorFlow's published "
        "benchmark (DGX-1, batch 64, synthetic data)",
    ),
)


@dataclass(frozen=True)
class Network:
    """The data plane the predictions assume: bus bandwidth and per-step latency."""

    name: str
    busbw_bytes_s: float
    latency_s: float
    source: str


ROCE = Network(
    "NCCL over 25 Gbit/s RoCE",
    0.9 * 25e9 / 8,
    5e-6,
    "assumed: 90% of the 25 Gbit/s line rate as NCCL's bus bandwidth across hosts (a ring's "
    "bandwidth is its slowest link, the NIC), 5 us per step (the issue's alpha); NCCL's "
    "trees give ceil(log2 p) steps each way",
)
CPU_LINK = Network(
    "ringplug's ring over 10 Gbit/s",
    10e9 / 8,
    0.0,  # the fitted alpha is used instead
    "the bed's shaped rate (10 Gbit/s); latency per message: the fitted alpha",
)
CPU_JOB = Model(
    "ResNet-50 on CPU hosts",
    25_557_032,  # torchvision.models.resnet50's parameters
    2.0,
    "assumed: a step of batch 32 on one many-core CPU host takes about 2 s",
)
# Gradients fuse into buffers of at most RINGPLUG_FUSION_THRESHOLD (64 MiB): a step
# negotiates one cycle per fused buffer, plus one.
FUSION_BYTES = 64 << 20
# The backward pass (about 2/3 of a step) overlaps the reduction of the gradients it has
# produced; the last buffer cannot overlap anything.
BACKWARD_SHARE = 2 / 3


@dataclass(frozen=True)
class Prediction:
    setting: str
    ranks: int
    engine_cpu_per_cycle_s: float
    control_s: float  # per step: the negotiation's messages and Python calls
    data_s: float  # per step: the data plane
    step_overhead_s: float  # what the step pays beyond its compute, with overlap
    efficiency: float  # compute / (compute + overhead), with overlap
    efficiency_no_overlap: float


def engine_cpu_per_cycle(cpu: Fit, ranks: int) -> float:
    """CPU seconds of one agreed cycle on `ranks` ranks, by the CPU fit: one Python call
    (the cycle) and its ceil(log2 p) negotiation messages."""
    return cpu.gamma + cpu.alpha * rounds(ranks)


def predict(
    wall: Fit, cpu: Fit, model: Model, network: Network, ranks: int, setting: str
) -> Prediction:
    """A step of `model` on `ranks` workers: ringplug's control plane (per cycle, the CPU
    fit's cost of the cycle and ceil(log2 p) message latencies) and the data plane of
    `network`. A network with a latency of its own (NCCL's) gives the messages' latency;
    one without (ringplug's ring) takes the wall fit's alpha for both."""
    buffers = math.ceil(model.gradient_bytes / FUSION_BYTES)
    cycles = buffers + 1
    cpu_per_cycle = engine_cpu_per_cycle(cpu, ranks)
    message_s = network.latency_s if network.latency_s > 0 else wall.alpha
    control = cycles * (message_s * rounds(ranks) + cpu_per_cycle)
    share = 2 * (ranks - 1) / ranks * model.gradient_bytes
    if network.latency_s > 0:  # NCCL: trees for the latency, the ring's bandwidth
        latency = buffers * 2 * rounds(ranks) * network.latency_s
    else:  # ringplug's ring: 2 (p - 1) messages per buffer
        latency = buffers * 2 * (ranks - 1) * wall.alpha
    data = share / network.busbw_bytes_s + latency
    exposed_data = max(data - BACKWARD_SHARE * model.compute_s, data / buffers)
    overhead = control + exposed_data
    return Prediction(
        setting,
        ranks,
        cpu_per_cycle,
        control,
        data,
        overhead,
        model.compute_s / (model.compute_s + overhead),
        model.compute_s / (model.compute_s + control + data),
    )


def predictions(wall: Fit, cpu: Fit, ranks: tuple[int, ...] = (64, 512, 4096)) -> list[Prediction]:
    """Horovod's two 512-GPU models on NCCL over RoCE, and the CPU job, at each of `ranks`."""
    found = []
    for model in HOROVOD_MODELS:
        for p in ranks:
            found.append(predict(wall, cpu, model, ROCE, p, f"{model.name}, {ROCE.name}"))
    for p in ranks:
        found.append(predict(wall, cpu, CPU_JOB, CPU_LINK, p, f"{CPU_JOB.name}, {CPU_LINK.name}"))
    return found
