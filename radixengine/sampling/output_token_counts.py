"""OutputTokenCounts: how often each token id occurs in each request's output so far, a float32
[bs, vocab] tensor on the device that the frequency, presence and repetition penalties read.

Only output tokens count, for all three penalties (SGLang's penalizers are fed output tokens only).

Overlap-safe by being lazy: the scheduler never reads or writes counts. It describes a batch's
counts as parts, rows gathered from tensors that earlier steps wrote (`filter` and `merge` only
rearrange that description). A step gathers its parts into its own `out` tensor, which the
scheduler allocated, samples, then adds the sampled token to `out` (`cumulate`); `out` is the
source of the next step of the same requests. Every read and write of counts thus runs on the
forward stream in launch order, like the FutureMap, with no host sync. A request that (re-)enters
through a prefill starts from its own output ids (none, or those kept across a retraction).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixengine.utils.host_to_device import host_tensor


@dataclass(frozen=True)
class _Part:
    size: int
    source: torch.Tensor | None = None  # float32 [m, vocab]; None: zeros
    rows: torch.Tensor | None = None  # int64 [size] rows of source, on its device; None: all of it


@dataclass(frozen=True)
class OutputTokenCounts:
    parts: tuple[_Part, ...]
    vocab_size: int

    @property
    def size(self) -> int:
        return sum(p.size for p in self.parts)

    @classmethod
    def zeros(cls, n: int, vocab_size: int) -> OutputTokenCounts:
        return cls((_Part(n),), vocab_size)

    @classmethod
    def of(cls, counts: torch.Tensor) -> OutputTokenCounts:
        return cls((_Part(counts.shape[0], counts),), counts.shape[1])

    @classmethod
    def from_output_ids(
        cls, output_ids: list[list[int]], vocab_size: int, device: torch.device | str
    ) -> OutputTokenCounts:
        """Counts built from the requests' output ids on the host (a new tensor, written before
        the step that reads it is launched)."""
        if not any(output_ids):
            return cls.zeros(len(output_ids), vocab_size)
        rows = [row for row, ids in enumerate(output_ids) for _ in ids]
        ids = [t for ids in output_ids for t in ids]
        counts = torch.zeros((len(output_ids), vocab_size), dtype=torch.float32, device=device)
        index = host_tensor([rows, ids], torch.int64, device)
        counts.index_put_((index[0], index[1]), torch.ones(len(ids), device=device), accumulate=True)
        return cls.of(counts)

    def filter(self, keep_indices: list[int], device: torch.device | str) -> OutputTokenCounts:
        """The rows `keep_indices` (ascending) of this batch."""
        parts = []
        start = 0
        for part in self.parts:
            local = [i - start for i in keep_indices if start <= i < start + part.size]
            start += part.size
            if not local:
                continue
            if len(local) == part.size or part.source is None:
                parts.append(part if len(local) == part.size else _Part(len(local)))
                continue
            rows = host_tensor(local, torch.int64, device)
            if part.rows is not None:
                rows = part.rows[rows]
            parts.append(_Part(len(local), part.source, rows))
        return OutputTokenCounts(tuple(parts), self.vocab_size)

    def merge(self, other: OutputTokenCounts) -> OutputTokenCounts:
        return OutputTokenCounts(self.parts + other.parts, self.vocab_size)

    def gather_into(self, out: torch.Tensor) -> torch.Tensor:
        """Write the counts into `out` ([size, vocab]) and return it. Run on the forward stream."""
        start = 0
        for part in self.parts:
            dst = out[start : start + part.size]
            if part.source is None:
                dst.zero_()
            elif part.rows is None:
                dst.copy_(part.source)
            else:
                torch.index_select(part.source, 0, part.rows, out=dst)
            start += part.size
        return out


def cumulate(counts: torch.Tensor, next_token_ids: torch.Tensor) -> None:
    """Add each row's sampled token to its counts, in place. Run on the forward stream."""
    rows = torch.arange(counts.shape[0], device=counts.device)
    counts.index_put_((rows, next_token_ids), torch.ones_like(rows, dtype=counts.dtype), accumulate=True)
