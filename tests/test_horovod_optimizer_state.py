"""hvd.broadcast_optimizer_state's state-creating step, in a world of one: it creates the
state and changes nothing else (parameters, hyperparameters, gradients, an LR scheduler's
mark), whatever the optimizer."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

import ringplug.horovod.torch as hvd  # noqa: E402

optim = torch.optim
# Each moves the parameters when it steps with zero gradients (weight decay, coupled or
# decoupled, with momentum, maximize, ASGD's averaging), except Rprop's.
OPTIMIZERS = {
    "SGD": lambda p: optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1),
    "SGD-maximize": lambda p: optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.1, maximize=True),
    "Adam": lambda p: optim.Adam(p, lr=0.1, weight_decay=0.1, amsgrad=True),
    "Adam-maximize": lambda p: optim.Adam(p, lr=0.1, weight_decay=0.1, maximize=True),
    "AdamW": lambda p: optim.AdamW(p, lr=0.1, weight_decay=0.1),
    "AdamW-foreach": lambda p: optim.AdamW(p, lr=0.1, weight_decay=0.1, foreach=True),
    "Adamax": lambda p: optim.Adamax(p, lr=0.1, weight_decay=0.1),
    "NAdam-decoupled": lambda p: optim.NAdam(
        p, lr=0.1, weight_decay=0.1, decoupled_weight_decay=True
    ),
    "RAdam": lambda p: optim.RAdam(p, lr=0.1, weight_decay=0.1),
    "Adagrad": lambda p: optim.Adagrad(p, lr=0.1, weight_decay=0.1),
    "Adadelta": lambda p: optim.Adadelta(p, lr=0.1, weight_decay=0.1),
    "RMSprop": lambda p: optim.RMSprop(p, lr=0.1, weight_decay=0.1, momentum=0.5, centered=True),
    "Rprop": lambda p: optim.Rprop(p, lr=0.1),
    "ASGD": lambda p: optim.ASGD(p, lr=0.1, weight_decay=0.1),
}


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    hvd.init()
    yield


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
@pytest.mark.parametrize("distributed", [False, True])
def test_the_state_creating_step_moves_no_parameter(kind, distributed):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = OPTIMIZERS[kind](model.parameters())
    if distributed:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    before = [p.detach().clone() for p in model.parameters()]
    settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    assert optimizer.state
    for old, new in zip(before, model.parameters(), strict=True):
        assert torch.equal(old.view(torch.int32), new.detach().view(torch.int32))
    assert [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups] == (
        settings
    )


def test_horovods_step_moves_them_where_ours_does_not():
    # What the test above guards against: the same step, parameters not put back.
    model = torch.nn.Linear(4, 3)
    optimizer = OPTIMIZERS["SGD"](model.parameters())
    before = model.weight.detach().clone()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    assert not torch.equal(before, model.weight)


def test_a_gradient_already_there_is_kept_and_a_missing_one_becomes_zero_as_in_horovod():
    model = torch.nn.Linear(4, 3)
    optimizer = optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    model.weight.grad = torch.ones_like(model.weight)
    gradient = model.weight.grad
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    assert model.weight.grad is gradient and torch.equal(gradient, torch.ones_like(gradient))
    assert torch.equal(model.bias.grad, torch.zeros_like(model.bias))  # Horovod's own test reads it


def test_an_lr_scheduler_still_warns_when_it_steps_before_the_optimizer():
    model = torch.nn.Linear(4, 3)
    optimizer = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = optim.lr_scheduler.StepLR(optimizer, step_size=1)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scheduler.step()
    assert any("before `optimizer.step()`" in str(w.message) for w in caught)
