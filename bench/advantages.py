"""Speed of the packed cross-trajectory GAE (issue 4; SPEC §3).

Builds a packed batch of at least ``--tokens`` optimized tokens: rollouts of 1–4 segments (execution segments of
several assistant turns with observation tokens between them and a masked prompt; summary segments of one long
turn), terminal rewards, random values, VAPO's length-adaptive lambda per segment. Times, best of
``--repeats`` runs after a warm-up (single-threaded CPU by default, timed by thread CPU time so that other load on
a shared machine does not distort the ratios; ``--threads 0 --device cuda`` for a GPU):

- ``packed``: :func:`compactionrl.algos.packed_cross_trajectory_gae` on the flat batch as the trainer calls it
  (``impl="auto"``: the compiled kernel of :mod:`compactionrl.algos.kernels` on CPU, the torch scan on a GPU);
- ``packed-torch`` / ``packed-kernel``: each implementation forced (the kernel only on CPU);
- ``decoupled``: :func:`compactionrl.algos.compute_advantages_and_returns` (policy and critic lambdas, ``auto``);
- ``loop``: the per-timestep loop over the padded ``[B, L]`` batch, vectorized over the batch (the way most RL
  frameworks compute GAE: verl's multi-turn ``compute_gae_advantage_return``), plus the eq. 14 factor;
- ``cumsum``: one ``torch.cumsum`` over the same flat float32 tensor.

Prints the ratios against the targets (loop / packed >= 50, packed / cumsum <= 5) and checks that the packed
result equals the loop's. Usage: ``python bench/advantages.py [--tokens N] [--device cuda] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import torch

from compactionrl.algos import kernels
from compactionrl.algos import (
    compute_advantages_and_returns,
    packed_cross_trajectory_gae,
    segment_lambdas,
    terminal_rewards,
)


def build_batch(min_tokens: int, seed: int) -> dict[str, torch.Tensor]:
    """A flat packed batch: ``rewards, values, loss_mask, segment_ids [T]``, ``segment_rollout, lam [S]``."""
    rng = random.Random(seed)
    mask_parts: list[torch.Tensor] = []
    seg_of_token: list[int] = []
    seg_rollout: list[int] = []
    lengths: list[int] = []
    optimized = 0
    while optimized < min_tokens:
        rollout = len(set(seg_rollout))
        for k in range(rng.randint(1, 4)):
            if k % 2 == 1:  # a summary segment: its context is masked, one long generated turn
                turns = [(rng.randint(2000, 8000), rng.randint(200, 2000))]
            else:  # an execution segment: prompt, then (action, observation) turns
                turns = [(rng.randint(300, 1500), 0)] + [
                    (rng.randint(20, 400), rng.randint(20, 600)) for _ in range(rng.randint(2, 30))
                ]
            pieces = []
            for masked, generated in turns:
                pieces += [torch.zeros(masked, dtype=torch.bool), torch.ones(generated, dtype=torch.bool)]
            m = torch.cat(pieces)
            mask_parts.append(m)
            lengths.append(m.numel())
            seg_of_token.append(len(seg_rollout))
            seg_rollout.append(rollout)
            optimized += int(m.sum())
    loss_mask = torch.cat(mask_parts)
    segment_ids = torch.repeat_interleave(torch.tensor(seg_of_token), torch.tensor(lengths))
    segment_rollout = torch.tensor(seg_rollout)
    n_opt = torch.tensor([int(m.sum()) for m in mask_parts])
    reward = (torch.rand(len(seg_rollout), generator=torch.Generator().manual_seed(seed)) < 0.5).float()
    reward = reward[segment_rollout]  # all segments of a rollout share its reward
    return {
        "rewards": terminal_rewards(loss_mask, segment_ids, reward),
        "values": torch.rand(loss_mask.numel(), generator=torch.Generator().manual_seed(seed + 1)),
        "loss_mask": loss_mask,
        "segment_ids": segment_ids,
        "segment_rollout": segment_rollout,
        "lam": segment_lambdas(n_opt, segment_rollout, mode="segment"),
        "lengths": torch.tensor(lengths),
    }


def pad(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same batch as padded ``[B, L]`` tensors, one row per segment."""
    lengths = batch["lengths"].tolist()
    rows = lambda x: torch.nn.utils.rnn.pad_sequence(list(x.split(lengths)), batch_first=True)  # noqa: E731
    return {k: rows(batch[k]) for k in ("rewards", "values", "loss_mask")}


def loop_gae(r: torch.Tensor, v: torch.Tensor, m: torch.Tensor, gamma: float, lam: torch.Tensor) -> torch.Tensor:
    """Per-timestep masked GAE over a padded batch, vectorized over rows: verl's ``compute_gae_advantage_return``
    (``verl/trainer/ppo/core_algos.py``, multi-turn version: observation tokens skipped through the response mask),
    with a per-row lambda. Returns the advantages ``[B, L]`` (returns = advantages + values, as verl does)."""
    b, length = r.shape
    mask = m.to(r.dtype)
    nextvalues = torch.zeros(b, dtype=r.dtype, device=r.device)
    lastgaelam = torch.zeros(b, dtype=r.dtype, device=r.device)
    gl = gamma * lam.to(r.dtype)
    advantages_reversed = []
    for t in reversed(range(length)):
        delta = r[:, t] + gamma * nextvalues - v[:, t]
        lastgaelam_ = delta + gl * lastgaelam
        # skip values and TD-error on observation tokens
        nextvalues = v[:, t] * mask[:, t] + (1 - mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * mask[:, t] + (1 - mask[:, t]) * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = advantages + v  # noqa: F841 - part of the per-step work verl does
    return advantages


def timeit(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Best of ``repeats`` runs after a warm-up, in seconds. On a single-threaded CPU run the clock is the thread's
    CPU time, which other processes on a shared machine barely disturb; otherwise wall time."""
    cpu_clock = device.type == "cpu" and torch.get_num_threads() == 1
    clock = time.thread_time if cpu_clock else time.perf_counter

    def once() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = clock()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return clock() - t0

    once()  # warm-up
    return min(once() for _ in range(repeats))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8 * 2**20, help="minimum optimized tokens in the batch")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    batch = {k: x.to(device) for k, x in build_batch(args.tokens, args.seed).items()}
    padded = pad(batch)
    gamma = 1.0
    ids, sr, lam = batch["segment_ids"], batch["segment_rollout"], batch["lam"]
    flat = (batch["rewards"], batch["values"], batch["loss_mask"], ids, sr)
    n_opt, n_tok = int(batch["loss_mask"].sum()), batch["loss_mask"].numel()
    b, length = padded["rewards"].shape
    print(f"device {device}, threads {torch.get_num_threads()}")
    print(f"batch: {n_opt:,} optimized of {n_tok:,} tokens, {len(sr):,} segments in {int(sr.max()) + 1:,} rollouts")
    print(f"padded [B, L] = [{b:,}, {length:,}]")

    # the eq. 14 factor for the loop baseline (same N_{>s} as the packed code)
    counts = torch.zeros(len(sr), dtype=torch.int64, device=device).index_add_(0, ids, batch["loss_mask"].long())
    n_after = torch.tensor(
        [int(counts[(sr == sr[s]) & (torch.arange(len(sr), device=device) > s)].sum()) for s in range(len(sr))]
    )
    factor = (gamma * lam).pow(n_after.to(lam))

    def run_loop() -> torch.Tensor:
        return loop_gae(padded["rewards"], padded["values"], padded["loss_mask"], gamma, lam) * factor[:, None].to(
            padded["rewards"].dtype
        )

    results = {
        "packed": timeit(lambda: packed_cross_trajectory_gae(*flat, gamma, lam), args.repeats, device),
        "packed-torch": timeit(lambda: packed_cross_trajectory_gae(*flat, gamma, lam, impl="torch"), args.repeats,
                               device),  # fmt: skip
    }
    if device.type == "cpu" and kernels.numba_available():
        results["packed-kernel"] = timeit(
            lambda: packed_cross_trajectory_gae(*flat, gamma, lam, impl="kernel"), args.repeats, device
        )
    results |= {
        "decoupled": timeit(lambda: compute_advantages_and_returns(*flat, gamma, lam, 1.0), args.repeats, device),
        "cumsum": timeit(lambda: torch.cumsum(batch["rewards"], 0), args.repeats, device),
        "loop": timeit(run_loop, 1, device),
    }
    # correctness: the packed result equals the loop's, run in float64 on the first 64 segments
    adv, _ = packed_cross_trajectory_gae(*flat, gamma, lam)
    adv_torch, _ = packed_cross_trajectory_gae(*flat, gamma, lam, impl="torch")
    err_impl = (adv - adv_torch).abs().max().item() if adv.numel() else 0.0
    rows = min(64, b)
    ref = loop_gae(*(padded[k][:rows].double() for k in ("rewards", "values")), padded["loss_mask"][:rows], gamma,
                   lam[:rows]) * factor[:rows, None]  # fmt: skip
    first = batch["lengths"][:rows].sum()
    err = (adv[:first][batch["loss_mask"][:first]].double() - ref[padded["loss_mask"][:rows]]).abs().max().item()

    for name, sec in results.items():
        print(f"{name:>14}: {sec * 1e3:10.1f} ms")
    speedup = results["loop"] / results["packed"]
    overhead = results["packed"] / results["cumsum"]
    verdict = lambda ok: "PASS" if ok else "FAIL"  # noqa: E731
    print(f"loop / packed   = {speedup:8.1f}x   (target >= 50)  {verdict(speedup >= 50)}")
    print(f"packed / cumsum = {overhead:8.1f}x   (target <= 5)   {verdict(overhead <= 5)}")
    torch_speedup = results["loop"] / results["packed-torch"]
    torch_overhead = results["packed-torch"] / results["cumsum"]
    print(f"torch scan alone: loop / packed-torch = {torch_speedup:.1f}x, packed-torch / cumsum = {torch_overhead:.1f}x")
    print(f"max |packed - loop (float64)| over the first {rows} segments = {err:.2e}")
    print(f"max |packed - packed-torch| = {err_impl:.2e}")


if __name__ == "__main__":
    main()
