"""One forward packed under several policies (``actcomp.whole_model.session.several_policies``),
a backward per policy over the retained graph: the budget search's op-kind rungs.

What must hold: each backward's gradients equal, bit for bit, those of a step of the same model
converted with that policy alone: on models with every special form (a ResNet's BatchNorm and
pooling, a ViT's fused attention recomputed from its codes, a Llama's gate products and RMSNorm
products), with dropout, and with checkpointed blocks (both checkpoint modes), whose
recomputation in each backward packs under the policy selected.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import actcomp
from actcomp.losses.causal_lm import has_routable_loss
from actcomp.tools import budget
from actcomp.tools.user_batch import UserBatch
from actcomp.whole_model.policy import RestPolicy
from actcomp.whole_model.session import several_policies
from tests.zoo import HF_ZOO, TIMM_ZOO

pytestmark = [
    pytest.mark.usefixtures("seeded", "single_thread"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

# The rungs the budget search asks for (one kind lossy, the others exact), and two presets.
RESTS = [budget._kinds_alone({"activation": "int8"}), budget._kinds_alone({"activation": "fewbit4"}),
         budget._kinds_alone({"normalization": "int4:group=64"}), budget._kinds_alone({"attention": "int2:group=32"}),
         budget._kinds_alone({"other": "bf16"}), "8bit", "4bit", "exact"]

ZOO = {entry.id: entry for entry in TIMM_ZOO + HF_ZOO}


class Block(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.down(nn.functional.gelu(self.up(self.norm(x)))))


class Checkpointed(nn.Module):
    def __init__(self, use_reentrant: bool):
        super().__init__()
        self.embed, self.head = nn.Linear(16, 32), nn.Linear(32, 4)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.use_reentrant = use_reentrant

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.use_reentrant)
        return self.head(x)


def _cases():
    for name in ("resnet18", "vit_tiny_patch16_224", "llama"):
        entry = ZOO[name]
        batch = entry.batch()
        batch.pop("targets", None)
        yield pytest.param(entry.build, batch, id=name)
    for use_reentrant in (False, True):
        yield pytest.param(lambda use_reentrant=use_reentrant: Checkpointed(use_reentrant),
                           {"x": torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)},
                           id=f"checkpointed-{'reentrant' if use_reentrant else 'non-reentrant'}")


@pytest.mark.parametrize(("build", "batch"), list(_cases()))
def test_each_backward_gives_its_policys_own_step_bit_for_bit(build, batch):
    torch.manual_seed(0)
    plain = build()
    run = UserBatch(batch)
    # The loss routed alike on both sides (a lossy rest takes the chunked loss by default, an
    # exact one the model's own), as the budget search routes it: the Llama's through the chunked
    # loss, whose saves a custom Function makes.
    loss = "chunked" if has_routable_loss(plain) else "plain"
    converted = actcomp.to_compressed(copy.deepcopy(plain), "mink0", rest="exact", loss=loss)
    with several_policies([RestPolicy.parse(rest) for rest in RESTS]) as select:
        found = run.over_backwards(converted, len(RESTS), select)
    differ = 0
    for rest, got in zip(RESTS, found):
        expected = run.gradients(actcomp.to_compressed(copy.deepcopy(plain), "mink0", rest=rest, loss=loss))
        assert list(got) == list(expected), rest
        for name, grad in expected.items():
            assert torch.equal(got[name], grad), (rest, name)
        differ += any(not torch.equal(got[name], found[-1][name]) for name in got)
    # The policies do differ (resnet18's ReLU keeps exact masks under any rung, so its activation
    # rungs give exact's gradient): each backward read its own forms, not the last's.
    assert differ >= 3


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_backward_in_another_thread_reads_the_policy_selected(use_reentrant):
    """On a GPU autograd runs the backward (its unpack hooks, a checkpointed block's
    recomputation) in a device thread of its own: the selection made in the caller's thread
    holds there. Each backward runs in a new thread here, as it would on a GPU."""
    import threading

    torch.manual_seed(0)
    plain = Checkpointed(use_reentrant)
    inputs = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    rests = [budget._kinds_alone({"activation": "int2:group=32"}), "exact"]
    converted = actcomp.to_compressed(copy.deepcopy(plain), "mink0", rest="exact", loss="plain")

    def backward_in_a_thread(loss):
        thread = threading.Thread(target=loss.backward, kwargs={"retain_graph": True})
        thread.start()
        thread.join()

    with several_policies([RestPolicy.parse(rest) for rest in rests]) as select:
        converted.train()
        torch.manual_seed(0)
        loss = converted(inputs).square().sum()
        found = []
        for index in range(len(rests)):
            converted.zero_grad(set_to_none=True)
            select(index)
            backward_in_a_thread(loss)
            found.append({name: p.grad.clone() for name, p in converted.named_parameters()})
    for rest, got in zip(rests, found):
        model = actcomp.to_compressed(copy.deepcopy(plain), "mink0", rest=rest, loss="plain").train()
        torch.manual_seed(0)
        model(inputs).square().sum().backward()
        for name, p in model.named_parameters():
            assert torch.equal(got[name], p.grad), (rest, name)
    assert not torch.equal(found[0]["blocks.0.up.weight"], found[1]["blocks.0.up.weight"])


def test_the_policies_are_forgotten_after_the_block_and_a_bad_index_is_refused():
    from actcomp.whole_model import session

    exact, lossy = RestPolicy.parse("exact"), RestPolicy.parse("8bit")
    with several_policies([exact, lossy]) as select:
        opened = session.open_session(exact, [])
        assert [one.policy for one in opened.sessions] == [exact, lossy]
        with several_policies([lossy]):
            assert [one.policy for one in session.open_session(exact, []).sessions] == [lossy]
        assert session._RUNGS.policies == (exact, lossy)
        with pytest.raises(IndexError, match="policy 2 of 2"):
            select(2)
    assert session._RUNGS.policies == () and session._RUNGS.current == 0
    assert type(session.open_session(lossy, [])) is session._Session
    with pytest.raises(ValueError, match="at least one policy"), several_policies([]):
        pass
    # A step afterwards packs under its own policy alone.
    model = actcomp.to_compressed(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1)), {"*": None}, rest="8bit")
    model(torch.randn(2, 8)).sum().backward()


def test_the_budget_searchs_kind_errors_are_each_rungs_own_steps():
    """``_Search.kind_errors`` (one forward, a backward per rung, float32 differences) against
    each rung's own step in float64, as the search measured them until stop 61: the same errors
    to float32's rounding of each difference."""
    torch.manual_seed(0)
    entry = ZOO["llama"]
    model, batch = entry.build(), entry.batch()
    search = budget._Search(model, UserBatch(batch), budget.LAYER_SPECS, budget.KIND_SPECS)
    rungs = [("activation", "int8"), ("activation", "fewbit4"), ("normalization", "int4:group=64"),
             ("attention", "int8"), ("other", "int2:group=32")]
    steps = search.steps
    errors = search.kind_errors(rungs)
    assert (search.steps, search.backwards) == (steps + 1, len(rungs) - 1)
    for (kind, spec), error in zip(rungs, errors):
        rest = budget._kinds_alone({kind: spec})
        got = search.measured.gradients(actcomp.to_compressed(copy.deepcopy(model), "mink0", rest=rest,
                                                              loss=search.loss))
        expected = sum(float((got[name] - grad).square().sum())
                       for name, grad in search.measured_reference.items()) / search.norm
        assert error == pytest.approx(expected, rel=1e-6), (kind, spec)
    assert len(set(errors)) == len(errors) and min(errors) > 0
