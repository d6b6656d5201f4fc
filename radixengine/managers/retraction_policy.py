"""Which running requests `ScheduleBatch.retract_decode` retracts first when decode runs out of KV
memory (SGLang's `--retraction-policy`).

- `length` (default): the fewest decoded tokens first, then the longest prompt (the least work
  lost, the most memory freed).
- `priority`: the least important priority first (the direction of priority scheduling), then as
  `length`.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixengine.managers.schedule_batch import Req
    from radixengine.server_args import ServerArgs

RETRACTION_POLICIES = ("length", "priority")


def retraction_order(reqs: list[Req], server_args: ServerArgs) -> list[int]:
    """Indices into `reqs`, the one to keep longest first: retraction pops from the end."""

    def length_key(req: Req) -> tuple[int, int]:
        return (len(req.output_ids), -len(req.origin_input_ids))

    if server_args.retraction_policy == "priority":
        low_first = server_args.schedule_low_priority_values_first
        sign = 1 if low_first else -1  # priority * sign ascending: the most important first
        unset = sys.maxsize if low_first else -sys.maxsize - 1

        def key(req: Req) -> tuple[int, int, int]:
            priority = unset if req.priority is None else req.priority
            return (-priority * sign, *length_key(req))

    else:
        key = length_key
    return sorted(range(len(reqs)), key=lambda i: key(reqs[i]), reverse=True)
