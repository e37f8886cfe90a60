"""The allreduce kind: how the engine runs allreduces (in fused batches, or from the copies
a negotiation message carried) and how one is described."""

from __future__ import annotations

from ....wire import Kind, Response, Signature
from ..kind import CollectiveKind, EngineView, register, shape_text
from . import eager
from .fusion import Fusion, reduce_carried


class Allreduce(CollectiveKind):
    """Consecutive allreduces of one dtype, op and place run as one fused collective
    (`fusion`); small host ones travel in the negotiation message (`eager`). What a joined
    rank contributes is in `fusion` too."""

    label = "allreduce"
    cacheable = True
    fused = True

    def shape_text(self, signature: Signature) -> str:
        if signature.parts:
            shown = ", ".join(shape_text(p) for p in signature.parts[:8])
            more = ", ..." if len(signature.parts) > 8 else ""
            return f"of {len(signature.parts)} tensors with shapes {shown}{more}"
        return super().shape_text(signature)

    def fuses_with(self, first: Signature, signature: Signature) -> bool:
        return (
            first.code == signature.code
            and first.op == signature.op
            and first.place == signature.place
        )

    def run_batch(self, engine: EngineView, batch: list[Response]) -> None:
        (engine.kind_state.get(self.label) or _fusion(engine)).run(batch)

    def carried_bytes(self, signature: Signature, threshold: int) -> int:
        return eager.size_of(signature, threshold)

    # `eager.pieces` itself, not a method calling it: a cycle's fast path calls it per call.
    carried_pieces = staticmethod(eager.pieces)

    # `fusion.reduce_carried` itself (it needs no fusion buffer): a cycle's fast path calls it.
    run_carried = staticmethod(reduce_carried)


def _fusion(engine: EngineView) -> Fusion:
    """The engine's fusion (its reused buffer), made at its first allreduce."""
    fusion = engine.kind_state.get(Allreduce.label)
    if fusion is None:
        fusion = engine.kind_state[Allreduce.label] = Fusion(engine, engine.settings)
    return fusion


register(Kind.ALLREDUCE, Allreduce())
