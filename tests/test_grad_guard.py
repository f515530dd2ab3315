"""The gradient guard: options, the decision core (vs hand-computed sequences and an
independent reference), its state, and the fused gradient measurement."""
from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from library import grad_guard
from library.errors import UserError
from library.grad_guard import GradGuard, GradientMonitor, GuardConfig

NAN = math.nan
INF = math.inf


def run(config: GuardConfig, norms, start_step: int = 1, guard: GradGuard | None = None):
    guard = guard or GradGuard(config, announce=lambda line: None)
    return [guard.decide(step, norm) for step, norm in enumerate(norms, start_step)]


def parse(argv):
    parser = argparse.ArgumentParser()
    grad_guard.add_arguments(parser)
    args = parser.parse_args(argv)
    grad_guard.apply_preset(args, grad_guard.explicit_dests(parser, argv))
    return args


# --------------------------------------------------------------------------- options


def test_defaults_match_the_spec():
    args = parse([])
    assert args.skip_grad_norm is False and args.skip_grad_norm_max is None
    assert args.skip_nan_immediate is True and args.skip_inf_immediate is True
    assert (args.cap_release_trigger_ratio, args.cap_release_trigger_steps, args.cap_release_length,
            args.cap_release_scale) == (0.66, 200, 200, 3.0)
    assert (args.idle_max_steps, args.idle_free_len) == (4000, 200)
    assert GuardConfig.from_args(args) == GuardConfig()


def test_boolean_optional_flags():
    args = parse(["--no-skip_nan_immediate", "--no-skip_inf_immediate"])
    assert args.skip_nan_immediate is False and args.skip_inf_immediate is False


def test_stable_preset_sets_everything_it_names():
    args = parse(["--grad_guard_preset", "stable"])
    assert args.skip_grad_norm and args.grad_norm_log and args.grad_cosine_log
    assert args.skip_grad_norm_max is None  # relative limits instead of the fork's absolute ones
    assert args.skip_grad_norm_warmup_factor == 20 and args.skip_grad_norm_max_factor == 20
    assert args.nan_to_window and args.inf_to_window
    assert args.skip_nan_immediate is False and args.skip_inf_immediate is False


def test_minimal_preset():
    args = parse(["--grad_guard_preset", "minimal"])
    assert args.skip_grad_norm and args.grad_norm_log and not args.grad_cosine_log
    assert args.skip_grad_norm_max is None and args.skip_nan_immediate is True


def test_explicit_flags_win_over_the_preset():
    argv = ["--skip_nan_immediate", "--grad_guard_preset", "stable", "--skip_grad_norm_max", "5"]
    args = parse(argv)
    assert args.skip_nan_immediate is True  # explicit, although equal to the default
    assert args.skip_grad_norm_max == 5.0
    assert args.skip_inf_immediate is False  # from the preset


def test_explicit_dests_reports_only_given_options():
    parser = argparse.ArgumentParser()
    parser.add_argument("--other", default=3)
    parser.set_defaults(hidden=1)
    grad_guard.add_arguments(parser)
    argv = ["--no-skip_inf_immediate", "--idle_max_steps", "4000"]
    assert grad_guard.explicit_dests(parser, argv) == {"skip_inf_immediate", "idle_max_steps"}
    assert parser.parse_args([]).other == 3 and parser.parse_args([]).hidden == 1  # defaults restored


def test_apply_preset_with_explicit_set_from_a_config_file():
    args = parse([])
    args.grad_guard_preset = "stable"
    args.nan_to_window = False
    grad_guard.apply_preset(args, {"nan_to_window", "grad_guard_preset"})
    assert args.nan_to_window is False and args.inf_to_window is True


def test_unknown_preset_is_a_user_error():
    args = parse([])
    args.grad_guard_preset = "fast"
    with pytest.raises(UserError, match="--grad_guard_preset"):
        grad_guard.apply_preset(args, set())


@pytest.mark.parametrize("flag, value", [
    ("--skip_grad_norm_max", "-1"), ("--skip_grad_norm_max", "nan"), ("--cap_release_trigger_ratio", "0"),
    ("--cap_release_trigger_steps", "0"), ("--cap_release_length", "-5"), ("--cap_release_scale", "-3"),
    ("--idle_max_steps", "0"), ("--idle_free_len", "-1"), ("--nan_inf_until_step", "0"),
    ("--skip_grad_norm_warmup_factor", "0"), ("--skip_grad_norm_max_factor", "inf"),
])
def test_invalid_values_are_user_errors_naming_the_flag(flag, value):
    with pytest.raises(UserError, match=flag):
        GuardConfig.from_args(parse([flag, value]))


def test_config_file_types_are_checked():
    args = parse([])
    args.idle_free_len = 2.5
    with pytest.raises(UserError, match="--idle_free_len"):
        GuardConfig.from_args(args)
    args.idle_free_len = 20.0
    args.skip_grad_norm_max = 200000  # a TOML integer
    config = GuardConfig.from_args(args)
    assert config.idle_free_len == 20 and config.skip_grad_norm_max == 200000.0


def test_auto_cap_release_without_max_warns(caplog):
    GuardConfig.from_args(parse(["--auto_cap_release"]))
    assert "--auto_cap_release has no effect" in caplog.text


# --------------------------------------------------------------------------- decision core, by rule

SKIP = GuardConfig(skip_grad_norm=True)


def test_warm_up_threshold_and_cap_ignored_until_the_window_is_full():
    config = GuardConfig(skip_grad_norm=True, skip_grad_norm_max=5.0)
    decisions = run(config, [1.0] * 150 + [150000.0, 250000.0] + [1.0] * 47 + [3.0, 1.0])
    assert all(d.threshold == 200000.0 for d in decisions[:199])
    assert not decisions[150].skip and decisions[151].skip  # 150000 kept, 250000 skipped
    assert not any(d.skip for d in decisions[:150])
    window = [1.0] * 150 + [150000.0, 250000.0] + [1.0] * 47 + [3.0]  # step 200: window is full
    expected = float(np.mean(window) + 2.5 * np.std(window))
    assert expected > 5.0 and decisions[199].threshold == 5.0 and not decisions[199].skip
    assert decisions[200].threshold == 5.0


def test_threshold_is_mean_plus_2_5_population_std_including_the_current_norm():
    decisions = run(SKIP, [1.0] * 200 + [2.0, 1.1])
    assert decisions[199].threshold == 1.0 and not decisions[199].skip  # std 0, 1.0 > 1.0 is False
    window = [1.0] * 199 + [2.0]
    mean = 201 / 200
    std = math.sqrt((199 * (1 - mean) ** 2 + (2 - mean) ** 2) / 200)
    assert decisions[200].threshold == pytest.approx(mean + 2.5 * std, rel=1e-12)
    assert decisions[200].threshold == float(np.mean(window) + 2.5 * np.std(window))
    assert decisions[200].skip  # 2.0 > 1.18
    assert not decisions[201].skip and decisions[201].thresh_off == 0


def test_nan_in_window_makes_the_threshold_nan_until_it_leaves_200_steps_later():
    config = GuardConfig(skip_grad_norm=True, nan_to_window=True, skip_nan_immediate=False)
    norms = [1.0] * 210
    norms[204] = NAN  # step 205
    norms += [1e9] * 200 + [1e9]
    decisions = run(config, norms)
    assert not decisions[204].skip
    assert [d.thresh_off for d in decisions[199:204]] == [0] * 5
    poisoned = decisions[204:404]  # steps 205..404
    assert all(math.isnan(d.threshold) and d.thresh_off == 1 and not d.skip for d in poisoned)
    assert decisions[404].thresh_off == 0 and not math.isnan(decisions[404].threshold)  # step 405


def test_nan_entered_during_warm_up_poisons_from_the_first_full_window():
    config = GuardConfig(skip_grad_norm=True, nan_to_window=True, skip_nan_immediate=False)
    norms = [1.0] * 210
    norms[4] = NAN  # step 5
    decisions = run(config, norms)
    assert decisions[4].threshold == 200000.0 and decisions[4].thresh_off == 0
    assert all(d.thresh_off == 1 for d in decisions[199:204])  # steps 200..204
    assert decisions[204].thresh_off == 0 and decisions[204].threshold == 1.0  # step 205


def test_inf_in_window_gives_nan_threshold():
    config = GuardConfig(skip_grad_norm=True, inf_to_window=True, skip_inf_immediate=False)
    decisions = run(config, [1.0] * 199 + [INF, 5.0])
    assert math.isnan(decisions[199].threshold) and decisions[199].thresh_off == 1
    assert not decisions[199].skip and not decisions[200].skip


def test_immediate_skips_keep_nan_and_inf_out_of_the_window():
    guard = GradGuard(SKIP)
    decisions = run(SKIP, [NAN, INF, -INF, 1.0], guard=guard)
    assert [d.skip for d in decisions] == [True, True, True, False]
    assert guard.state_dict()["window"] == [1.0] and guard.skipped_steps == 3


def test_no_skip_immediate_variants():
    config = GuardConfig(skip_grad_norm=True, skip_nan_immediate=False, skip_inf_immediate=False)
    warm = run(config, [NAN, INF])
    assert not warm[0].skip  # NaN > 200000 is False
    assert warm[1].skip  # Inf > 200000
    full = run(config, [1.0] * 200 + [NAN, INF])
    assert not full[200].skip and full[201].skip  # Inf against a finite threshold is skipped
    assert full[200].thresh_off == 0  # NaN kept out of the window


def test_nothing_skipped_against_a_nan_threshold():
    config = GuardConfig(skip_grad_norm=True, nan_to_window=True, skip_nan_immediate=False,
                         skip_inf_immediate=False)
    decisions = run(config, [1.0] * 199 + [NAN, 1e12, INF])
    assert [d.skip for d in decisions[199:]] == [False, False, False]


def test_without_skip_grad_norm_nothing_is_skipped_but_thresholds_are_computed():
    guard = GradGuard(GuardConfig())
    decisions = run(GuardConfig(), [1.0] * 200 + [NAN, INF, 1e12], guard=guard)
    assert not any(d.skip for d in decisions) and guard.skipped_steps == 0
    assert decisions[199].threshold == 1.0


def test_nan_inf_until_step_switch_takes_effect_at_step_n_plus_1():
    lines = []
    config = GuardConfig(skip_grad_norm=True, nan_to_window=True, skip_nan_immediate=False,
                         skip_inf_immediate=False, nan_inf_until_step=3)
    guard = GradGuard(config, announce=lines.append)
    decisions = run(config, [1.0, 1.0, NAN], guard=guard)
    assert guard.state_dict()["switched"] is True  # switched right after step N
    assert guard.options == grad_guard.FORCED_NAN_INF_OPTIONS
    assert len(lines) == 1 and "--nan_inf_until_step 3" in lines[0] and "at step 3" in lines[0]
    decisions += run(config, [NAN, INF], start_step=4, guard=guard)
    assert [d.skip for d in decisions] == [False, False, False, True, True]
    assert len(guard.state_dict()["window"]) == 3  # the step-3 NaN only
    assert len(lines) == 1


def test_until_step_switches_before_a_step_past_n_when_resumed_late():
    config = GuardConfig(skip_grad_norm=True, skip_nan_immediate=False, nan_inf_until_step=10)
    guard = GradGuard(config, announce=lambda line: None)
    assert guard.decide(50, NAN).skip


def test_cap_release_timing_during_warm_up():
    config = GuardConfig(skip_grad_norm=True, skip_grad_norm_max=100000.0, auto_cap_release=True,
                         cap_release_trigger_ratio=0.5, cap_release_trigger_steps=3, cap_release_length=2,
                         cap_release_scale=3.0)
    thresholds = [d.threshold for d in run(config, [1.0] * 12)]
    warm, released = 200000.0, 300000.0  # window not full: the pre-cap value (release replaces it)
    assert thresholds == [warm, warm, warm, released, released] * 2 + [warm, warm]


def test_cap_release_with_a_full_window():
    config = GuardConfig(skip_grad_norm=True, skip_grad_norm_max=8.0, auto_cap_release=True,
                         cap_release_trigger_ratio=0.5, cap_release_trigger_steps=250, cap_release_length=2,
                         cap_release_scale=3.0)
    decisions = run(config, [10.0] * 250 + [20.0, 10.0, 20.0])
    assert decisions[249].threshold == 8.0 and decisions[249].skip  # step 250: trigger reaches 250
    assert [d.threshold for d in decisions[250:252]] == [24.0, 24.0]  # steps 251, 252: released
    assert not decisions[250].skip
    assert decisions[252].threshold == 8.0 and decisions[252].skip  # step 253: capped again


def test_cap_release_trigger_resets_below_ratio_and_needs_a_max():
    config = GuardConfig(skip_grad_norm=True, skip_grad_norm_max=1000.0, auto_cap_release=True,
                         cap_release_trigger_ratio=0.5, cap_release_trigger_steps=3, cap_release_length=2)
    guard = GradGuard(config)
    run(config, [1.0] * 201, guard=guard)  # full window: pre = 1.0 < 500 resets the trigger
    assert guard.state_dict()["trigger"] == 0 and guard.state_dict()["release"] == 0
    no_max = GuardConfig(skip_grad_norm=True, auto_cap_release=True, cap_release_trigger_steps=1)
    assert all(d.threshold == 200000.0 for d in run(no_max, [1.0] * 5))


def test_idle_free_phase_start_length_and_thresh_off_2():
    config = GuardConfig(skip_grad_norm=True, idle_free_phase=True, idle_max_steps=5, idle_free_len=3)
    decisions = run(config, [300000.0] * 16)
    free_steps = [step for step, d in enumerate(decisions, 1) if d.thresh_off == 2]
    assert free_steps == [5, 6, 7, 13, 14, 15]
    assert [step for step, d in enumerate(decisions, 1) if not d.skip] == free_steps


def test_immediate_skips_still_apply_in_a_free_phase():
    config = GuardConfig(skip_grad_norm=True, idle_free_phase=True, idle_max_steps=2, idle_free_len=3)
    decisions = run(config, [1.0, NAN, INF, 1.0])
    assert [d.thresh_off for d in decisions] == [0, 2, 2, 2]
    assert [d.skip for d in decisions] == [False, True, True, False]


def test_a_nan_appended_to_the_window_resets_the_idle_counter():
    config = GuardConfig(skip_grad_norm=True, idle_free_phase=True, idle_max_steps=3, idle_free_len=2,
                         nan_to_window=True, skip_nan_immediate=False)
    decisions = run(config, [1.0, 1.0, NAN, 1.0, 1.0, 1.0])
    assert [d.thresh_off for d in decisions] == [0, 0, 0, 0, 0, 2]


STABLE = GuardConfig.from_args(parse(["--grad_guard_preset", "stable"]))
FORK_STABLE = GuardConfig.from_args(parse(["--skip_grad_norm", "--skip_grad_norm_max", "200000", "--nan_to_window",
                                           "--inf_to_window", "--no-skip_nan_immediate", "--no-skip_inf_immediate"]))


def test_relative_warm_up_threshold_is_a_multiple_of_the_median_norm_so_far():
    # the current norm is in the window: the first two steps can never be above 20 x the median
    assert [d.skip for d in run(STABLE, [1.0, 1e6])] == [False, False]
    decisions = run(STABLE, [1.0] * 20 + [21.0])
    assert decisions[-1].threshold == 20.0 and decisions[-1].skip  # median of 20 ones and 21.0: 1
    assert not run(STABLE, [1.0] * 20 + [19.0])[-1].skip
    # zeros and NaN/Inf do not count for the median; before any other norm nothing is skipped by threshold
    decisions = run(STABLE, [0.0, NAN, INF, 2.0, 0.0, 50.0])
    assert [d.threshold for d in decisions[:3]] == [INF, INF, INF] and not any(d.skip for d in decisions[:3])
    assert decisions[3].threshold == 40.0 and decisions[5].threshold == 20 * 26.0


def test_relative_cap_is_a_multiple_of_the_median_of_the_full_window():
    decisions = run(STABLE, [1.0] * 195 + [1000.0] * 5 + [25.0, 19.0])
    window = [1.0] * 195 + [1000.0] * 5
    assert float(np.mean(window) + 2.5 * np.std(window)) > 400  # the spikes lift mean + 2.5 std ...
    assert decisions[199].threshold == 20.0  # ... the cap holds it at 20 x the median (1)
    assert decisions[200].skip and not decisions[201].skip
    capped = GuardConfig(skip_grad_norm=True, skip_grad_norm_max=10.0, skip_grad_norm_max_factor=20.0)
    assert run(capped, [1.0] * 195 + [1000.0] * 5)[-1].threshold == 10.0  # both caps: the lower one


def test_stable_preset_trains_at_a_full_weight_gradient_scale_where_the_fork_values_skip_every_step():
    """LyCORIS Full on the tiny SDXL in fp16: norms of 2.8e5..4.6e5 (loss scale 65536, measured); a LoRA's
    are ~150 times smaller. The fork's absolute values (200000 in warm-up, then the cap) skip every step."""
    rng = np.random.default_rng(0)
    norms = [float(x) for x in rng.lognormal(math.log(3.5e5), 0.1, size=450)]
    assert all(d.skip for d in run(FORK_STABLE, norms))
    skipped = [step for step, d in enumerate(run(STABLE, norms), 1) if d.skip]
    # only mean + 2.5 std's own few (the fork's window rule, scale-free), none in warm-up
    assert len(skipped) <= 0.02 * len(norms) and all(step > 200 for step in skipped)
    assert skipped == [step for step, d in enumerate(run(STABLE, [norm / 128 for norm in norms]), 1) if d.skip]
    spiked = norms[:100] + [norms[100] * 25] + norms[101:]  # a spike in warm-up: above 20 x the median
    assert [step for step, d in enumerate(run(STABLE, spiked), 1) if d.skip][0] == 101


def test_agree_turns_a_local_keep_into_a_counted_skip():
    guard = GradGuard(SKIP)
    decision = guard.decide(1, 1.0, agree=lambda skip: True)
    assert decision.skip and guard.skipped_steps == 1


class _TwoRanks:
    """Stands in for an Accelerator whose other rank wants ``other_skip``."""

    num_processes = 2
    device = torch.device("cpu")

    def __init__(self, other_skip: bool):
        self.other = torch.tensor([1.0 if other_skip else 0.0])

    def reduce(self, tensor, reduction):
        assert reduction == "max"
        return torch.maximum(tensor, self.other)


def test_agree_across_processes():
    class Single:
        num_processes = 1

    assert grad_guard.agree_across_processes(True, Single()) is True
    assert grad_guard.agree_across_processes(False, _TwoRanks(other_skip=True)) is True
    assert grad_guard.agree_across_processes(False, _TwoRanks(other_skip=False)) is False


# --------------------------------------------------------------------------- independent reference


def reference_decisions(norms, c: GuardConfig):
    """The spec's algorithm written plainly over a list of everything appended so far."""
    history = []
    nan_win, inf_win, nan_skip, inf_skip = c.nan_to_window, c.inf_to_window, c.skip_nan_immediate, c.skip_inf_immediate
    trigger = release = idle = free_count = 0
    in_free = switched = False
    out = []
    for step, n in enumerate(norms, 1):
        nan, inf = np.isnan(n), np.isinf(n)
        appended = False
        if np.isfinite(n):
            history.append(n)
        if nan and nan_win or inf and inf_win:
            history.append(n)
            appended = True
        if in_free:
            free_count += 1
            if free_count >= c.idle_free_len:
                in_free, free_count = False, 0
        else:
            idle = 0 if appended else idle + 1
            if c.idle_free_phase and idle >= c.idle_max_steps:
                in_free, idle, free_count = True, 0, 0
        window = np.array(history[-200:], dtype=np.float64)
        full = len(window) == 200
        usable = sorted(value for value in window if math.isfinite(value) and value > 0)
        middle = len(usable) // 2  # the median, by hand
        median = None if not usable else (usable[middle] if len(usable) % 2 else (usable[middle - 1] + usable[middle]) / 2)
        with np.errstate(invalid="ignore"):
            pre = float(window.mean() + 2.5 * window.std()) if full else 200000.0
        if not full and c.skip_grad_norm_warmup_factor is not None:
            pre = INF if median is None else c.skip_grad_norm_warmup_factor * median
        caps = [c.skip_grad_norm_max] if c.skip_grad_norm_max is not None else []
        if c.skip_grad_norm_max_factor is not None and median is not None:
            caps.append(c.skip_grad_norm_max_factor * median)
        cap = min(caps) if caps else None
        if c.auto_cap_release and cap is not None:
            base_cap = cap
            if release > 0:
                cap = base_cap * c.cap_release_scale
                pre = cap
                release -= 1
            elif pre == pre and pre >= c.cap_release_trigger_ratio * base_cap:
                trigger += 1
                if trigger >= c.cap_release_trigger_steps:
                    release, trigger = c.cap_release_length, 0
            else:
                trigger = 0
        threshold = min(pre, cap) if (full and cap is not None and pre > cap) else pre
        off = 2 if in_free else int(np.isnan(threshold))
        if not c.skip_grad_norm:
            skip = False
        elif nan and nan_skip or inf and inf_skip:
            skip = True
        else:
            skip = not in_free and n > threshold
        out.append((skip, threshold, off))
        if c.nan_inf_until_step is not None and not switched and step >= c.nan_inf_until_step:
            nan_win, inf_win, nan_skip, inf_skip, switched = False, False, True, True, True
    return out


configs = st.builds(
    GuardConfig,
    skip_grad_norm=st.booleans(),
    skip_grad_norm_max=st.one_of(st.none(), st.sampled_from([0.5, 1.5, 3.0, 100.0, 150000.0])),
    skip_grad_norm_warmup_factor=st.one_of(st.none(), st.none(), st.sampled_from([1.5, 3.0, 20.0])),
    skip_grad_norm_max_factor=st.one_of(st.none(), st.none(), st.sampled_from([1.2, 3.0, 20.0])),
    nan_to_window=st.booleans(), inf_to_window=st.booleans(),
    skip_nan_immediate=st.booleans(), skip_inf_immediate=st.booleans(),
    nan_inf_until_step=st.one_of(st.none(), st.integers(1, 400)),
    auto_cap_release=st.booleans(),
    cap_release_trigger_ratio=st.sampled_from([0.1, 0.66, 1.0, 2.0]),
    cap_release_trigger_steps=st.integers(1, 60), cap_release_length=st.integers(1, 60),
    cap_release_scale=st.sampled_from([0.5, 3.0]),
    idle_free_phase=st.booleans(), idle_max_steps=st.integers(1, 120), idle_free_len=st.integers(1, 60),
)


@st.composite
def norm_sequences(draw):
    length = draw(st.integers(0, 520))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    norms = rng.lognormal(0.0, draw(st.sampled_from([0.1, 0.5, 1.5])), size=length)
    for _ in range(draw(st.integers(0, 8))):
        if length:
            norms[draw(st.integers(0, length - 1))] = draw(st.sampled_from([NAN, INF, 50.0, 1e6, 0.0]))
    return [float(x) for x in norms]


@settings(max_examples=150, deadline=None)
@given(configs, norm_sequences())
def test_guard_matches_the_reference(config, norms):
    guard = GradGuard(config, announce=lambda line: None)
    got = [guard.decide(step, norm) for step, norm in enumerate(norms, 1)]
    expected = reference_decisions(norms, config)
    assert len(got) == len(expected)
    for step, (decision, (skip, threshold, off)) in enumerate(zip(got, expected), 1):
        assert decision.skip == skip, step
        assert decision.thresh_off == off, step
        assert decision.threshold == threshold or (math.isnan(decision.threshold) and math.isnan(threshold)), step
    assert guard.skipped_steps == sum(skip for skip, _, _ in expected)


@settings(max_examples=60, deadline=None)
@given(norm_sequences(), st.integers(-40, 40))
def test_stable_preset_decisions_do_not_depend_on_the_gradient_scale(norms, exponent):
    """A network type's (or loss scale's) gradient scale multiplies every norm: the stable preset's decisions
    stay the same (scaling by a power of two is exact, so equal means bit-equal)."""
    factor = 2.0 ** exponent
    plain, scaled = run(STABLE, norms), run(STABLE, [norm * factor for norm in norms])
    assert [(d.skip, d.thresh_off) for d in plain] == [(d.skip, d.thresh_off) for d in scaled]
    for a, b in zip(plain, scaled):
        assert a.threshold * factor == b.threshold or (math.isnan(a.threshold) and math.isnan(b.threshold))


@settings(max_examples=60, deadline=None)
@given(configs, norm_sequences(), st.floats(0.0, 1.0))
def test_state_dict_round_trip_mid_sequence(config, norms, fraction):
    split = int(len(norms) * fraction)
    guard = GradGuard(config, announce=lambda line: None)
    for step, norm in enumerate(norms[:split], 1):
        guard.decide(step, norm)
    state = json.loads(json.dumps(guard.state_dict(), allow_nan=False))  # strictly JSON-able
    resumed = GradGuard(config, announce=lambda line: None)
    resumed.load_state_dict(state)
    for step, norm in enumerate(norms[split:], split + 1):
        a, b = guard.decide(step, norm), resumed.decide(step, norm)
        assert (a.skip, a.thresh_off) == (b.skip, b.thresh_off)
        assert a.threshold == b.threshold or (math.isnan(a.threshold) and math.isnan(b.threshold))
    assert guard.state_dict() == resumed.state_dict()


def test_state_dict_holds_plain_values_and_keeps_the_switch():
    config = GuardConfig(skip_grad_norm=True, nan_to_window=True, skip_nan_immediate=False, nan_inf_until_step=2)
    guard = GradGuard(config, announce=lambda line: None)
    run(config, [NAN, 1.0, 2.0], guard=guard)
    state = guard.state_dict()
    assert state["window"] == ["nan", 1.0, 2.0] and state["switched"] is True
    assert state["nan_inf_options"]["skip_nan_immediate"] is True
    resumed = GradGuard(config)
    resumed.load_state_dict(state)
    assert resumed.options == grad_guard.FORCED_NAN_INF_OPTIONS
    without_until = GradGuard(GuardConfig(skip_grad_norm=True, nan_to_window=True))
    without_until.load_state_dict(state)
    assert without_until.options.nan_to_window is True  # the current flags apply


# --------------------------------------------------------------------------- measurement


def make_parameters(seed: int = 0, dtype=torch.float32, device: torch.device = torch.device("cpu")):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(4, 7), (7, 4), (3,), (16, 5), (5, 16), (1,)]
    parameters = [torch.nn.Parameter(torch.zeros(shape, dtype=dtype, device=device)) for shape in shapes]
    for parameter in parameters:
        parameter.grad = torch.randn(parameter.shape, generator=generator).to(device, dtype)
    frozen = torch.nn.Parameter(torch.ones(3, device=device), requires_grad=False)
    return parameters, frozen


def flat_grad(parameters):
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).double().flatten()
                      for p in parameters])


def set_new_grads(parameters, seed):
    generator = torch.Generator().manual_seed(seed)
    for parameter in parameters:
        parameter.grad = torch.randn(parameter.shape, generator=generator).to(parameter.device, parameter.dtype)


@pytest.mark.parametrize("chunk_numel", [None, 1, 30, 10**6])
@pytest.mark.device
def test_monitor_norm_and_cosine_match_direct_computation(chunk_numel, device):
    parameters, frozen = make_parameters(device=device)
    monitor = GradientMonitor(parameters + [frozen], cosine=True, chunk_numel=chunk_numel)
    first = monitor.measure()
    assert first.norm == pytest.approx(torch.linalg.vector_norm(flat_grad(parameters)).item(), rel=1e-6)
    assert math.isnan(first.cosine) and first.scale == 1.0
    previous = flat_grad(parameters)
    for seed in (1, 2):
        set_new_grads(parameters, seed)
        if seed == 2:
            for p in parameters:  # partly correlated with the previous step
                p.grad += 0.5 * torch.ones_like(p)
        current = flat_grad(parameters)
        measurement = monitor.measure()
        expected = torch.nn.functional.cosine_similarity(current, previous, dim=0).item()
        assert measurement.cosine == pytest.approx(expected, abs=1e-6)
        assert measurement.norm == pytest.approx(torch.linalg.vector_norm(current).item(), rel=1e-6)
        previous = current


@pytest.mark.device
def test_norm_is_bit_identical_with_and_without_cosine(device):
    parameters, _ = make_parameters(3, device=device)
    plain = GradientMonitor(parameters)
    chunked = GradientMonitor(parameters, cosine=True, chunk_numel=20)
    for seed in range(4):
        set_new_grads(parameters, seed)
        assert plain.measure().norm == chunked.measure().norm


@pytest.mark.device
def test_monitor_does_not_modify_gradients(device):
    parameters, _ = make_parameters(device=device)
    monitor = GradientMonitor(parameters, cosine=True, unscaled=True, chunk_numel=25)
    for seed in range(3):
        set_new_grads(parameters, seed)
        before = [p.grad.clone() for p in parameters]
        monitor.measure(scale=torch.tensor([1024.0], device=device))
        assert all(torch.equal(p.grad, b) for p, b in zip(parameters, before))


@pytest.mark.device
def test_missing_grads_count_as_zero(device):
    parameters, _ = make_parameters(device=device)
    monitor = GradientMonitor(parameters, cosine=True, chunk_numel=30)
    monitor.measure()
    previous = flat_grad(parameters)
    set_new_grads(parameters, 5)
    parameters[0].grad = None
    parameters[3].grad = None
    current = flat_grad(parameters)
    measurement = monitor.measure()
    assert measurement.norm == pytest.approx(torch.linalg.vector_norm(current).item(), rel=1e-6)
    expected = torch.nn.functional.cosine_similarity(current, previous, dim=0).item()
    assert measurement.cosine == pytest.approx(expected, abs=1e-6)
    set_new_grads(parameters, 6)  # the zeroed slices must not leak stale values two steps later
    parameters[1].grad = None
    current2 = flat_grad(parameters)
    expected2 = torch.nn.functional.cosine_similarity(current2, current, dim=0).item()
    assert monitor.measure().cosine == pytest.approx(expected2, abs=1e-6)


@pytest.mark.device
def test_cosine_is_nan_for_zero_and_non_finite_gradients(device):
    parameters, _ = make_parameters(device=device)
    monitor = GradientMonitor(parameters, cosine=True)
    monitor.measure()
    for p in parameters:
        p.grad.zero_()
    zero = monitor.measure()
    assert zero.norm == 0.0 and math.isnan(zero.cosine)
    set_new_grads(parameters, 1)
    assert math.isnan(monitor.measure().cosine)  # previous norm was 0
    parameters[2].grad[0] = math.inf
    infinite = monitor.measure()
    assert infinite.norm == math.inf and math.isnan(infinite.cosine)
    set_new_grads(parameters, 2)
    assert math.isnan(monitor.measure().cosine)  # previous norm was inf
    parameters[2].grad[0] = math.nan
    assert math.isnan(monitor.measure().norm)


@pytest.mark.device
def test_cosine_off_gives_nan_and_no_buffers(device):
    parameters, _ = make_parameters(device=device)
    monitor = GradientMonitor(parameters)
    assert math.isnan(monitor.measure().cosine) and math.isnan(monitor.measure().cosine)
    assert monitor.state_dict()["previous_gradient"] is None


@pytest.mark.device
def test_scale_handling_and_unscaled_norm(device):
    parameters, _ = make_parameters(device=device)
    raw = torch.linalg.vector_norm(flat_grad(parameters)).item()
    scaled = GradientMonitor(parameters).measure(scale=torch.tensor([512.0], device=device))
    assert scaled.norm == pytest.approx(raw, rel=1e-6) and scaled.scale == 512.0
    unscaled = GradientMonitor(parameters, unscaled=True)
    assert unscaled.measure(scale=torch.tensor([512.0], device=device)).norm == pytest.approx(raw / 512, rel=1e-6)
    assert unscaled.measure(scale=256.0).norm == pytest.approx(raw / 256, rel=1e-6)
    assert unscaled.measure().norm == pytest.approx(raw, rel=1e-6)


@pytest.mark.device
def test_half_precision_gradients_do_not_overflow(device):
    parameter = torch.nn.Parameter(torch.zeros(100, dtype=torch.float16, device=device))
    parameter.grad = torch.full((100,), 60000.0, dtype=torch.float16, device=device)
    assert GradientMonitor([parameter]).measure().norm == pytest.approx(600000.0, rel=1e-3)


def test_monitor_state_dict_round_trip():
    parameters, _ = make_parameters()
    monitor = GradientMonitor(parameters, cosine=True, chunk_numel=40)
    monitor.measure()
    set_new_grads(parameters, 1)
    monitor.measure()
    state = monitor.state_dict()
    assert isinstance(state["previous_gradient"], torch.Tensor)
    assert torch.equal(state["previous_gradient"].double(), flat_grad(parameters))
    resumed = GradientMonitor(parameters, cosine=True)
    resumed.load_state_dict(state)
    set_new_grads(parameters, 2)
    assert resumed.measure().cosine == pytest.approx(monitor.measure().cosine, abs=1e-7)


def test_monitor_state_of_another_size_is_dropped_with_a_warning(caplog):
    parameters, _ = make_parameters()
    monitor = GradientMonitor(parameters[:2], cosine=True)
    monitor.measure()
    other = GradientMonitor(parameters, cosine=True)
    other.load_state_dict(monitor.state_dict())
    assert "previous gradient has" in caplog.text
    assert math.isnan(other.measure().cosine)


def test_monitor_reads_the_step_loss_in_the_same_sync():
    parameter = torch.nn.Parameter(torch.ones(3))
    parameter.grad = torch.full((3,), 2.0)
    monitor = GradientMonitor([parameter], cosine=True)
    measured = monitor.measure(scale=torch.tensor(4.0), loss=torch.tensor(0.25))
    assert measured.loss == 0.25 and measured.scale == 4.0
    assert measured.norm == pytest.approx(math.sqrt(12.0))
    assert math.isnan(monitor.measure().loss)
