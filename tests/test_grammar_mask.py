"""The pieces of constrained decoding without a model: the packed masks in the Sampler (only
the constrained rows change; the model's vocabulary padding is never allowed), the grammar
backends' matchers, the front end's validation, and the OpenAI fields' mapping to SGLang's."""

from __future__ import annotations

import json

import pytest
import torch
from test_engine_utils import build_tokenizer

from radixengine.constrained.backend_factory import create_grammar_backend, validate_grammar
from radixengine.constrained.base_grammar_backend import (
    BaseGrammarObject,
    InvalidGrammarObject,
    allocate_vocab_mask,
    apply_vocab_mask,
)
from radixengine.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest
from radixengine.entrypoints.openai_serving import constraint_params
from radixengine.layers.sampler import Sampler
from radixengine.managers.tokenizer_manager import RequestError
from radixengine.sampling.sampling_batch_info import SamplingBatchInfo
from radixengine.sampling.sampling_params import SamplingParams

VOCAB = 448  # the model's rows: the tokenizer's 400 tokens, padded


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(str(tmp_path_factory.mktemp("tok")), vocab_size=400)


class Allow(BaseGrammarObject):
    """A stand-in matcher that allows a fixed set of tokens."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def fill_vocab_mask(self, mask: torch.Tensor, idx: int) -> None:
        mask[idx].zero_()
        for t in self.tokens:
            mask[idx, t // 32] |= 1 << (t % 32)


def info_for(params: list[SamplingParams]) -> SamplingBatchInfo:
    return SamplingBatchInfo.from_sampling_params(params, [3] * len(params), "cpu", VOCAB)


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_only_the_constrained_rows_change(greedy):
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB) * 3
    temp = 0.0 if greedy else 0.8
    params = [SamplingParams(temperature=temp, sampling_seed=i) for i in range(4)]
    plain = Sampler()(logits.clone(), info_for(params), return_logprob=True)
    info = info_for(params)
    info.update_regex_vocab_mask([None, Allow([5, 300]), None, Allow([31, 32, 33])], VOCAB)
    masked = Sampler()(logits.clone(), info, return_logprob=True)
    ids, logprobs = masked[0], masked[1]
    assert ids[1].item() in (5, 300) and ids[3].item() in (31, 32, 33)
    for row in (0, 2):  # bit-identical
        assert ids[row] == plain[0][row] and logprobs[row] == plain[1][row]
    # The constrained rows' logprobs are over the allowed tokens only.
    assert logprobs[1] > plain[1][1] or ids[1] != plain[0][1]


def test_no_grammar_means_no_mask():
    info = info_for([SamplingParams()])
    info.update_regex_vocab_mask([None], VOCAB)
    assert info.vocab_mask is None
    logits = torch.randn(1, VOCAB)
    assert info.apply_vocab_mask(logits) is logits


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_matcher_masks_the_vocabulary_padding_and_ends_with_eos(tokenizer, backend):
    grammar_backend = create_grammar_backend(backend, tokenizer, VOCAB, [tokenizer.eos_token_id])
    grammar = grammar_backend.get_future(("regex", "ab+")).result().copy()
    mask = allocate_vocab_mask(1, VOCAB)
    logits = torch.zeros(1, VOCAB)
    logits[0, 400:] = 1e4  # padding rows the model may score high: never allowed
    text = ""
    for _ in range(6):
        mask.fill_(-1)
        grammar.fill_vocab_mask(mask, 0)
        row = logits.clone()
        apply_vocab_mask(row, mask, [0])
        assert torch.isinf(row[0, 400:]).all()
        allowed = torch.nonzero(torch.isfinite(row[0])).view(-1).tolist()
        token = next((t for t in allowed if t != tokenizer.eos_token_id), None) if len(text) < 3 else None
        if token is None:
            assert tokenizer.eos_token_id in allowed
            token = tokenizer.eos_token_id
        grammar.accept_token(token)
        if token == tokenizer.eos_token_id:
            break
        text += tokenizer.decode([token])
    assert grammar.is_terminated()
    assert text.startswith("ab")
    grammar_backend.shutdown()


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_a_grammar_that_allows_no_first_token_fails_to_compile(tokenizer, backend):
    """Found once, when the grammar compiles (its failure is cached with it): a grammar that
    allows no token at its start and has not ended matches no output. One that allows only EOS
    (the empty string) or a first token is fine."""
    grammar_backend = create_grammar_backend(backend, tokenizer, VOCAB, [tokenizer.eos_token_id])
    empty = grammar_backend.get_future(("regex", r"[^\s\S]")).result()
    assert isinstance(empty, InvalidGrammarObject)
    assert "the regex matches no output" in empty.error_message
    for text in ("", "ab+"):
        grammar = grammar_backend.get_future(("regex", text)).result()
        assert isinstance(grammar, BaseGrammarObject), (text, grammar)
        assert not grammar.copy().allows_no_token(VOCAB)
    grammar_backend.shutdown()


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_a_dead_end_fills_an_all_zero_row(tokenizer, backend):
    """The matcher of a grammar stuck with no allowed token fills a row that allows nothing (so
    the sampler flags the row, and the scheduler fails that request alone); llguidance, which
    would allow only EOS there, too."""
    grammar_backend = create_grammar_backend(backend, tokenizer, VOCAB, [tokenizer.eos_token_id])
    grammar = grammar_backend.dispatch_regex(r"[^\s\S]")
    mask = allocate_vocab_mask(2, VOCAB)
    grammar.fill_vocab_mask(mask, 1)
    assert not mask[1].any() and (mask[0] == -1).all()
    assert grammar.allows_no_token(VOCAB) and not grammar.is_terminated()
    grammar_backend.shutdown()


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
@pytest.mark.parametrize(
    "kind,text,fragment",
    [
        ("regex", "[a-z", "regex"),
        ("json_schema", "{bad", "not valid JSON"),
        ("json_schema", '{"type": "nope"}', "json_schema"),
    ],
)
def test_validation_names_the_problem(backend, kind, text, fragment):
    message = validate_grammar(backend, kind, text)
    assert message is not None and fragment in message


def test_validation_accepts_good_grammars_and_none_refuses_all():
    for backend in ("xgrammar", "llguidance"):
        assert validate_grammar(backend, "regex", "[a-z]+") is None
        assert validate_grammar(backend, "json_schema", json.dumps({"type": "object"})) is None
        assert validate_grammar(backend, "json_schema", "$$ANY$$") is None
    assert validate_grammar("xgrammar", "ebnf", 'root ::= "a" | "b"') is None
    assert "--grammar-backend none" in validate_grammar("none", "regex", "a")


def test_at_most_one_grammar_per_request():
    with pytest.raises(ValueError, match="Only one of"):
        SamplingParams(regex="a", ebnf='root ::= "a"')
    assert SamplingParams(regex="a").grammar_key == ("regex", "a")
    assert SamplingParams().grammar_key is None


def test_response_format_maps_to_sglangs_sampling_params():
    msgs = [{"role": "user", "content": "hi"}]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = ChatCompletionRequest.model_validate(
        {
            "messages": msgs,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        }
    )
    assert json.loads(constraint_params(chat)["json_schema"]) == schema
    obj = CompletionRequest.model_validate({"prompt": "p", "response_format": {"type": "json_object"}})
    assert constraint_params(obj) == {"json_schema": '{"type": "object"}'}
    assert constraint_params(CompletionRequest.model_validate({"prompt": "p", "regex": "a+"})) == {
        "regex": "a+"
    }
    text = CompletionRequest.model_validate({"prompt": "p", "response_format": {"type": "text"}})
    assert constraint_params(text) == {}
    both = CompletionRequest.model_validate({"prompt": "p", "regex": "a", "ebnf": 'root ::= "a"'})
    with pytest.raises(RequestError, match="Only one of"):
        constraint_params(both)
