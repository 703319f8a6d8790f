"""The one table of failures (pfs/core/errors.py) and what is derived from it."""
from __future__ import annotations

import errno
from pathlib import Path

import pytest

from pfs.client import plan
from pfs.client.meta import FIRST_DELAY, MAX_DELAY, Retry
from pfs.core import errors as E
from pfs.core.auth import AuthError
from pfs.core.messages import meta as M
from pfs.core.messages.records import At

pytestmark = pytest.mark.unit
DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def test_the_docs_render_the_table_in_code() -> None:
    text = DOC.read_text()
    assert "## Errors" in text
    assert E.markdown() in text, "docs/architecture.md 'Errors': paste errors.markdown()"


def test_the_planner_classes_come_from_the_table() -> None:
    assert plan.classify(OSError(errno.EACCES, "")) is plan.Failure.RENEW
    assert plan.classify(OSError(errno.ECONNRESET, "")) is plan.Failure.RECONNECT
    for code in (errno.EINVAL, errno.ENOSPC, errno.EFBIG):
        assert plan.classify(OSError(code, "")) is plan.Failure.FINAL
    assert plan.classify(OSError(errno.EIO, "")) is plan.Failure.ELSEWHERE
    assert plan.CONNECTION_ERRNOS == E.errnos(E.Action.RECONNECT)


def test_transient_outages_and_final_refusals() -> None:
    for code in (errno.ECONNREFUSED, errno.ECONNRESET, errno.ENOTCONN, errno.EAGAIN,
                 errno.ETIMEDOUT):
        assert E.transient(OSError(code, "")), errno.errorcode[code]
    for code in (errno.ENOSPC, errno.EINVAL, errno.EFBIG, errno.ENOENT, errno.EACCES):
        assert not E.transient(OSError(code, "")), errno.errorcode[code]
    # a refused key, and an outage past the deadline, are never retried
    assert not E.transient(AuthError("no"))
    assert not E.transient(E.Final(errno.ETIMEDOUT, "gave up"))
    assert E.action(AuthError("no")) is E.Action.FAIL


def test_every_row_names_a_real_errno_once_per_failure() -> None:
    whats = [f.what for f in E.FAILURES]
    assert len(whats) == len(set(whats))
    assert all(f.errno in errno.errorcode for f in E.FAILURES)


def test_the_metadata_clients_retry_policy() -> None:

    r = Retry("metaserver x:1", 60.0)
    down = OSError(errno.ECONNREFUSED, "refused")
    pauses = [r.pause(down, False, M.Mkdir(at=At(1, b"d"), mode=0o755, cred=(0, 0, ())))
              for _ in range(8)]
    assert pauses[0] == FIRST_DELAY and pauses[-1] == MAX_DELAY  # backing off
    # a change that may have reached the server is not sent again; a read is
    mkdir = M.Mkdir(at=At(1, b"d"), mode=0o755, cred=(0, 0, ()))
    reset = OSError(errno.ECONNRESET, "reset")
    with pytest.raises(OSError) as ei:
        r.pause(reset, True, mkdir)
    assert ei.value is reset
    assert r.pause(reset, True, M.Getattr(ino=1)) > 0
    assert r.pause(OSError(errno.EAGAIN, "starting"), True, mkdir) > 0  # it did nothing
    with pytest.raises(OSError) as ei:  # not an outage
        r.pause(OSError(errno.ENOSPC, "full"), False, mkdir)
    assert ei.value.errno == errno.ENOSPC
    late = Retry("metaserver x:1", 0.0)
    with pytest.raises(E.Final) as fin:
        late.pause(down, False, mkdir)
    assert fin.value.errno == errno.ETIMEDOUT and "x:1" in str(fin.value)


def test_the_mount_answers_eio_for_a_connection_errno_never_enotconn() -> None:
    pyfuse3 = pytest.importorskip("pyfuse3")
    fuse_ops = pytest.importorskip("pfs.fuse.ops")
    for code, want in ((errno.ENOTCONN, errno.EIO), (errno.ECONNREFUSED, errno.EIO),
                       (errno.ECONNRESET, errno.EIO), (errno.ETIMEDOUT, errno.ETIMEDOUT),
                       (errno.ENOSPC, errno.ENOSPC)):
        with pytest.raises(pyfuse3.FUSEError) as ei, fuse_ops.fs_errors():
            raise OSError(code, "x")
        assert ei.value.errno == want, errno.errorcode[code]
