"""Compiled CPU kernels for the packed cross-trajectory GAE (SPEC §3, eqs. 13–14), via numba.

On a CPU, the vectorized torch scan of :mod:`compactionrl.algos.scan` makes about twenty passes over the batch
(compaction of the optimized tokens, float64 conversions, the chunk scaling, scatters back), so it costs about
ten ``torch.cumsum`` of the same tensor. The GAE recursion itself is one backward pass with a few flops per token:
compiled, it runs at memory speed, about one ``cumsum``. These kernels are that pass, and they compute exactly the
per-token recursion of the reference loop (float64 accumulators), so they agree with the torch path to rounding.

Used by :func:`compactionrl.algos.advantages.packed_cross_trajectory_gae` and
:func:`~compactionrl.algos.advantages.compute_advantages_and_returns` for CPU tensors when numba is importable
(``impl="auto"``); the torch path serves GPUs and machines without numba. Compiled on first use (about 2 s) and
cached next to this file when the folder is writable.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import Tensor

__all__ = ["numba_available", "segment_token_counts", "packed_gae_kernel"]


@functools.cache
def _kernels():
    """Compile (or load from cache) the two kernels; None when numba is missing."""
    try:
        import numba
    except ImportError:  # pragma: no cover - numba is a dependency; GPU-only installs may drop it
        return None

    @numba.njit(cache=True, nogil=True)
    def count(mask, seg, counts):  # pragma: no cover - compiled
        """counts[s] += 1 per optimized token; returns -1, or the index of an optimized token whose id is bad."""
        n_seg = counts.shape[0]
        for i in range(mask.shape[0]):
            if mask[i]:
                s = seg[i]
                if s < 0 or s >= n_seg:
                    return i
                counts[s] += 1
        return -1

    @numba.njit(cache=True, nogil=True)
    def gae(r, v, mask, seg, gamma, c_a, f_a, c_c, f_c, adv, ret, seen):  # pragma: no cover - compiled
        """One backward pass; returns -1, or the id of a segment whose optimized tokens are not contiguous."""
        cur = -1
        next_v = 0.0
        a_pol = 0.0
        a_cri = 0.0
        ca = 0.0
        cc = 0.0
        fa = 1.0
        fc = 1.0
        for i in range(r.shape[0] - 1, -1, -1):
            if not mask[i]:
                continue
            s = seg[i]
            if s != cur:  # the last optimized token (in time) of segment s: V(x_{s, n_s + 1}) = 0
                if seen[s]:
                    return s
                seen[s] = True
                cur = s
                next_v = 0.0
                a_pol = 0.0
                a_cri = 0.0
                ca = c_a[s]
                cc = c_c[s]
                fa = f_a[s]
                fc = f_c[s]
            vi = np.float64(v[i])
            delta = np.float64(r[i]) + gamma * next_v - vi  # eq. 13
            a_pol = delta + ca * a_pol  # local GAE, eq. 4
            a_cri = delta + cc * a_cri
            adv[i] = a_pol * fa  # eq. 14
            ret[i] = a_cri * fc + vi  # eq. 5
            next_v = vi
        return -1

    return count, gae


def numba_available() -> bool:
    """Whether the compiled kernels can be used (numba importable)."""
    return _kernels() is not None


def _np(x: Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor (bfloat16/float16 widened to float32, which numpy lacks or numba slows)."""
    x = x.detach()
    if x.dtype in (torch.bfloat16, torch.float16):
        x = x.float()
    return x.contiguous().numpy()


def segment_token_counts(loss_mask: Tensor, segment_ids: Tensor, num_segments: int) -> Tensor:
    """Optimized tokens per segment, ``n_s``, in one pass.

    Args:
        loss_mask: ``[T]`` bool (CPU).
        segment_ids: ``[T]`` int64 (CPU); only optimized tokens' ids are read.
        num_segments: ``S``.

    Returns:
        ``[S]`` int64 counts.

    Raises:
        ValueError: an optimized token's segment id lies outside ``[0, S)`` (names the token).
    """
    count, _ = _kernels()
    counts = np.zeros(num_segments, dtype=np.int64)
    bad = count(_np(loss_mask), _np(segment_ids), counts)
    if bad >= 0:
        raise ValueError(
            f"segment_ids of optimized tokens must lie in [0, {num_segments}); token {bad} has "
            f"{int(segment_ids[bad])}"
        )
    return torch.from_numpy(counts)


def packed_gae_kernel(
    rewards: Tensor,
    values: Tensor,
    loss_mask: Tensor,
    segment_ids: Tensor,
    gamma: float,
    discount_policy: Tensor,
    factor_policy: Tensor,
    discount_critic: Tensor,
    factor_critic: Tensor,
) -> tuple[Tensor, Tensor]:
    """Advantages and returns of a packed batch in one backward pass over the flat tensors (CPU).

    Per segment ``s`` over its optimized tokens, backwards in time: ``delta = r + gamma * V(next) - V`` (eq. 13),
    ``A = delta + c_s * A`` (eq. 4), ``advantages = A_pol * f_pol[s]`` (eq. 14), ``returns = A_cri * f_cri[s] + V``
    (eq. 5). Ids must already be validated (:func:`segment_token_counts`).

    Args:
        rewards, values: ``[T]`` float (any float dtype; accumulated in float64).
        loss_mask: ``[T]`` bool.
        segment_ids: ``[T]`` int64 in ``[0, S)`` on optimized tokens.
        gamma: discount.
        discount_policy, discount_critic: ``[S]`` float64 ``gamma * lam_s`` for the two GAEs.
        factor_policy, factor_critic: ``[S]`` float64 eq. 14 factors (ones for local GAE).

    Returns:
        ``(advantages, returns)``, ``[T]`` of ``values.dtype``, 0 off the loss mask.

    Raises:
        ValueError: a segment's optimized tokens are not contiguous in the packed batch.
    """
    _, gae = _kernels()
    out_dtype = values.dtype
    np_dtype = np.float64 if out_dtype == torch.float64 else np.float32
    t = loss_mask.shape[0]
    adv = np.zeros(t, dtype=np_dtype)
    ret = np.zeros(t, dtype=np_dtype)
    seen = np.zeros(discount_policy.numel(), dtype=np.bool_)
    bad = gae(
        _np(rewards), _np(values), _np(loss_mask), _np(segment_ids), float(gamma),
        _np(discount_policy), _np(factor_policy), _np(discount_critic), _np(factor_critic), adv, ret, seen,
    )  # fmt: skip
    if bad >= 0:
        raise ValueError(f"the optimized tokens of segment {bad} are not contiguous in the packed batch")
    return torch.from_numpy(adv).to(out_dtype), torch.from_numpy(ret).to(out_dtype)
