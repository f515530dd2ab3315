"""Fused backward (library/fused_backward.py): the update applied during the backward gives the unfused
run's weights, guard decisions, scaler scale and optimizer state, with guard skips and scaler overflows
in the run, whether the measuring pass keeps none, some or all of the gradients for the update; no
gradient outlives its step; the second pass skips what only the kept gradients need; bf16 stochastic
rounding is unbiased; kohya's group split.

Why equality is exact here (torch.equal, not a tolerance): each gradient reaching the optimizer is the
same tensor an unfused backward produces (the same graph, backward twice; the RNG restored between),
unscaled by the same elementwise multiply, clipped by the same coefficient (the same per-tensor norms
stacked in the same order), and stepped by the optimizer's own step code on the same inputs: every
operation on every element is the unfused one. A gradient the measuring pass keeps is that pass's
tensor, which is the second pass's (the same graph; autograd pruned to fewer inputs runs the same nodes
for the rest, in the same order). Only the guard's norm is combined in another order
(per parameter, then over parameters, against the flat buffer's rows of 4096): its relative difference
is bounded by float32 summation error, (rows + row length) * eps.
"""
from __future__ import annotations

import argparse
import copy
import gc
import io
import math
import weakref

import numpy
import pytest
import torch
from transformers.optimization import Adafactor

from library import fused_backward
from library.errors import UserError
from library.fused_backward import FusedBackward, FusedOptions, split_into_groups
from library.grad_guard import CPU_NORM_ROW, GradGuard, GradientMonitor, GuardConfig
from library.loss_scaling import DynamicPolicy, LossScaler

EPS32 = torch.finfo(torch.float32).eps
SPIKE = 1e4  # the loss factor of the step the guard must skip (its norm is 1e4 x the others)
GUARD = GuardConfig(skip_grad_norm=True, skip_grad_norm_warmup_factor=20.0,
                    skip_nan_immediate=False, skip_inf_immediate=False)


@pytest.fixture(scope="module")
def tiny_unet() -> torch.nn.Module:
    from tools.build_tiny_models import tiny_sdxl
    return tiny_sdxl().unet


def unet_inputs(unet: torch.nn.Module, step: int) -> tuple[dict, torch.Tensor]:
    """One batch of the tiny SDXL UNet (1 x 4 x 8 x 8, 8 text tokens), keyed by the step."""
    generator = torch.Generator().manual_seed(1000 + step)
    randn = lambda *shape: torch.randn(*shape, generator=generator)  # noqa: E731
    inputs = dict(sample=randn(1, 4, 8, 8), timestep=torch.tensor([100 + 37 * step]),
                  encoder_hidden_states=randn(1, 8, unet.config.cross_attention_dim),
                  added_cond_kwargs={"text_embeds": randn(1, 64), "time_ids": randn(1, 6)})
    return inputs, randn(1, 4, 8, 8)


def unet_loss(unet: torch.nn.Module, step: int, autocast: bool = False, spike_step: int | None = None,
              spike: float = SPIKE) -> torch.Tensor:
    inputs, target = unet_inputs(unet, step)
    with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
        prediction = unet(**inputs).sample
    loss = torch.nn.functional.mse_loss(prediction.float(), target)
    return loss * spike if step == spike_step else loss


def run(model: torch.nn.Module, make_optimizers, steps: int, *, fused: bool, per_parameter: bool = True,
        max_grad_norm: float | None = 1.0, scaler_args: dict | None = None, autocast: bool = False,
        spike_step: int | None = None, spike: float = SPIKE, loss_fn=unet_loss, state: dict | None = None,
        cosine: bool = False, kept_gradient_bytes: int = 0, passes: list | None = None):
    """Train a copy of ``model`` for ``steps`` steps, unfused (the trainer's order: backward, measure,
    guard, unscale, clip, step, update) or fused; return the model, optimizers, scaler, per-step log and
    the most parameters that held a gradient at once after a fused hook ran (0 when fused per parameter).
    ``kept_gradient_bytes``: the fused measuring pass's budget; ``passes`` (a list) gets, per fused step,
    (bytes kept, gradients the second pass computed)."""
    model = copy.deepcopy(model)
    optimizers = make_optimizers(model)
    scaler = LossScaler(DynamicPolicy(**scaler_args)) if scaler_args else None
    guard = GradGuard(GUARD, announce=lambda line: None)
    params = [p for p in model.parameters() if p.requires_grad]
    if state is not None:
        for optimizer, saved in zip(optimizers, state["optimizers"]):
            optimizer.load_state_dict(copy.deepcopy(saved))  # loading keeps the tensors; stepping changes them
    fused_step = FusedBackward(optimizers, per_parameter=per_parameter, max_grad_norm=max_grad_norm,
                               scaler=scaler, cosine=cosine, kept_gradient_bytes=kept_gradient_bytes) if fused else None
    monitor = None if fused else GradientMonitor(params, cosine=cosine)
    most_held = [0]
    if fused and not kept_gradient_bytes:
        def count_held(_: torch.Tensor) -> None:  # registered after the fused hooks: runs after each of them
            most_held[0] = max(most_held[0], sum(p.grad is not None for p in params))
        for parameter in params:
            parameter.register_post_accumulate_grad_hook(count_held)
    log = []
    for step in range(1, steps + 1):
        loss = loss_fn(model, step, autocast=autocast, spike_step=spike_step, spike=spike)
        scaled = scaler.scale(loss) if scaler else loss
        if fused:
            measured = fused_step.measure(scaled, loss_value=loss.detach())
        else:
            scaled.backward()
            measured = monitor.measure(scale=scaler.get_scale_tensor() if scaler else None, loss=loss.detach())
        skip = guard.decide(step, measured.norm).skip
        stepped = False
        if skip and fused:
            fused_step.discard()
        elif skip:
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
        elif fused:
            stepped = fused_step.apply()
            if scaler:
                scaler.update()
        else:
            if scaler:
                for optimizer in optimizers:
                    scaler.unscale_(optimizer)
            if max_grad_norm:
                torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            stepped = all([scaler.step(optimizer) if scaler else optimizer.step() is None for optimizer in optimizers])
            if scaler:
                scaler.update()
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
        assert all(p.grad is None for p in params), "a gradient outlived its step"
        if fused and passes is not None:
            passes.append((fused_step.kept_gradient_bytes, fused_step.recomputed_gradients))
        log.append((step, measured.norm, skip, stepped, scaler.get_scale() if scaler else None, measured.cosine))
    return model, optimizers, scaler, log, most_held[0]


def adafactor(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    # kohya's recommended fused settings: a fixed lr, no relative step
    return [Adafactor(model.parameters(), lr=1e-3, relative_step=False, scale_parameter=False, warmup_init=False)]


def assert_same_run(unfused, fused) -> None:
    (model_a, optimizers_a, scaler_a, log_a, _), (model_b, optimizers_b, scaler_b, log_b, _) = unfused, fused
    for (name, a), b in zip(model_a.state_dict().items(), model_b.state_dict().values()):
        assert torch.equal(a, b), f"{name}: max difference {(a - b).abs().max().item()}"
    rows = max(1, sum(p.numel() for p in model_a.parameters()) // CPU_NORM_ROW)
    norm_bound = (rows + CPU_NORM_ROW) * EPS32
    for (step, norm_a, skip_a, stepped_a, scale_a, cosine_a), (_, norm_b, skip_b, stepped_b, scale_b, cosine_b) \
            in zip(log_a, log_b):
        assert (skip_a, stepped_a, scale_a) == (skip_b, stepped_b, scale_b), step
        if torch.isfinite(torch.tensor(norm_a)):
            assert abs(norm_a - norm_b) <= norm_bound * norm_a, (step, norm_a, norm_b)
        else:
            assert str(norm_a) == str(norm_b)
        if math.isnan(cosine_a):
            assert math.isnan(cosine_b), step
        else:  # dot / (norm x norm), each summed in another order: three summation errors
            assert abs(cosine_a - cosine_b) <= 3 * norm_bound, (step, cosine_a, cosine_b)
    for optimizer_a, optimizer_b in zip(optimizers_a, optimizers_b):
        assert_equal_states(optimizer_a.state_dict(), optimizer_b.state_dict())
    if scaler_a is not None:
        assert scaler_a.state_dict() == scaler_b.state_dict()


def assert_equal_states(a, b) -> None:
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert list(a) == list(b)  # the same keys in the same order: the same saved bytes
        for key in a:
            assert_equal_states(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_equal_states(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    else:
        assert a == b


def test_adafactor_fused_equals_unfused_with_guard_skip(tiny_unet):
    """--fused_backward_pass + Adafactor + --max_grad_norm 1: weights, decisions, optimizer state equal the
    unfused run's; step 3 (loss x 1e4) is skipped by the guard in both."""
    unfused = run(tiny_unet, adafactor, 4, fused=False, spike_step=3)
    fused = run(tiny_unet, adafactor, 4, fused=True, spike_step=3)
    assert [row[2] for row in unfused[3]] == [False, False, True, False]
    assert_same_run(unfused, fused)
    moved = [not torch.equal(a, b) for a, b in zip(tiny_unet.parameters(), fused[0].parameters())]
    assert all(moved)
    assert fused[4] == 0  # every gradient freed in its own hook: never two at once


def test_gradient_checkpointing_unet(tiny_unet):
    """--gradient_checkpointing (diffusers' own, on the UNet): the second backward recomputes every block
    again; still the unfused run's weights."""
    unet = copy.deepcopy(tiny_unet)
    unet.enable_gradient_checkpointing()
    unet.train()
    assert_same_run(run(unet, adafactor, 2, fused=False), run(unet, adafactor, 2, fused=True))


def gradient_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def checkpointed_unet(unet: torch.nn.Module) -> torch.nn.Module:
    unet = copy.deepcopy(unet)
    unet.enable_gradient_checkpointing()
    unet.train()
    return unet


@pytest.mark.parametrize("share", [0.4, 1.0])
def test_kept_gradients_give_the_unfused_run(tiny_unet, share):
    """The measuring pass keeps the gradients that complete last, up to a budget (40% of all of them, or
    all: then no second pass at all), with gradient checkpointing, a guard skip (step 3) and the clip:
    the same weights, decisions and optimizer state as unfused; the second pass computes only the others."""
    unet = checkpointed_unet(tiny_unet)
    budget = int(share * gradient_bytes(unet))
    passes: list = []
    unfused = run(unet, adafactor, 4, fused=False, spike_step=3)
    fused = run(unet, adafactor, 4, fused=True, spike_step=3, kept_gradient_bytes=budget, passes=passes)
    assert_same_run(unfused, fused)
    count = len(list(unet.parameters()))
    applied = [row for row, log_row in zip(passes, fused[3]) if not log_row[2]]
    assert len(applied) == 3 and all(0 < kept <= budget for kept, _ in passes)
    if share == 1.0:
        assert all(kept == budget and recomputed == 0 for kept, recomputed in applied)
    else:
        assert all(0 < recomputed < count for _, recomputed in applied)
        # a gradient more would not have fitted: the budget is used up to the next gradient's size
        largest = max(p.numel() * p.element_size() for p in unet.parameters())
        assert all(kept > budget - largest for kept, _ in passes)


def test_the_second_pass_skips_the_kept_gradients_part_of_the_graph(tiny_unet):
    """With the down blocks' and the time embedding's gradients kept (they complete last), the applying
    pass never reaches the down blocks: their checkpointed blocks are recomputed once per step (by the
    measuring pass) instead of twice; the up blocks still are, and every weight still moves as unfused.
    (Counted by forward pre-hooks: torch stops a recomputation early, once it has what the backward
    needs, so a forward hook would not see it.)"""
    unet = checkpointed_unet(tiny_unet)
    late = [module for module in (unet.conv_in, unet.time_embedding, unet.add_embedding, *unet.down_blocks)]
    budget = sum(p.numel() * p.element_size() for module in late for p in module.parameters())
    calls = {"down": 0, "up": 0}
    unet.down_blocks[0].resnets[0].register_forward_pre_hook(lambda *_: calls.__setitem__("down", calls["down"] + 1))
    unet.up_blocks[-1].resnets[0].register_forward_pre_hook(lambda *_: calls.__setitem__("up", calls["up"] + 1))
    results = {}
    for kept in (0, budget):
        calls.update(down=0, up=0)
        passes: list = []
        results[kept] = run(unet, adafactor, 2, fused=True, kept_gradient_bytes=kept, passes=passes)
        # deepcopy inside run() copies the hooks too: the counts are the trained copy's
        results[kept] = (results[kept], dict(calls), passes)
    (plain, plain_calls, _), (kept_run, kept_calls, kept_passes) = results[0], results[budget]
    assert plain_calls == {"down": 2 * 3, "up": 2 * 3}  # forward + the recomputation in each of two passes
    assert kept_calls == {"down": 2 * 2, "up": 2 * 3}
    assert all(0 < kept <= budget for kept, _ in kept_passes)
    for a, b in zip(plain[0].parameters(), kept_run[0].parameters()):
        assert torch.equal(a, b)


def test_the_automatic_budget_keeps_a_fifth_of_the_gradients(tiny_unet):
    """Default budget: the smaller of KEPT_GRADIENT_SHARE of the trainable gradients' bytes (here, far below
    half the machine's free memory) and half the free memory (a gradient size above it); a size given in GiB
    is taken as it is. The run keeps at most that share, and some of it."""
    budget = fused_backward.kept_gradient_budget(None, torch.device("cpu"))
    assert budget(10 * 2**20) == int(0.2 * 10 * 2**20)
    half_free = 0.5 * fused_backward.available_memory_bytes(torch.device("cpu"))
    assert 0.8 * half_free < budget(2**60) < 1.2 * half_free
    assert fused_backward.kept_gradient_budget(0.5, torch.device("cpu"))(2**60) == 2**29
    passes: list = []
    run(tiny_unet, adafactor, 2, fused=True, kept_gradient_bytes=budget, passes=passes)
    total = sum(p.numel() * p.element_size() for p in tiny_unet.parameters() if p.requires_grad)
    assert all(0 < kept <= 0.2 * total and recomputed > 0 for kept, recomputed in passes)


def test_the_graph_is_freed_after_apply_and_discard(tiny_unet):
    """No second pass (all kept) and a discarded step (no backward at all) still release every tensor
    the graph saved: nothing but the caller's loss held it."""
    unet = copy.deepcopy(tiny_unet)
    optimizer = adafactor(unet)[0]
    fused = FusedBackward([optimizer], per_parameter=True, kept_gradient_bytes=gradient_bytes(unet))
    parameters = {id(p) for p in unet.parameters()}
    for finish in (fused.apply, fused.discard):
        saved: list[weakref.ref] = []

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if id(tensor) in parameters:
                return tensor
            # detached: a saved output would otherwise hold its own node (a cycle autograd avoids itself)
            detached = tensor.detach()
            saved.append(weakref.ref(detached))
            return detached

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = unet_loss(unet, 1)
        fused.measure(loss)
        del loss
        finish()
        gc.collect()
        assert saved and all(ref() is None for ref in saved), finish.__name__
        assert all(p.grad is None for p in unet.parameters())


def test_fused_groups_adamw_equal_one_unfused_adamw(tiny_unet):
    """--fused_optimizer_groups 3 with AdamW (3 optimizers, each stepped when its gradients are ready)
    gives the weights of one unfused AdamW over all parameters (AdamW's update is per parameter)."""
    def one_adamw(model):
        return [torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)]

    def three_adamws(model):
        groups = split_into_groups([{"params": list(model.parameters()), "lr": 1e-3}], 3)
        return [torch.optim.AdamW([group], lr=1e-3, weight_decay=0.01) for group in groups]

    unfused = run(tiny_unet, one_adamw, 3, fused=False, spike_step=2)
    kept = run(tiny_unet, three_adamws, 3, fused=True, per_parameter=False, spike_step=2,
               kept_gradient_bytes=gradient_bytes(tiny_unet) // 2)  # a group's gradients partly kept
    for a, b in zip(unfused[0].parameters(), kept[0].parameters()):
        assert torch.equal(a, b)
    fused = run(tiny_unet, three_adamws, 3, fused=True, per_parameter=False, spike_step=2)
    assert len(fused[1]) == 3
    # never the full gradient: a group is freed when it steps. (Not one group at most: kohya splits by
    # parameter order, and the first group holds the time embedding, whose gradient completes last, after
    # every block that uses it; meanwhile a second group may wait too.)
    assert 0 < fused[4] < 2 * max(len(group["params"]) for optimizer in fused[1] for group in optimizer.param_groups)
    assert fused[4] < len(list(fused[0].parameters()))
    for a, b in zip(unfused[0].parameters(), fused[0].parameters()):
        assert torch.equal(a, b)
    # the three optimizers' states together are the one optimizer's, parameter by parameter
    one_state = unfused[1][0].state
    for optimizer in fused[1]:
        for parameter, state in optimizer.state.items():
            index = [id(p) for p in fused[0].parameters()].index(id(parameter))
            assert_equal_states(state, one_state[list(unfused[0].parameters())[index]])


def test_scaler_overflow_step_fused_equals_unfused(tiny_unet):
    """fp16 autocast with the loss scaler: step 1's scale 2**120 overflows (both runs skip it, back off to
    2**10), step 4 (loss x 100, small enough not to overflow fp16 at 2**10) is a guard skip; the other
    steps update identically."""
    scaler_args = dict(init_scale=2.0**120, backoff_factor=2.0**-110)
    common = dict(scaler_args=scaler_args, autocast=True, spike_step=4, spike=100.0)
    unfused = run(tiny_unet, adafactor, 5, fused=False, **common)
    fused = run(tiny_unet, adafactor, 5, fused=True, **common)
    assert_same_run(unfused, run(tiny_unet, adafactor, 5, fused=True, kept_gradient_bytes=gradient_bytes(tiny_unet) // 3,
                                 **common))  # kept gradients: unscaled once, by the measuring pass
    kept = (False, True, 2.0**10)
    assert [(row[2], row[3], row[4]) for row in unfused[3]] == [(False, False, 2.0**10), kept, kept,
                                                               (True, False, 2.0**10), kept]
    assert unfused[2].overflow_count == 1
    assert_same_run(unfused, fused)


def test_optimizer_state_round_trip(tiny_unet):
    """A fused run's saved optimizer state, loaded into a new run, continues exactly as the unfused run."""
    unfused_first = run(tiny_unet, adafactor, 2, fused=False)
    fused_first = run(tiny_unet, adafactor, 2, fused=True)
    assert_equal_states(unfused_first[1][0].state_dict(), fused_first[1][0].state_dict())
    buffers = []  # the bytes of the saved optimizer state, as a train state holds it
    for result in (unfused_first, fused_first):
        buffer = io.BytesIO()
        torch.save(result[1][0].state_dict(), buffer)
        buffers.append(buffer.getvalue())
    assert buffers[0] == buffers[1]

    state = {"optimizers": [torch.load(io.BytesIO(buffers[1]))]}
    unfused_rest = run(fused_first[0], adafactor, 2, fused=False, state=state)
    fused_rest = run(fused_first[0], adafactor, 2, fused=True, state=state)
    assert_same_run(unfused_rest, fused_rest)


class DropoutNet(torch.nn.Module):
    """A small real module whose forward draws random numbers (dropout) inside a gradient-checkpointed
    block: its backward recomputes the block, so RNG handling decides whether the passes agree."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.use_reentrant = use_reentrant
        self.stem = torch.nn.Linear(16, 16)  # so the checkpointed block's input requires grad (reentrant)
        self.block = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Dropout(0.3),
                                         torch.nn.Linear(64, 16))
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x):
        hidden = torch.utils.checkpoint.checkpoint(self.block, self.stem(x), use_reentrant=self.use_reentrant)
        return self.head(torch.nn.functional.dropout(hidden, 0.2))


def dropout_loss(model, step, autocast=False, spike_step=None, spike=SPIKE):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
    loss = model(x).square().mean()
    return loss * spike if step == spike_step else loss


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("kept", [0, 6_000])
def test_dropout_and_checkpointing_rng(use_reentrant, kept):
    """Dropout under gradient checkpointing, both of torch's kinds (the backward recomputes the block with
    its saved RNG state): the same weights, and the global RNG after the run is the unfused run's (so
    later draws are too). The cosine log's column matches too (from step 2 on; nan on step 1). With
    6000 bytes kept (the stem's and the block's first layer: 5440 bytes, the last 4 of 8 tensors to
    complete): the second pass computes the other 4; reentrant checkpointing refuses a pruned pass, so
    there it computes all 8 and drops the kept ones' (applied once)."""
    results = []
    passes: list = []
    for fused in (False, True):
        torch.manual_seed(123)
        result = run(DropoutNet(use_reentrant), adafactor, 4, fused=fused, loss_fn=dropout_loss, spike_step=3,
                     cosine=True, kept_gradient_bytes=kept, passes=passes)
        results.append((result, torch.get_rng_state()))
    (unfused, rng_a), (fused, rng_b) = results
    assert_same_run(unfused, fused)
    total = len(list(fused[0].parameters()))
    if kept:
        assert all(0 < kept_bytes <= kept for kept_bytes, _ in passes)
        # the skipped step 3 runs no second pass; unpruned (reentrant), every gradient is computed again
        assert [computed for _, computed in passes][:2] == ([total] * 2 if use_reentrant else [4] * 2)
    assert math.isnan(fused[3][0][5]) and all(-1 <= row[5] <= 1 for row in fused[3][1:])
    assert torch.equal(rng_a, rng_b)


def test_bfloat16_stochastic_rounding_is_unbiased_and_keyed():
    """bf16 weights under fused Adafactor are rounded stochastically (kohya): each value is one of its two
    bf16 neighbours, the mean over many draws is the float32 value, and the draws are keyed (the same
    seed gives the same bits, the global RNG is untouched)."""
    # rows: 1/8 of a bf16 step above 1.0, 3/4 of a step beyond -3.0 (the sign bit through the integer
    # arithmetic), and values bf16 holds exactly (never moved)
    value = torch.stack([torch.full((100_000,), 1.0 + 2.0**-10), torch.full((100_000,), -(3.0 + 3 * 2.0**-8)),
                         torch.tensor([0.0, -0.0, 1.0, -2.5, 2.0**-100, -(2.0**127)]).repeat(100_000 // 6 + 1)[:100_000]])
    target = torch.empty(value.shape, dtype=torch.bfloat16)
    rng_before, numpy_before = torch.get_rng_state(), numpy.random.get_state()[1].copy()
    fused_backward.stochastic_round_to_bfloat16_(target, value, 5)
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert (numpy.random.get_state()[1] == numpy_before).all()
    for row, low, high, expected_up in [(0, 1.0, 1.0 + 2.0**-7, 1 / 8), (1, -3.0, -(3.0 + 2.0**-6), 3 / 4)]:
        assert set(target[row].float().unique().tolist()) == {low, high}
        fraction_up = (target[row].float() == high).double().mean().item()
        # binomial: 6 standard deviations of 100k draws
        assert abs(fraction_up - expected_up) <= 6 * (expected_up * (1 - expected_up) / 100_000) ** 0.5
    assert torch.equal(target[2].view(torch.int16), value[2].bfloat16().view(torch.int16))
    again = torch.empty_like(target)
    fused_backward.stochastic_round_to_bfloat16_(again, value, 5)
    assert torch.equal(target, again)
    fused_backward.stochastic_round_to_bfloat16_(again, value, 6)
    assert not torch.equal(target, again)


def test_bfloat16_fused_adafactor_rounds_the_float32_update():
    """bf16 weights under fused Adafactor: each lands on one of the two bf16 neighbours of the float32
    update Adafactor computes from the same bf16 gradient (kohya's float32 working copy + stochastic
    rounding), and the optimizer state stays float32, keyed by the bf16 parameter."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)).to(torch.bfloat16)
    x = torch.randn(16, 32).bfloat16()
    with_grads = copy.deepcopy(model)
    with_grads(x).float().square().mean().backward()
    reference = copy.deepcopy(model).float()
    for target, source in zip(reference.parameters(), with_grads.parameters()):
        target.grad = source.grad.float()
    adafactor(reference)[0].step()

    optimizer = adafactor(model)[0]
    fused = FusedBackward([optimizer], per_parameter=True)
    fused.measure(model(x).float().square().mean())
    assert fused.apply()
    bf16_step = torch.finfo(torch.bfloat16).eps
    rounded_up = 0
    for (name, weight), expected in zip(model.named_parameters(), reference.parameters()):
        expected = expected.detach()
        nearest = expected.bfloat16().float()
        spacing = bf16_step * expected.abs().clamp_min(1e-30)  # a bf16 step near the value (2x at most)
        assert ((weight.float() - expected).abs() <= spacing).all(), name
        rounded_up += int((weight.float() != nearest).sum())
        state = optimizer.state[weight]
        assert state["step"] == 1 and all(v.dtype == torch.float32 for v in state.values() if torch.is_tensor(v))
    assert rounded_up > 0  # not round-to-nearest


def test_split_into_groups_follows_kohya():
    """kohya's rule: runs of ceil(total / N) tensors, and a new run whenever the learning rate changes."""
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(7)]
    groups = split_into_groups([{"params": params[:5], "lr": 1e-4}, {"params": params[5:], "lr": 2e-4}], 3)
    assert [(len(group["params"]), group["lr"]) for group in groups] == [(3, 1e-4), (2, 1e-4), (2, 2e-4)]
    assert [p for group in groups for p in group["params"]] == params


def test_options_refuse_what_cannot_work():
    def options(*argv, optimizer="AdamW"):
        parser = argparse.ArgumentParser()
        fused_backward.add_arguments(parser)
        parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
        return FusedOptions.from_args(parser.parse_args(list(argv)), optimizer, announce=lambda line: None)

    assert options("--fused_backward_pass", optimizer="Adafactor") == FusedOptions(True, None, None)
    assert options("--fused_backward_pass", "--fused_backward_kept_gradient_gib", "1.5",
                   optimizer="Adafactor").kept_gradient_gib == 1.5
    for wrong in ("-1", "nan", "inf"):
        with pytest.raises(UserError, match="--fused_backward_kept_gradient_gib must be a size in GiB >= 0"):
            options("--fused_backward_pass", "--fused_backward_kept_gradient_gib", wrong, optimizer="Adafactor")
    assert options("--fused_optimizer_groups", "4") == FusedOptions(False, 4)
    assert options("--fused_optimizer_groups", "0") == FusedOptions(False, None)
    assert options("--fused_backward_pass", "--fused_optimizer_groups", "4", optimizer="Adafactor").groups is None
    with pytest.raises(UserError, match="--fused_backward_pass needs --optimizer_type Adafactor"):
        options("--fused_backward_pass")
    with pytest.raises(UserError, match="--gradient_accumulation_steps 1"):
        options("--fused_optimizer_groups", "2", "--gradient_accumulation_steps", "2")
    with pytest.raises(UserError, match="--fused_optimizer_groups must be"):
        options("--fused_optimizer_groups", "-1")
