"""Cross-trajectory GAE (SPEC §3, eqs. 3–5, 13–15) against slow references written as plain Python loops."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compactionrl.algos import (
    compute_advantages_and_returns,
    cross_trajectory_gae,
    length_adaptive_lambda,
    packed_cross_trajectory_gae,
    segment_lambdas,
)

SETTINGS = settings(max_examples=40, deadline=None)


@pytest.fixture(scope="module", autouse=True, params=["torch", "kernel"])
def gae_impl(request):
    """Every test runs against both implementations: the vectorized torch scan and the compiled CPU kernel."""
    import os

    old = os.environ.get("COMPACTIONRL_GAE_IMPL")
    os.environ["COMPACTIONRL_GAE_IMPL"] = request.param
    yield request.param
    if old is None:
        del os.environ["COMPACTIONRL_GAE_IMPL"]
    else:
        os.environ["COMPACTIONRL_GAE_IMPL"] = old
F64 = torch.float64

# ---------------------------------------------------------------- slow references (lists of floats, no torch)


def ref_cross_gae(rewards, values, gamma, lams, correct=True):
    """Eqs. 13–14 literally: a double sum per token, then the (gamma*lam_s)**N_{>s} factor."""
    adv = []
    for s, (r, v) in enumerate(zip(rewards, values)):
        n, c = len(r), gamma * lams[s]
        delta = [r[i] + gamma * (v[i + 1] if i + 1 < n else 0.0) - v[i] for i in range(n)]
        local = [sum(c**k * delta[i + k] for k in range(n - i)) for i in range(n)]
        n_after = sum(len(x) for x in rewards[s + 1 :])
        adv.append([a * (c**n_after if correct else 1.0) for a in local])
    rets = [[a + x for a, x in zip(aa, vv)] for aa, vv in zip(adv, values)]
    return adv, rets


def ref_plain_gae(r, v, gamma, lam):
    """Textbook GAE over one sequence: the backward recursion A_t = delta_t + gamma*lam*A_{t+1}."""
    out, acc = [0.0] * len(r), 0.0
    for t in reversed(range(len(r))):
        nxt = v[t + 1] if t + 1 < len(r) else 0.0
        acc = r[t] + gamma * nxt - v[t] + gamma * lam * acc
        out[t] = acc
    return out


def close(a, b, tol=1e-9):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert abs(float(x) - float(y)) <= tol * (1 + abs(float(y))), (a, b)


# ---------------------------------------------------------------- strategies

unit = st.one_of(st.sampled_from([0.0, 0.3, 0.5, 0.9, 0.99, 1.0]), st.floats(0.0, 1.0))
val = st.floats(-2.0, 2.0, allow_nan=False)


@st.composite
def rollout(draw, max_segments=4, max_len=10):
    k = draw(st.integers(1, max_segments))
    lens = [draw(st.integers(0, max_len)) for _ in range(k)]
    r = [[draw(val) for _ in range(n)] for n in lens]
    v = [[draw(val) for _ in range(n)] for n in lens]
    lams = [draw(unit) for _ in range(k)]
    return r, v, lams


def t64(xs):
    return [torch.tensor(x, dtype=F64) for x in xs]


# ---------------------------------------------------------------- per-rollout function


@SETTINGS
@given(rollout(), unit, st.booleans(), st.booleans())
def test_cross_trajectory_gae_matches_reference(ro, gamma, correct, per_segment):
    r, v, lams = ro
    lam = lams if per_segment else lams[0]
    adv, ret = cross_trajectory_gae(t64(r), t64(v), gamma, lam, correct=correct)
    ref_adv, ref_ret = ref_cross_gae(r, v, gamma, lams if per_segment else [lams[0]] * len(r), correct)
    for a, b, c, d in zip(adv, ref_adv, ret, ref_ret):
        close(a.tolist(), b)
        close(c.tolist(), d)


@SETTINGS
@given(rollout(), unit, unit, st.floats(0.1, 5.0))
def test_eq15_zero_values_equal_gae_over_concatenation(ro, gamma, lam, reward):
    """V ≡ 0 and the shared reward R on each segment's last token: Â = GAE over all segments concatenated with R
    once, at the very end (eq. 15)."""
    lens = [len(x) for x in ro[0]]
    rewards = [[0.0] * (n - 1) + [reward] if n else [] for n in lens]
    zeros = [[0.0] * n for n in lens]
    adv, _ = cross_trajectory_gae(t64(rewards), t64(zeros), gamma, lam)
    total = sum(lens)
    concat = ref_plain_gae([0.0] * (total - 1) + [reward] if total else [], [0.0] * total, gamma, lam)
    close(torch.cat(adv).tolist(), concat)


@SETTINGS
@given(st.lists(val, min_size=1, max_size=30), unit, unit, st.data())
def test_single_segment_is_plain_gae(r, gamma, lam, data):
    v = data.draw(st.lists(val, min_size=len(r), max_size=len(r)))
    for correct in (True, False):
        adv, ret = cross_trajectory_gae(t64([r]), t64([v]), gamma, lam, correct=correct)
        close(adv[0].tolist(), ref_plain_gae(r, v, gamma, lam))
        close(ret[0].tolist(), [a + b for a, b in zip(ref_plain_gae(r, v, gamma, lam), v)])


@settings(max_examples=25, deadline=None)
@given(rollout())
def test_gamma_lam_one_makes_correction_identity(ro):
    r, v, _ = ro
    a1, r1 = cross_trajectory_gae(t64(r), t64(v), 1.0, 1.0, correct=True)
    a0, r0 = cross_trajectory_gae(t64(r), t64(v), 1.0, 1.0, correct=False)
    for x, y in zip(a1 + r1, a0 + r0):
        assert torch.equal(x, y)


def test_hand_computed_two_segments():
    # seg 2: delta = [0 + .5 - .4, 1 - .5] = [.1, .5]; A = [.1 + .9*.5, .5]
    # seg 1: delta = [.1, .1, .7]; A_loc = [.757, .73, .7]; times .9**2 (N_{>1} = 2)
    adv, ret = cross_trajectory_gae(
        t64([[0, 0, 1.0], [0, 1.0]]), t64([[0.1, 0.2, 0.3], [0.4, 0.5]]), gamma=1.0, lam=0.9
    )
    close(adv[0].tolist(), [0.757 * 0.81, 0.73 * 0.81, 0.7 * 0.81])
    close(adv[1].tolist(), [0.55, 0.5])
    close(ret[1].tolist(), [0.95, 1.0])


def test_cross_trajectory_gae_rejects_bad_input():
    with pytest.raises(ValueError, match="segments"):
        cross_trajectory_gae(t64([[1.0]]), [], 1.0, 0.9)
    with pytest.raises(ValueError, match="lam has 1 entries for 2"):
        cross_trajectory_gae(t64([[1.0], [1.0]]), t64([[0.0], [0.0]]), 1.0, [0.9])
    with pytest.raises(ValueError, match="lam must lie"):
        cross_trajectory_gae(t64([[1.0]]), t64([[0.0]]), 1.0, 1.5)
    with pytest.raises(ValueError, match="gamma must lie"):
        cross_trajectory_gae(t64([[1.0]]), t64([[0.0]]), -0.1, 0.9)


# ---------------------------------------------------------------- packed batch


def pack(rollouts, rng, obs_max=3, pad=2):
    """Flat batch of all segments in a shuffled order, observation tokens (mask 0, junk rewards/values) inserted
    between optimized tokens, and -1 padding at the end. Returns the tensors and each optimized token's
    (rollout, segment-in-rollout, position) in flat order."""
    seg_keys = [(ri, si) for ri, ro in enumerate(rollouts) for si in range(len(ro[0]))]
    seg_id = {key: i for i, key in enumerate(seg_keys)}  # ids increase with time inside a rollout
    order = seg_keys[:]
    rng.shuffle(order)
    rew, val, mask, ids, where = [], [], [], [], []
    for ri, si in order:
        r, v = rollouts[ri][0][si], rollouts[ri][1][si]
        for i in range(len(r) + 1):
            for _ in range(rng.randint(0, obs_max)):  # an observation / prompt token: skipped by GAE
                rew.append(rng.uniform(-9, 9)), val.append(rng.uniform(-9, 9)), mask.append(False)
                ids.append(seg_id[(ri, si)]), where.append(None)
            if i < len(r):
                rew.append(r[i]), val.append(v[i]), mask.append(True), ids.append(seg_id[(ri, si)])
                where.append((ri, si, i))
    for _ in range(pad):
        rew.append(5.0), val.append(5.0), mask.append(False), ids.append(-1), where.append(None)
    seg_rollout = torch.tensor([ri for ri, _ in seg_keys], dtype=torch.int64)
    tensors = (
        torch.tensor(rew, dtype=F64),
        torch.tensor(val, dtype=F64),
        torch.tensor(mask, dtype=torch.bool),
        torch.tensor(ids, dtype=torch.int64),
        seg_rollout,
    )
    return tensors, where, seg_keys


def check_packed(out, where, per_rollout):
    for t, w in enumerate(where):
        if w is None:
            assert float(out[t]) == 0.0
        else:
            ri, si, i = w
            close([out[t]], [per_rollout[ri][si][i]])


@SETTINGS
@given(st.lists(rollout(), min_size=1, max_size=4), unit, st.booleans(), st.randoms(use_true_random=False))
def test_packed_equals_per_rollout(rollouts, gamma, correct, rng):
    (rew, val, mask, ids, seg_rollout), where, seg_keys = pack(rollouts, rng)
    lam = torch.tensor([rollouts[ri][2][si] for ri, si in seg_keys], dtype=F64)
    adv, ret = packed_cross_trajectory_gae(rew, val, mask, ids, seg_rollout, gamma, lam, correct=correct)
    # the per-rollout function through the other implementation: the two cross-check each other
    per = [cross_trajectory_gae(t64(r), t64(v), gamma, lams, correct=correct, impl="torch") for r, v, lams in rollouts]
    check_packed(adv, where, [[a.tolist() for a in p[0]] for p in per])
    check_packed(ret, where, [[a.tolist() for a in p[1]] for p in per])
    ref = [ref_cross_gae(r, v, gamma, lams, correct) for r, v, lams in rollouts]
    check_packed(adv, where, [p[0] for p in ref])


@SETTINGS
@given(
    st.lists(rollout(), min_size=1, max_size=4),
    unit,
    st.booleans(),
    st.sampled_from(["corrected", "local"]),
    st.randoms(use_true_random=False),
)
def test_decoupled_lambdas_equal_per_rollout(rollouts, gamma, correct, value_target, rng):
    (rew, val, mask, ids, seg_rollout), where, seg_keys = pack(rollouts, rng)
    lam_policy = torch.tensor([rollouts[ri][2][si] for ri, si in seg_keys], dtype=F64)
    lam_critic = 1.0 - 0.5 * lam_policy.flip(0)  # a different lambda per segment
    adv, ret = compute_advantages_and_returns(
        rew, val, mask, ids, seg_rollout, gamma, lam_policy, lam_critic, correct=correct, value_target=value_target
    )
    ref_adv, ref_ret = [], []
    for ri, (r, v, lams) in enumerate(rollouts):
        critic = [float(lam_critic[seg_keys.index((ri, si))]) for si in range(len(r))]
        ref_adv.append(ref_cross_gae(r, v, gamma, lams, correct)[0])
        ref_ret.append(ref_cross_gae(r, v, gamma, critic, value_target == "corrected")[1])
    check_packed(adv, where, ref_adv)
    check_packed(ret, where, ref_ret)


@settings(max_examples=25, deadline=None)
@given(rollout(), unit, unit, st.randoms(use_true_random=False))
def test_inserting_observation_tokens_changes_nothing(ro, gamma, lam, rng):
    (rew0, val0, mask0, ids0, sr0), _, _ = pack([ro], random.Random(0), obs_max=0, pad=0)
    (rew1, val1, mask1, ids1, sr1), _, _ = pack([ro], rng, obs_max=4, pad=3)
    # the two packs order segments differently: compare segment by segment
    a0, r0 = packed_cross_trajectory_gae(rew0, val0, mask0, ids0, sr0, gamma, lam)
    a1, r1 = packed_cross_trajectory_gae(rew1, val1, mask1, ids1, sr1, gamma, lam)
    by_seg0 = {int(s): a0[mask0 & (ids0 == s)] for s in range(len(sr0))}
    by_seg1 = {int(s): a1[mask1 & (ids1 == s)] for s in range(len(sr1))}
    for s in by_seg0:
        assert torch.allclose(by_seg0[s], by_seg1[s], rtol=1e-12, atol=1e-12)
    assert torch.all(a1[~mask1] == 0) and torch.all(r1[~mask1] == 0)


def test_shared_lambda_reuses_the_advantages():
    (rew, val, mask, ids, sr), _, _ = pack([([[0.0, 1.0], [0.5]], [[0.2, 0.1], [0.3]], [0.9, 0.9])], random.Random(1))
    adv, ret = packed_cross_trajectory_gae(rew, val, mask, ids, sr, 0.99, 0.9)
    adv2, ret2 = compute_advantages_and_returns(rew, val, mask, ids, sr, 0.99, 0.9, 0.9)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)
    _, ret_local = compute_advantages_and_returns(rew, val, mask, ids, sr, 0.99, 0.9, 0.9, value_target="local")
    _, ref_local = packed_cross_trajectory_gae(rew, val, mask, ids, sr, 0.99, 0.9, correct=False)
    assert torch.equal(ret_local, ref_local) and not torch.equal(ret_local, ret)


def test_packed_float32_and_empty():
    rew = torch.tensor([0.0, 0.0, 1.0])
    val = torch.tensor([0.5, 0.1, 0.2])
    mask = torch.tensor([False, True, True])
    ids = torch.tensor([0, 0, 0])
    adv, ret = packed_cross_trajectory_gae(rew, val, mask, ids, torch.tensor([0]), 1.0, 0.5)
    assert adv.dtype == torch.float32
    close(adv.tolist(), [0.0, 0.1 + 0.5 * 0.8, 0.8], tol=1e-6)
    close(ret.tolist(), [0.0, 0.6, 1.0], tol=1e-6)
    empty = torch.zeros(0)
    a, r = packed_cross_trajectory_gae(
        empty, empty, empty.bool(), empty.long(), torch.zeros(0, dtype=torch.int64), 1.0, 0.9
    )
    assert a.shape == (0,) and r.shape == (0,)


def test_packed_rejects_bad_layouts():
    rew = torch.zeros(4)
    mask = torch.ones(4, dtype=torch.bool)
    sr = torch.tensor([0, 0])
    with pytest.raises(ValueError, match="segment 0 are not contiguous"):
        packed_cross_trajectory_gae(rew, rew, mask, torch.tensor([0, 1, 1, 0]), sr, 1.0, 0.9)
    with pytest.raises(ValueError, match=r"must lie in \[0, 2\)"):
        packed_cross_trajectory_gae(rew, rew, mask, torch.tensor([0, 0, 2, 2]), sr, 1.0, 0.9)
    with pytest.raises(ValueError, match="must lie in"):
        packed_cross_trajectory_gae(rew, rew, mask, torch.tensor([0, 0, -1, -1]), sr, 1.0, 0.9)
    with pytest.raises(ValueError, match=r"lam has shape \(3,\)"):
        packed_cross_trajectory_gae(rew, rew, mask, torch.tensor([0, 0, 1, 1]), sr, 1.0, torch.ones(3))
    with pytest.raises(ValueError, match="loss_mask must be bool"):
        packed_cross_trajectory_gae(rew, rew, mask.float(), torch.tensor([0, 0, 1, 1]), sr, 1.0, 0.9)
    with pytest.raises(ValueError, match="value_target"):
        compute_advantages_and_returns(rew, rew, mask, torch.tensor([0, 0, 1, 1]), sr, 1.0, 0.9, 1.0,
                                       value_target="mc")  # fmt: skip


# ---------------------------------------------------------------- lambdas


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 10**7), st.floats(1.0, 4.0))
def test_length_adaptive_lambda_scalar_and_tensor(length, alpha):
    lam = length_adaptive_lambda(length, alpha)
    assert isinstance(lam, float)
    assert abs(lam - (1 - 1 / (alpha * length))) < 1e-15
    t = length_adaptive_lambda(torch.tensor([length]), alpha)
    assert t.dtype == F64 and abs(float(t[0]) - lam) < 1e-15


def test_length_adaptive_lambda_errors():
    assert length_adaptive_lambda(2) == pytest.approx(1 - 1 / 3)
    for bad in (0, -3, 0.0):
        with pytest.raises(ValueError, match="length must be > 0"):
            length_adaptive_lambda(bad)
    with pytest.raises(ValueError, match="every length must be > 0"):
        length_adaptive_lambda(torch.tensor([3, 0]))
    with pytest.raises(ValueError, match="alpha must be > 0"):
        length_adaptive_lambda(5, alpha=0.0)
    with pytest.raises(ValueError, match="alpha \\* length must be >= 1"):
        length_adaptive_lambda(1, alpha=0.5)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 50)), min_size=1, max_size=12))
def test_segment_lambdas_modes(segs):
    rollout_of = torch.tensor([r for r, _ in segs])
    n = torch.tensor([k for _, k in segs])
    per_seg = segment_lambdas(n, rollout_of, mode="segment")
    per_rollout = segment_lambdas(n, rollout_of, mode="rollout", alpha=2.0)
    for i, (r, k) in enumerate(segs):
        assert float(per_seg[i]) == pytest.approx(1 - 1 / (1.5 * max(k, 1)), abs=1e-15)
        total = sum(kk for rr, kk in segs if rr == r)
        assert float(per_rollout[i]) == pytest.approx(1 - 1 / (2.0 * max(total, 1)), abs=1e-15)
    with pytest.raises(ValueError, match="mode"):
        segment_lambdas(n, rollout_of, mode="turn")  # type: ignore[arg-type]


def test_impl_choice_is_validated():
    rew = torch.zeros(2)
    args = (rew, rew, torch.ones(2, dtype=torch.bool), torch.tensor([0, 0]), torch.tensor([0]), 1.0, 0.9)
    with pytest.raises(ValueError, match="impl .*'auto', 'torch' or 'kernel'"):
        packed_cross_trajectory_gae(*args, impl="numpy")
    a, _ = packed_cross_trajectory_gae(*args, impl="kernel")
    b, _ = packed_cross_trajectory_gae(*args, impl="torch")
    assert torch.equal(a, b)
