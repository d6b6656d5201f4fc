"""The speculative-decoding flags (SGLang's names), their validation and the n-gram parameters
they make."""

from __future__ import annotations

from typing import Protocol

from radixengine.speculative.ngram_index import NgramParams

SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE")
DEFAULT_NGRAM_DRAFT_TOKENS = 8


class SpeculativeArgs(Protocol):
    speculative_algorithm: str | None
    speculative_num_draft_tokens: int | None
    speculative_num_steps: int | None
    speculative_draft_model_path: str | None
    speculative_ngram_min_match_window_size: int
    speculative_ngram_max_match_window_size: int
    speculative_ngram_min_bfs_breadth: int
    speculative_ngram_max_bfs_breadth: int
    speculative_ngram_branch_length: int
    speculative_ngram_capacity: int
    speculative_max_verify_tokens: int
    tp_size: int


def validate_speculative_args(args: SpeculativeArgs) -> None:
    """Refuse, with the reason, a speculative configuration this engine cannot run."""
    algo = args.speculative_algorithm
    if algo is None:
        return
    if algo not in SPECULATIVE_ALGORITHMS:
        raise ValueError(
            f"--speculative-algorithm must be one of {', '.join(SPECULATIVE_ALGORITHMS)}; got {algo!r}"
        )
    if algo == "STANDALONE":
        raise ValueError(
            "--speculative-algorithm STANDALONE (a draft model) is not supported yet; use NGRAM, "
            "which drafts from the request's own tokens"
        )
    if args.speculative_draft_model_path is not None:
        raise ValueError("--speculative-draft-model-path is for STANDALONE; NGRAM takes no draft model")
    if args.speculative_ngram_max_bfs_breadth > 1:
        raise ValueError(
            "--speculative-ngram-max-bfs-breadth > 1 (tree drafts) is not supported yet: the verify "
            "extend runs chains (breadth 1)"
        )
    if args.tp_size > 1:
        raise ValueError("speculative decoding with --tp-size > 1 is not supported yet")
    if args.speculative_max_verify_tokens < 2:
        raise ValueError(
            f"--speculative-max-verify-tokens must be >= 2 (a last token and a draft), got "
            f"{args.speculative_max_verify_tokens}"
        )
    ngram_params(args)  # the n-gram knobs' own checks


def ngram_params(args: SpeculativeArgs) -> NgramParams:
    return NgramParams(
        num_draft_tokens=args.speculative_num_draft_tokens or DEFAULT_NGRAM_DRAFT_TOKENS,
        min_match_window_size=args.speculative_ngram_min_match_window_size,
        max_match_window_size=args.speculative_ngram_max_match_window_size,
        min_bfs_breadth=args.speculative_ngram_min_bfs_breadth,
        max_bfs_breadth=args.speculative_ngram_max_bfs_breadth,
        max_branch_length=args.speculative_ngram_branch_length,
        capacity=args.speculative_ngram_capacity,
    )
