"""The cost models of `ringplug-bench scale`, fitted by least squares to measured points, and
what they predict for large jobs.

Two models, each fitted by minimising the squared *relative* error over its points (a 4 KiB
call and a 64 MiB one count alike) with every coefficient at least zero:

- **wall time** (:func:`fit_model`): a measured point is what one rank did in a timed
  operation (messages and bytes it sent, Python calls it made) and the seconds it took;
  ``seconds = alpha * messages + beta * bytes + gamma * calls`` (a network's alpha and
  beta, Python's gamma).
- **calls outside the waits** (:func:`fit_calls`): a point is one small step of one rank,
  agreed in one cycle (so many 4 KiB tensors), and the function calls it made outside its
  waits, counted by part: inside the agreement (``once + per_round * rounds``), inside
  recursive doubling (``per_round * rounds``) and the rest (``per_cycle + per_tensor *
  tensors``). The CPU is the calls times the CPU one call costs, measured where each
  rank has a core (:class:`CpuModel`): the calls do not change when ranks share cores;
  the CPU time of each does.

The predictions put the fitted control plane (ringplug's negotiation: ceil(log2 p)
messages per cycle, and the cycle's and the tensors' CPU) next to a data plane taken from
published figures, for Horovod's 512-GPU benchmark (:data:`HOROVOD_MODELS`, :data:`ROCE`)
and for a CPU job whose data plane is ringplug's ring on 10 Gbit/s links (:data:`CPU_JOB`).
Every assumption is a named constant below, with where it comes from.

Example:
    >>> points = [Point("a", 1, 0, 0, 2e-6), Point("b", 0, 1e6, 0, 1e-3), Point("c", 0, 0, 1, 5e-6)]
    >>> fit = fit_model(points)
    >>> round(fit.alpha * 1e6, 3), round(fit.beta * 1e9, 3), round(fit.gamma * 1e6, 3)
    (2.0, 1.0, 5.0)
    >>> calls = fit_calls([
    ...     StepPoint("1", 1, 3, 3, 48, 57, 130), StepPoint("8", 8, 4, 0, 60, 0, 494)])
    >>> terms = (calls.per_cycle, calls.per_tensor, calls.agreement_once,
    ...          calls.agreement_per_round, calls.doubling_per_round)
    >>> [round(c, 6) for c in terms], round(calls.cycle(512, 1, doubling=False), 6)
    ([78.0, 52.0, 12.0, 12.0, 19.0], 250.0)
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
        return _rms(self.errors)


def fit_model(points: list[Point]) -> Fit:
    """Least squares of relative error with alpha, beta, gamma >= 0."""
    if not points:
        raise ValueError("the model needs at least one measured point")
    coefficients, errors = _fit_relative(
        [[p.messages, p.bytes, p.calls] for p in points],
        [p.seconds for p in points],
        [p.label for p in points],
    )
    return Fit(*coefficients, errors)


@dataclass(frozen=True)
class StepPoint:
    """One small step of one rank in one cycle, for the CPU model: the ranks, the tensors
    it submitted, the rounds its agreement and its recursive doubling (0: another
    algorithm moved the data) took, and the function calls it made outside its waits,
    by part: inside the agreement, inside recursive doubling, and the rest."""

    label: str
    tensors: float
    agreement_rounds: float
    doubling_rounds: float
    agreement: float
    doubling: float
    rest: float


@dataclass(frozen=True)
class CallFit:
    """The calls of an agreed cycle by part: the rest (the cycle's own, its MPI
    collective's, and per tensor its submission, its place in the fused buffer and its
    completion), the agreement (once, and per round) and recursive doubling (per round: all
    of its calls counted per round, an upper bound); and the fits' relative errors."""

    per_cycle: float
    per_tensor: float
    agreement_once: float
    agreement_per_round: float
    doubling_per_round: float
    errors: dict[str, float]

    def cycle(self, ranks: int, tensors: int, doubling: bool) -> float:
        """The calls of one agreed cycle of `tensors` tensors on `ranks` ranks, its data
        moved by recursive doubling or (`doubling` False) by an MPI collective."""
        steps = rounds(ranks)
        calls = self.per_cycle + self.per_tensor * tensors
        calls += self.agreement_once + self.agreement_per_round * steps
        return calls + (self.doubling_per_round * steps if doubling else 0.0)

    @property
    def rms_error(self) -> float:
        return _rms(self.errors)


def fit_calls(points: list[StepPoint]) -> CallFit:
    """Least squares of relative error, every coefficient >= 0: the rest against the
    tensors, the agreement against its rounds; recursive doubling's calls per round are
    their median over the points that doubled."""
    if not points:
        raise ValueError("the CPU model needs at least one counted step")
    labels = [p.label for p in points]
    (per_cycle, per_tensor), rest_errors = _fit_relative(
        [[1.0, p.tensors] for p in points], [p.rest for p in points], labels
    )
    (once, per_round), agreement_errors = _fit_relative(
        [[1.0, p.agreement_rounds] for p in points], [p.agreement for p in points], labels
    )
    doubled = sorted(p.doubling / p.doubling_rounds for p in points if p.doubling_rounds)
    doubling = doubled[len(doubled) // 2] if doubled else 0.0
    errors = {f"rest: {label}": e for label, e in rest_errors.items()}
    errors |= {f"agreement: {label}": e for label, e in agreement_errors.items()}
    return CallFit(per_cycle, per_tensor, once, per_round, doubling, errors)


@dataclass(frozen=True)
class CpuModel:
    """The CPU of the engine's work: the calls it makes (`calls`) at the CPU one call costs
    where each rank has a core (`seconds_per_call`)."""

    calls: CallFit
    seconds_per_call: float


def _fit_relative(
    rows: list[list[float]], measured: list[float], labels: list[str]
) -> tuple[list[float], dict[str, float]]:
    """The coefficients (one per column of `rows`, each >= 0) that minimise the squared
    relative error against `measured`: the unconstrained solution on every subset of the
    columns, keeping the best one with no negative coefficient (exact for the few terms
    these models have), and the relative error at each label."""
    matrix = np.array(rows, dtype=np.float64)
    values = np.array(measured, dtype=np.float64)
    # Each row divided by its own measurement: the residual is the relative error.
    weighted = matrix / values[:, None]
    target = np.ones(len(values))
    terms = matrix.shape[1]
    best: tuple[float, np.ndarray] | None = None
    for used in itertools.chain.from_iterable(
        itertools.combinations(range(terms), k) for k in range(terms, 0, -1)
    ):
        columns = list(used)
        if not weighted[:, columns].any():
            continue
        solution, *_ = np.linalg.lstsq(weighted[:, columns], target, rcond=None)
        if (solution < 0).any():
            continue
        coefficients = np.zeros(terms)
        coefficients[columns] = solution
        residual = float(np.sum((weighted @ coefficients - target) ** 2))
        if best is None or residual < best[0] - 1e-15:
            best = (residual, coefficients)
    coefficients = best[1] if best is not None else np.zeros(terms)
    predicted = matrix @ coefficients
    errors = {label: float(predicted[i] / values[i] - 1.0) for i, label in enumerate(labels)}
    return [float(c) for c in coefficients], errors


def _rms(errors: dict[str, float]) -> float:
    values = list(errors.values())
    return math.sqrt(sum(e * e for e in values) / len(values)) if values else 0.0


def rounds(ranks: int) -> int:
    """Rounds of ringplug's negotiation on `ranks` ranks: ceil(log2 p)."""
    return math.ceil(math.log2(ranks)) if ranks > 1 else 0


@dataclass(frozen=True)
class Model:
    """A network the predictions assume (for its data plane)."""

    name: str
    parameters: int  # float32 gradients: 4 bytes each
    tensors: int  # gradient tensors per step (each one submission)
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
        # 104 convolutions (no bias) each with a batch norm (weight, bias), and the fc's
        # weight and bias: 104 x 3 + 2.
        314,
        HOROVOD_BATCH / 115.0,
        "torchvision parameter count; 115 images/s per P100 assumed: TensorFlow's published "
        "219 images/s for ResNet-50 (P100, batch 64, synthetic data) scaled by FLOPs "
        "(4.1 against 7.8 GFLOPs); Horovod's README measures 104 per GPU at 16 GPUs",
    ),
    Model(
        "Inception V3",
        27_161_264,  # torchvision.models.inception_v3's parameters (with the aux head)
        # 94 convolutions with batch norms (as Keras' InceptionV3 has), 2 more in the aux
        # head, and two fc layers: 96 x 3 + 4.
        292,
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
    161,  # 53 convolutions with batch norms and the fc: 53 x 3 + 2
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
    engine_cpu_per_cycle_s: float  # the cycle's own CPU, without its tensors'
    control_s: float  # per step: the negotiation's latency, the cycles' and tensors' CPU
    data_s: float  # per step: the data plane
    step_overhead_s: float  # what the step pays beyond its compute, with overlap
    efficiency: float  # compute / (compute + overhead), with overlap
    efficiency_no_overlap: float


def engine_cpu_per_cycle(
    cpu: CpuModel, ranks: int, tensors: int = 0, doubling: bool = False
) -> float:
    """CPU seconds of one agreed cycle of `tensors` small tensors on `ranks` ranks, its data
    moved by one collective call (MPI's allreduce, NCCL's) or, with `doubling`, by
    ringplug's recursive doubling, at the CPU a call costs."""
    return cpu.seconds_per_call * cpu.calls.cycle(ranks, tensors, doubling)


def predict(
    wall: Fit, cpu: CpuModel, model: Model, network: Network, ranks: int, setting: str
) -> Prediction:
    """A step of `model` on `ranks` workers: ringplug's control plane (per cycle, its CPU
    and ceil(log2 p) message latencies; per tensor, its CPU) and the data plane of
    `network`. A network with a latency of its own (NCCL's) gives the messages' latency;
    one without (ringplug's ring) takes the wall fit's alpha for both."""
    buffers = math.ceil(model.gradient_bytes / FUSION_BYTES)
    cycles = buffers + 1
    # Buffers of up to 64 MiB go by one collective call each (NCCL's, or the ring, whose
    # CPU is the data plane's), not by recursive doubling.
    cpu_per_cycle = engine_cpu_per_cycle(cpu, ranks)
    message_s = network.latency_s if network.latency_s > 0 else wall.alpha
    tensors_cpu = model.tensors * cpu.calls.per_tensor * cpu.seconds_per_call
    control = cycles * (message_s * rounds(ranks) + cpu_per_cycle) + tensors_cpu
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


def predictions(
    wall: Fit, cpu: CpuModel, ranks: tuple[int, ...] = (64, 512, 4096)
) -> list[Prediction]:
    """Horovod's two 512-GPU models on NCCL over RoCE, and the CPU job, at each of `ranks`."""
    found = []
    for model in HOROVOD_MODELS:
        for p in ranks:
            found.append(predict(wall, cpu, model, ROCE, p, f"{model.name}, {ROCE.name}"))
    for p in ranks:
        found.append(predict(wall, cpu, CPU_JOB, CPU_LINK, p, f"{CPU_JOB.name}, {CPU_LINK.name}"))
    return found
