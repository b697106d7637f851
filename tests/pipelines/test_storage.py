"""Run folders on a local disk and in S3 (moto): the newest complete checkpoint, retries, copies.

A checkpoint copy that is cut off halfway is built the way it happens: real checkpoints written
by ``save_checkpoint``, then the newer one cut (files gone, weights short, manifest gone or half
written) and, for S3, uploaded object by object with boto3 so the code under test does no writing.
"""

from __future__ import annotations

import errno
import json
import re
import shutil
from pathlib import Path

import pytest

from ctxmodels import checkpoint as ckpt
from pipelines import storage
from tests.ctxmodels.test_checkpoint import CUTS, write_small_checkpoint

# Ray Train V2's names (checkpoint_%Y-%m-%d_%H-%M-%S.%f); NEWER is one microsecond into a new year.
OLDER = "checkpoint_2025-12-31_23-59-59.999999"
NEWER = "checkpoint_2026-01-01_00-00-00.000000"
RAY_NAME = re.compile(r"checkpoint_\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2}\.\d{6}")
STORE = storage.Store()  # the defaults: AWS_ENDPOINT_URL (moto's, in the S3 tests) and data.retry_deadline_s


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """One complete checkpoint, written once and copied into each test's run folder."""
    return write_small_checkpoint(tmp_path_factory.mktemp("saved") / "checkpoint")


def local_run(tmp_path: Path, saved: Path, names=(OLDER, NEWER)) -> Path:
    run = tmp_path / "run"
    for name in names:
        shutil.copytree(saved, run / name)
    return run


def publish(run: Path, where: str, request) -> str:
    """The run's URI: the local folder itself, or a copy uploaded to a fresh moto bucket."""
    if where == "local":
        return str(run)
    import boto3

    bucket = request.getfixturevalue("s3_bucket")
    client = boto3.client("s3", endpoint_url=request.getfixturevalue("s3_server"))
    for file in sorted(p for p in run.rglob("*") if p.is_file()):
        client.upload_file(str(file), bucket, f"runs/r/{file.relative_to(run).as_posix()}")
    return f"s3://{bucket}/runs/r"


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ---- the newest complete checkpoint -----------------------------------------------------------


def test_checkpoint_names_follow_rays_format():
    from ray.train.v2._internal.execution.storage import StorageContext

    name = StorageContext.make_default_checkpoint_dir_name()
    assert RAY_NAME.fullmatch(name), f"Ray names checkpoints {name!r} now: update OLDER/NEWER and checkpoint_order"
    assert RAY_NAME.fullmatch(OLDER) and RAY_NAME.fullmatch(NEWER)


def test_checkpoint_order_is_time_order():
    ray_v2 = [
        "checkpoint_2025-12-31_23-59-59.999999",
        "checkpoint_2026-01-01_00-00-00.000000",
        "checkpoint_2026-01-01_00-00-00.000001",
        "checkpoint_2026-01-01_00-00-09.000000",
        "checkpoint_2026-01-01_00-00-10.000000",
        "checkpoint_2026-02-01_00-00-00.000000",
    ]
    ray_v1 = ["checkpoint_000009", "checkpoint_000010", "checkpoint_000100"]
    steps = ["checkpoint_step_9", "checkpoint_step_10", "checkpoint_step_100"]
    for names in (ray_v2, ray_v1, steps):
        assert sorted(reversed(names), key=storage.checkpoint_order) == names


def test_manifest_names_agree_with_the_checkpoint_format():
    assert storage.MANIFEST == ckpt.MANIFEST
    assert storage.REQUIRED_FILES == (ckpt.WEIGHTS, ckpt.CONFIG)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_the_newest_complete_checkpoint_wins(tmp_path, saved, where, request, capsys):
    run = publish(local_run(tmp_path, saved), where, request)
    assert STORE.latest_complete_checkpoint(run) == storage.join(run, NEWER)
    assert STORE.checkpoint_problem(storage.join(run, OLDER)) is None
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("cut", CUTS)
@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_newer_checkpoint_cut_in_half_is_skipped(tmp_path, saved, where, cut, request, capsys):
    local = local_run(tmp_path, saved)
    expected = CUTS[cut](local / NEWER)
    run = publish(local, where, request)

    assert STORE.latest_complete_checkpoint(run) == storage.join(run, OLDER)
    warning = capsys.readouterr().err
    assert warning.count("\n") == 1 and storage.join(run, NEWER) in warning and expected in warning, warning
    # The storage check (a listing and one read) and the local check tell the same story.
    assert STORE.checkpoint_problem(storage.join(run, NEWER)) == ckpt.checkpoint_problem(local / NEWER)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_no_complete_checkpoint_gives_none(tmp_path, saved, where, request, capsys):
    local = local_run(tmp_path, saved)
    CUTS["manifest-missing"](local / OLDER)
    CUTS["weights-truncated"](local / NEWER)
    (local / "tokenizer").mkdir()  # not a checkpoint folder: ignored
    run = publish(local, where, request)
    assert STORE.latest_complete_checkpoint(run) is None
    assert len(capsys.readouterr().err.splitlines()) == 2
    assert STORE.latest_complete_checkpoint(storage.join(run, "no-such-run")) is None


def test_names_with_unpadded_numbers_still_pick_the_newest(tmp_path, saved):
    run = local_run(tmp_path, saved, names=("checkpoint_step_9", "checkpoint_step_10"))
    assert STORE.latest_complete_checkpoint(str(run)) == str(run / "checkpoint_step_10")


# ---- retries ------------------------------------------------------------------------------------


class FlakyFileSystem:
    """Wraps a pyarrow filesystem; the first ``failures`` calls to any method raise ``error``."""

    def __init__(self, fs, error: BaseException, failures: int):
        self.fs, self.error, self.failures, self.calls = fs, error, failures, 0

    def __getattr__(self, name):
        method = getattr(self.fs, name)

        def call(*args, **kwargs):
            self.calls += 1
            if self.calls <= self.failures:
                raise self.error
            return method(*args, **kwargs)

        return call


@pytest.fixture()
def flaky(monkeypatch):
    """flaky(error, failures): make storage.filesystem hand out a FlakyFileSystem; returns it."""
    real = storage.filesystem

    def install(error: BaseException, failures: int) -> FlakyFileSystem:
        wrapper = FlakyFileSystem(None, error, failures)

        def filesystem(uri, endpoint_url=None, **options):
            fs, path = real(uri, endpoint_url, **options)
            wrapper.fs = fs
            return wrapper, path

        monkeypatch.setattr(storage, "filesystem", filesystem)
        return wrapper

    return install


TRANSIENT = {
    "slow-down": OSError("When listing objects under key 'r/' in bucket 'b': AWS Error SLOW_DOWN during ListObjectsV2 operation: Please reduce your request rate."),
    "http-503": OSError("AWS Error UNKNOWN (HTTP status 503) during HeadObject operation: No response body."),
    "network": OSError("AWS Error NETWORK_CONNECTION during ListObjectsV2 operation: curlCode: 7, Could not connect to server"),
    "connection-reset": ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
    "timeout": TimeoutError("read timed out"),
    "path-says-forbidden": OSError("When listing objects under key 'forbidden/' in bucket 'b': AWS Error SLOW_DOWN during ListObjectsV2 operation"),
}
PERMANENT = {
    "not-found": FileNotFoundError(errno.ENOENT, "Path does not exist 'b/r'"),
    "permission": PermissionError(errno.EACCES, "Permission denied"),
    "access-denied": OSError("AWS Error ACCESS_DENIED (HTTP status 403) during ListObjectsV2 operation: Access Denied"),
    "no-such-bucket": OSError("AWS Error NO_SUCH_BUCKET during ListObjectsV2 operation: The specified bucket does not exist"),
    "disk-full": OSError(errno.ENOSPC, "No space left on device"),
    "invalid-argument": ValueError("Expected a URI"),
    "path-says-timeout": OSError("When getting information for key 'timeout-sweep/x' in bucket 'b': AWS Error ACCESS_DENIED during HeadObject operation"),
}


@pytest.mark.parametrize("kind", TRANSIENT)
def test_transient_errors_are_retried_until_the_call_succeeds(tmp_path, saved, flaky, sleeps, kind):
    run = local_run(tmp_path, saved)
    fs = flaky(TRANSIENT[kind], failures=2)
    assert STORE.latest_complete_checkpoint(str(run)) == str(run / NEWER)
    # two failures, then: list the run, read both trainer states, list the newest checkpoint, read its manifest
    assert fs.calls == 2 + 5
    assert len(sleeps) == 2 and 0.1 <= sleeps[0] <= 0.2 <= sleeps[1] <= 0.4  # 0.2 s, 0.4 s, jittered


@pytest.mark.parametrize("kind", PERMANENT)
def test_permanent_errors_are_raised_at_once(tmp_path, saved, flaky, sleeps, kind):
    fs = flaky(PERMANENT[kind], failures=1)
    with pytest.raises(type(PERMANENT[kind])) as raised:
        STORE.latest_complete_checkpoint(str(local_run(tmp_path, saved)))
    assert raised.value is PERMANENT[kind]
    assert fs.calls == 1 and sleeps == []


def test_retries_go_on_until_the_deadline_then_name_the_uri_attempts_and_time(tmp_path, saved, flaky, sleeps):
    run = local_run(tmp_path, saved)
    fs = flaky(TRANSIENT["slow-down"], failures=100_000)
    with pytest.raises(storage.StorageError, match=rf"list {re.escape(str(run))}: gave up after \d+ attempts in 45 s \(data.retry_deadline_s=45\): .*SLOW_DOWN"):
        storage.Store(deadline_s=45).latest_complete_checkpoint(str(run))
    # waited until the deadline, not a fixed count: the last wait ends exactly there
    assert sum(sleeps) == pytest.approx(45) and fs.calls == len(sleeps) + 1 and max(sleeps) <= 10.0
    assert fs.calls > 5  # more than the 5 attempts (1.5-3 s in all) this used to give up after


def test_an_s3_error_at_the_deadline_names_the_endpoint(sleeps):
    def refused():
        raise TRANSIENT["network"]

    with pytest.raises(storage.StorageError, match=r"read s3://b/run/x \(endpoint http://127.0.0.1:9\): gave up after"):
        storage.with_retries(refused, "read s3://b/run/x", deadline_s=1, endpoint_url="http://127.0.0.1:9")


def test_best_effort_warns_and_returns_none(sleeps, capsys):
    def full():
        raise PERMANENT["disk-full"]

    assert STORE.best_effort(full, "write metrics /x") is None
    assert "warning: write metrics /x failed, training goes on without it" in capsys.readouterr().err
    assert sleeps == []  # a full disk is not waited for


def test_retries_on_s3_reach_the_bucket_after_the_blips(tmp_path, saved, flaky, sleeps, request):
    run = publish(local_run(tmp_path, saved), "s3", request)
    flaky(TRANSIENT["http-503"], failures=2)
    assert STORE.latest_complete_checkpoint(run) == storage.join(run, NEWER)
    assert len(sleeps) == 2


def test_backoff_doubles_with_jitter_up_to_a_cap(sleeps):
    calls = []

    def always_throttled():
        calls.append(1)
        raise TRANSIENT["slow-down"]

    with pytest.raises(storage.StorageError, match=r"gave up after \d+ attempts in 120 s"):
        storage.with_retries(always_throttled, "list s3://b/r", deadline_s=120, base_delay=1.0, max_delay=10.0)
    assert len(calls) == len(sleeps) + 1 and len(sleeps) >= 12  # 1+2+4+8 s, then at most 10 s each
    for i, wait in enumerate(sleeps[:-1]):  # the last wait is cut to end at the deadline
        full = min(10.0, 2.0**i)
        assert full / 2 <= wait <= full, (i, wait)


def test_s3_retry_attempts_cover_the_deadline():
    # the AWS SDK's waits: ~15 s over the first 6 attempts, ~18 s per attempt after (see the docstring)
    assert storage.s3_retry_attempts(1) == 3  # pyarrow's default
    assert storage.s3_retry_attempts(60) == 9 and storage.s3_retry_attempts(300) == 22



def test_the_retrying_s3_filesystem_keeps_its_retries_through_a_pickle():
    """Ray Train ships the run's filesystem to its controller by pickle; pyarrow's own pickle of
    an S3FileSystem drops the retry strategy (back to 3 attempts, about 1 s)."""
    import pickle

    fs, path = storage.filesystem("s3://b/run", "http://127.0.0.1:9", retry_deadline_s=60)
    copy = pickle.loads(pickle.dumps(fs))
    assert isinstance(copy, storage.RetryingS3FileSystem) and copy.max_attempts == 9 and path == "b/run"
    assert copy.kwargs["endpoint_override"] == "http://127.0.0.1:9"


@pytest.mark.parametrize("error", [*TRANSIENT.values(), OSError("flaky network")], ids=[*TRANSIENT, "errno-less"])
def test_is_transient_says_yes(error):
    assert storage.is_transient(error)


@pytest.mark.parametrize("error", PERMANENT.values(), ids=PERMANENT)
def test_is_transient_says_no(error):
    assert not storage.is_transient(error)


# ---- write_bytes -------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["local", "s3"])
def test_write_bytes_replaces_a_file_whole_and_reads_back(tmp_path, where, request):
    dest = f"s3://{request.getfixturevalue('s3_bucket')}/out/new/f.jsonl" if where == "s3" else str(tmp_path / "out" / "new" / "f.jsonl")
    STORE.write_bytes(dest, b"first\n")  # a local folder that is not there yet is made
    STORE.write_bytes(dest, b"second\n")
    assert STORE.read_bytes(dest) == b"second\n"
    if where == "local":
        assert sorted(p.name for p in (tmp_path / "out" / "new").iterdir()) == ["f.jsonl"]  # no temporary left


# ---- copy_dir ----------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["local", "s3"])
def test_copy_dir_copies_everything_with_the_manifest_last(tmp_path, saved, where, request, monkeypatch):
    dest = f"s3://{request.getfixturevalue('s3_bucket')}/runs/r" if where == "s3" else str(tmp_path / "runs" / "r")
    written = []
    real_put = storage._put_file
    monkeypatch.setattr(storage, "_put_file", lambda file, fs, path, rename: (written.append(path), real_put(file, fs, path, rename)))

    STORE.copy_dir(saved, storage.join(dest, NEWER))
    assert written[-1].endswith("/MANIFEST.json") and len(written) == len(tree(saved))
    assert STORE.latest_complete_checkpoint(dest) == storage.join(dest, NEWER)
    back = STORE.download_dir(storage.join(dest, NEWER), tmp_path / "back")
    assert tree(back) == tree(saved)
    assert not list(back.rglob("*.tmp"))
    assert ckpt.load_checkpoint(back, verify_hashes=True).family == "bert"


@pytest.mark.parametrize("where", ["local", "s3"])
def test_copy_dir_cut_off_midway_leaves_no_manifest(tmp_path, saved, where, request, monkeypatch, capsys):
    """Overwriting a complete copy and dying halfway must not leave the old manifest behind."""
    dest = f"s3://{request.getfixturevalue('s3_bucket')}/runs/r" if where == "s3" else str(tmp_path / "runs" / "r")
    STORE.copy_dir(saved, storage.join(dest, OLDER))
    STORE.copy_dir(saved, storage.join(dest, NEWER))
    assert STORE.latest_complete_checkpoint(dest) == storage.join(dest, NEWER)

    real_put = storage._put_file
    written = []

    def dies_on_the_third_file(file, fs, path, rename):
        if len(written) == 2:
            raise RuntimeError("worker preempted")
        written.append(path)
        real_put(file, fs, path, rename)

    monkeypatch.setattr(storage, "_put_file", dies_on_the_third_file)
    with pytest.raises(RuntimeError, match="preempted"):
        STORE.copy_dir(saved, storage.join(dest, NEWER))
    assert STORE.checkpoint_problem(storage.join(dest, NEWER)) == "MANIFEST.json missing"
    assert STORE.latest_complete_checkpoint(dest) == storage.join(dest, OLDER)
    assert "MANIFEST.json missing" in capsys.readouterr().err


def test_copy_dir_onto_itself_or_from_nowhere(tmp_path, saved):
    folder = shutil.copytree(saved, tmp_path / "ck")
    before = tree(folder)
    STORE.copy_dir(folder, str(folder))
    assert tree(folder) == before
    with pytest.raises(storage.StorageError, match="not a local folder"):
        STORE.copy_dir(tmp_path / "missing", str(tmp_path / "out"))


def test_copy_dir_without_a_manifest_copies_a_plain_folder(tmp_path):
    src = tmp_path / "tokenizer"
    (src / "sub").mkdir(parents=True)
    (src / "vocab.txt").write_text("a\nb\n")
    (src / "sub" / "merges.txt").write_text("a b\n")
    STORE.copy_dir(src, f"file://{tmp_path}/out/tokenizer")
    assert tree(tmp_path / "out" / "tokenizer") == tree(src)
    STORE.copy_dir(src, str(tmp_path / "out" / "tokenizer"))  # again: overwrites in place
    assert tree(tmp_path / "out" / "tokenizer") == tree(src)


# ---- newest by step, not by name; stale incomplete folders ----------------------------------------

# The clocks went back an hour (summer time ended, or the machine moved to another time zone):
# Ray Train's local-time names of later checkpoints sort before earlier ones.
BEFORE_CHANGE, AFTER_CHANGE = "checkpoint_2026-10-25_02-50-00.000000", "checkpoint_2026-10-25_02-10-00.000000"


@pytest.fixture(scope="module")
def by_step(tmp_path_factory):
    """by_step(step): a complete checkpoint whose trainer_state.json says ``step`` (written once)."""
    root = tmp_path_factory.mktemp("by-step")
    made: dict[int, Path] = {}

    def make(step: int) -> Path:
        if step not in made:
            made[step] = write_small_checkpoint(root / f"step-{step}" / "checkpoint", seed=step)
        return made[step]

    return make


def run_of(tmp_path: Path, by_step, folders: dict[str, int]) -> Path:
    run = tmp_path / "run"
    for name, step in folders.items():
        shutil.copytree(by_step(step), run / name)
    return run


@pytest.mark.parametrize("where", ["local", "s3"])
def test_the_newest_checkpoint_is_the_highest_step_when_names_go_backwards(tmp_path, by_step, where, request):
    run = publish(run_of(tmp_path, by_step, {BEFORE_CHANGE: 100, AFTER_CHANGE: 200}), where, request)
    assert sorted([BEFORE_CHANGE, AFTER_CHANGE], key=storage.checkpoint_order)[-1] == BEFORE_CHANGE  # the names mislead
    assert STORE.checkpoints_by_step(run) == [(BEFORE_CHANGE, 100), (AFTER_CHANGE, 200)]
    assert STORE.latest_complete_checkpoint(run) == storage.join(run, AFTER_CHANGE)


def test_equal_steps_and_folders_without_a_step_fall_back_to_name_order(tmp_path, by_step):
    run = run_of(tmp_path, by_step, {"checkpoint_b": 5, "checkpoint_a": 5, "checkpoint_c": 3, "checkpoint_d": 3})
    (run / "checkpoint_d" / "trainer_state.json").unlink()  # its name follows checkpoint_c's: just after it
    (run / "checkpoint_0" / "sub").mkdir(parents=True)  # no step and first by name: the oldest
    assert STORE.checkpoints_by_step(str(run)) == [
        ("checkpoint_0", None), ("checkpoint_c", 3), ("checkpoint_d", None), ("checkpoint_a", 5), ("checkpoint_b", 5),
    ]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_incomplete_folders_older_than_the_newest_complete_one_are_removed(tmp_path, by_step, where, request, capsys):
    local = run_of(tmp_path, by_step, {
        "checkpoint_2026-10-25_02-50-00.000000": 10,  # complete, older: kept (Ray's rotation decides about it)
        "checkpoint_2026-10-25_02-55-00.000000": 20,  # cut off, older: removed
        "checkpoint_2026-10-25_02-52-00.000000": 15,  # cut off, older, but Ray's snapshot lists it: kept
        "checkpoint_2026-10-25_02-10-00.000000": 30,  # complete, the newest (a name from after the change)
        "checkpoint_2026-10-25_02-20-00.000000": 40,  # cut off, newer: kept (a copy may be under way)
        "checkpoint_2026-10-25_02-05-00.000000": 5,   # cut off before its trainer_state.json: placed by name, removed
    })
    for name in ("02-55", "02-52", "02-20"):
        CUTS["weights-truncated"](local / f"checkpoint_2026-10-25_{name}-00.000000")
    stepless = local / "checkpoint_2026-10-25_02-05-00.000000"
    (stepless / "trainer_state.json").unlink()
    (stepless / "MANIFEST.json").unlink()
    (local / storage.RAY_SNAPSHOT).write_text(json.dumps({"checkpoint_results": [{"dir": "checkpoint_2026-10-25_02-52-00.000000"}]}))
    run = publish(local, where, request)

    removed = STORE.remove_incomplete_checkpoints(run)
    assert sorted(uri for uri, _ in removed) == [storage.join(run, "checkpoint_2026-10-25_02-05-00.000000"),
                                                  storage.join(run, "checkpoint_2026-10-25_02-55-00.000000")]
    assert dict(removed)[storage.join(run, "checkpoint_2026-10-25_02-05-00.000000")] == "MANIFEST.json missing"
    left = [name for name, _ in STORE.checkpoints_by_step(run)]
    assert left == ["checkpoint_2026-10-25_02-50-00.000000", "checkpoint_2026-10-25_02-52-00.000000",
                    "checkpoint_2026-10-25_02-10-00.000000", "checkpoint_2026-10-25_02-20-00.000000"]
    assert STORE.latest_complete_checkpoint(run) == storage.join(run, "checkpoint_2026-10-25_02-10-00.000000")
    assert STORE.remove_incomplete_checkpoints(run) == []  # nothing more to do
    capsys.readouterr()


def test_nothing_is_removed_without_a_complete_checkpoint(tmp_path, by_step):
    run = run_of(tmp_path, by_step, {"checkpoint_a": 1, "checkpoint_b": 2})
    for name in ("checkpoint_a", "checkpoint_b"):
        CUTS["manifest-missing"](run / name)
    assert STORE.remove_incomplete_checkpoints(str(run)) == []
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint_a", "checkpoint_b"]
