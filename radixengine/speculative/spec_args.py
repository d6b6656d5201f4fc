"""The speculative-decoding flags (SGLang's names), their validation and the n-gram parameters
they make."""

from __future__ import annotations

from typing import Protocol

from radixengine.speculative.ngram_index import MIN_SHARED_CAPACITY, SHARED_KEY_LEN, NgramParams

SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE")
DEFAULT_NGRAM_DRAFT_TOKENS = 8
DEFAULT_DRAFT_STEPS = 3


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
        _validate_standalone(args)
    elif args.speculative_draft_model_path is not None:
        raise ValueError("--speculative-draft-model-path is for STANDALONE; NGRAM takes no draft model")
    if args.speculative_ngram_max_bfs_breadth > 1:
        raise ValueError(
            "--speculative-ngram-max-bfs-breadth > 1 (tree drafts) is not supported yet: the verify "
            "extend runs chains (breadth 1)"
        )
    if args.speculative_max_verify_tokens < 2:
        raise ValueError(
            f"--speculative-max-verify-tokens must be >= 2 (a last token and a draft), got "
            f"{args.speculative_max_verify_tokens}"
        )
    if algo == "NGRAM":
        ngram_params(args)  # the n-gram knobs' own checks
        capacity = args.speculative_ngram_capacity
        if 0 < capacity < MIN_SHARED_CAPACITY:
            raise ValueError(
                f"--speculative-ngram-capacity must be 0 (no shared index) or >= {MIN_SHARED_CAPACITY} "
                f"(tokens of recent requests; {SHARED_KEY_LEN}-grams are its keys), got {capacity}"
            )


def _validate_standalone(args: SpeculativeArgs) -> None:
    if args.speculative_draft_model_path is None:
        raise ValueError(
            "--speculative-algorithm STANDALONE needs --speculative-draft-model-path (the draft model)"
        )
    steps = standalone_num_steps(args)
    if steps < 1:
        raise ValueError(f"--speculative-num-steps must be >= 1, got {steps}")
    if args.speculative_num_draft_tokens is not None and args.speculative_num_draft_tokens != steps + 1:
        raise ValueError(
            f"--speculative-num-draft-tokens must be --speculative-num-steps + 1 ({steps + 1}) for a draft "
            f"model's chain, got {args.speculative_num_draft_tokens}"
        )


def standalone_num_steps(args: SpeculativeArgs) -> int:
    """Tokens the draft model proposes a step (SGLang's --speculative-num-steps; default 3)."""
    if args.speculative_num_steps is not None:
        return args.speculative_num_steps
    if args.speculative_num_draft_tokens is not None:
        return args.speculative_num_draft_tokens - 1
    return DEFAULT_DRAFT_STEPS


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


def max_verify_nodes(args: SpeculativeArgs) -> int:
    """The most nodes (the root included) a request verifies in one step; 0 without speculation."""
    if args.speculative_algorithm is None:
        return 0
    if args.speculative_algorithm == "STANDALONE":
        return standalone_num_steps(args) + 1
    return ngram_params(args).num_draft_tokens
