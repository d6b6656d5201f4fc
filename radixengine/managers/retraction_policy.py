"""Which running requests `ScheduleBatch.retract_decode` retracts first when decode runs out of KV
memory (SGLang's `--retraction-policy`).

- `length` (default): the fewest decoded tokens first, then the longest prompt (the least work
  lost, the most memory freed).
- `priority`: the least important priority first (the direction of priority scheduling), then as
  `length`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixengine.managers.schedule_policy import lowest_priority_value, priority_sign

if TYPE_CHECKING:
    from radixengine.managers.req import Req


def retraction_order(
    reqs: list[Req], policy: str = "length", low_priority_values_first: bool = False
) -> list[int]:
    """Indices into `reqs`, the one to keep longest first: retraction pops from the end. Batch
    lines (not `interactive`) go before any interactive request, whatever the policy."""

    def length_key(req: Req) -> tuple[int, int, int]:
        return (req.interactive, len(req.output_ids), -len(req.origin_input_ids))

    if policy == "priority":
        sign = priority_sign(low_priority_values_first)  # priority * sign ascending: the most important first
        unset = lowest_priority_value(low_priority_values_first)

        def key(req: Req) -> tuple[int, int, int, int]:
            priority = unset if req.priority is None else req.priority
            interactive, *length = length_key(req)
            return (interactive, -priority * sign, *length)

    else:
        key = length_key
    return sorted(range(len(reqs)), key=lambda i: key(reqs[i]), reverse=True)
