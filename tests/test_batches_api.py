"""/v1/files and /v1/batches through the official openai client against a real server (a tiny
random Llama): a batch over chat completions answers every good line as the chat route does
(greedy) in OpenAI's output line format, a malformed line or a refused request is a line of the
error file (the batch still completes), completions batches, cancel, the limits; and a server
killed mid-batch and started again on the same --batch-dir finishes the batch with every line
answered exactly once, the lines finished before the kill kept as they were."""

from __future__ import annotations

import json
import select
import socket
import time

import httpx
import openai
import psutil
import pytest
from test_engine_utils import (
    build_tiny_model,
    children_paused,
    launch_test_server,
    stop_test_server,
    wait_for_idle_accounting,
    wait_until,
)

MESSAGES = [{"role": "user", "content": "hello world this is a test"}]
MAX_LINES = 40


def chat_line(custom_id: str, max_tokens: int = 4, **body) -> dict:
    body = {"model": "m", "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **body}  # fmt: skip
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def jsonl(lines: list) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("batches") / "model"), max_position_embeddings=4096)


def serve(model, root, log_name: str = "server.log", max_running: int = 4):
    """A server on `root / "batch_dir"`."""
    args = ["--dtype", "float32", "--num-threads", "1", "--max-total-tokens", "16384", "--batch-dir",
            str(root / "batch_dir"), "--batch-max-running", str(max_running), "--max-batch-lines", str(MAX_LINES),
            "--max-batch-file-bytes", "100000", "--log-requests", "--log-requests-level", "0"]  # fmt: skip
    return launch_test_server(model, root / log_name, args)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    proc = serve(model, tmp_path_factory.mktemp("batch_server"))
    proc.root = proc.log.parent
    yield proc
    stop_test_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def assert_idle_accounting(server) -> None:
    """Nothing runs or waits, every KV slot is free, evictable or protected, and the scheduler's
    idle self-check (which also checks the req_to_token rows) has logged no broken accounting."""
    wait_for_idle_accounting(lambda: httpx.get(server.base_url + "/get_server_info", timeout=60).json())
    assert "token accounting broken" not in server.log.read_text()


def wait_batch(client, batch_id: str, until=("completed", "failed", "cancelled"), timeout: float = 120):
    deadline = time.monotonic() + timeout
    while (batch := client.batches.retrieve(batch_id)).status not in until:
        assert time.monotonic() < deadline, batch
        time.sleep(0.05)
    return batch


def lines_of(client, file_id: str) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).content.split(b"\n") if line]


def test_chat_batch_in_openai_line_format(client):
    good = [chat_line(f"req-{i}", max_tokens=3 + i) for i in range(5)]
    bad = ["{not json", chat_line("req-0"), {**chat_line("x"), "url": "/v1/embeddings"},
           chat_line("refused", temperature=-1), {"method": "POST", "url": "/v1/chat/completions", "body": {}}]  # fmt: skip
    upload = client.files.create(file=("in.jsonl", jsonl(good[:3] + bad + good[3:])), purpose="batch")
    assert upload.purpose == "batch" and upload.bytes > 0 and client.files.retrieve(upload.id).id == upload.id
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"job": "t"})  # fmt: skip
    assert batch.status == "validating" and batch.request_counts.total == 10
    batch = wait_batch(client, batch.id)
    assert batch.status == "completed" and batch.metadata == {"job": "t"}
    assert (batch.request_counts.completed, batch.request_counts.failed) == (5, 5)
    out = {line["custom_id"]: line for line in lines_of(client, batch.output_file_id)}
    assert sorted(out) == [f"req-{i}" for i in range(5)]
    for i, line in enumerate(good):
        record = out[line["custom_id"]]
        assert record["id"].startswith("batch_req_") and record["error"] is None
        assert record["response"]["status_code"] == 200
        body = record["response"]["body"]
        direct = httpx.post(str(client.base_url) + "chat/completions", json=line["body"], timeout=60).json()
        assert body["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
        assert body["usage"]["completion_tokens"] == 3 + i
    errors = lines_of(client, batch.error_file_id)
    malformed = [e for e in errors if e["response"] is None]
    assert [e["custom_id"] for e in malformed] == [None, "req-0", "x", None]
    assert "line 4: invalid JSON" in malformed[0]["error"]["message"]
    assert "not unique" in malformed[1]["error"]["message"] and "url" in malformed[2]["error"]["message"]
    (refused,) = [e for e in errors if e["response"] is not None]
    assert refused["custom_id"] == "refused" and refused["response"]["status_code"] == 400
    assert refused["response"]["body"]["error"]["param"] == "temperature"
    assert batch.id in [b.id for b in client.batches.list()]


LINE_BREAKS = "\u2028\u2029\u0085"  # what str.splitlines() ends a line at and JSON may hold raw


def test_lines_end_at_newline_only(server, client):
    """A line written with ensure_ascii=False keeps U+2028 / U+2029 / U+0085 raw: still one line,
    as OpenAI and vLLM read it; a CRLF file reads as LF; line numbers count newlines."""
    good = [
        chat_line(f"id{c}{i}", messages=[{"role": "user", "content": f"a{c}b"}])
        for i, c in enumerate(LINE_BREAKS)
    ]
    text = "".join(json.dumps(x, ensure_ascii=False) + "\r\n" for x in good) + "{bad\r\n"
    assert len(text.splitlines()) > len(good) + 1  # what a splitlines() reader would see
    upload = client.files.create(file=("in.jsonl", text.encode()), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert batch.request_counts.total == 4
    batch = wait_batch(client, batch.id)
    assert (batch.request_counts.completed, batch.request_counts.failed) == (3, 1)
    out = lines_of(client, batch.output_file_id)
    assert sorted(line["custom_id"] for line in out) == sorted(x["custom_id"] for x in good)
    (error,) = lines_of(client, batch.error_file_id)
    assert error["error"]["message"].startswith("line 4: invalid JSON")
    assert_idle_accounting(server)


def test_a_line_that_is_not_utf8_is_an_error_line(server, client):
    good = json.dumps(chat_line("good")).encode()
    latin1 = json.dumps(
        chat_line("latin-1", messages=[{"role": "user", "content": "caf\u00e9"}]), ensure_ascii=False
    ).encode("latin-1")
    upload = client.files.create(file=("in.jsonl", good + b"\n" + latin1 + b"\n"), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = wait_batch(client, batch.id)
    assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 1)
    (error,) = lines_of(client, batch.error_file_id)
    at = latin1.index(b"\xe9")
    assert (
        error["custom_id"] is None
        and error["error"]["message"] == f"line 2: not valid UTF-8 (byte {at + 1}: b'\\xe9')"
    )
    assert_idle_accounting(server)


def test_completions_batch(client):
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "m", "prompt": f"hello {i}", "max_tokens": 2, "temperature": 0}} for i in range(3)]  # fmt: skip
    upload = client.files.create(file=("c.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
    )
    batch = wait_batch(client, batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 3 and batch.error_file_id is None
    for record in lines_of(client, batch.output_file_id):
        assert record["response"]["body"]["object"] == "text_completion"


def test_cancel(server, client):
    upload = client.files.create(
        file=("in.jsonl", jsonl([chat_line(f"r{i}") for i in range(8)])), purpose="batch"
    )
    with children_paused(server):  # nothing finishes before the cancel
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")  # fmt: skip
        assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
        batch = wait_batch(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at and batch.request_counts.completed == 0
    assert_idle_accounting(server)


def test_batch_max_running_holds_for_all_batches_together(server, client):
    """Three batches of four lines under --batch-max-running 4, created while the engine is
    paused: at no time are more than 4 batch lines in the engine (the server's request log, in
    order: each line's Receive and Finish)."""
    start = server.log.stat().st_size
    uploads = [client.files.create(file=(f"{k}.jsonl", jsonl([chat_line(f"{k}-{i}") for i in range(4)])),
                                   purpose="batch") for k in range(3)]  # fmt: skip
    with children_paused(server):
        batches = [client.batches.create(input_file_id=u.id, endpoint="/v1/chat/completions", completion_window="24h")
                   for u in uploads]  # fmt: skip
        wait_until(
            lambda: all(client.batches.retrieve(b.id).status == "in_progress" for b in batches), "runs"
        )
        time.sleep(1)  # (before the fix, every batch's lines reached the engine here)
    for b in batches:
        assert wait_batch(client, b.id).request_counts.completed == 4
    with open(server.log, "rb") as f:
        f.seek(start)
        log = f.read().decode()
    in_engine, most = 0, 0
    for line in log.splitlines():
        if "interactive=False" in line:
            in_engine += ("Receive: " in line) - ("Finish: " in line)
            most = max(most, in_engine)
    assert most == 4 and in_engine == 0
    assert_idle_accounting(server)


LIMITS = [
    ({"endpoint": "/v1/embeddings"}, "endpoint"),
    ({"completion_window": "1h"}, "completion_window"),
    ({"input_file_id": "file-nope"}, "input_file_id"),
    ({"endpoint": "/v1/foo", "input_file_id": "file-nope"}, "endpoint"),  # the request's fields first
]


@pytest.mark.parametrize("fields, param", LIMITS)
def test_bad_batches_are_400(client, fields, param):
    upload = client.files.create(file=("in.jsonl", jsonl([chat_line("a")])), purpose="batch")
    body = {
        "input_file_id": upload.id,
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
        **fields,
    }
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(**body)
    assert e.value.body["param"] == param


def test_upload_limits(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("in.jsonl", jsonl([chat_line(f"{i}") for i in range(MAX_LINES + 1)])),
                            purpose="batch")  # fmt: skip
    assert e.value.body["param"] == "file"
    r = httpx.post(server.base_url + "/v1/files", files={"file": ("big.jsonl", b"x" * 100001)},
                   data={"purpose": "batch"})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "file"  # OpenAI's 400 "File is too large"
    assert r.json()["error"]["message"].startswith("File is too large")
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("in.jsonl", jsonl([chat_line("a")])), purpose="fine-tune")
    upload = client.files.create(file=("in.jsonl", jsonl([chat_line("a")])), purpose="batch")
    assert upload.id in [f.id for f in client.files.list()]
    client.files.delete(upload.id)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(upload.id)


def test_files_list_pages(server, client):
    """GET /v1/files takes OpenAI's limit, after and order: the pages, followed by `after` (the
    openai client's auto-paging), add up to the whole list, newest first or (asc) oldest first."""
    for i in range(3):
        client.files.create(file=(f"p{i}.jsonl", jsonl([chat_line("a")])), purpose="batch")
    whole = [f.id for f in client.files.list(purpose="batch")]
    assert len(whole) >= 3
    page = client.files.list(purpose="batch", limit=2)
    assert [f.id for f in page.data] == whole[:2] and page.has_more
    assert [f.id for f in client.files.list(purpose="batch", limit=2)] == whole  # auto-paged
    assert [f.id for f in client.files.list(purpose="batch", limit=1, order="asc")] == whole[::-1]
    last = client.files.list(purpose="batch", after=whole[-2])
    assert [f.id for f in last.data] == whole[-1:] and not last.has_more
    for query, param in (("limit=0", "limit"), ("limit=x", "limit"), ("order=up", "order")):
        r = httpx.get(f"{server.base_url}/v1/files?{query}")
        assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_a_chunked_upload_is_cut_at_the_limit(server):
    """An upload without Content-Length (chunked) past --max-batch-file-bytes (100,000 here) is
    refused once the server has read about that much (the limit and 1 MiB for the form), not
    after the whole body: the client, which would send 64 MiB, is answered (or cut off) long
    before it is done."""
    boundary = "b0undary"
    head = (f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--{boundary}\r\n'
            f'Content-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n').encode()  # fmt: skip
    chunk = b"x" * (1 << 16)
    host, port = server.base_url.removeprefix("http://").split(":")
    sent, total = 0, 64 << 20
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(f"POST /v1/files HTTP/1.1\r\nHost: {host}\r\nTransfer-Encoding: chunked\r\n"
                     f"Content-Type: multipart/form-data; boundary={boundary}\r\n\r\n".encode())  # fmt: skip
        try:
            for piece in [head] + [chunk] * (total // len(chunk)):
                if select.select([sock], [], [], 0)[0]:
                    break  # answered
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                sent += len(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server closed the connection on the rest of the body
        answer = read_answer(sock)
    assert sent < total // 4, f"the server read {sent} bytes of the upload"
    if answer:  # (a reset can drop the answer on the way)
        assert answer.startswith(b"HTTP/1.1 400") and b"File is too large" in answer, answer[:300]


def read_answer(sock: socket.socket) -> bytes:
    """An HTTP answer with a Content-Length, read whole (what came before a reset otherwise)."""
    answer = b""
    try:
        while b"\r\n\r\n" not in answer and (data := sock.recv(1 << 16)):
            answer += data
        if b"\r\n\r\n" not in answer:
            return answer
        head, _, body = answer.partition(b"\r\n\r\n")
        length = int(
            next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
        )
        while len(body) < length and (data := sock.recv(1 << 16)):
            body += data
        return head + b"\r\n\r\n" + body
    except ConnectionResetError:
        return answer


def kill_tree(proc) -> None:
    """SIGKILL the server and its children: nothing of it gets to clean up."""
    kids = psutil.Process(proc.pid).children(recursive=True)
    proc.kill()
    for kid in kids:
        kid.kill()
    proc.wait()


def test_restart_resumes_without_redoing_finished_lines(model, tmp_path):
    # One line at a time: four short lines, one long one (killed in flight), then three short. The
    # custom_ids hold line breaks that JSON keeps raw: the logs read back at \n only.
    lines = [chat_line(f"s{i}{LINE_BREAKS}", max_tokens=3) for i in range(4)]
    lines += [chat_line("long", max_tokens=3000)] + [chat_line(f"t{i}", max_tokens=3) for i in range(3)]
    first = serve(model, tmp_path, "first.log", max_running=1)
    client = openai.OpenAI(base_url=first.base_url + "/v1", api_key="none", max_retries=0)
    try:
        upload = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")  # fmt: skip
        deadline = time.monotonic() + 60
        while client.batches.retrieve(batch.id).request_counts.completed < 4:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        log = tmp_path / "batch_dir" / "batches" / f"{batch.id}.output.jsonl"
        with children_paused(first):
            before = log.read_text().split("\n")[:-1]
            kill_tree(first)
    finally:
        stop_test_server(first)
    assert [json.loads(line)["custom_id"] for line in before] == [f"s{i}{LINE_BREAKS}" for i in range(4)]
    second = serve(model, tmp_path, "second.log", max_running=1)
    try:
        client = openai.OpenAI(base_url=second.base_url + "/v1", api_key="none", max_retries=0)
        done = wait_batch(client, batch.id, timeout=300)
        assert done.status == "completed" and done.request_counts.completed == 8
        out = client.files.content(done.output_file_id).text.split("\n")[:-1]
        assert sorted(json.loads(line)["custom_id"] for line in out) == sorted(
            line["custom_id"] for line in lines
        )
        assert out[:4] == before  # the finished lines were not answered again
        assert json.loads(out[4])["response"]["body"]["usage"]["completion_tokens"] == 3000
        assert_idle_accounting(second)
    finally:
        stop_test_server(second)


def test_a_run_that_fails_ends_the_batch_failed_and_a_cancel_ends_it(model, tmp_path):
    """Two batches left unfinished by a kill, whose state on disk a restart cannot use (the input
    file's bytes gone; a result log line that is not a result): each ends `failed` with the reason
    in `errors`, the results so far in its files; a cancel answers that real end (not a batch left
    `cancelling`), and the input file can then be deleted."""
    first = serve(model, tmp_path, "first.log", max_running=1)
    client = openai.OpenAI(base_url=first.base_url + "/v1", api_key="none", max_retries=0)
    try:
        gone = client.files.create(file=("a.jsonl", jsonl([chat_line("a0"), chat_line("a1", max_tokens=3000)])),
                                   purpose="batch")  # fmt: skip
        broken = client.files.create(file=("b.jsonl", jsonl([chat_line("b0")])), purpose="batch")
        a = client.batches.create(
            input_file_id=gone.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        wait_until(lambda: client.batches.retrieve(a.id).request_counts.completed == 1, "a0 answered")
        with children_paused(first):
            b = client.batches.create(input_file_id=broken.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")  # fmt: skip
            wait_until(lambda: client.batches.retrieve(b.id).status == "in_progress", "b in progress")
            kill_tree(first)
    finally:
        stop_test_server(first)
    root = tmp_path / "batch_dir"
    (root / "files" / f"{gone.id}.data").unlink()
    with open(root / "batches" / f"{b.id}.output.jsonl", "a") as f:
        f.write("not a result\n")
    second = serve(model, tmp_path, "second.log", max_running=1)
    try:
        client = openai.OpenAI(base_url=second.base_url + "/v1", api_key="none", max_retries=0)
        why = {
            a.id: f"No such file or directory: {gone.id}.data",
            b.id: "output.jsonl line 1 is not a result line",
        }
        for batch_id in (b.id, a.id):
            assert client.batches.cancel(batch_id).status in ("failed", "cancelling")
            done = wait_batch(client, batch_id, timeout=60)
            assert done.status == "failed" and done.failed_at and done.errors.data[0].code == "batch_failed"
            assert (
                why[batch_id] in done.errors.data[0].message
                and str(tmp_path) not in done.errors.data[0].message
            )
        assert [
            line["custom_id"] for line in lines_of(client, client.batches.retrieve(a.id).output_file_id)
        ] == ["a0"]
        assert client.files.delete(broken.id).deleted
        assert f"batch {b.id} failed" in (tmp_path / "second.log").read_text()
        assert_idle_accounting(second)
    finally:
        stop_test_server(second)


def test_a_second_server_on_the_same_batch_dir_leaves_it_alone(model, server, client):
    other = serve(model, server.root, "other.log")
    try:
        r = httpx.get(other.base_url + "/v1/batches", timeout=60)
        assert r.status_code == 503 and "another server" in r.json()["error"]["message"]
        assert httpx.get(other.base_url + "/health", timeout=60).status_code == 200
    finally:
        stop_test_server(other)
    assert client.batches.list() is not None  # the first one still serves them


def test_an_unusable_batch_dir_turns_batches_off_not_the_server(tmp_path):
    from radixengine.entrypoints.http_server import batch_runner
    from radixengine.server_args import ServerArgs

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert batch_runner(object(), ServerArgs(model_path="unused", batch_dir=str(blocker / "sub"))) is None
