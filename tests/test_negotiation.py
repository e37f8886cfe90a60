"""`negotiation.decide`: the same messages give every rank the same plan."""

from __future__ import annotations

from ringplug.core.dtypes import DType
from ringplug.core.engine.negotiation import Cache, decide
from ringplug.core.ops import ReduceOp
from ringplug.wire import Kind, Message, Signature, numbered

W = Signature(Kind.ALLREDUCE, DType.FLOAT32, ReduceOp.AVERAGE, -1, (4, 3))
B = Signature(Kind.ALLREDUCE, DType.FLOAT32, ReduceOp.AVERAGE, -1, (3,))


def new(*items):
    return [(name, signature, 0) for name, signature in items]


def test_requests_ready_everywhere_run_in_the_lowest_active_ranks_order():
    messages = [Message(1, new=new(("w", W), ("b", B))), Message(1, new=new(("b", B), ("w", W)))]
    plan = decide(messages, Cache(16))
    assert [r.name for r in plan.responses] == ["w", "b"]
    assert plan.partial == {} and plan.errors == {}


def test_a_request_missing_on_some_rank_waits_and_is_reported_with_its_holders():
    messages = [Message(1, new=new(("w", W), ("b", B))), Message(1, new=new(("w", W)))]
    plan = decide(messages, Cache(16))
    assert [r.name for r in plan.responses] == ["w"]
    assert plan.partial == {"b": [0]}


def test_different_signatures_under_one_name_fail_with_both_shapes():
    messages = [Message(1, new=new(("w", W))), Message(1, new=new(("w", B)))]
    plan = decide(messages, Cache(16))
    assert plan.responses == []
    assert "rank 0 submitted allreduce with shape (4, 3) float32" in plan.errors["w"]
    assert "rank 1 submitted allreduce with shape (3,) float32" in plan.errors["w"]


def test_agreed_names_get_cache_slots_and_then_travel_as_bits():
    cache = Cache(16)
    first = decide([Message(1, new=new(("w", W))), Message(1, new=new(("w", W)))], cache)
    cache.learn(first, {"w"})
    assert cache.slot_for("w", W) == 0
    # Next step: both ranks send only bit 0, and the plan is the same.
    again = decide([Message(2, cached=1), Message(2, cached=1)], cache)
    assert [(r.name, r.signature) for r in again.responses] == [("w", W)]


def test_a_cached_name_with_a_new_shape_on_one_rank_is_a_mismatch():
    cache = Cache(16)
    cache.learn(
        decide([Message(1, new=new(("w", W))), Message(1, new=new(("w", W)))], cache), {"w"}
    )
    plan = decide([Message(2, cached=1), Message(2, new=new(("w", B)))], cache)
    assert "does not match across ranks" in plan.errors["w"]


def test_joined_ranks_do_not_hold_others_back_and_the_last_to_join_is_named():
    messages = [Message(3, joined_cycle=2), Message(3, new=new(("w", W)))]
    plan = decide(messages, Cache(16))
    assert [(r.name, r.have) for r in plan.responses] == [("w", [False, True])]
    done = decide([Message(4, joined_cycle=2), Message(4, joined_cycle=4)], Cache(16))
    assert done.all_joined and done.last_joined == 1


def test_any_rank_shutting_down_stops_everyone():
    plan = decide([Message(1, new=new(("w", W))), Message(1, shutdown=True)], Cache(16))
    assert plan.shutdown_by == 1 and plan.responses == []


def test_names_numbered_in_call_order_split_into_prefix_and_number():
    assert numbered("noname.12") == ("noname.", 12)
    assert numbered("torch.default#7") == ("torch.default#", 7)
    assert numbered("layer1/kernel") is None
    assert numbered("noname.012") is None  # not the canonical spelling of a number
    assert numbered("a#b") is None


def test_numbered_requests_travel_as_slot_and_number_once_their_form_is_agreed():
    cache = Cache(16)
    first = [Message(1, new=new(("noname.1", W))) for _ in range(2)]
    plan = decide(first, cache)
    cache.learn(plan, set())  # numbered names are never cacheable by name ...
    assert cache.by_name == {}
    entry = cache.numbered_slot("noname.2", W)  # ... but their prefix and signature are
    assert entry == (0, 2) and cache.numbered_slot("noname.3", B) is None
    messages = [Message(2, numbered=[entry]), Message(2, numbered=[entry])]
    plan = decide(messages, cache)
    assert [(r.name, r.signature) for r in plan.responses] == [("noname.2", W)]
    assert plan.repeated


def test_numbered_requests_of_different_signatures_on_two_ranks_fail_as_a_mismatch():
    cache = Cache(16)
    for signature in (W, B):
        cache.learn(decide([Message(1, new=new(("noname.1", signature)))] * 2, cache), set())
    messages = [
        Message(3, numbered=[cache.numbered_slot("noname.5", W)]),
        Message(3, numbered=[cache.numbered_slot("noname.5", B)]),
    ]
    plan = decide(messages, cache)
    assert plan.responses == []
    assert "rank 0 submitted allreduce with shape (4, 3) float32" in plan.errors["noname.5"]
    assert "rank 1 submitted allreduce with shape (3,) float32" in plan.errors["noname.5"]


def _cache_of(*names):
    """A cache that learned `names` (signature W) in this order: slot i is names[i]."""
    cache = Cache(16)
    items = new(*((name, W) for name in names))
    cache.learn(decide([Message(1, new=items), Message(1, new=items)], cache), set(names))
    return cache


def test_ranks_part_way_through_a_burst_run_the_slots_all_have_and_the_rest_wait():
    cache = _cache_of("a", "b", "c", "d", "e")
    # Rank 0 has a, b, c, e ready, rank 1 b, c, d, e, rank 2 a, b, c, e: bits only.
    messages = [Message(2, cached=0b10111), Message(2, cached=0b11110), Message(2, cached=0b10111)]
    plan = decide(messages, cache)
    assert [r.name for r in plan.responses] == ["b", "c", "e"]  # slot order
    assert all(r.have == [True, True, True] and r.extras == [0, 0, 0] for r in plan.responses)
    assert plan.partial == {"a": [0, 2], "d": [1]}
    assert plan.errors == {} and not plan.repeated and plan.nothing_new
    # Nothing of it is new: the cache would learn nothing from it.
    slots = list(cache.slots)
    cache.learn(plan, {"a", "b", "c", "d", "e"})
    assert cache.slots == slots


def test_a_burst_of_slots_beside_a_new_name_takes_the_full_negotiation():
    cache = _cache_of("a", "b")
    messages = [Message(2, cached=0b11), Message(2, cached=0b01, new=new(("z", B)))]
    plan = decide(messages, cache)
    assert [r.name for r in plan.responses] == ["a"]
    assert plan.partial == {"b": [0], "z": [1]} and not plan.nothing_new


def test_a_repeated_step_reuses_its_responses_until_a_slot_changes():
    cache = _cache_of("a", "b", "c")
    step = [Message(2, cached=0b111), Message(2, cached=0b111)]
    first = decide(step, cache)
    again = decide([Message(3, cached=0b111), Message(3, cached=0b111)], cache)
    assert first.repeated and again.repeated
    assert [(r.name, r.signature) for r in again.responses] == [("a", W), ("b", W), ("c", W)]
    assert again.responses is first.responses  # made once
    # Another set of slots is a step of its own, with its own responses.
    part = decide([Message(4, cached=0b101), Message(4, cached=0b101)], cache)
    assert [r.name for r in part.responses] == ["a", "c"]
    # Learning another name (a barrier between steps, say) leaves the step's slots alone.
    other = new(("z", B))
    cache.learn(decide([Message(5, new=other), Message(5, new=other)], cache), {"z"})
    assert decide(step, cache).responses is first.responses
    # "b" changes its shape: the cache learns it, and the step's responses follow.
    changed = new(("a", W), ("b", B), ("c", W))
    cache.learn(decide([Message(6, new=changed), Message(6, new=changed)], cache), {"a", "b", "c"})
    after = decide([Message(7, cached=0b111), Message(7, cached=0b111)], cache)
    assert [(r.name, r.signature) for r in after.responses] == [("a", W), ("b", B), ("c", W)]
