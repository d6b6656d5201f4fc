"""The grammar queue (managers/grammar_manager.py): a compile that finishes on the backend's
thread while the scheduler reads the queue puts its request in exactly one list, ready or still
waiting, so no request is lost."""

from __future__ import annotations

import threading
from concurrent.futures import Future

from radixengine.constrained.base_grammar_backend import InvalidGrammarObject
from radixengine.managers.grammar_manager import GrammarManager
from radixengine.managers.req import Req
from radixengine.sampling.sampling_params import SamplingParams


class CompletesAfterFirstRead(Future):
    """A compile that another thread finishes right after the scheduler's first done() read:
    the interleaving that lost requests, made deterministic."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def done(self) -> bool:
        self.reads += 1
        was_done = super().done()
        if self.reads == 1:
            compiler = threading.Thread(target=self.set_result, args=(InvalidGrammarObject("bad grammar"),))
            compiler.start()
            compiler.join()
        return was_done


def _manager() -> GrammarManager:
    return GrammarManager("xgrammar", False, None, 16, frozenset({0}))


def _queued(manager: GrammarManager, rid: str, future: Future) -> Req:
    req = Req(rid, None, [1, 2, 3], SamplingParams(max_new_tokens=4))
    req.grammar = future
    manager.grammar_queue.append(req)
    return req


def test_a_compile_finishing_between_reads_is_not_lost():
    manager = _manager()
    racing = _queued(manager, "racing", CompletesAfterFirstRead())
    done = Future()
    done.set_result(InvalidGrammarObject("other"))
    _queued(manager, "done", done)
    first = manager.get_ready_grammar_requests()
    assert [r.rid for r, _ in first] == ["done"]
    assert manager.grammar_queue == [racing]
    second = manager.get_ready_grammar_requests()
    assert [(r.rid, error) for r, error in second] == [("racing", "bad grammar")]
    assert manager.grammar_queue == []


def test_every_request_comes_out_once_while_compiles_finish_on_other_threads():
    manager = _manager()
    futures = [Future() for _ in range(200)]
    for i, future in enumerate(futures):
        _queued(manager, str(i), future)
    finishers = [threading.Thread(target=f.set_result, args=(InvalidGrammarObject("e"),)) for f in futures]
    seen: list[str] = []
    for finisher in finishers:
        finisher.start()
        seen += [r.rid for r, _ in manager.get_ready_grammar_requests()]
    for finisher in finishers:
        finisher.join()
    seen += [r.rid for r, _ in manager.get_ready_grammar_requests()]
    assert sorted(seen, key=int) == [str(i) for i in range(200)]
    assert manager.grammar_queue == []
