"""The root of every error this client raises."""

from __future__ import annotations


class UmbraError(Exception):
    """An error from umbrad or from this client. ``code`` is the stable snake_case name
    (``"session_not_found"``, docs/ipc.md); ``rpc_code`` the JSON-RPC number."""

    code: str = "unknown"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        rpc_code: int | None = None,
        method: str | None = None,
        daemon_code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.rpc_code = rpc_code
        #: The method whose call failed, when the error answers a call.
        self.method = method
        #: The code as the daemon sent it, when this client does not know it.
        self.daemon_code = daemon_code
