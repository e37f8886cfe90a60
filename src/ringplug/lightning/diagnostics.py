"""RingDiagnostics: the step-time breakdown and verdict of a RingStrategy fit.

`RingStrategy` installs one per fit (``RingStrategy(diagnose=...)``, ``RINGPLUG_DIAGNOSE``)
and calls it from its own hooks: no Lightning Callback is added, because every Callback
costs the Trainer a dispatch per hook per step, and the strategy's hooks run anyway.
Where the phases come from: the training dataloader's fetches (`AgreedLoader`), the
strategy's ``training_step`` (compute begins), and `DistributedOptimizer` (backward's end,
the reduction's end, the step's end). The numbers go to every logger of the Trainer
(``logger.log_metrics``), so TensorBoard and CSV show them.
"""

from __future__ import annotations

from typing import Any

from .. import core
from ..config import diagnose_setting
from ..diagnose import Diagnosis, StepClock

# On unless turned off: measured with `ringplug-bench lightning` (docs/benchmarks.md), the
# breakdown costs less than 1% of a step.
DEFAULT_ON = True


def diagnostics_for(diagnose: bool | int | None, trace: bool = True) -> RingDiagnostics | None:
    """The diagnostics a RingStrategy(diagnose=...) fit gets: ``None`` follows
    ``RINGPLUG_DIAGNOSE`` (default on) and ``RINGPLUG_DIAGNOSE_EVERY``; ``False`` none;
    ``True`` a report at the end of fit; an int N also one every N steps."""
    if not isinstance(diagnose, (bool, type(None))) and (
        not isinstance(diagnose, int) or diagnose < 1
    ):
        raise ValueError(
            f"RingStrategy(diagnose={diagnose!r}): use True, False, None or a "
            "positive number of steps between reports."
        )
    enabled, every = diagnose_setting()
    if diagnose is None:
        diagnose = DEFAULT_ON if enabled is None else enabled
    if diagnose is False or core.size() == 1:  # one rank: no distribution to diagnose
        return None
    if diagnose is not True:
        every = int(diagnose)
    return RingDiagnostics(every, trace=trace)


class RingDiagnostics:
    """Measures each rank's training steps during ``fit`` and reports over every rank.

    Args:
        every_n_steps: also report every this many training steps. Defaults to ``None``
            (at the end of fit only).
        trace: put every rank's steps on the timeline when one records. Defaults to True.
    """

    def __init__(self, every_n_steps: int | None = None, trace: bool = True) -> None:
        self.every_n_steps = every_n_steps
        self.trace = trace
        self.clock: StepClock | None = None
        self.diagnosis: Diagnosis | None = None  # the last report (the same on every rank)
        self._trainer: Any = None

    def on_train_start(self, trainer: Any) -> None:
        """Start the clock (every rank, before the first training batch)."""
        self._trainer = trainer
        self.clock = StepClock(self.every_n_steps, on_report=self._log, trace=self.trace)
        self.clock.start()

    def on_train_end(self) -> None:
        """Report over every rank (a collective: every rank's fit ends here together)."""
        clock, self.clock = self.clock, None
        if clock is not None and core.size() > 1:
            clock.finish()

    def _log(self, diagnosis: Diagnosis) -> None:
        self.diagnosis = diagnosis
        trainer = self._trainer
        if trainer is None or core.rank() != 0:
            return
        metrics = diagnosis.metrics()
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
