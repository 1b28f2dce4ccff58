"""Min-cost covering knapsack, exactly: the inner problem of the recompute planner.

Choose a subset of items ``(saving, cost, index)`` whose savings sum to at least ``need`` at
the least total cost (ties: fewer items). Depth-first branch and bound: items in order of cost
per byte saved, a node is cut when its lower bound cannot beat the incumbent: the larger of the
LP relaxation's cost (greedy, one fractional item) and (items still needed, at least
``need / largest saving``) x (cheapest item); on a cost tie, the fewest items that cover.
Exact like the dynamic program it replaces, and fast on uneven sizes where that program's
Pareto frontier grows exponentially (200 blocks: see benchmarks/memory_accuracy.py --planner).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence

Item = tuple[int, float, int]
Answer = tuple[float, int, tuple[int, ...]]
_REL = 1e-12  # float sums in different orders: costs this close are ties


class _Search:
    def __init__(self, order: list[Item], best: tuple[float, float]) -> None:
        self.sav = [it[0] for it in order]
        self.cost = [it[1] for it in order]
        self.index = [it[2] for it in order]
        n = len(order)
        self.suffix = [0] * (n + 1)
        self.max_sav = [0] * (n + 1)  # largest saving among items k.. (count bound)
        self.min_cost = [math.inf] * (n + 1)  # cheapest item among items k.. (cost bound)
        for i in range(n - 1, -1, -1):
            self.suffix[i] = self.suffix[i + 1] + self.sav[i]
            self.max_sav[i] = max(self.max_sav[i + 1], self.sav[i])
            self.min_cost[i] = min(self.min_cost[i + 1], self.cost[i])
        self.prefix_sav = list(itertools.accumulate(self.sav, initial=0))
        self.prefix_cost = list(itertools.accumulate(self.cost, initial=0.0))
        self.by_saving = sorted(range(n), key=lambda i: -self.sav[i])
        self.best_cost, self.best_count = best
        self.best: tuple[int, ...] | None = None
        self.chosen: list[int] = []

    def _lp_cost(self, k: int, need: int) -> float:
        """Greedy in cost-per-byte order from item k, the last item taken fractionally."""
        target = self.prefix_sav[k] + need
        j = bisect.bisect_left(self.prefix_sav, target, lo=k + 1) - 1  # items k..j-1 whole
        if j >= len(self.sav):
            return math.inf
        whole = self.prefix_cost[j] - self.prefix_cost[k]
        rest = target - self.prefix_sav[j]
        return whole + self.cost[j] * rest / self.sav[j]

    def _fewest(self, k: int, need: int) -> int:
        count = 0
        for i in self.by_saving:
            if i >= k:
                count += 1
                need -= self.sav[i]
                if need <= 0:
                    return count
        return len(self.sav) + 1

    def _cannot_beat(self, cost: float, count: int) -> bool:
        tol = _REL * max(1.0, abs(self.best_cost))
        if cost > self.best_cost + tol:
            return True
        return cost >= self.best_cost - tol and count >= self.best_count

    def run(self, k: int, need: int, cost: float) -> None:
        if need <= 0:
            if not self._cannot_beat(cost, len(self.chosen)):
                self.best_cost, self.best_count = cost, len(self.chosen)
                self.best = tuple(self.index[i] for i in self.chosen)
            return
        if k == len(self.sav) or self.suffix[k] < need:
            return
        # at least ceil(need / largest saving) more items, each at least the cheapest one's cost
        more = -(-need // self.max_sav[k])
        bound = cost + max(self._lp_cost(k, need), more * self.min_cost[k])
        tol = _REL * max(1.0, abs(self.best_cost))
        if bound > self.best_cost + tol:
            return
        if bound >= self.best_cost - tol and self._cannot_beat(
            bound, len(self.chosen) + self._fewest(k, need)
        ):
            return  # a cost tie at best: only fewer blocks would be better
        self.chosen.append(k)
        self.run(k + 1, need - self.sav[k], cost + self.cost[k])
        self.chosen.pop()
        self.run(k + 1, need, cost)


def min_cost_cover(
    items: Sequence[Item], need: int, *, beat: tuple[float, int] | None = None
) -> Answer | None:
    """Cheapest subset with total saving >= ``need``: ``(cost, count, indices)``, or None.

    ``beat``: only answers strictly better than this ``(cost, count)`` are wanted (None when
    no subset is), which lets a caller solving many instances prune with its incumbent.
    """
    if need <= 0:
        return (0.0, 0, ())
    useful = [it for it in items if it[0] > 0]  # saving nothing never helps
    if sum(it[0] for it in useful) < need:
        return None
    order = sorted(useful, key=lambda it: (it[1] / it[0], -it[0]))
    search = _Search(order, (math.inf, math.inf) if beat is None else beat)
    search.run(0, need, 0.0)
    if search.best is None:
        return None
    return (search.best_cost, int(search.best_count), search.best)
