"""Language servers in the guest and diagnostics for a change, from ``session.languages``,
against a real umbrad and a guest of the standard image (pylsp)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

import umbra
from umbra import Umbra

from .conftest import Daemon, built_bundle


@pytest.fixture(scope="module")
def standard() -> Iterator[Daemon]:
    d = Daemon("languages", bundle=built_bundle("standard"), memory_mib=768)
    try:
        yield d
    finally:
        d.stop()


def test_for_change_and_a_server_of_ones_own(standard: Daemon) -> None:
    work = os.path.join(standard.dir, "work")
    os.makedirs(work)
    with open(os.path.join(work, "util.py"), "w") as f:
        f.write("def helper(x):\n    return x + 1\n")
    with open(os.path.join(work, "main.py"), "w") as f:
        f.write("import os\n\nprint(helper)\n")
    with Umbra.connect(standard.socket) as client:
        s = client.sessions.start("lint", folders=[{"path": work, "name": "work", "mode": "shadow"}])
        # The import is used and the name defined by the change: both errors resolved, one new.
        change = {"main.py": "import os\nfrom util import helper\n\nprint(helper(os.sep), bad)\n"}
        r = s.languages.for_change("work", change, timeout_ms=120_000)
        assert r["complete"]
        assert sorted(d["message"] for d in r["resolved"]) == ["'os' imported but unused", "undefined name 'helper'"]
        assert [(d["path"], d["range"]["start"]["line"], d["message"]) for d in r["diagnostics"]] == [
            ("main.py", 3, "undefined name 'bad'")
        ]
        with open(os.path.join(work, "main.py")) as f:
            assert f.read() == "import os\n\nprint(helper)\n"
        assert s.shadow.diff("work")["changes"] == []

        server = s.languages.start("work", language="python")
        assert [i["server"] for i in s.languages.list()] == [server.id]
        with pytest.raises(umbra.UmbraError, match="no/such/method"):
            server.request("no/such/method", {}, timeout_ms=30_000)
        server.stop()
        assert s.languages.list() == []
