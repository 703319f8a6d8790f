"""The one table of failures (pfs/core/errors.py) and what is derived from it."""
from __future__ import annotations

import errno
from pathlib import Path

import pytest

from pfs.client import plan
from pfs.core import errors as E
from pfs.core.auth import AuthError

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
