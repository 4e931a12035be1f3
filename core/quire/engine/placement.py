"""Which data-parallel replica takes a request: the least loaded, unless another replica
already holds the request's prompt prefix in its cache and is not much busier.

Load is what each replica last reported (waiting requests count double: they hold no
pages yet but will; running ones; KV pages in use) plus the requests placed on it since
that report, which it could not have counted yet. Prefix affinity goes beyond vLLM's
load-only balancing: requests whose prompts share their first full KV pages (a system
prompt, a chat's history) are remembered by the hash of those pages, and go back to the
replica that computed them, where the prefix cache will hit, as long as that replica's
load is within ``slack`` requests (plus ``relative_slack`` of the least load) of the least
loaded one; past it, load wins and the prefix moves. Under a flood of requests sharing one
system prompt the prefix thus moves back and forth, each replica computes it once, and
the replicas' loads stay within the slack of each other.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from quire.engine.messages import EngineStats

#: Full pages of a prompt's start that name its prefix (a system prompt fits in a few).
PREFIX_PAGES = 4
#: Prefixes remembered, least recently used forgotten first.
MAX_PREFIXES = 65536


class Placement:
    """Chooses a replica per request; one per front, fed by the replicas' stats.

    :param slack: how much busier (in load units: about one request each) the replica
        holding a prefix may be than the least loaded one and still get the request...
    :param relative_slack: ... plus this share of the least loaded replica's load.
    """

    def __init__(self, num_replicas: int, block_size: int, slack: float = 4.0,
                 relative_slack: float = 0.25) -> None:
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.slack = slack
        self.relative_slack = relative_slack
        self._since_stats = [0] * num_replicas
        self._prefixes: OrderedDict[int, int] = OrderedDict()
        #: Requests placed on each replica, and how many by prefix affinity (metrics).
        self.placed = [0] * num_replicas
        self.by_prefix = 0

    def saw_stats(self, replica: int) -> None:
        """Replica ``replica`` reported: its stats now count what was placed on it."""
        self._since_stats[replica] = 0

    def load(self, replica: int, stats: Sequence[EngineStats | None]) -> float:
        s = stats[replica]
        reported = 0.0 if s is None else 2 * s.num_waiting + s.num_running + s.kv_usage
        return reported + self._since_stats[replica]

    def place(self, prompt_token_ids: Sequence[int],
              stats: Sequence[EngineStats | None]) -> int:
        """The replica for a prompt; records the choice."""
        if self.num_replicas == 1:
            return 0
        loads = [self.load(r, stats) for r in range(self.num_replicas)]
        least = min(range(self.num_replicas), key=lambda r: (loads[r], self.placed[r]))
        choice = least
        key = self._prefix_key(prompt_token_ids)
        if key is not None:
            held = self._prefixes.get(key)
            bound = loads[least] * (1 + self.relative_slack) + self.slack
            if held is not None and loads[held] <= bound:
                choice = held
                self.by_prefix += 1
            self._prefixes[key] = choice
            self._prefixes.move_to_end(key)
            if len(self._prefixes) > MAX_PREFIXES:
                self._prefixes.popitem(last=False)
        self._since_stats[choice] += 1
        self.placed[choice] += 1
        return choice

    def _prefix_key(self, tokens: Sequence[int]) -> int | None:
        """The hash of the prompt's first full pages (at most :data:`PREFIX_PAGES`), or
        None for a prompt shorter than one page (nothing the cache could share)."""
        pages = min(PREFIX_PAGES, len(tokens) // self.block_size)
        if pages == 0:
            return None
        return hash(tuple(tokens[: pages * self.block_size]))
