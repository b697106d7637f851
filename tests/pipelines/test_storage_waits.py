"""Waiting on object storage is visible and bounded (issue 28), in-process.

What a wait says and when: the first retry of an operation gives one line (what, the endpoint, the
error, the time left), a wait that goes on gives at most one line every 30 s, and a recovery one
line. The clock is a fake one (``sleeps``: retries record their waits instead of sleeping, and
their clock is the sum of the waits), so a five-minute outage takes milliseconds. Calls that go
through a real client reach a closed port on loopback: a socket bound and closed again, so every
connection is refused at once.
"""

from __future__ import annotations

import errno
import time

import pytest

from pipelines import storage

S3_REFUSED = OSError("When getting information for key 'x' in bucket 'corp': AWS Error NETWORK_CONNECTION during HeadObject "
                     "operation: curlCode: 7, Could not connect to server; Details: Failed to connect to 127.0.0.1 port 9")
SLOW_DOWN = OSError("AWS Error SLOW_DOWN during ListObjectsV2 operation: Please reduce your request rate.")


@pytest.fixture()
def said(monkeypatch) -> list[tuple[float, str]]:
    """(clock, line) of every retry notice."""
    lines: list[tuple[float, str]] = []
    monkeypatch.setattr(storage, "_say", lambda line: lines.append((storage._clock(), line)))
    return lines


@pytest.fixture()
def never_answered(monkeypatch) -> None:
    """No endpoint has answered this process yet (as at the start of a command)."""
    monkeypatch.setattr(storage, "_answered", set())


def failing(error: BaseException, times: int, calls: list[int] | None = None):
    """A call that raises ``error`` ``times`` times, then returns "ok"."""
    calls = [] if calls is None else calls

    def fn() -> str:
        calls.append(1)
        if len(calls) <= times:
            raise error
        return "ok"

    return fn


def test_a_call_that_succeeds_says_nothing(sleeps, said):
    assert storage.with_retries(failing(SLOW_DOWN, 0), "list s3://b/r") == "ok"
    assert said == [] and sleeps == []


def test_the_first_retry_says_what_where_why_and_how_long_and_the_recovery_one_line(sleeps, said):
    assert storage.with_retries(failing(SLOW_DOWN, 2), "list s3://b/r", deadline_s=45, endpoint_url="http://store:9000") == "ok"
    assert len(said) == 2
    (t0, first), (_, back) = said
    assert t0 == 0  # before the first wait
    assert first.startswith("storage: list s3://b/r (endpoint http://store:9000) failed: AWS Error SLOW_DOWN")
    assert "retrying for up to 45 s more (data.retry_deadline_s=45)" in first
    assert back.startswith("storage: list s3://b/r (endpoint http://store:9000) succeeded after 3 attempts in ")


def test_a_long_outage_says_so_at_most_every_30_s_and_once_when_it_is_over(sleeps, said):
    calls: list[int] = []
    fn = failing(SLOW_DOWN, 10**6, calls)

    def outage_of_200_s() -> str:  # fails until the fake clock passes 200 s
        if storage._clock() < 200:
            return fn()
        return "ok"

    assert storage.with_retries(outage_of_200_s, "read s3://b/r/x", endpoint_url="http://store:9000") == "ok"
    times = [t for t, _ in said]
    assert len(calls) > 20  # many attempts ...
    assert 1 + 200 // 30 - 1 <= len(said) - 1 <= 1 + 200 // 30  # ... and a line about every 30 s, not one per attempt
    gaps = [b - a for a, b in zip(times[:-1], times[1:-1])]
    assert all(30 <= g <= 30 + 10 for g in gaps), gaps  # never closer than 30 s; at most one wait (10 s) later
    assert all("still waiting on read s3://b/r/x (endpoint http://store:9000)" in line for _, line in said[1:-1])
    assert all(" s left (data.retry_deadline_s=300); last error: AWS Error SLOW_DOWN" in line for _, line in said[1:-1])
    assert said[-1][1].startswith(f"storage: read s3://b/r/x (endpoint http://store:9000) succeeded after {len(calls) + 1} attempts")


def test_giving_up_at_the_deadline_names_operation_endpoint_and_setting(sleeps, said):
    store = storage.Store("http://store:9000", 5, "--retry-deadline")
    with pytest.raises(storage.StorageError) as e:
        store.retry(failing(SLOW_DOWN, 10**6), "stat s3://b/r")
    assert str(e.value).startswith("stat s3://b/r (endpoint http://store:9000): gave up after ")
    assert " in 5 s (--retry-deadline=5): AWS Error SLOW_DOWN" in str(e.value)
    assert sum(sleeps) == pytest.approx(5)  # the deadline, to the second
    assert [line for _, line in said] == [
        "storage: stat s3://b/r (endpoint http://store:9000) failed: AWS Error SLOW_DOWN during ListObjectsV2 operation: "
        "Please reduce your request rate.; retrying for up to 5 s more (--retry-deadline=5)"
    ]


def test_a_refused_connection_before_anything_was_read_says_so_plainly(sleeps, said, never_answered):
    with pytest.raises(storage.StorageError):
        storage.with_retries(failing(S3_REFUSED, 10**6), "stat s3://corp/x/", deadline_s=5, endpoint_url="http://127.0.0.1:9")
    first = said[0][1]
    assert first.startswith("storage: stat s3://corp/x/: connection refused by http://127.0.0.1:9, and nothing has been read from it yet")
    assert "data.endpoint_url" in first and "AWS_ENDPOINT_URL" in first and "retrying for up to 5 s more" in first
    assert "curlCode: 7" in first  # the error itself too


def test_a_refused_connection_after_the_endpoint_answered_is_an_outage(sleeps, said, never_answered):
    storage.with_retries(failing(S3_REFUSED, 0), "stat s3://corp/a", endpoint_url="http://127.0.0.1:9")  # it answered once
    storage.with_retries(failing(ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"), 1), "stat s3://corp/b",
                         endpoint_url="http://127.0.0.1:9")
    assert said[0][1].startswith("storage: stat s3://corp/b (endpoint http://127.0.0.1:9) failed: [Errno 111] Connection refused")
    assert "nothing has been read" not in said[0][1]


def test_an_endpoint_with_a_password_in_it_is_never_shown_with_it(sleeps, said):
    url = "http://AKIAMARKER:s3cr3tMARKER@store.example:9000"
    assert storage.shown_endpoint(url) == "http://store.example:9000"
    with pytest.raises(storage.StorageError) as e:
        storage.Store(url, 2).retry(failing(SLOW_DOWN, 10**6), "read s3://b/x")
    text = str(e.value) + "".join(line for _, line in said) + repr(storage.Store(url, 2))
    assert "MARKER" not in text and "store.example:9000" in text


def test_a_store_binds_its_deadline_to_every_call(sleeps, said, closed_port, never_answered):
    """The calls a driver makes through its Store (list, stat, read, download, copy, checkpoints) all
    give up at its deadline, here 7 s, not the 300 s default: real pyarrow and boto3 clients, one
    refused connection per attempt."""
    store = storage.Store(closed_port, 7)
    calls = {
        "list": lambda: store.list_files("s3://corp/x/"),
        "exists": lambda: store.exists("s3://corp/x/a.txt"),
        "read": lambda: store.read_bytes("s3://corp/x/a.txt"),
        "download": lambda: store.download_dir("s3://corp/ckpt", "/nonexistent"),
        "latest": lambda: store.latest_complete_checkpoint("s3://corp/run"),
    }
    for name, call in calls.items():
        sleeps.clear()
        with pytest.raises(storage.StorageError, match=rf"s3://corp/\S+ \(endpoint {closed_port}\): gave up after \d+ attempts "
                                                       rf"in 7 s \(data.retry_deadline_s=7\)"):
            call()
        assert sum(sleeps) == pytest.approx(7), name


def test_one_attempt_of_our_own_client_fails_at_once(closed_port):
    """Our calls use one try per request (with_retries does the rest): pyarrow's default three tries
    take ~1.6 s on a refused connection before a retry could say anything."""
    fs, path = storage.Store(closed_port).filesystem("s3://corp/x")
    t0 = time.monotonic()
    with pytest.raises(OSError, match="NETWORK_CONNECTION"):
        fs.get_file_info(path)
    assert time.monotonic() - t0 < 0.5


def test_the_first_line_of_a_real_wait_comes_at_once(said, closed_port, never_answered, monkeypatch):
    """A real clock: list_files against a closed port says so within 2 s, and gives up at 2 s."""
    monkeypatch.setattr(storage, "_say", lambda line: said.append((time.monotonic(), line)))
    t0 = time.monotonic()
    with pytest.raises(storage.StorageError, match="gave up"):
        storage.Store(closed_port, 2).list_files("s3://corp/x/")
    spent = time.monotonic() - t0
    assert said and said[0][0] - t0 < 2 and "connection refused by" in said[0][1]
    assert 1.8 <= spent <= 2.2


def test_boto3_errors_are_retried_like_pyarrow_ones(sleeps, said, closed_port, monkeypatch):
    """The run lock and the shard list reach S3 through boto3: a refused connection and a 503 are
    transient, a missing key is not."""
    from botocore.exceptions import ClientError

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")

    client = storage.s3_client(closed_port)
    with pytest.raises(storage.StorageError, match=rf"read s3://corp/x \(endpoint {closed_port}\): gave up .* in 3 s"):
        storage.Store(closed_port, 3).retry(lambda: storage.boto_call(lambda: client.get_object(Bucket="corp", Key="x")), "read s3://corp/x")

    def answer(status: int, code: str):
        def call():
            raise ClientError({"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")
        return lambda: storage.boto_call(call)

    with pytest.raises(OSError) as e:
        answer(503, "ServiceUnavailable")()
    assert storage.is_transient(e.value)
    with pytest.raises(ClientError):
        answer(404, "NoSuchKey")()


def test_a_store_pickles_and_refuses_a_deadline_that_is_not_positive():
    import pickle

    store = storage.Store("http://store:9000", 12.5, "--retry-deadline")
    assert pickle.loads(pickle.dumps(store)) == store
    with pytest.raises(ValueError, match="--retry-deadline: a retry deadline is a number of seconds above 0"):
        storage.Store(None, 0, "--retry-deadline")
    assert storage.as_store("http://x:1") == storage.Store("http://x:1") and storage.as_store(store) is store
